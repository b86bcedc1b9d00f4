"""The warm-up's variant matrix (``qsa_aiter/tools/warmup.py``): every kernel, cache dtype, page size and index dtype
of the model's serving path; tuned rows' tiles; each variant the plan a launch makes (the registry's for the
scorers); the public ops, planned as on sm_90 and gfx950, launch no variant outside the matrix; the matrix's
argument errors.

The specialisations are made in a child without ``TRITON_INTERPRET`` (Triton's binder needs compiled kernels); the
plans are compared in this process (a plan is host code only).
"""

from __future__ import annotations

import collections

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels import catalog
from qsa_aiter.runtime import dispatch, registries
from qsa_aiter.tools import warmup, work_points
from qsa_aiter.tools.aot import SCORERS
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.quant.formats import CACHE_FORMATS
from qsa_aiter.runtime.settings import get_settings
from qsa_aiter.kernels.spec import LaunchPlan
from qsa_aiter.tools.workloads import make_batch
from qsa_aiter.runtime import tuned

from jit_children import run_child, same_sources_here, sources  # noqa: F401 (the module's autouse fixtures)

_MATRIX = r"""
import collections, json, torch
from qsa_aiter.tools import warmup as w
from qsa_aiter.tools.aot import TARGETS

out = {}
for arch in ("sm_90", "gfx950"):
    specs = [(spec, launch) for spec, launch in
             w._unique(w.launches(w.Matrix(), arch, torch.device("cpu")), TARGETS[arch])]
    variants = []
    for spec, launch in specs:
        names = spec.fn.arg_names
        constexprs = {names[k[0]]: str(v) for k, v in spec.constexprs.items()}
        variants.append({"kernel": launch.kernel, "constexprs": constexprs, "num_warps": spec.options.num_warps,
                         "num_stages": spec.options.num_stages, "label": launch.label})
    out[arch] = variants
print("JIT-RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def matrix_variants():
    return run_child(_MATRIX)[0]


def test_the_matrix_covers_every_kernel_cache_page_and_index_dtype(matrix_variants):
    for arch, variants in matrix_variants.items():
        kinds = collections.Counter(v["kernel"] for v in variants)
        # scorers: 5 cache dtypes x 2 page sizes x 2 index dtypes, at least one config each; the writer: 5 x 2;
        # top-k: alone (no index tensors: one variant) and fused with the expansion for 3 request-count kinds x 2,
        # each for short rows, for long rows through the block maxima and for a prefill batch (programs of 4 warps,
        # topk.warps_for); the block maxima: one; the expansion:
        # 3 x 2. Tuned rows add their buckets' configs (sm_90 has rows for every scorer).
        assert kinds["rowwise"] >= 20 and kinds["tiled"] >= 20 and kinds["stacked"] >= 20
        if arch == "gfx950":  # rows for the stacked scorer only
            assert kinds["rowwise"] == kinds["tiled"] == 20
        assert (kinds["cache_writer"], kinds["topk"], kinds["block_maxima"], kinds["expand"]) == (10, 20, 1, 6)
        for kernel in SCORERS:
            mine = [v for v in variants if v["kernel"] == kernel]
            assert {v["constexprs"]["KV_KIND"] for v in mine} == {"0", "1", "2", "3"}
            assert {v["constexprs"]["PAGE_SIZE"] for v in mine} == {"16", "64"}
            # PTX decoders on NVIDIA for quantised caches, never on AMD
            fast = {v["constexprs"]["FAST_DECODE"] for v in mine if v["constexprs"]["KV_KIND"] != "0"}
            assert fast == ({"True"} if arch == "sm_90" else {"False"})


def test_tuned_rows_give_their_configs(matrix_variants):
    # configs/scoring.csv ships gfx950 stacked rows for bf16 (BMT 4, BN 32, 2 warps): warm-up compiles that tile for
    # gfx950 (as its launches look it up), and not for sm_90, whose rows are other tiles
    def tuned_tiles(arch):
        return [v for v in matrix_variants[arch] if v["kernel"] == "stacked" and v["constexprs"]["BLOCK_N"] == "32"
                and v["num_warps"] == 2 and v["constexprs"]["KV_KIND"] == "0"]

    assert tuned_tiles("gfx950") and not tuned_tiles("sm_90")
    # every H200 row's tile is among the sm_90 variants, for its kernel, cache kind and page size
    kinds = {"bf16": {"0"}, "fp8": {"1", "2"}, "fp4": {"3"}}
    rows = [row for key, rows in tuned.load_tables(()).rows.items() if key[0] == "sm_90" for row in rows]
    assert rows
    for row in rows:
        assert any(v["kernel"] == row.kernel and v["constexprs"]["KV_KIND"] in kinds[row.kv_dtype]
                   and v["constexprs"]["PAGE_SIZE"] == str(row.page_size)
                   and v["constexprs"]["BLOCK_N"] == str(row.block_n) and v["num_warps"] == row.num_warps
                   and v["num_stages"] == row.num_stages for v in matrix_variants["sm_90"]), row


def _variant(kernel: str, kwargs: dict) -> tuple:
    """What makes a plan one Triton variant (besides its arguments' kinds): kernel, constexprs, options."""
    return kernel, tuple(sorted((k, str(v)) for k, v in kwargs.items()))


def _shape(value) -> tuple:
    return (tuple(value.shape), value.dtype, value.device.type) if isinstance(value, torch.Tensor) else (value,)


@pytest.mark.parametrize("arch", ["sm_90", "gfx950"])
def test_each_variant_is_the_plan_its_launch_makes(arch):
    """Warm-up's launches are, in order, every (index dtype, kernel, warm problem) of the matrix, each the plan a
    launch of that problem on ``arch`` makes, on the spec's example inputs: for a scorer the registry's
    (``registry.plan_for``, as its candidates launch), for the selection and writer kernels the spec's own (as
    their launch functions plan)."""
    settings = get_settings()
    matrix, platform = warmup.Matrix(), Platform.named(arch)
    context = warmup.WarmContext(matrix, platform, settings)
    want = [(index_name, spec, label, problem) for index_name in matrix.index_dtypes for spec in catalog.SPECS
            for label, problem in spec.warm_problems(context)]
    launches = warmup.launches(matrix, arch, torch.device("cpu"), settings)
    assert [launch.label for launch in launches] == [f"{label} {index}" for index, _, label, _ in want]
    assert {spec.name for _, spec, _, _ in want} == set(warmup.KERNELS)
    for launch, (index_name, spec, _, problem) in zip(launches, want):
        plan = (dispatch.plan_for(spec, problem, platform, settings) if spec.family == "scoring"
                else spec.plan(problem, platform))
        assert launch.kernel == spec.name and launch.fn is plan.fn is spec.fn
        assert launch.grid == plan.grid and launch.kwargs == plan.kwargs, launch.label
        example = spec.example_args(problem, warmup.INDEX_DTYPES[index_name], torch.device("cpu"))
        assert [_shape(a) for a in launch.args] == [_shape(a) for a in example], launch.label


@pytest.mark.parametrize("arch", ["sm_90", "gfx950"])
def test_the_public_ops_launch_only_warmed_variants(arch, monkeypatch):
    """The ops' own launch paths, planned as on ``arch`` (``Platform.of`` answers its named platform; the kernels
    are not run, their plans recorded), make no variant that the warm-up of the default matrix does not build:
    scoring in every phase for each cache kind and page size, selection (top-k alone, fused with the expansion,
    the expansion alone) for each request-count kind, and the writer for each cache dtype."""
    settings = get_settings()
    warmed = {_variant(launch.kernel, launch.kwargs)
              for launch in warmup.launches(warmup.Matrix(), arch, torch.device("cpu"), settings)}
    monkeypatch.setattr(Platform, "of", classmethod(lambda cls, device: Platform.named(arch)))
    launched = []
    monkeypatch.setattr(LaunchPlan, "launch", lambda plan, *args: launched.append(_variant(plan.kernel, plan.kwargs)))
    gen = torch.Generator().manual_seed(0)
    phases = {"verify": (9, 4), "draft": (16, 1), "decode": (1, 1), "prefill": (1, 300)}
    for cache in ("bf16", "fp8", "fp8_fnuz", "fp4"):
        for page_size in registries.BLOCK_SIZES:
            for phase, (requests, rows) in phases.items():
                batch = make_batch([8192] * requests, rows, page_size=page_size, cache=cache, generator=gen)
                qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **batch.kwargs(), phase=phase, max_query_len=rows)
    # Where measurements send decode to the stacked scorer, the row-wise one serves with the switch off.
    monkeypatch.setenv("ATOM_QSA_STACKED_DECODE_SCORER", "0")
    for cache in ("bf16", "fp8"):
        batch = make_batch([8192], 1, page_size=64, cache=cache, generator=gen)
        qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **batch.kwargs(), phase="decode", max_query_len=1)
    monkeypatch.delenv("ATOM_QSA_STACKED_DECODE_SCORER")
    for requests in warmup.REQUEST_COUNTS:
        for context in (8192, 280000):  # the second: long rows, through the block maxima
            sel = make_batch([context] * requests, 1, page_size=64, generator=gen)
            qsa_aiter.qsa_select_paged_tokens(*sel.args()[:6], 2048, 4, phase="draft")
        for width in (1024, 70000):
            logits = torch.zeros(requests, width)
            visible = torch.full((requests,), width, dtype=torch.int32)
            groups = qsa_aiter.qsa_block_topk(logits, visible, 512)
        qsa_aiter.qsa_expand_block_indices(groups, sel.query_positions, sel.context_lens, sel.token_to_request, 4,
                                           2048)
    for name in warmup.CACHES:
        cache, scale = qsa_aiter.allocate_index_cache(name, 4, 16, 128)
        keys = torch.randn(8, 128, generator=gen).to(CACHE_FORMATS[name].query_dtype)
        qsa_aiter.qsa_write_index_cache(keys, torch.arange(8), cache, scale)
    kinds = collections.Counter(kernel for kernel, _ in launched)
    # The keys-major scorer serves where the tuned rows measured it faster: only the H200 has such rows.
    expected = set(warmup.KERNELS) - ({"keys_major"} if arch != "sm_90" else set())
    assert set(kinds) == expected, kinds
    missing = sorted({v for v in launched if v not in warmed})
    assert missing == [], f"{len(missing)} launched variants are not warmed, e.g. {missing[:2]}"


def test_matrix_rejects_bad_axes():
    with pytest.raises(ValueError, match="kernels must be"):
        warmup.Matrix(kernels=("flash",))
    with pytest.raises(ValueError, match="caches must be"):
        warmup.Matrix(caches=("fp6",))
    with pytest.raises(ValueError, match="caches must be"), pytest.warns(DeprecationWarning, match="'fp8'"):
        warmup.Matrix(caches=("fp8_e4m3fn", "fp6"))
    with pytest.raises(ValueError, match="page_sizes must be"):
        warmup.Matrix(page_sizes=(0,))
    with pytest.raises(ValueError, match="index_dtypes must be"):
        warmup.Matrix(index_dtypes=())
    with pytest.raises(ValueError, match="page_sizes must be"):
        warmup.Matrix(page_sizes=[16])  # a list, not a tuple


def test_matrix_takes_former_cache_spellings_with_a_warning():
    with pytest.warns(DeprecationWarning, match="'fp8_e4m3fnuz' is now spelled 'fp8_fnuz'"):
        assert warmup.Matrix(caches=("bf16", "fp8_e4m3fnuz")).caches == ("bf16", "fp8_fnuz")


def test_scorers_are_warmed_at_the_warm_work_points():
    """Each scorer's warm problems include every warmed work point of each phase its registry order lists (the
    points declared once, in ``tools.work_points``), at the point's widest page table."""
    context = warmup.WarmContext(warmup.Matrix(caches=("bf16",), page_sizes=(64,)), Platform.named("gfx942"),
                                 get_settings())
    problems = {(p.phase, p.num_requests, p.max_query_len, p.table_width)
                for _, p in context.scorer_problems(catalog.spec_named("rowwise"))}
    phases = {phase for phase, *_ in problems}
    assert {"draft", "decode"} <= phases  # the row-wise scorer is in (at least) these phases' orders
    for phase in phases:
        for point in work_points.warm_points(phase):
            width = -(-point.longest_context // 4 // 64)
            assert (phase, point.requests, point.rows_per_request, width) in problems, (phase, point.name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_warmup_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="arch must be"):
        warmup.warmup("sm_80", root=tmp_path)
    with pytest.raises(ValueError, match="arch: no GPU here"):
        warmup.warmup(None, root=tmp_path)

"""The native tensor-core scorer (``kernels/scoring/native_scorer.cu``, its spec ``native_scorer.SPEC``, its launch
``runtime/native_scorer.py`` and the ``native`` scoring candidate).

- Host logic: the declared parameters are the source's, the variants and targets, plans (rows per group, column
  splits), the launch's scalars, the reasons (and ``explain``'s text), forcing it where it cannot run.
- The device code on the CPU through the CUDA emulator (``runtime/jit/cuda_emulator.h``: its ``mma.sync``,
  ``ldmatrix`` and ``cp.async``), against the torch reference on the exact ``[0, visible)`` region of a NaN-poisoned
  output (nothing past it is written): page 16 and 64, int32 and int64 metadata, bf16 and fp16, padded rows, uneven
  contexts and rows per request, bad page ids, strided and unaligned caches; identical keys score identically, a row
  scored alone equals the same row in its verify group, and neither the column splits nor the threads' order change
  a bit.
- NVRTC (marked ``nvrtc``): every variant compiles for sm_90 (and sm_80) without spills, warm-up builds them into the
  JIT cache and ``jit list`` lists them.
- On a GPU (marked ``gpu``): the same cases through the public op with ``QSA_AITER_BACKEND=native``, a work-point
  shape, a row alone against its batch, the replayed second call, and a CUDA-graph capture replayed over new
  positions.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels import catalog
from qsa_aiter.kernels.native_spec import macro_params, target_of
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring import native_scorer as ns
from qsa_aiter.kernels.scoring.base import ScoreArgs, example_problem
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits
from qsa_aiter.ops.scoring import ScoringPlan, describe_call
from qsa_aiter.runtime import registries
from qsa_aiter.runtime.jit import emulated
from qsa_aiter.runtime.native_scorer import NATIVE_SCORER_LAUNCH, emulated_score, native_scorer_reasons
from qsa_aiter.runtime.settings import ConfigurationError, get_settings
from qsa_aiter.tools.timing import capture_graph
from qsa_aiter.tools.workloads import ScoringBatch, make_batch

from helpers import assert_matches_reference, force_backend, phase_batch, poisoned_logits, run_poisoned, visible_bits

SM90 = Platform.named("sm_90")
ON_GPU = torch.cuda.is_available() and torch.version.cuda is not None
needs_emulator = pytest.mark.skipif(emulated.unavailable_reason() is not None,
                                    reason=f"cannot emulate: {emulated.unavailable_reason()}")
TOL = 1e-5


def widened(batch, index_dtype: torch.dtype):
    """``batch`` with its page table and row metadata in ``index_dtype``."""
    for name in ("page_table", "token_to_request", "query_positions", "context_lens"):
        setattr(batch, name, getattr(batch, name).to(index_dtype))
    return batch


# ---------------------------------------------------------------------------------------------------------------
# Host logic
# ---------------------------------------------------------------------------------------------------------------


def test_the_source_spells_the_declared_parameters_and_constants():
    text = ns.source()
    assert macro_params(text, "QSA_SCORER_PARAMS") == ns.PARAMS
    constants = {"QSA_HEADS": ns.HEADS, "QSA_HEAD_DIM": ns.HEAD_DIM, "QSA_TILE": ns.TILE_COLUMNS,
                 "QSA_STAGES": ns.STAGES, "QSA_THREADS": ns.THREADS, "QSA_CTAS_PER_SM": ns.CTAS_PER_SM}
    for macro, value in constants.items():
        assert re.search(rf"#define {macro} (\d+)\n", text).group(1) == str(value), macro
    # Both headers are spliced in (the JIT key's hash covers them) and no include is left.
    assert '#line 1 "native_compat.h"' in text and '#line 1 "native_mma.h"' in text and "#include" not in text
    # Each declared variant is instantiated once, with its page size, query type and cache format.
    kinds = {"bf16": None, "fp8": "QSA_KIND_FP8", "fp4": "QSA_KIND_FP4"}
    instantiated = {m[0]: m[1:] for m in re.findall(
        r"\nQSA_(?:QUANT_)?SCORER_KERNEL\((\w+), (\d+), (true|false)(?:, (\w+))?\)", text)}
    assert instantiated == {v.name: (str(v.page_size), "true" if v.key_dtype == "fp16" else "false",
                                     kinds[v.kv] or "") for v in ns.VARIANTS}
    binding = {name: (pointers, count) for name, pointers, count in ns.SPEC.emulator_kernels()}
    assert set(binding) == set(ns.BY_NAME)
    assert binding["qsa_score_bf16_page64"] == (tuple(c for _, c in ns.POINTERS), len(ns.SCALARS))


def test_variants_targets_and_the_catalog():
    assert [v.name for v in ns.variants_for(SM90)] == [
        "qsa_score_bf16_page16", "qsa_score_bf16_page64", "qsa_score_fp16_page16", "qsa_score_fp16_page64",
        "qsa_score_fp8_bf16_page16", "qsa_score_fp8_bf16_page64", "qsa_score_fp8_fp16_page16",
        "qsa_score_fp8_fp16_page64", "qsa_score_fp4_bf16_page16", "qsa_score_fp4_bf16_page64"]
    assert ns.variants_for(Platform("sm_75", "cuda", (7, 5), 40, False)) == ()
    assert ns.variants_for(Platform.named("gfx942")) == () and ns.variants_for(Platform.named("gfx950")) == ()
    assert ns.SPEC.defines(ns.BY_NAME["qsa_score_fp16_page16"], "sm_90") == (
        "QSA_NATIVE_SINGLE", "QSA_NATIVE_KERNEL_qsa_score_fp16_page16", *target_of("sm_90").defines)
    assert ns.variant_for(torch.float16, 64).name == "qsa_score_fp16_page64"
    assert ns.variant_for(torch.float8_e4m3fn, 16, torch.float16).name == "qsa_score_fp8_fp16_page16"
    assert ns.variant_for(torch.float4_e2m1fn_x2, 64, torch.bfloat16).name == "qsa_score_fp4_bf16_page64"
    with pytest.raises(ValueError, match="no native scorer kernel for torch.bfloat16 keys in pages of 32"):
        ns.variant_for(torch.bfloat16, 32)
    with pytest.raises(ValueError, match="float4_e2m1fn_x2 keys with torch.float16 queries"):
        ns.variant_for(torch.float4_e2m1fn_x2, 64, torch.float16)
    assert catalog.native_spec_named("native_scorer") is ns.SPEC
    assert all(v.max_registers == 170 for v in ns.VARIANTS)


@pytest.mark.parametrize("phase,rows,requests,max_query_len,group_rows", [
    ("verify", 36, 9, 4, 4), ("verify", 27, 9, 3, 3), ("verify", 16, 2, 8, 4), ("verify", 11, 3, None, 3),
    ("draft", 64, 64, 1, 1), ("decode", 16, 16, None, 1), ("prefill", 200, 1, 200, 4)])
def test_plans_group_a_request_s_rows(phase, rows, requests, max_query_len, group_rows):
    problem = example_problem(phase=phase, num_tokens=rows, num_requests=requests, max_query_len=max_query_len)
    plan = ns.choose_plan(problem, SM90)
    assert plan.group_rows == group_rows and plan.row_groups == -(-rows // group_rows)
    tiles = -(-problem.num_columns // ns.TILE_COLUMNS)
    expected = max(1, min(-(-tiles // ns.MIN_TILES_PER_CTA), SM90.multiprocessors * ns.CTAS_PER_SM // plan.row_groups))
    assert plan.splits == expected and plan.grid == (plan.row_groups * plan.splits, 1, 1)
    assert plan.shared_bytes == ns.SHARED_BYTES == 4 * 64 * 256 + 4 * 64 + 32
    assert plan.variant.name == "qsa_score_bf16_page64"
    # A few columns: at least MIN_TILES_PER_CTA tiles a CTA.
    narrow = ns.choose_plan(example_problem(phase=phase, num_tokens=rows, num_requests=requests,
                                            max_query_len=max_query_len, num_columns=300), SM90)
    assert narrow.splits == min(3, max(1, SM90.multiprocessors * ns.CTAS_PER_SM // narrow.row_groups))


def test_launch_arguments_come_in_the_declared_order():
    plan = ns.choose_plan(example_problem(), SM90)
    values = {name: i for i, (name, _) in enumerate(ns.SCALARS)}
    call = ns.launch_arguments(plan, values)
    assert call.pointers == ns.POINTERS and [name for name, _, _ in call.scalars] == [n for n, _ in ns.SCALARS]
    assert call.scalar("group_rows") == plan.group_rows and call.scalar("splits") == plan.splits
    assert call.block == (128, 1, 1) and call.shared_bytes == ns.SHARED_BYTES and call.kernel == plan.variant.name
    with pytest.raises(ValueError, match="page_stride must fit a C int"):
        ns.launch_arguments(plan, dict(values, page_stride=2**31))
    with pytest.raises(ValueError, match="missing scalar argument"):
        ns.launch_arguments(plan, {})
    assert ns.float_bits(1.0) == 0x3F800000 and ns.float_bits(-2.0) == -(2**31) + 0x40000000
    assert ns.float_bits(1 / math.sqrt(128)) == torch.tensor([1 / math.sqrt(128)]).view(torch.int32).item()


def test_reasons_name_what_it_does_not_serve():
    good = example_problem()
    assert ns.SPEC.reasons(good, SM90) == []
    for kv, dtype in (("fp8", torch.float8_e4m3fn), ("fp4", torch.float4_e2m1fn_x2)):
        assert ns.SPEC.reasons(example_problem(kv_dtype=kv, cache_dtype=dtype), SM90) == [], kv
    cases = [
        (dict(kv_dtype="fp8", cache_dtype=torch.float8_e4m3fnuz), "float8_e4m3fnuz cache (gfx942's fp8)"),
        (dict(kv_dtype="fp4", cache_dtype=torch.float4_e2m1fn_x2, q_dtype=torch.float16),
         "MXFP4 keys with float16 queries"),
        (dict(kv_dtype="fp4", cache_dtype=torch.float4_e2m1fn_x2, scale_aligned=False), "not 4-byte aligned"),
        (dict(num_heads=8), "needs 4 heads (got 8)"),
        (dict(head_dim=64), "needs head_dim 128 (got 64)"),
        (dict(block_size=32), "needs pages of 16 or 64 groups (got 32)"),
        (dict(phase="prefill", num_tokens=4096, max_query_len=4096), "prefill of 4096 rows"),
        (dict(key_strides=(2**31, 128)), "strides"),
    ]
    for change, text in cases:
        found = ns.SPEC.reasons(example_problem(**change), SM90)
        assert len(found) == 1 and text in found[0], (change, found)
    assert "no AMD version yet" in ns.SPEC.reasons(good, Platform.named("gfx942"))[0]
    volta = Platform("sm_70", "cuda", (7, 0), 80, False)
    assert "compute capability 8.0 or newer" in ns.SPEC.reasons(good, volta)[0]
    assert ns.SPEC.describe_plan(example_problem(num_heads=8), SM90).startswith("none (needs 4 heads")
    assert ns.SPEC.describe_plan(good, SM90).startswith("qsa_score_bf16_page64: 9 row groups of 4 rows x ")
    # The candidate's: CPU tensors, and the histogram the Triton scorers count.
    on_cpu = native_scorer_reasons(example_problem(device_type="cpu", histogram=True), SM90, None)
    assert on_cpu[0] == "needs CUDA GPU tensors (tensors are on cpu)"
    assert any("histogram" in reason for reason in on_cpu)


def test_the_registry_ranks_it_after_the_triton_scorers_and_forcing_it_names_its_reasons(monkeypatch, rng):
    assert registries.SCORING.candidates["native"].reasons is native_scorer_reasons
    for kv in registries.KV_DTYPES:
        for page in registries.BLOCK_SIZES:
            for phase in ("verify", "draft", "decode"):
                order = registries.SCORING_TABLE[(kv, page, phase)]
                triton = [i for i, name in enumerate(order) if name in registries.SCORER_KERNELS]
                assert order.index("native") > max(triton) and order.index("native") < order.index("torch")
            assert "native" not in registries.SCORING_TABLE[(kv, page, "prefill")]
    batch, hints = phase_batch("verify", 64, rng, head_dim=128)
    text = qsa_aiter.explain(*batch.args(), **hints)
    assert "- native: needs CUDA GPU tensors (tensors are on cpu)" in text
    force_backend(monkeypatch, "native")
    with pytest.raises(ValueError, match="native: needs CUDA GPU tensors"):
        qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)


def test_a_recorded_native_launch_replays_with_the_scorers_addresses():
    """``ScoringPlan.of`` keeps the native scorer's recorded launch (a ``PreparedLaunch``, named
    ``native_scorer``) and replays it with the Triton scorers' ten addresses, passing its own nine by name."""

    class Recorded:
        name = NATIVE_SCORER_LAUNCH
        pointer_names = tuple(name for name, _ in ns.POINTERS)
        calls: list = []

        def __call__(self, *addresses):
            self.calls.append(addresses)

        def taking(self, *names):
            order = [names.index(n) for n in self.pointer_names]
            return lambda *addresses: self(*(addresses[i] for i in order))

    recorded = Recorded()
    plan = ScoringPlan.of(example_problem(), [recorded])
    plan.launch(*range(100, 110))  # q, k, ks, pt, t2r, pos, ctx, out, vis, hist
    assert recorded.calls == [(100, 101, 102, 103, 104, 105, 106, 107, 108)]
    recorded.name = "other"
    assert ScoringPlan.of(example_problem(), [recorded]) is None


def test_tuned_rows_can_time_it_faster_than_the_triton_scorers(monkeypatch, tmp_path):
    """Rows of ``native_scorer`` in a tuned table (measured times, no tile settings) take part in measured dispatch:
    timed faster than the order's first kernel at the call's bucket, it is chosen; a tile setting on its row is
    refused naming the file."""
    problem = example_problem()
    rows, context = problem.num_tokens, problem.num_columns * problem.compress_ratio
    header = "arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context,us,measured,source"
    table = tmp_path / "native.csv"
    table.write_text(f"{header}\nsm_90,stacked,bf16,64,4,128,{rows},{context},20.0,1,test\n"
                     f"sm_90,native_scorer,bf16,64,4,128,{rows},{context},1.5,1,test\n")
    monkeypatch.setenv("QSA_AITER_TUNED_CONFIG", str(table))
    serving = ["stacked", "keys_major", "rowwise", "native"]
    chosen = registries.SCORING.measured_choice(problem, serving, SM90, get_settings())
    assert chosen[0] == "native" and chosen[1].startswith("measurement: native 1.50 us < ") and "native" in chosen[2]
    assert registries.SCORING.candidates["native"].measurement(problem, SM90, get_settings()).us == 1.5
    tiled = tmp_path / "tile.csv"  # (tables are read once per file list)
    tiled.write_text(f"{header},block_n\nsm_90,native_scorer,bf16,64,4,128,{rows},{context},1.5,1,test,64\n")
    monkeypatch.setenv("QSA_AITER_TUNED_CONFIG", str(tiled))
    with pytest.raises(ConfigurationError, match="block_n is not a setting of the native_scorer kernel"):
        registries.SCORING.measured_choice(problem, serving, SM90, get_settings())


# ---------------------------------------------------------------------------------------------------------------
# The device code, emulated
# ---------------------------------------------------------------------------------------------------------------


def emulate(batch, hints: dict, *, splits: int | None = None, order_seed: int = 0, score_divisor=None):
    """The native scorer's kernel on ``batch`` through the emulator, into a NaN-poisoned output: ``(logits, visible,
    plan)``."""
    args = batch.args()
    problem = describe_call(*args, score_divisor=score_divisor, **hints)
    logits = poisoned_logits(args)
    visible = torch.full((problem.num_tokens,), -7, dtype=torch.int32)
    divisor = math.sqrt(problem.head_dim) if score_divisor is None else score_divisor
    score = ScoreArgs(batch.q, batch.compressed_k_cache, batch.page_table, batch.token_to_request,
                      batch.query_positions, batch.context_lens, logits, visible, problem.num_columns,
                      problem.compress_ratio, 1.0 / divisor, batch.k_scale)
    plan = ns.choose_plan(problem, SM90, splits=splits)
    emulated_score(problem, score, plan, order_seed)
    return logits, visible, plan


def check_emulated(batch, hints: dict, **kwargs):
    """``emulate`` against the reference on ``[0, visible)``, and nothing written past it."""
    logits, visible, plan = emulate(batch, hints, **kwargs)
    extra = {"score_divisor": kwargs["score_divisor"]} if kwargs.get("score_divisor") else {}
    ref_logits, ref_visible = reference_paged_mqa_logits(*batch.args(), **extra, **batch.kwargs())
    assert_matches_reference(logits, visible, ref_logits, ref_visible, rtol=TOL, atol=TOL, label=plan.describe())
    past = torch.arange(logits.shape[1])[None, :] >= visible.long()[:, None]
    assert torch.isnan(logits[past]).all(), "the kernel wrote a column at or past a row's visible count"
    return logits, visible, plan


@needs_emulator
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=("int32", "int64"))
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("phase", ("verify", "draft"))
def test_emulated_phases_match_the_reference(rng, phase, page_size, index_dtype):
    """Verify (uneven rows per request: groups straddle requests; padded rows) and draft (one row per request) batches
    of uneven contexts."""
    batch, hints = phase_batch(phase, page_size, rng, head_dim=128)
    _, _, plan = check_emulated(widened(batch, index_dtype), hints)
    assert plan.group_rows == (4 if phase == "verify" else 1) and plan.splits > 1


@needs_emulator
@pytest.mark.parametrize("page_size", (16, 64))
def test_emulated_fp16_and_a_score_divisor(rng, page_size):
    batch = make_batch([700, 1300], [3, 2], page_size=page_size, dtype=torch.float16, padded_rows=1, generator=rng)
    check_emulated(batch, dict(max_query_len=3), score_divisor=3.0)


@needs_emulator
@pytest.mark.parametrize("page_size", (16, 64))
def test_emulated_bad_page_ids_score_minus_inf(rng, page_size):
    """Negative ids, ids at and past the cache's pages, an int64 id past 2**31 (never truncated): -inf, never read
    (the keys under them are NaN, which a read would carry into the score)."""
    batch = widened(make_batch([1500, 1100, 700], 3, page_size=page_size, generator=rng, spare_pages=4),
                    torch.int64)
    pages = batch.compressed_k_cache.shape[0]
    used = set(batch.page_table[batch.page_table >= 0].tolist())
    spare = [p for p in range(pages) if p not in used]
    batch.compressed_k_cache[spare] = float("nan")  # unread: no bad id below may reach them
    bad = [(0, 1, -3), (1, 0, pages), (1, 2, pages + 100), (2, 0, 2**32 + spare[0]), (0, 4, -(2**40))]
    for r, slot, value in bad:
        batch.page_table[r, slot] = value
    logits, visible, _ = check_emulated(batch, dict(max_query_len=3))
    for r, slot, _ in bad:
        for t in torch.nonzero(batch.token_to_request == r).flatten().tolist():
            lo, hi = slot * page_size, min((slot + 1) * page_size, int(visible[t]))
            assert hi > lo and torch.isneginf(logits[t, lo:hi]).all(), (r, slot, t)


@needs_emulator
@pytest.mark.parametrize("cache", (None, "fp8", "fp4"), ids=("16bit", "fp8", "fp4"))
def test_emulated_metadata_past_32_bits_and_visible_clamped(rng, cache):
    """int64 positions and context lengths past 2**31 (visible clamped to the columns), a position of -1 and a
    request id past the requests (rows that see nothing), an int32 position of 2**31 - 1; 16-bit and quantised
    caches."""
    batch = widened(make_batch([900, 1200, 400], 2, page_size=16, generator=rng, table_width=30, cache=cache),
                    torch.int64)
    batch.context_lens[1] = 2**34
    batch.query_positions[2] = 2**33
    batch.query_positions[0] = -1
    batch.token_to_request[5] = 7
    _, visible, _ = check_emulated(batch, dict(max_query_len=2, **batch.kwargs()))
    assert visible[2].item() == 30 * 16 and visible[0].item() == 0 and visible[5].item() == 0
    narrow = widened(make_batch([900], 1, page_size=64, generator=rng, cache=cache), torch.int32)
    narrow.query_positions[0] = 2**31 - 1
    check_emulated(narrow, dict(phase="decode", **narrow.kwargs()))


@needs_emulator
@pytest.mark.parametrize("view", ("strided", "unaligned"))
def test_emulated_strided_and_unaligned_caches(rng, view):
    """A cache that is a view of a wider buffer (cp.async at its strides), and one at an address and slot stride that
    are not 16-byte aligned (16-bit loads instead)."""
    batch = make_batch([800, 1300], [2, 3], page_size=16, generator=rng)
    cache = batch.compressed_k_cache
    width, offset = (192, 0) if view == "strided" else (139, 3)
    wide = torch.full((*cache.shape[:3], width), float("nan"), dtype=cache.dtype)
    wide[..., offset:offset + 128] = cache
    batch.compressed_k_cache = wide[..., offset:offset + 128]
    problem = describe_call(*batch.args(), max_query_len=3)
    assert problem.key_strides == (16 * width, width)
    check_emulated(batch, dict(max_query_len=3))


@needs_emulator
def test_emulated_scores_do_not_depend_on_the_split_the_group_or_the_thread_order(rng):
    """Identical keys (at every position of a tile and in several tiles) score bitwise alike; the same logits come out
    with 1, 2 and 5 column splits and another thread order; a verify row scored alone (decode, M row 0 of its MMA)
    equals the same row in its group."""
    batch = make_batch([2100, 900], [4, 3], page_size=64, generator=rng)
    cache, table = batch.compressed_k_cache, batch.page_table
    key = cache[table[0, 0], 5].clone()
    for page in table[0, :3].tolist():  # request 0's first 192 groups: one key
        cache[page] = key
    hints = dict(max_query_len=4)
    logits, visible, _ = check_emulated(batch, hints, splits=1)
    for t in range(4):
        same = logits[t, :192]
        assert torch.equal(same.view(torch.int32), same[:1].expand(192).contiguous().view(torch.int32)), t
    for splits, seed in ((2, 0), (5, 3)):
        again, visible2, plan = emulate(batch, hints, splits=splits, order_seed=seed)
        assert plan.splits == splits and torch.equal(visible_bits(again, visible2), visible_bits(logits, visible))
    for t in (1, 3, 5):
        row = ScoringBatch(batch.q[t:t + 1], cache, table, batch.token_to_request[t:t + 1],
                           batch.query_positions[t:t + 1], batch.context_lens, batch.compress_ratio, 1, 0)
        alone, seen, plan = emulate(row, dict(phase="decode"))
        assert plan.group_rows == 1 and seen.item() == visible[t].item()
        assert torch.equal(visible_bits(alone, seen), visible_bits(logits[t:t + 1], visible[t:t + 1])), t


# Quantised caches: (cache format, query dtype) of each quantised kernel.
QUANT_FORMATS = [("fp8", torch.bfloat16), ("fp8", torch.float16), ("fp4", torch.bfloat16)]
QUANT_IDS = ["fp8-bf16q", "fp8-fp16q", "fp4-bf16q"]


def poison_keys(batch, slots):
    """The keys at ``slots`` (``(page, offset)`` index tensors or ints) dequantised to NaN: fp8 a NaN scale and NaN
    codes, MXFP4 e8m0's NaN exponent (255) and zero codes, 16-bit caches NaN values."""
    cache, scale = batch.compressed_k_cache, batch.k_scale
    if cache.dtype == torch.float8_e4m3fn:
        cache.view(torch.uint8)[slots] = 0x7F
        scale[slots] = float("nan")
    elif cache.dtype == torch.float4_e2m1fn_x2:
        cache.view(torch.uint8)[slots] = 0
        scale.view(torch.uint8)[slots] = 255
    else:
        cache[slots] = float("nan")


def assert_matches_with_nans(logits, visible, ref_logits, ref_visible, label=""):
    """``assert_matches_reference``, where the reference's NaN scores must be NaN in ``logits`` too."""
    region = torch.arange(logits.shape[1])[None, :] < visible.long()[:, None]
    nan = torch.isnan(ref_logits) & region
    assert torch.isnan(logits[nan]).all(), f"{label}: a NaN key did not give a NaN score"
    assert_matches_reference(torch.where(nan, 0.0, logits), visible, torch.where(nan, 0.0, ref_logits), ref_visible,
                             rtol=TOL, atol=TOL, label=label)
    return nan


@needs_emulator
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=("int32", "int64"))
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("cache,dtype", QUANT_FORMATS, ids=QUANT_IDS)
def test_emulated_quantised_caches_match_the_dequantised_reference(rng, cache, dtype, page_size, index_dtype):
    """fp8 (bf16 and fp16 queries) and MXFP4 caches against the reference on the dequantised cache: verify batches
    (groups straddle requests, padded rows) in int32 and int64 metadata, and a draft batch."""
    batch, hints = phase_batch("verify", page_size, rng, head_dim=128, cache=cache, dtype=dtype)
    _, _, plan = check_emulated(widened(batch, index_dtype), hints)
    assert plan.variant.kv == cache and plan.variant.key_dtype == ns.KEY_DTYPES[dtype]
    if index_dtype == torch.int64:
        batch, hints = phase_batch("draft", page_size, rng, head_dim=128, cache=cache, dtype=dtype)
        check_emulated(batch, hints)


@needs_emulator
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("cache,dtype", QUANT_FORMATS, ids=QUANT_IDS)
def test_emulated_quantised_bad_pages_nan_keys_and_identical_keys(rng, cache, dtype, page_size):
    """Bad page ids score -inf and are never read (the unused pages' keys are NaN); a NaN key (fp8: a NaN scale, or
    NaN codes under a finite scale; MXFP4: exponent 255) scores NaN in its column only; identical keys score bitwise
    alike and a row scored alone equals it in its group."""
    batch = widened(make_batch([1500, 1100, 700], 3, page_size=page_size, cache=cache, dtype=dtype, generator=rng,
                               spare_pages=4), torch.int64)
    table, pages = batch.page_table, batch.compressed_k_cache.shape[0]
    used = set(table[table >= 0].tolist())
    spare = [p for p in range(pages) if p not in used]
    poison_keys(batch, torch.tensor(spare))  # unread: no bad id below may reach them
    bad = [(0, 1, -3), (1, 0, pages), (2, 0, 2**32 + spare[0])]
    for r, slot, value in bad:
        table[r, slot] = value
    # NaN keys: request 1's column page_size + 3; fp8: request 2's column page_size + 5 has a NaN code, finite scale.
    poison_keys(batch, (int(table[1, 1]), 3))
    if cache == "fp8":
        batch.compressed_k_cache.view(torch.uint8)[int(table[2, 1]), 5, 0, 17] = 0xFF
    # Identical keys: request 0's pages 2 and 3 all hold one key.
    codes, scales = batch.compressed_k_cache.view(torch.uint8), batch.k_scale
    scales = scales.view(torch.uint8) if scales.dtype.itemsize == 1 else scales
    key, scale = codes[int(table[0, 2]), 1].clone(), scales[int(table[0, 2]), 1].clone()
    for page in table[0, 2:4].tolist():
        codes[page], scales[page] = key, scale
    hints = dict(max_query_len=3, **batch.kwargs())
    logits, visible, _ = emulate(batch, hints)
    ref_logits, ref_visible = reference_paged_mqa_logits(*batch.args(), **batch.kwargs())
    nan = assert_matches_with_nans(logits, visible, ref_logits, ref_visible, label=f"{cache}/page{page_size}")
    nan_columns = {(1, page_size + 3)} | ({(2, page_size + 5)} if cache == "fp8" else set())
    assert {(int(batch.token_to_request[t]), c) for t, c in torch.nonzero(nan).tolist()} == nan_columns
    past = torch.arange(logits.shape[1])[None, :] >= visible.long()[:, None]
    assert torch.isnan(logits[past]).all(), "the kernel wrote a column at or past a row's visible count"
    for r, slot, _ in bad:
        for t in torch.nonzero(batch.token_to_request == r).flatten().tolist():
            lo, hi = slot * page_size, min((slot + 1) * page_size, int(visible[t]))
            assert hi > lo and torch.isneginf(logits[t, lo:hi]).all(), (r, slot, t)
    for t in range(3):
        same = logits[t, 2 * page_size:4 * page_size]
        assert torch.equal(same.view(torch.int32), same[:1].expand_as(same).contiguous().view(torch.int32)), t
    for t in (1, 4):
        row = ScoringBatch(batch.q[t:t + 1], batch.compressed_k_cache, table, batch.token_to_request[t:t + 1],
                           batch.query_positions[t:t + 1], batch.context_lens, batch.compress_ratio, 1, 0,
                           k_scale=batch.k_scale)
        alone, seen, plan = emulate(row, dict(phase="decode", **row.kwargs()))
        assert plan.group_rows == 1 and seen.item() == visible[t].item()
        assert torch.equal(visible_bits(alone, seen), visible_bits(logits[t:t + 1], visible[t:t + 1])), t


@needs_emulator
@pytest.mark.parametrize("cache", ("fp8", "fp4"))
def test_emulated_quantised_caches_strided_and_unaligned(rng, cache):
    """A quantised cache that is a view of a wider byte buffer: at 16-byte strides (cp.async) and at an odd offset
    and slot stride (byte loads)."""
    batch = make_batch([800, 1300], [2, 3], page_size=16, cache=cache, generator=rng)
    raw = batch.compressed_k_cache.view(torch.uint8)
    key = raw.shape[-1]
    dtype = batch.compressed_k_cache.dtype
    for width, offset in ((key + 48, 16), (key + 11, 3)):
        wide = torch.full((*raw.shape[:3], width), 0x7F, dtype=torch.uint8)
        wide[..., offset:offset + key] = raw
        batch.compressed_k_cache = wide[..., offset:offset + key].view(dtype)
        check_emulated(batch, dict(max_query_len=3, **batch.kwargs()))


@needs_emulator
def test_emulated_mxfp4_exponent_extremes_match_the_dequantiser(rng):
    """MXFP4 blocks at e8m0 exponents 0 (2**-127: bf16 subnormals), 1, 127, 200, 250 and 254 (6 x 2**127 overflows
    to inf in fp32 and bf16, as in the dequantised cache): the scores match the reference on the dequantised cache,
    infinities and NaNs included."""
    batch = make_batch([600], [2], page_size=16, cache="fp4", generator=rng)
    exps = batch.k_scale.view(torch.uint8)
    page = int(batch.page_table[0, 0])
    for slot, e in enumerate((0, 1, 127, 200, 254, 250)):
        exps[page, slot, 0, :] = e
    codes = batch.compressed_k_cache.view(torch.uint8)
    codes[page, 4] = 0x77  # all 6 under 2**127: inf
    codes[page, 5] = 0
    codes[page, 5, 0, 0] = 0x01  # one 0.5 under 2**123: finite
    batch.q.abs_()  # positive dots: the inf of exponent 254 stays inf
    logits, visible, _ = emulate(batch, dict(max_query_len=2, **batch.kwargs()))
    ref_logits, ref_visible = reference_paged_mqa_logits(*batch.args(), **batch.kwargs())
    inf = torch.isposinf(ref_logits[:, :6])
    assert inf[:, 4].all() and not inf[:, 5].any()
    assert torch.equal(torch.isposinf(logits[:, :6]), inf)
    assert_matches_with_nans(torch.where(torch.isposinf(logits), 0.0, logits), visible,
                             torch.where(torch.isposinf(ref_logits), 0.0, ref_logits), ref_visible, label="fp4 exps")


# ---------------------------------------------------------------------------------------------------------------
# NVRTC
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.nvrtc
def test_every_variant_compiles_without_spills_and_warm_up_lists_it(tmp_path, capsys):
    from qsa_aiter.runtime.jit import nvrtc
    from qsa_aiter.runtime.jit.native_store import NativeStore
    from qsa_aiter.tools.cli import main

    root = tmp_path / "jit"
    assert main(["warmup", "--arch", "sm_90", "--kernels", "native_scorer", "--jit-dir", str(root),
                 "--no-progress"]) == 0
    assert f"warm-up sm_90: {len(ns.VARIANTS)} variants, {len(ns.VARIANTS)} compiled" in capsys.readouterr().out
    store = NativeStore(root, "sm_90")
    records = [store.read(eid) for eid in store.entry_ids()]
    assert sorted(r.kernel for r in records) == sorted(ns.BY_NAME)
    for record in records:
        assert (record.spill_store_bytes, record.spill_load_bytes, record.stack_bytes) == (0, 0, 0), record.report
        assert 0 < record.registers <= ns.BY_NAME[record.kernel].max_registers
    assert main(["jit", "list", "--jit-dir", str(root)]) == 0
    listing = capsys.readouterr().out
    assert f"native / sm_90: {len(ns.VARIANTS)} entries" in listing and listing.count("  ok\n") == len(ns.VARIANTS)
    # sm_80, the oldest target: every kernel of the whole source, without spills.
    report = nvrtc.ptxas_report(nvrtc.compile_cubin(ns.source(), "sm_80", name="native_scorer.cu").log)
    assert set(report) == set(ns.BY_NAME)
    assert all((r.spill_store_bytes, r.spill_load_bytes, r.stack_bytes) == (0, 0, 0) for r in report.values())


# ---------------------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------------------

GPU_TOL = 1e-4
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def check_gpu(monkeypatch, batch, hints: dict, label: str):
    """The public op forced to the native scorer on ``batch`` (CUDA tensors), against the reference."""
    force_backend(monkeypatch, "native")
    args = batch.args()
    assert qsa_aiter.selected_kernel(*args, **hints) == "native", qsa_aiter.explain(*args, **hints)
    logits, visible = run_poisoned(args, **hints)
    ref_logits, ref_visible = reference_paged_mqa_logits(*args, **batch.kwargs())
    assert_matches_reference(logits, visible, ref_logits, ref_visible, rtol=GPU_TOL, atol=GPU_TOL, label=label)
    return logits, visible


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=("int32", "int64"))
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=("bf16", "fp16"))
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("phase", ("verify", "draft", "decode"))
def test_gpu_phases_match_the_reference(monkeypatch, rng, phase, page_size, dtype, index_dtype):
    batch, hints = phase_batch(phase, page_size, rng, head_dim=128, dtype=dtype, device="cuda")
    check_gpu(monkeypatch, widened(batch, index_dtype), hints, f"native/{phase}/page{page_size}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=("int32", "int64"))
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("cache,dtype", QUANT_FORMATS, ids=QUANT_IDS)
@pytest.mark.parametrize("phase", ("verify", "draft", "decode"))
def test_gpu_quantised_caches_match_the_dequantised_reference(monkeypatch, rng, phase, cache, dtype, page_size,
                                                              index_dtype):
    batch, hints = phase_batch(phase, page_size, rng, head_dim=128, cache=cache, dtype=dtype, device="cuda")
    check_gpu(monkeypatch, widened(batch, index_dtype), hints, f"native/{phase}/{cache}/page{page_size}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("cache,dtype", QUANT_FORMATS, ids=QUANT_IDS)
def test_gpu_quantised_bad_pages_nan_keys_identical_keys(monkeypatch, rng, cache, dtype, page_size):
    """On the GPU: bad page ids -inf (the unused pages' keys NaN, never read), NaN keys NaN in their column only,
    identical keys bitwise alike, each row alone bitwise as in its group, a strided view of the cache."""
    batch = widened(make_batch([1500, 1100, 700], 3, page_size=page_size, cache=cache, dtype=dtype, generator=rng,
                               spare_pages=4, device="cuda"), torch.int64)
    table, pages = batch.page_table, batch.compressed_k_cache.shape[0]
    used = set(table[table >= 0].tolist())
    poison_keys(batch, torch.tensor([p for p in range(pages) if p not in used], device="cuda"))
    for r, slot, value in [(0, 1, -3), (1, 0, pages), (2, 0, 2**32 + 1)]:
        table[r, slot] = value
    poison_keys(batch, (int(table[1, 1]), 3))
    codes, scales = batch.compressed_k_cache.view(torch.uint8), batch.k_scale
    scales = scales.view(torch.uint8) if scales.dtype.itemsize == 1 else scales
    key, scale = codes[int(table[0, 2]), 1].clone(), scales[int(table[0, 2]), 1].clone()
    for page in table[0, 2:4].tolist():
        codes[page], scales[page] = key, scale
    force_backend(monkeypatch, "native")
    hints = dict(max_query_len=3, **batch.kwargs())
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "native", qsa_aiter.explain(*batch.args(), **hints)
    logits, visible = run_poisoned(batch.args(), **hints)
    ref_logits, ref_visible = reference_paged_mqa_logits(*batch.args(), **batch.kwargs())
    region = torch.arange(logits.shape[1], device="cuda")[None, :] < visible.long()[:, None]
    nan = torch.isnan(ref_logits) & region
    assert nan.any() and torch.isnan(logits[nan]).all()
    assert_matches_reference(torch.where(nan, 0.0, logits), visible, torch.where(nan, 0.0, ref_logits), ref_visible,
                             rtol=GPU_TOL, atol=GPU_TOL, label=f"native/{cache}/page{page_size}")
    for t in range(3):
        same = logits[t, 2 * page_size:4 * page_size]
        assert torch.equal(same, same[:1].expand_as(same)), t
    for t in range(batch.q.shape[0]):
        args = (batch.q[t:t + 1], batch.compressed_k_cache, table, batch.token_to_request[t:t + 1],
                batch.query_positions[t:t + 1], batch.context_lens, batch.compress_ratio)
        alone, seen = run_poisoned(args, phase="decode", max_query_len=1, **batch.kwargs())
        assert torch.equal(visible_bits(alone, seen), visible_bits(logits[t:t + 1], visible[t:t + 1])), t
    raw = codes
    wide = torch.full((*raw.shape[:3], raw.shape[-1] + 48), 0x7F, dtype=torch.uint8, device="cuda")
    wide[..., 16:16 + raw.shape[-1]] = raw
    batch.compressed_k_cache = wide[..., 16:16 + raw.shape[-1]].view(batch.compressed_k_cache.dtype)
    strided, seen = run_poisoned(batch.args(), **hints)
    assert torch.equal(visible_bits(strided, seen), visible_bits(logits, visible))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page_size", (16, 64))
def test_gpu_bad_pages_and_strided_caches(monkeypatch, rng, page_size):
    batch = widened(make_batch([1500, 1100, 700], 3, page_size=page_size, generator=rng, device="cuda"), torch.int64)
    pages = batch.compressed_k_cache.shape[0]
    for r, slot, value in [(0, 1, -3), (1, 0, pages), (2, 0, 2**32 + 1)]:
        batch.page_table[r, slot] = value
    check_gpu(monkeypatch, batch, dict(max_query_len=3), f"native/bad pages/page{page_size}")
    cache = batch.compressed_k_cache
    for width, offset in ((192, 0), (139, 3)):
        wide = torch.full((*cache.shape[:3], width), float("nan"), dtype=cache.dtype, device="cuda")
        wide[..., offset:offset + 128] = cache
        batch.compressed_k_cache = wide[..., offset:offset + 128]
        check_gpu(monkeypatch, batch, dict(max_query_len=3), f"native/view {width}+{offset}/page{page_size}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page_size", (16, 64))
def test_gpu_a_row_alone_equals_it_in_its_batch_and_identical_keys_tie(monkeypatch, rng, page_size):
    """9 requests x 4 verify rows over 20K-70K tokens (a work-point shape, smaller); every row scored alone (decode)
    equals its row in the batch bitwise; a request whose keys are all one key scores every column alike; a second
    call (the replayed launch) is bitwise the first."""
    contexts = [20000 + 6000 * i + 13 * i for i in range(9)]
    batch = make_batch(contexts, 4, page_size=page_size, generator=rng, device="cuda")
    cache, table = batch.compressed_k_cache, batch.page_table
    cache[table[3, :4].long()] = cache[table[3, 0], 7].clone()
    hints = dict(max_query_len=4)
    logits, visible = check_gpu(monkeypatch, batch, hints, f"native/9x4/page{page_size}")
    tied = logits[12:16, : 4 * page_size]
    assert torch.equal(tied, tied[:, :1].expand_as(tied))
    again, visible2 = run_poisoned(batch.args(), **hints)
    assert torch.equal(visible_bits(again, visible2), visible_bits(logits, visible))
    for t in range(0, 36, 5):
        args = (batch.q[t:t + 1], cache, table, batch.token_to_request[t:t + 1], batch.query_positions[t:t + 1],
                batch.context_lens, batch.compress_ratio)
        alone, seen = run_poisoned(args, phase="decode", max_query_len=1)
        assert torch.equal(visible_bits(alone, seen), visible_bits(logits[t:t + 1], visible[t:t + 1])), t


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_captured_call_replays_with_new_positions(monkeypatch, rng):
    """The op forced to the native scorer inside a CUDA graph: each replay scores the queries, positions and context
    lengths the tensors hold then (read on the device), like an eager call."""
    batch = make_batch([9000, 5000, 12000], 4, page_size=64, generator=rng, device="cuda", padded_rows=2)
    force_backend(monkeypatch, "native")
    q, cache, table, t2r, pos, ctx, _ = batch.args()
    out = poisoned_logits(batch.args())
    graph, (logits, visible) = capture_graph(
        lambda: qsa_aiter.qsa_paged_mqa_logits(q, cache, table, t2r, pos, ctx, out=out, max_query_len=4), warmups=2)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for step in range(2):
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype))
        if step:
            pos[:12].add_(1)
            ctx.add_(1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_logits, ref_visible = reference_paged_mqa_logits(q, cache, table, t2r, pos, ctx)
        assert_matches_reference(out, visible, ref_logits, ref_visible, rtol=GPU_TOL, atol=GPU_TOL,
                                 label=f"native/graph replay {step}")

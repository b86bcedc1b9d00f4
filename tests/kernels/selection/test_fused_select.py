"""The fused selection (``kernels/selection/fused_select.cu``: the native scorer's tiles, candidates above a gate and
the last CTA's and the selectors' exact select with the expansion, in one launch; its spec ``fused_select.SPEC``, its
launch ``runtime/fused_select.py`` and the ``native_fused`` selection candidate).

- Host logic: the declared parameters are the source's, the variants, the catalog, plans (row groups, split, the
  scores' room, the workspace), the reasons, the registry's order, ``explain_selection`` and forcing it.
- The device code on the CPU through the CUDA emulator (the grid's CTAs together, in several thread orders), the outputs
  poisoned: the block indices and tokens equal ``torch_block_topk`` + ``torch_expand_block_indices`` over the
  kernel's own debug scores, and the debug scores equal the oracle (``reference_paged_mqa_logits``) on ``[0,
  visible)`` (nothing written past it); verify and decode shapes, page 16 and 64, int32 and int64 metadata, bad page
  ids, padded rows, uneven contexts, identical keys (ties to the lower group), rows shorter than the budget, 1 to 4
  CTAs a group; repeats and thread orders bitwise alike, the workspace clean after each launch, a row alone equal to
  it in its batch, the gate's candidates fewer than the columns of random rows and all of them for constant rows; fp8
  (bf16 and fp16 queries) and MXFP4 caches, their scores against the oracle on the dequantised cache.
- NVRTC (marked ``nvrtc``): every variant compiles for sm_90 without spills; warm-up builds them, ``jit list`` lists
  them.
- On a GPU (marked ``gpu``): the op forced to ``native_fused`` against its composite path (every cache format),
  wider rows, and a CUDA-graph capture replayed with new lengths.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels import catalog
from qsa_aiter.kernels.native_spec import macro_params
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring.base import example_problem
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits
from qsa_aiter.kernels.selection import fused_select as fs
from qsa_aiter.kernels.selection import grid_topk as gt
from qsa_aiter.kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from qsa_aiter.runtime import registries
from qsa_aiter.runtime.fused_select import (CANDIDATE, candidates_offered, emulated_fused_select,
                                             fused_select_reasons)
from qsa_aiter.runtime.jit import emulated
from qsa_aiter.runtime.registries import SelectionProblem
from qsa_aiter.tools.inputs import selection_call
from qsa_aiter.tools.workloads import ScoringBatch, make_batch

SM90 = Platform.named("sm_90")
ON_GPU = torch.cuda.is_available() and torch.version.cuda is not None
needs_emulator = pytest.mark.skipif(emulated.unavailable_reason() is not None,
                                    reason=f"cannot emulate: {emulated.unavailable_reason()}")
TOL = 1e-5


def widened(batch, index_dtype: torch.dtype):
    for name in ("page_table", "token_to_request", "query_positions", "context_lens"):
        setattr(batch, name, getattr(batch, name).to(index_dtype))
    return batch


#: ``(problem, args)`` of a ``qsa_select_paged_tokens`` call on a batch (validated as the op validates it).
selection = selection_call


def emulate(batch, token_topk: int, hints: dict, *, split: int = 2, order_seed: int = 0, workspace=None,
            candidates=None, cached=None, cluster=False):
    """The fused kernel on ``batch`` through the emulator, outputs poisoned: ``(blocks, tokens, scores, workspace,
    plan)``."""
    problem, args = selection(batch, token_topk, hints)
    score = problem.score
    variant = fs.variant_for(batch.compressed_k_cache.dtype, batch.compressed_k_cache.shape[1], batch.q.dtype)
    groups = -(-score.num_tokens // fs.scorer.group_rows_of(score))
    columns = max(score.num_columns, 1) if score.num_columns > problem.block_topk else 1
    plan = fs.split_plan(split, variant, fs.scorer.group_rows_of(score), groups, columns, SM90, cluster)
    if score.num_columns <= problem.block_topk:
        plan = fs.Plan(variant, plan.group_rows, groups, split, 0, plan.cluster)
    scores = torch.full((score.num_tokens, score.num_columns), float("nan"))
    blocks, workspace = emulated_fused_select(problem, args, plan, scores=scores, workspace=workspace,
                                              order_seed=order_seed, candidates=candidates, cached=cached)
    return blocks, args.out, scores, workspace, plan


def assert_clean(workspace: torch.Tensor, plan: fs.Plan) -> None:
    """Every row's arrival counter, gate and histogram are zero again after a launch (the next one, of any plan,
    needs no zeroing; the counts and candidates are rewritten before they are read)."""
    assert not workspace.any(), "the launch left the workspace dirty"


def check(batch, token_topk: int, hints: dict, **kwargs):
    """``emulate`` against the torch top-k and expansion of its own scores, its scores against the oracle, nothing
    written past a row's visible count, the workspace clean."""
    blocks, tokens, scores, workspace, plan = emulate(batch, token_topk, hints, **kwargs)
    ratio, block_topk = batch.compress_ratio, token_topk // batch.compress_ratio
    ref_logits, visible = reference_paged_mqa_logits(*batch.args(), **batch.kwargs())
    columns = torch.arange(scores.shape[1])[None, :]
    inside = columns < visible.long()[:, None]
    wide = (visible > block_topk)
    # Rows wider than the budget are scored (their group's other rows too): the oracle's scores on [0, visible).
    rows = wide.nonzero().flatten()
    mask = inside[rows]
    torch.testing.assert_close(scores[rows][mask], ref_logits[rows][mask], rtol=TOL, atol=TOL, equal_nan=True)
    assert torch.isnan(scores[~inside]).all(), "the kernel wrote a score at or past a row's visible count"
    want = torch.empty_like(blocks)
    torch_block_topk(torch.where(inside, scores, 0.0), visible, block_topk, want)
    assert torch.equal(blocks, want), plan.describe()
    want_tokens = torch.empty_like(tokens)
    torch_expand_block_indices(want, batch.query_positions, batch.context_lens, batch.token_to_request, ratio,
                               token_topk, want_tokens)
    assert torch.equal(tokens, want_tokens), plan.describe()
    assert_clean(workspace, plan)
    return blocks, tokens, scores, plan


# ---------------------------------------------------------------------------------------------------------------
# Host logic
# ---------------------------------------------------------------------------------------------------------------


def test_the_source_spells_the_declared_parameters_and_splices_both_halves():
    text = fs.source()
    assert macro_params(text, "QSA_FUSED_PARAMS") == fs.PARAMS
    assert re.search(r"#define QSA_FUSED_CTAS_PER_SM (\d+)\n", text).group(1) == str(fs.CTAS_PER_SM)
    for macro, value in (("FUSED_TAIL_WORDS", fs.TAIL_WORDS), ("FUSED_MAX_SPLIT", fs.MAX_SPLIT),
                         ("FUSED_MAX_CLUSTER", fs.MAX_CLUSTER), ("FUSED_ROW_HEAD", fs.ROW_HEAD_WORDS),
                         ("GRID_BINS", fs.BINS)):
        assert re.search(rf"#define {macro} (\d+)\n", text).group(1) == str(value), macro
    for name in ("native_scorer.cu", "native_compat.h", "native_mma.h", "grid_topk.cu"):
        assert f'#line 1 "{name}"' in text, name
    assert "#include" not in text
    # Each declared variant is instantiated once, with its page size, query type and the scorer's format; k_scale is
    # where the scorer takes it (after keys).
    kinds = {"bf16": "QSA_KIND_16BIT", "fp8": "QSA_KIND_FP8", "fp4": "QSA_KIND_FP4"}
    instantiated = {m[0]: m[1:] for m in re.findall(r"\nQSA_FUSED_KERNEL\((\w+), (\d+), (true|false), (\w+)\)", text)}
    assert instantiated == {v.name: (str(v.page_size), "true" if v.key_dtype == "fp16" else "false", kinds[v.kv])
                            for v in fs.VARIANTS}
    assert [p.name for p in fs.PARAMS[:3]] == [p.name for p in fs.scorer.PARAMS[:3]] == ["q", "keys", "k_scale"]
    binding = {name: (pointers, count) for name, pointers, count in fs.SPEC.emulator_kernels()}
    assert set(binding) == set(fs.BY_NAME) and len(fs.SCALARS) <= emulated.MAX_SCALARS
    assert len(fs.POINTERS) <= emulated.MAX_POINTERS


def test_variants_the_catalog_and_plans():
    assert [v.name for v in fs.variants_for(SM90)] == [
        "qsa_fused_bf16_page16", "qsa_fused_bf16_page64", "qsa_fused_fp16_page16", "qsa_fused_fp16_page64",
        "qsa_fused_fp8_bf16_page16", "qsa_fused_fp8_bf16_page64", "qsa_fused_fp8_fp16_page16",
        "qsa_fused_fp8_fp16_page64", "qsa_fused_fp4_bf16_page16", "qsa_fused_fp4_bf16_page64"]
    assert [v.name.replace("qsa_fused_", "") for v in fs.VARIANTS] == [
        v.name.replace("qsa_score_", "") for v in fs.scorer.VARIANTS]  # the scorer's formats, one for one
    assert fs.variants_for(Platform.named("gfx942")) == ()
    assert catalog.native_spec_named("fused_select") is fs.SPEC
    assert fs.variant_for(torch.float16, 64).name == "qsa_fused_fp16_page64"
    assert fs.variant_for(torch.float8_e4m3fn, 16, torch.float16).name == "qsa_fused_fp8_fp16_page16"
    assert fs.variant_for(torch.float4_e2m1fn_x2, 64, torch.bfloat16).name == "qsa_fused_fp4_bf16_page64"
    with pytest.raises(ValueError, match="no native scorer kernel"):
        fs.variant_for(torch.float4_e2m1fn_x2, 64, torch.float16)
    for cache, dtype, name in (("fp8", torch.float16, "qsa_fused_fp8_fp16_page64"),
                               ("fp4", torch.bfloat16, "qsa_fused_fp4_bf16_page64")):
        quant, _ = selection(make_batch([5000, 3000], 4, page_size=64, cache=cache, dtype=dtype), 512,
                             dict(max_query_len=4))
        assert fs.choose_plan(quant, SM90).variant.name == name
    assert fs.SPEC.defines(fs.BY_NAME["qsa_fused_bf16_page16"], "sm_90")[:2] == (
        "QSA_FUSED_SINGLE", "QSA_FUSED_KERNEL_qsa_fused_bf16_page16")
    batch = make_batch([20000, 30000, 9000], 4, page_size=64)
    problem, _ = selection(batch, 2048, dict(max_query_len=4))
    plan = fs.choose_plan(problem, SM90)
    assert plan.group_rows == 4 and plan.row_groups == 3 and plan.selectors == 9 and plan.grid == 3 * plan.split + 9
    assert plan.cap * plan.split >= problem.score.num_columns and plan.cap % 64 == 0
    # The scorer's split where the scores fit 3 CTAs a multiprocessor: one wave over the multiprocessors.
    assert plan.split == min(-(-problem.score.num_columns // 128), SM90.multiprocessors * 3 // 3)
    assert 3 * (plan.shared_bytes + gt.RESERVED_PER_CTA) <= SM90.shared_memory_per_multiprocessor
    assert plan.workspace_words == 12 * 2080
    assert plan.candidate_words == 12 * (-(-plan.split // 4) * 4 + 2 * plan.split * plan.cap)
    call = fs.launch_arguments(plan, {name: 1 for name in fs.SCALARS})
    assert call.scalar("split") == plan.split and call.scalar("cap") == plan.cap and call.block == (128, 1, 1)
    with pytest.raises(ValueError, match="missing scalar"):
        fs.launch_arguments(plan, {})
    # A budget wider than every row: no scores held.
    narrow, _ = selection(make_batch([300, 200], 1, page_size=16), 2048, dict(phase="decode"))
    assert fs.choose_plan(narrow, SM90).cap == 0


def test_cluster_plans():
    """One cluster a group where asked (sm_90 only, one CTA a row at least, at most 16, no selectors, launched with
    the cluster's size); choose_plan keeps the last arriver's design (cluster plans measured slower)."""
    many, _ = selection(make_batch([33000] * 16, 4, page_size=64), 2048, dict(max_query_len=4))
    assert fs.choose_plan(many, SM90).cluster == 0
    plan = fs.problem_split_plan(many, 16, SM90, cluster=True)
    assert (plan.cluster, plan.split, plan.selectors, plan.grid) == (16, 16, 0, 16 * 16), plan
    assert "one cluster each" in plan.describe()
    call = fs.launch_arguments(plan, {name: 1 for name in fs.SCALARS})
    assert call.cluster == 16 and call.scalar("cluster") == 16 and call.grid == (256, 1, 1)
    assert fs.launch_arguments(fs.choose_plan(many, SM90), {name: 1 for name in fs.SCALARS}).cluster == 1
    sm80 = dataclasses.replace(SM90, arch="sm_80", capability=(8, 0))
    variant = plan.variant
    with pytest.raises(ValueError, match="4 to 16 CTAs a group"):
        fs.split_plan(3, variant, 4, 16, 8192, SM90, cluster=True)
    with pytest.raises(ValueError, match="4 to 16 CTAs a group"):
        fs.split_plan(17, variant, 4, 16, 8192, SM90, cluster=True)
    with pytest.raises(ValueError, match="compute capability 9.0"):
        fs.split_plan(8, variant, 4, 16, 8192, sm80, cluster=True)


def test_reasons_name_what_it_does_not_serve():
    def problem_of(**change):
        batch = make_batch([4000, 3000], 4, page_size=64, **change)
        return selection(batch, 512, dict(max_query_len=4))[0]

    assert fs.SPEC.reasons(problem_of(), SM90) == []
    for cache, dtype in (("fp8", torch.bfloat16), ("fp8", torch.float16), ("fp4", torch.bfloat16)):
        assert fs.SPEC.reasons(problem_of(cache=cache, dtype=dtype), SM90) == [], (cache, dtype)
    assert "float8_e4m3fnuz cache" in fs.SPEC.reasons(problem_of(cache="fp8_fnuz"), SM90)[0]
    fp4_fp16 = dataclasses.replace(problem_of(cache="fp4"), score=dataclasses.replace(
        problem_of(cache="fp4").score, q_dtype=torch.float16))
    assert "MXFP4 keys with float16 queries" in fs.SPEC.reasons(fp4_fp16, SM90)[0]
    assert "needs 4 heads (got 8)" in fs.SPEC.reasons(problem_of(heads=8), SM90)[0]
    assert "needs head_dim 128 (got 64)" in fs.SPEC.reasons(problem_of(head_dim=64), SM90)[0]
    assert "no AMD version yet" in fs.SPEC.reasons(problem_of(), Platform.named("gfx942"))[0]
    volta = Platform("sm_70", "cuda", (7, 0), 80, False)
    assert "compute capability 8.0 or newer" in fs.SPEC.reasons(problem_of(), volta)[0]
    # Scores past what shared memory holds across MAX_SPLIT CTAs: a context of 44M tokens, 4 rows a group.
    huge = SelectionProblem(example_problem(num_tokens=4, num_requests=1, max_query_len=4, num_columns=11_000_000),
                            512, 4)
    found = fs.SPEC.reasons(huge, SM90)
    assert len(found) == 1 and "exceed shared memory" in found[0], found
    on_cpu = fused_select_reasons(problem_of(), SM90, None)
    assert on_cpu[0] == "needs CUDA GPU tensors (tensors are on cpu)"


def test_the_registry_ranks_it_after_the_composite_path_and_forcing_it_names_its_reasons(monkeypatch):
    assert CANDIDATE in registries.SELECTION.candidates
    assert registries.SELECTION.candidates[CANDIDATE].reasons is fused_select_reasons
    batch = make_batch([1500, 900], [4, 3], page_size=16)
    args = (*batch.args()[:6], 64, 4)
    text = qsa_aiter.explain_selection(*args, max_query_len=4)
    assert "composite > native_fused" in text and "- native_fused: needs CUDA GPU tensors" in text, text
    monkeypatch.setenv("QSA_AITER_SELECT_BACKEND", CANDIDATE)
    with pytest.raises(ValueError, match="native_fused: needs CUDA GPU tensors"):
        qsa_aiter.qsa_select_paged_tokens(*args, max_query_len=4)


def test_tuned_rows_time_it_against_the_composite_path(monkeypatch, tmp_path, without_shipped_topk_rows):
    """Rows of ``fused_select`` in the scoring table (the whole call's time) are compared with the composite path's
    measured scoring plus top-k at the same bucket: the faster is chosen; without the top-k's row the composite path
    has no measurement and the order stands."""
    from qsa_aiter.runtime.settings import get_settings

    score = example_problem()
    problem = SelectionProblem(score, 2048, score.num_tokens)
    rows, context = score.num_tokens, score.num_columns * score.compress_ratio
    header = "arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context,us,measured,source"
    topk = tmp_path / "topk.csv"
    topk.write_text("arch,block_topk,rows,columns,candidate,plan,us,measured,source\n"
                    f"sm_90,512,{rows},{score.num_columns},triton,,30.0,1,test\n")
    serving = ["composite", CANDIDATE]
    for fused_us, expected in ((20.0, CANDIDATE), (40.0, "composite")):
        scoring = tmp_path / f"scoring{fused_us:.0f}.csv"  # (tables are read once per file list)
        scoring.write_text(f"{header}\nsm_90,stacked,bf16,64,4,128,{rows},{context},1.0,1,test\n"
                           f"sm_90,fused_select,bf16,64,4,128,{rows},{context},{fused_us},1,test\n")
        monkeypatch.setenv("QSA_AITER_TUNED_CONFIG", f"{scoring}:{topk}")
        chosen = registries.SELECTION.measured_choice(problem, serving, SM90, get_settings())
        assert chosen is not None and chosen[0] == expected, chosen
        assert "composite 31.00 us" in chosen[1] and f"{CANDIDATE} {fused_us:.2f} us" in chosen[1], chosen[1]
        assert "scoring 1.00 us + top-k 30.00 us" in chosen[1]
    only = tmp_path / "only.csv"
    only.write_text(f"{header}\nsm_90,fused_select,bf16,64,4,128,{rows},{context},1.0,1,test\n")
    monkeypatch.setenv("QSA_AITER_TUNED_CONFIG", str(only))
    assert registries.SELECTION.measured_choice(problem, serving, SM90, get_settings()) is None


# ---------------------------------------------------------------------------------------------------------------
# The device code, emulated
# ---------------------------------------------------------------------------------------------------------------


@needs_emulator
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=("int32", "int64"))
@pytest.mark.parametrize("page_size", (16, 64))
def test_emulated_verify_matches_its_scores_and_the_oracle(rng, page_size, index_dtype):
    """Uneven rows per request (groups straddle requests), a padded row, uneven contexts; 1 and 3 CTAs a group."""
    batch = widened(make_batch([2000, 900, 1300], [4, 3, 2], page_size=page_size, generator=rng, padded_rows=1),
                    index_dtype)
    for split in (1, 3):
        check(batch, 64, dict(max_query_len=4), split=split)


@needs_emulator
@pytest.mark.parametrize("page_size", (16, 64))
def test_emulated_cluster_plans_match_their_scores_and_the_oracle(rng, page_size):
    """Each group's CTAs one cluster: verify rows (groups straddle requests, a padded row, uneven contexts, a request
    shorter than the budget) with 4 and 5 CTAs a group, decode rows with 2 and 3, int64 metadata."""
    batch = widened(make_batch([2000, 900, 60, 1300], [4, 3, 2, 2], page_size=page_size, generator=rng,
                               padded_rows=1), torch.int64)
    for split in (4, 5):
        check(batch, 64, dict(max_query_len=4), split=split, cluster=True)
    decode = make_batch([1700, 100, 800, 2600], 1, page_size=page_size, generator=rng)
    for split in (2, 3):
        blocks, _, _, plan = check(decode, 128, dict(phase="decode"), split=split, cluster=True)
        assert plan.cluster == split and blocks[1].tolist() == list(range(25)) + [-1] * 7


@needs_emulator
@pytest.mark.parametrize("page_size", (16, 64))
def test_emulated_decode_short_rows_and_fp16(rng, page_size):
    """One row a request (decode), K = 32 groups: a request shorter than the budget takes every group, unscored."""
    batch = make_batch([1700, 100, 800, 2600], 1, page_size=page_size, generator=rng, dtype=torch.float16)
    blocks, _, _, _ = check(batch, 128, dict(phase="decode"), split=4)
    assert blocks[1].tolist() == list(range(25)) + [-1] * 7


@needs_emulator
def test_emulated_bad_page_ids_and_identical_keys_tie_to_the_lower_group(rng):
    """Bad page ids score -inf (they rank last but count); a request whose first pages hold one key: its tied
    columns are taken lowest first."""
    batch = widened(make_batch([1500, 1100], [4, 2], page_size=16, generator=rng), torch.int64)
    pages = batch.compressed_k_cache.shape[0]
    for r, slot, value in [(0, 5, -3), (1, 0, pages), (1, 2, 2**32 + 1)]:
        batch.page_table[r, slot] = value
    cache, table = batch.compressed_k_cache, batch.page_table
    key = cache[table[0, 0], 3].clone() * 4  # a strong key: its ties fill the budget
    for page in table[0, :6].tolist():
        if 0 <= page < pages:
            cache[page] = key
    blocks, _, scores, _ = check(batch, 64, dict(max_query_len=4), split=2)
    taken = 0
    for t in range(4):
        assert torch.isneginf(scores[t, 80:96]).all()
        assert (scores[t, :80] == scores[t, 0]).all()
        tied = [c for c in blocks[t].tolist() if 0 <= c < 80]
        assert tied == list(range(len(tied))), blocks[t]  # the lowest of the tied groups
        taken += len(tied)
    assert taken > 0


@needs_emulator
def test_emulated_repeats_splits_orders_and_a_row_alone_are_bitwise_alike(rng):
    """The same tokens with 1 to 4 CTAs a group, another thread order and a reused workspace; each row selected alone
    (decode) equals its row in the batch."""
    batch = make_batch([2100, 1400], [4, 3], page_size=64, generator=rng)
    first, tokens, scores, _ = check(batch, 32, dict(max_query_len=4), split=1)
    workspace = None
    for split, seed in ((2, 0), (3, 5), (4, 9), (2, 1)):
        blocks, again, _, workspace, plan = emulate(batch, 32, dict(max_query_len=4), split=split, order_seed=seed,
                                                 workspace=workspace if split == 2 else None)
        assert torch.equal(blocks, first) and torch.equal(again, tokens), (split, seed)
        assert_clean(workspace, plan)
    for t in (0, 3, 5):
        row = ScoringBatch(batch.q[t:t + 1], batch.compressed_k_cache, batch.page_table,
                           batch.token_to_request[t:t + 1], batch.query_positions[t:t + 1], batch.context_lens,
                           batch.compress_ratio, 1, 0)
        alone, alone_tokens, alone_scores, _ = check(row, 32, dict(phase="decode"), split=2)
        assert torch.equal(alone, first[t:t + 1]) and torch.equal(alone_tokens, tokens[t:t + 1]), t
        seen = ~torch.isnan(alone_scores[0])
        assert torch.equal(alone_scores[0][seen].view(torch.int32), scores[t][seen].view(torch.int32)), t


# Quantised caches: (cache format, query dtype) of each quantised kernel (the scorer's, test_native_scorer.py's).
QUANT_FORMATS = [("fp8", torch.bfloat16), ("fp8", torch.float16), ("fp4", torch.bfloat16)]
QUANT_IDS = ["fp8-bf16q", "fp8-fp16q", "fp4-bf16q"]


@needs_emulator
@pytest.mark.parametrize("index_dtype", (torch.int32, torch.int64), ids=("int32", "int64"))
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("cache,dtype", QUANT_FORMATS, ids=QUANT_IDS)
def test_emulated_quantised_caches_match_their_scores_and_the_oracle(rng, cache, dtype, page_size, index_dtype):
    """fp8 (bf16 and fp16 queries) and MXFP4 caches: verify rows (groups straddle requests, a padded row, uneven
    contexts) with 2 CTAs a group, then decode rows (one a request, one shorter than the budget) with 3: the blocks
    and tokens are the torch top-k of the kernel's own scores, and those the oracle's on the dequantised cache within
    the scorer's tolerance."""
    batch = widened(make_batch([2000, 900, 1300], [4, 3, 2], page_size=page_size, cache=cache, dtype=dtype,
                               generator=rng, padded_rows=1), index_dtype)
    _, _, scores, plan = check(batch, 64, dict(max_query_len=4), split=2)
    assert plan.variant.kv == cache and plan.variant.key_dtype == fs.scorer.KEY_DTYPES[dtype]
    assert plan.variant.name == f"qsa_fused_{cache}_{plan.variant.key_dtype}_page{page_size}"
    assert torch.isfinite(scores[~torch.isnan(scores)]).all()
    decode = widened(make_batch([1500, 100, 700], 1, page_size=page_size, cache=cache, dtype=dtype, generator=rng),
                     index_dtype)
    blocks, _, _, _ = check(decode, 128, dict(phase="decode"), split=3)
    assert blocks[1].tolist() == list(range(25)) + [-1] * 7


@needs_emulator
@pytest.mark.parametrize("cache", ("fp8", "fp4"))
def test_emulated_quantised_bad_pages_and_strided_unaligned_caches(rng, cache):
    """Bad page ids score -inf (their keys and scales never read); the cache a view of a wider byte buffer (its gaps
    e4m3fn NaN bytes) at 16-byte strides (cp.async) and at an odd offset and slot stride (byte loads)."""
    batch = widened(make_batch([1500, 1100], [4, 2], page_size=16, cache=cache, generator=rng), torch.int64)
    pages = batch.compressed_k_cache.shape[0]
    for r, slot, value in [(0, 5, -3), (1, 0, pages), (1, 2, 2**32 + 1)]:
        batch.page_table[r, slot] = value
    _, _, scores, _ = check(batch, 64, dict(max_query_len=4), split=2)
    assert torch.isneginf(scores[:4, 80:96]).all() and torch.isneginf(scores[4:, :16]).all()
    raw = batch.compressed_k_cache.view(torch.uint8)
    key, dtype = raw.shape[-1], batch.compressed_k_cache.dtype
    for width, offset in ((key + 48, 16), (key + 11, 3)):
        wide = torch.full((*raw.shape[:3], width), 0x7F, dtype=torch.uint8)
        wide[..., offset:offset + key] = raw
        batch.compressed_k_cache = wide[..., offset:offset + key].view(dtype)
        _, _, again, _ = check(batch, 64, dict(max_query_len=4), split=3)
        assert torch.equal(again.view(torch.int32), scores.view(torch.int32)), (width, offset)


@needs_emulator
@pytest.mark.parametrize("cached", (None, 24), ids=("shared", "workspace"))
def test_emulated_the_gate_keeps_few_candidates_and_never_drops_a_selected_one(rng, cached):
    """Two 4-row groups whose rows differ: a row whose K best columns share one bin and nothing else does, random rows,
    a row with fewer visible groups than K, two constant rows (every key tied: every column a candidate, ties to the
    lowest columns) and a padded row.  Random rows offer far fewer candidates than columns (the gate rises as the
    CTAs merge their histograms), and every row's output is exact; then again on the same workspace with new lengths
    (shorter positions) and another thread order, the workspace clean after each launch.  With the finish's shared
    cache cut to 24 candidates a row, every row's candidates are read from the workspace instead: the same output."""
    k, ratio = 16, 4
    batch = make_batch([2000, 1800, 60, 1500, 900], [1, 2, 1, 2, 1], page_size=16, generator=rng, padded_rows=1)
    cache, table = batch.compressed_k_cache, batch.page_table

    def column(r: int, c: int):
        return cache[table[r, c // 16], c % 16]

    for r in (0, 3):  # request 0: zero keys but K strong ones (one bin); request 3: every key zero
        for page in table[r][table[r] >= 0].tolist():
            cache[page] = 0
    strong = [3, 40, 41, 90, 130, 131, 200, 201, 250, 300, 301, 330, 400, 401, 440, 470]
    for c in strong:
        column(0, c).copy_(batch.q[0, 0])
    workspace = torch.zeros(2 * 4 * fs.ROW_CLEAN_WORDS, dtype=torch.int32)
    for step, seed in ((0, 0), (1, 3)):
        problem, _ = selection(batch, k * ratio, dict(max_query_len=4))
        variant = fs.variant_for(cache.dtype, 16, batch.q.dtype)
        plan = fs.split_plan(4, variant, 4, 2, problem.score.num_columns, SM90)
        candidates = torch.full((plan.candidate_words,), -7, dtype=torch.int32)
        blocks, _, scores, _ = check(batch, k * ratio, dict(max_query_len=4), split=4, workspace=workspace,
                                     order_seed=seed, candidates=candidates, cached=cached)
        _, visible = reference_paged_mqa_logits(*batch.args())
        offered = candidates_offered(candidates, plan)
        if step == 0:
            assert blocks[0].tolist() == strong and blocks[4].tolist() == list(range(k)), blocks
            assert offered[4:6].tolist() == visible[4:6].tolist(), "a constant row offers every column"
        for t in (1, 2, 6):  # random rows
            assert k <= int(offered[t]) < int(visible[t]) // 2, (step, t, offered, visible)
        batch.query_positions -= torch.tensor([1500, 600, 0, 900, 20, 10, 0, 0], dtype=batch.query_positions.dtype)


@needs_emulator
@pytest.mark.parametrize("cached", (None, 24), ids=("shared", "workspace"))
def test_emulated_cluster_plans_with_ties_constant_rows_and_overflow(rng, cached):
    """Cluster plans on the gate test's rows: K strong keys in one bin, random rows, a row shorter than the budget,
    two constant rows (every column in the threshold bin: ties to the lowest columns) and a padded row, 4 CTAs a
    group; with the selecting CTA's cache cut to 24 candidates, the rows' candidates go through the workspace."""
    k, ratio = 16, 4
    batch = make_batch([2000, 1800, 60, 1500, 900], [1, 2, 1, 2, 1], page_size=16, generator=rng, padded_rows=1)
    cache, table = batch.compressed_k_cache, batch.page_table
    for r in (0, 3):
        for page in table[r][table[r] >= 0].tolist():
            cache[page] = 0
    strong = [3, 40, 41, 90, 130, 131, 200, 201, 250, 300, 301, 330, 400, 401, 440, 470]
    for c in strong:
        cache[table[0, c // 16], c % 16].copy_(batch.q[0, 0])
    blocks, _, _, plan = check(batch, k * ratio, dict(max_query_len=4), split=4, cluster=True, cached=cached)
    assert plan.cluster == 4
    assert blocks[0].tolist() == strong and blocks[4].tolist() == list(range(k)), blocks


@pytest.mark.slow
@needs_emulator
@pytest.mark.parametrize("token_topk", (32, 256))
def test_emulated_more_requests_and_budgets(rng, token_topk):
    """~2000 columns (8000 tokens) beside short and uneven requests, budgets of 8 and 64 groups."""
    batch = make_batch([8000, 700, 1900, 260, 1200], [4, 4, 1, 2, 3], page_size=16, generator=rng, padded_rows=2)
    for split in (1, 2, 4):
        check(batch, token_topk, dict(max_query_len=4), split=split)


# ---------------------------------------------------------------------------------------------------------------
# NVRTC
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.nvrtc
def test_every_variant_compiles_without_spills_and_warm_up_lists_it(tmp_path, capsys):
    from qsa_aiter.runtime.jit.native_store import NativeStore
    from qsa_aiter.tools.cli import main

    root = tmp_path / "jit"
    assert main(["warmup", "--arch", "sm_90", "--kernels", "fused_select", "--jit-dir", str(root),
                 "--no-progress"]) == 0
    assert f"warm-up sm_90: {len(fs.VARIANTS)} variants, {len(fs.VARIANTS)} compiled" in capsys.readouterr().out
    store = NativeStore(root, "sm_90")
    records = [store.read(eid) for eid in store.entry_ids()]
    assert sorted(r.kernel for r in records) == sorted(fs.BY_NAME)
    for record in records:
        print(record.kernel, record.registers, record.spill_store_bytes, record.spill_load_bytes, record.stack_bytes)
        assert (record.spill_store_bytes, record.spill_load_bytes, record.stack_bytes) == (0, 0, 0), record.report
        assert 0 < record.registers <= fs.BY_NAME[record.kernel].max_registers
    assert main(["jit", "list", "--jit-dir", str(root)]) == 0
    listing = capsys.readouterr().out
    assert listing.count("  ok\n") == len(fs.VARIANTS)


# ---------------------------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def run_op(monkeypatch, batch, token_topk: int, hints: dict, backend: str) -> torch.Tensor:
    monkeypatch.setenv("QSA_AITER_SELECT_BACKEND", backend)
    out = torch.full((batch.q.shape[0], token_topk + batch.compress_ratio - 1), -5, dtype=torch.int32,
                     device=batch.q.device)
    return qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], token_topk, batch.compress_ratio, out=out,
                                             **batch.kwargs(), **hints)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cache,dtype", [(None, torch.bfloat16), (None, torch.float16), *QUANT_FORMATS],
                         ids=["bf16", "fp16", *QUANT_IDS])
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("shape", ("verify", "decode", "wide"))
def test_gpu_matches_its_own_scores_and_the_composite_path(monkeypatch, rng, shape, page_size, cache, dtype):
    """The op forced to native_fused equals the torch top-k of the kernel's own debug scores (exact; the scores
    within the scorer's tolerance of the oracle, on the dequantised cache for fp8 and MXFP4), and the composite
    path's tokens with the native scorer forced (the same scores: exactly)."""
    from qsa_aiter.runtime.fused_select import fused_select

    contexts, rows, hints, token_topk = {
        "verify": ([9000, 20000, 3000, 14000], 4, dict(max_query_len=4), 512),
        "decode": ([9000, 20000, 3000, 14000, 60000, 1000], 1, dict(phase="decode"), 2048),
        "wide": ([120000, 250000], 4, dict(max_query_len=4), 2048),
    }[shape]
    batch = make_batch(contexts, rows, page_size=page_size, cache=cache, dtype=dtype, generator=rng, device="cuda",
                       padded_rows=1)
    problem, args = selection(batch, token_topk, hints, out=torch.empty(
        (batch.q.shape[0], token_topk + 3), dtype=torch.int32, device="cuda"))
    scores = torch.full((problem.score.num_tokens, problem.score.num_columns), float("nan"), device="cuda")
    blocks = fused_select(problem, args, scores=scores)
    ref_logits, visible = reference_paged_mqa_logits(*batch.args(), **batch.kwargs())
    inside = torch.arange(scores.shape[1], device="cuda")[None, :] < visible.long()[:, None]
    wide = (visible > problem.block_topk).nonzero().flatten()
    torch.testing.assert_close(scores[wide][inside[wide]], ref_logits[wide][inside[wide]], rtol=1e-4, atol=1e-4)
    want = torch.empty_like(blocks)
    torch_block_topk(torch.where(inside, scores, 0.0), visible, problem.block_topk, want)
    assert torch.equal(blocks, want)
    want_tokens = torch.empty_like(args.out)
    torch_expand_block_indices(want, batch.query_positions, batch.context_lens, batch.token_to_request, 4, token_topk,
                               want_tokens)
    assert torch.equal(args.out, want_tokens)
    assert fs.choose_plan(problem, Platform.of(batch.q.device)).variant.kv == (cache or "bf16")
    fused = run_op(monkeypatch, batch, token_topk, hints, CANDIDATE)
    assert torch.equal(fused, want_tokens) and torch.equal(run_op(monkeypatch, batch, token_topk, hints, CANDIDATE),
                                                           fused)
    # The composite path with the native scorer forced scores every column with the same instructions: the same
    # scores, so exactly the same tokens.  (With its default scorer the composite path may score another way: the
    # quantised Triton scorers round differently, and coarse keys leave many near-ties at the threshold.)
    monkeypatch.setenv("QSA_AITER_BACKEND", "native")
    composite = run_op(monkeypatch, batch, token_topk, hints, "composite")
    assert torch.equal(fused, composite)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cache,dtype", [(None, torch.bfloat16), *QUANT_FORMATS[::2]], ids=["bf16", *QUANT_IDS[::2]])
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("shape", ("verify", "decode"))
def test_gpu_cluster_plans_equal_the_last_arriver_s(rng, shape, page_size, cache, dtype):
    """Each group's CTAs one thread-block cluster (2 to 16 CTAs, 16 needing the non-portable size): exactly the torch
    top-k of the kernel's own debug scores, and the same blocks as the last arriver's design; a batch of 16 verify
    requests in clusters of 16."""
    from qsa_aiter.runtime.fused_select import fused_select

    contexts, rows, hints, token_topk, splits = {
        "verify": ([9000, 20000, 3000, 14000], 4, dict(max_query_len=4), 512, (4, 8, 16)),
        "decode": ([9000, 20000, 3000, 14000, 60000, 1000], 1, dict(phase="decode"), 2048, (2, 6, 16)),
    }[shape]
    batch = make_batch(contexts, rows, page_size=page_size, cache=cache, dtype=dtype, generator=rng, device="cuda",
                       padded_rows=1)
    platform = Platform.of(batch.q.device)
    if platform.capability < (9, 0):
        pytest.skip("thread-block clusters need sm_90+")
    problem, args = selection(batch, token_topk, hints, out=torch.empty(
        (batch.q.shape[0], token_topk + 3), dtype=torch.int32, device="cuda"))
    ref_logits, visible = reference_paged_mqa_logits(*batch.args(), **batch.kwargs())
    inside = torch.arange(problem.score.num_columns, device="cuda")[None, :] < visible.long()[:, None]
    wide = (visible > problem.block_topk).nonzero().flatten()
    arriver = fused_select(problem, args, plan=fs.problem_split_plan(problem, splits[0], platform))
    arriver_tokens = args.out.clone()
    for split in splits:
        plan = fs.problem_split_plan(problem, split, platform, cluster=True)
        scores = torch.full((problem.score.num_tokens, problem.score.num_columns), float("nan"), device="cuda")
        args.out.fill_(-5)
        blocks = fused_select(problem, args, plan=plan, scores=scores)
        torch.testing.assert_close(scores[wide][inside[wide]], ref_logits[wide][inside[wide]], rtol=1e-4, atol=1e-4)
        want = torch.empty_like(blocks)
        torch_block_topk(torch.where(inside, scores, 0.0), visible, problem.block_topk, want)
        assert torch.equal(blocks, want), split
        assert torch.equal(blocks, arriver) and torch.equal(args.out, arriver_tokens), split
    many = make_batch([33000] * 16, 4, page_size=page_size, cache=cache, dtype=dtype, generator=rng, device="cuda")
    problem, args = selection(many, 2048, dict(max_query_len=4), out=torch.empty(
        (many.q.shape[0], 2048 + 3), dtype=torch.int32, device="cuda"))
    plan = fs.problem_split_plan(problem, 16, platform, cluster=True)
    scores = torch.full((problem.score.num_tokens, problem.score.num_columns), float("nan"), device="cuda")
    blocks = fused_select(problem, args, plan=plan, scores=scores)
    _, visible = reference_paged_mqa_logits(*many.args(), **many.kwargs())
    inside = torch.arange(problem.score.num_columns, device="cuda")[None, :] < visible.long()[:, None]
    want = torch.empty_like(blocks)
    torch_block_topk(torch.where(inside, scores, 0.0), visible, problem.block_topk, want)
    assert torch.equal(blocks, want)


@pytest.mark.gpu
@needs_cuda
def test_gpu_a_captured_call_replays_with_new_lengths(monkeypatch, rng):
    from qsa_aiter.tools.timing import capture_graph

    batch = make_batch([9000, 5000, 12000], 4, page_size=64, generator=rng, device="cuda", padded_rows=2)
    monkeypatch.setenv("QSA_AITER_SELECT_BACKEND", CANDIDATE)
    q, cache, table, t2r, pos, ctx, ratio = batch.args()
    out = torch.empty((q.shape[0], 512 + ratio - 1), dtype=torch.int32, device="cuda")
    graph, _ = capture_graph(lambda: qsa_aiter.qsa_select_paged_tokens(
        q, cache, table, t2r, pos, ctx, 512, ratio, out=out, max_query_len=4, max_seq_len=16384), warmups=2)
    for step in range(3):
        if step:
            pos[:12].add_(17 * step)
            ctx.add_(17 * step)
        out.fill_(-5)
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("QSA_AITER_SELECT_BACKEND", "composite")
        want = qsa_aiter.qsa_select_paged_tokens(q, cache, table, t2r, pos, ctx, 512, ratio, max_query_len=4,
                                                 max_seq_len=16384)
        monkeypatch.setenv("QSA_AITER_SELECT_BACKEND", CANDIDATE)
        assert (out == want).float().mean().item() > 0.99, step

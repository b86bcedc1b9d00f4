"""AITER's FlyDSL fused selection ("K1") as a candidate of the selection registry (``registries.SELECTION``), with a
stand-in module.

``aiter`` is not installed here and there is no ROCm GPU. The tests put a stand-in under ``aiter.ops.flydsl.qsa`` in
``sys.modules``: ``qsa_k1_selection_serves``, ``qsa_k1_serves`` and ``qsa_k1_block_ids`` with the signatures and
checks of the public ROCm/aiter source (one budget of 512 blocks at R 4, bf16, 4 or 8 heads of 128, a
``[pages, P, 1, 128]`` cache, int32 index tensors, ``context_lens`` per request in tokens), computing with the torch
oracle, returning its block ids in an order of its own and recording what it was given. The platform looks like a
gfx950 ROCm machine (``rocm._rocm_runtime``, ``rocm._gpu_arch``), and CPU tensors stand in for ROCm ones
(``rocm._rocm_gpu_reasons``), as in ``test_rocm.py``.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import logging
import sys
import types

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits
from qsa_aiter.kernels.selection.reference import reference_block_topk
from qsa_aiter.ops import selection
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.runtime import dispatch, registries, replay, rocm
from qsa_aiter.runtime.registries import SELECTION, SelectionProblem
from qsa_aiter.runtime.settings import ConfigurationError
from qsa_aiter.tools.workloads import make_batch

K1_BLOCKS, K1_RATIO, K1_HEAD_DIM, K1_HEADS = 512, 4, 128, (4, 8)
TOKEN_TOPK = K1_BLOCKS * K1_RATIO
OFF = "off (ROCM_QSA_FLYDSL=1 or VLLM_ROCM_QSA_FLYDSL=1 enables it)"


def k1_standin(calls: list, *, raises: bool = False) -> types.ModuleType:
    """Stand-in for ``aiter.ops.flydsl.qsa``'s K1 functions (the public signatures and checks; the torch oracle)."""

    def qsa_k1_selection_serves(token_topk, compress_ratio):
        if compress_ratio != K1_RATIO or token_topk != K1_BLOCKS * K1_RATIO:
            return (f"FlyDSL K1 selects {K1_BLOCKS} blocks at compress ratio {K1_RATIO} (token_topk={TOKEN_TOPK}), "
                    f"got token_topk={token_topk} compress_ratio={compress_ratio}")
        return None

    def qsa_k1_serves(q, k_cache, page_table, heads=K1_HEADS):
        if not heads or any(h not in K1_HEADS for h in heads):
            raise ValueError(f"heads must be a non-empty subset of {K1_HEADS}")
        if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16:
            return f"q and k_cache must be bfloat16, got {q.dtype} and {k_cache.dtype}"
        if q.dim() != 3 or q.shape[1] not in heads or q.shape[2] != K1_HEAD_DIM:
            return f"q must be [M, {'|'.join(map(str, heads))}, {K1_HEAD_DIM}], got {tuple(q.shape)}"
        if k_cache.dim() != 4 or k_cache.shape[2] != 1 or k_cache.shape[3] != K1_HEAD_DIM:
            return f"k_cache KV/D must be (1, {K1_HEAD_DIM}), got {k_cache.shape[2:]}"
        if k_cache.stride(3) != 1 or any(s % 8 for s in k_cache.stride()[:3]):
            return f"k_cache strides must be multiples of 8 elements, got {k_cache.stride()}"
        if page_table.dim() != 2 or page_table.dtype != torch.int32:
            return f"page_table must be int32 [n_req, n_pages], got {tuple(page_table.shape)}"
        return None

    def qsa_k1_block_ids(q, k_cache, page_table, token_to_req, query_positions, context_lens, out=None,
                         score_scale=K1_HEAD_DIM ** -0.5, heads=K1_HEADS):
        if raises:
            raise RuntimeError("stand-in K1 launch failure")
        reason = qsa_k1_serves(q, k_cache, page_table, heads)
        if reason is not None:
            raise ValueError(f"[FlyDSL qsa_k1] {reason}")
        m = q.shape[0]
        for name, t in (("token_to_req", token_to_req), ("query_positions", query_positions)):
            if t.shape != (m,) or t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32 [{m}]")
        if context_lens.dim() != 1 or context_lens.dtype != torch.int32:
            raise ValueError("context_lens must be 1-D int32")
        if out.shape != (m, K1_BLOCKS) or out.dtype != torch.int32 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous int32 [{m}, {K1_BLOCKS}]")
        calls.append(dict(rows=m, heads=heads, score_scale=score_scale, table=page_table.clone(),
                          requests=token_to_req.clone(), positions=query_positions.clone(),
                          lengths=context_lens.clone(), out=out))
        columns = page_table.shape[1] * k_cache.shape[1]  # K1 scores the whole table it is given
        logits, visible = reference_paged_mqa_logits(q, k_cache, page_table, token_to_req, query_positions,
                                                     context_lens, K1_RATIO, 1.0 / score_scale, columns)
        # The library's selector promises no order: the ids descending, -1 first.
        out.copy_(reference_block_topk(logits, visible, K1_BLOCKS).flip(1))
        return out

    m = types.ModuleType(rocm.FLYDSL_K1)
    m.__spec__ = importlib.machinery.ModuleSpec(rocm.FLYDSL_K1, None)
    m.__dict__.update(qsa_k1_selection_serves=qsa_k1_selection_serves, qsa_k1_serves=qsa_k1_serves,
                      qsa_k1_block_ids=qsa_k1_block_ids)
    return m


@pytest.fixture
def gfx950(monkeypatch):
    """A gfx950 ROCm machine on which CPU tensors stand in for GPU ones; import results forgotten before and after."""
    monkeypatch.setattr(rocm, "_rocm_runtime", lambda: "7.0.0")
    monkeypatch.setattr(rocm, "_gpu_arch", lambda: "gfx950")
    monkeypatch.setattr(rocm, "_rocm_gpu_reasons", lambda problem: [])
    monkeypatch.setattr(dispatch, "platform_of", lambda problem: Platform.named("gfx950"))
    rocm.reset()
    dispatch.clear_broken()
    yield monkeypatch
    rocm.reset()
    dispatch.clear_broken()


def k1_ready(monkeypatch, calls: list | None = None, **kwargs) -> None:
    monkeypatch.setenv("ROCM_QSA_FLYDSL", "1")
    monkeypatch.setitem(sys.modules, rocm.FLYDSL_K1, k1_standin([] if calls is None else calls, **kwargs))


def batch_of(rng, *, heads=4, index_dtype=torch.int64, **kwargs):
    """Three requests (the first two longer than K1's 512 blocks, the third shorter) and two padded rows; index
    tensors as ``index_dtype``."""
    batch = make_batch([3000, 2500, 900], [3, 2, 2], heads=heads, head_dim=K1_HEAD_DIM, page_size=16,
                       padded_rows=2, dtype=torch.bfloat16, generator=rng, **kwargs)
    q, cache, table, requests, positions, lengths = batch.args()[:6]
    return (q, cache, table, requests.to(index_dtype), positions.to(index_dtype), lengths.to(index_dtype))


def selection_problem(args, token_topk=TOKEN_TOPK, **changes) -> SelectionProblem:
    score = describe_call(*args, K1_RATIO, phase="prefill")
    return SelectionProblem(dataclasses.replace(score, **changes), token_topk, score.num_tokens)


# ---------------------------------------------------------------------------------------------------------------
# Gates
# ---------------------------------------------------------------------------------------------------------------

def test_off_unless_asked_for_imports_nothing_and_composite_serves(gfx950, rng):
    gfx950.setitem(sys.modules, rocm.FLYDSL_K1, k1_standin([]))
    args = batch_of(rng)
    assert rocm.flydsl_k1_reasons(selection_problem(args)) == [OFF]
    assert rocm._loaded == {}, "not imported while off"
    report = qsa_aiter.explain_selection(*args, TOKEN_TOPK, K1_RATIO)
    assert "selection: " in report and "candidates (order flydsl_k1 > composite > " in report
    assert f"- flydsl_k1: {OFF}" in report and "* composite: serves" in report
    assert "\nqsa_paged_mqa_logits: " in report and "\nblock top-k: " in report


def test_without_rocm_it_says_why(monkeypatch, rng):
    monkeypatch.setenv("ROCM_QSA_FLYDSL", "1")
    rocm.reset()
    args = batch_of(rng)
    assert rocm.flydsl_k1_reasons(selection_problem(args)) == ["needs ROCm GPU tensors (tensors are on cpu)"]
    reasons = rocm.flydsl_k1_reasons(selection_problem(args, device_type="cuda"))
    assert reasons == [f"needs a ROCm build of torch (this one is {'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU'})"]
    assert rocm._loaded == {}


def test_serves_its_shapes_and_leads(gfx950, rng):
    k1_ready(gfx950)
    for heads in (4, 8):
        problem = selection_problem(batch_of(rng, heads=heads))
        assert rocm.flydsl_k1_reasons(problem) == []
        assert SELECTION.select(problem).chosen == "flydsl_k1"


@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100"])
def test_needs_gfx942_or_gfx950(gfx950, rng, arch):
    k1_ready(gfx950)
    gfx950.setattr(rocm, "_gpu_arch", lambda: arch)
    problem = selection_problem(batch_of(rng))
    assert rocm.flydsl_k1_reasons(problem) == [f"needs gfx942 or gfx950 (this GPU is {arch})"]
    gfx950.setattr(rocm, "_gpu_arch", lambda: "gfx942")
    assert rocm.flydsl_k1_reasons(problem) == []


def test_needs_the_module(gfx950, rng):
    gfx950.setenv("ROCM_QSA_FLYDSL", "1")
    gfx950.setitem(sys.modules, rocm.FLYDSL_K1, None)  # the import fails
    reasons = rocm.flydsl_k1_reasons(selection_problem(batch_of(rng)))
    assert len(reasons) == 1 and "aiter.ops.flydsl.qsa.qsa_k1_selection_serves is not importable" in reasons[0]


@pytest.mark.parametrize("change,token_topk,why", [
    ({}, 1024, "qsa_k1_selection_serves: FlyDSL K1 selects 512 blocks at compress ratio 4 (token_topk=2048), got "
               "token_topk=1024 compress_ratio=4"),
    (dict(num_heads=2), TOKEN_TOPK, "aiter.ops.flydsl.qsa.qsa_k1_serves refuses it (ValueError: heads must be a "
                                    "non-empty subset of (4, 8))"),
    (dict(q_dtype=torch.float16, cache_dtype=torch.float16), TOKEN_TOPK,
     "qsa_k1_serves: q and k_cache must be bfloat16, got torch.float16 and torch.float16"),
    (dict(head_dim=64), TOKEN_TOPK, "qsa_k1_serves: q must be [M, 4, 128], got (9, 4, 64)"),
    (dict(key_strides=(16 * 132, 132)), TOKEN_TOPK, "qsa_k1_serves: k_cache strides must be multiples of 8"),
    (dict(num_columns=1001), TOKEN_TOPK, "scores whole pages: the logits width (1001 columns, from max_seq_len) is "
                                         "not a multiple of the page's 16 groups"),
])
def test_the_librarys_own_answers_and_ours(gfx950, rng, change, token_topk, why):
    """The library's predicates are asked with meta tensors of the call's shapes, dtypes and strides."""
    k1_ready(gfx950)
    problem = selection_problem(batch_of(rng), token_topk, **change)
    reasons = rocm.flydsl_k1_reasons(problem)
    assert len(reasons) == 1 and reasons[0].startswith(why), reasons
    assert SELECTION.select(problem).chosen == "composite"
    assert f"- flydsl_k1: {reasons[0]}" in SELECTION.explain(problem)


def test_a_strided_cache_view_it_reads_in_place_serves(gfx950, rng):
    k1_ready(gfx950)
    assert rocm.flydsl_k1_reasons(selection_problem(batch_of(rng), key_strides=(16 * 256, 256))) == []


def test_the_rejection_is_logged_once_as_a_warning(gfx950, rng, caplog):
    k1_ready(gfx950)
    gfx950.setattr(rocm, "_gpu_arch", lambda: "gfx90a")
    problem = selection_problem(batch_of(rng))
    with caplog.at_level(logging.WARNING, logger="qsa_aiter"):
        for _ in range(3):
            dispatch.clear_broken()  # the memoised decision dropped: the reasons are asked for again
            SELECTION.select(problem)
    lines = [r.getMessage() for r in caplog.records if "flydsl_k1 does not serve" in r.getMessage()]
    assert len(lines) == 1 and "gfx90a" in lines[0]


# ---------------------------------------------------------------------------------------------------------------
# Running it: argument mapping and the output contract
# ---------------------------------------------------------------------------------------------------------------

def composite_tokens(monkeypatch, args, **kwargs) -> torch.Tensor:
    """The op's result on the composite path (forced), then the variable dropped again."""
    monkeypatch.setenv("QSA_AITER_SELECT_BACKEND", "composite")
    out = qsa_aiter.qsa_select_paged_tokens(*args, TOKEN_TOPK, K1_RATIO, **kwargs)
    monkeypatch.delenv("QSA_AITER_SELECT_BACKEND")
    return out


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_k1_tokens_equal_the_composite_paths_and_its_arguments_are_mapped(gfx950, rng, index_dtype):
    calls = []
    k1_ready(gfx950, calls)
    args = batch_of(rng, index_dtype=index_dtype)
    q, cache, table, requests, positions, lengths = args
    expected = composite_tokens(gfx950, args)
    assert calls == [], "the composite path does not call K1"
    got = qsa_aiter.qsa_select_paged_tokens(*args, TOKEN_TOPK, K1_RATIO)
    assert torch.equal(got, expected)
    assert len(calls) == 1
    call = calls[0]
    assert call["heads"] == (4,) and call["rows"] == q.shape[0]
    assert call["score_scale"] == pytest.approx(K1_HEAD_DIM ** -0.5)
    # int32 positions and requests per row, sequence lengths per request in tokens, the whole table as int32.
    for name, given in (("positions", positions), ("requests", requests), ("lengths", lengths)):
        assert call[name].dtype == torch.int32 and torch.equal(call[name].long(), given.long()), name
    assert call["lengths"].shape == (3,) and call["lengths"].tolist() == [3000, 2500, 900]
    assert call["table"].dtype == torch.int32 and torch.equal(call["table"].long(), table.long())
    # The block ids K1 wrote were put in the project's order (ascending, -1 after): a padded row is all -1, the
    # short request's rows keep every visible group.
    blocks = call["out"]
    assert torch.equal(blocks, reference_block_topk(*_oracle_logits(args), K1_BLOCKS))
    assert (blocks[-2:] == -1).all()
    assert blocks[5].tolist()[:224] == list(range(224)) and (blocks[5, 224:] == -1).all()


def _oracle_logits(args):
    logits, visible = reference_paged_mqa_logits(*args, K1_RATIO, K1_HEAD_DIM ** 0.5)
    return logits, visible


def test_chunks_and_max_seq_len(gfx950, rng):
    """K1 runs per chunk of rows of the workspace bound, on the table narrowed to the logits width."""
    calls = []
    k1_ready(gfx950, calls)
    args = batch_of(rng, table_width=300)
    columns = 200 * 16  # max_seq_len below: 200 pages of the table's 300
    kwargs = dict(max_seq_len=columns * K1_RATIO, logits_workspace_bytes=4 * columns * 4)
    expected = composite_tokens(gfx950, args, **kwargs)
    got = qsa_aiter.qsa_select_paged_tokens(*args, TOKEN_TOPK, K1_RATIO, **kwargs)
    assert torch.equal(got, expected)
    assert [c["rows"] for c in calls] == [4, 4, 1]
    assert all(c["table"].shape == (3, 200) for c in calls)
    assert torch.equal(got, composite_tokens(gfx950, args))  # the width holds every context


def test_explain_selection_names_k1_and_the_expansion(gfx950, rng):
    k1_ready(gfx950)
    report = qsa_aiter.explain_selection(*batch_of(rng), TOKEN_TOPK, K1_RATIO)
    assert "* flydsl_k1: serves (AITER's FlyDSL fused selection K1" in report
    assert "- composite: serves, but an earlier candidate is preferred" in report
    assert "\nexpansion: rows=9 groups=512 compress_ratio=4 token_topk=2048" in report
    assert "qsa_paged_mqa_logits:" not in report, "K1 scores: no scoring decision is made"


# ---------------------------------------------------------------------------------------------------------------
# Forcing and failures
# ---------------------------------------------------------------------------------------------------------------

def test_select_backend_forces_and_is_checked(gfx950, rng):
    args = batch_of(rng)
    gfx950.setenv("QSA_AITER_SELECT_BACKEND", "flydsl_k1")
    with pytest.raises(ValueError, match=r"forced by QSA_AITER_SELECT_BACKEND\):\n    - flydsl_k1: off"):
        qsa_aiter.qsa_select_paged_tokens(*args, TOKEN_TOPK, K1_RATIO)
    calls = []
    k1_ready(gfx950, calls)
    assert "forced by QSA_AITER_SELECT_BACKEND" in qsa_aiter.explain_selection(*args, TOKEN_TOPK, K1_RATIO)
    qsa_aiter.qsa_select_paged_tokens(*args, TOKEN_TOPK, K1_RATIO)
    assert len(calls) == 1
    gfx950.setenv("QSA_AITER_SELECT_BACKEND", "Fused")
    with pytest.raises(ConfigurationError, match="QSA_AITER_SELECT_BACKEND='fused' is invalid: allowed: auto, "
                                                 "flydsl_k1, composite"):
        qsa_aiter.qsa_select_paged_tokens(*args, TOKEN_TOPK, K1_RATIO)
    gfx950.setenv("QSA_AITER_SELECT_BACKEND", "no such")
    with pytest.raises(ConfigurationError, match="QSA_AITER_SELECT_BACKEND='no such' is invalid"):
        qsa_aiter.explain_selection(*args, TOKEN_TOPK, K1_RATIO)


def test_a_failing_k1_is_marked_broken_and_the_composite_path_serves(gfx950, rng, caplog):
    k1_ready(gfx950, raises=True)
    args = batch_of(rng)
    expected = composite_tokens(gfx950, args)
    replay.clear()
    with caplog.at_level(logging.WARNING, logger="qsa_aiter"):
        assert torch.equal(qsa_aiter.qsa_select_paged_tokens(*args, TOKEN_TOPK, K1_RATIO), expected)
    assert any("selection kernel flydsl_k1 failed" in r.getMessage() for r in caplog.records)
    assert ("marked broken in this process: RuntimeError: stand-in K1 launch failure"
            in qsa_aiter.explain_selection(*args, TOKEN_TOPK, K1_RATIO))
    gfx950.setenv("QSA_AITER_STRICT", "1")
    dispatch.clear_broken()
    with pytest.raises(RuntimeError, match="stand-in K1 launch failure"):
        qsa_aiter.qsa_select_paged_tokens(*args, TOKEN_TOPK, K1_RATIO)


def test_an_error_inside_the_composite_path_is_raised_and_marks_nothing(monkeypatch, rng):
    """The composite path's steps fall back inside their own registries; what escapes them is the call's error,
    raised as it is, and the composite path is not marked broken."""
    args = batch_of(rng)

    def failing(*a, **k):
        raise RuntimeError("scoring failed past every candidate")

    monkeypatch.setattr(selection, "score_validated", failing)
    replay.clear()
    with pytest.raises(RuntimeError, match="scoring failed past every candidate"):
        qsa_aiter.qsa_select_paged_tokens(*args, TOKEN_TOPK, K1_RATIO)
    assert SELECTION.reasons("composite", selection_problem(args)) == []
    assert registries.SELECTION.candidates["composite"].final

"""Selection half of the indexer (SPEC section 2): block top-k, expansion, and ``qsa_select_paged_tokens``.

- ``qsa_block_topk``: the ``block_topk`` best visible groups of each row, by ``(-score, index)``, listed in ascending
  order with ``-1`` after them; rows with ``visible <= block_topk`` take every visible group without reading a score.
  Runs the Triton radix select (``selection/topk.py``) where Triton runs, the torch path (a stable sort) elsewhere,
  and AITER's HIP top-k when the AITER path is forced on a ROCm GPU (``rocm.aiter_block_topk``).
- ``qsa_expand_block_indices``: groups back to tokens, plus each row's causal tail (``selection/expand.py``).
- ``qsa_select_paged_tokens``: scoring, then top-k and expansion in one launch, rows chunked so the fp32 logits stay
  within ``logits_workspace_bytes``.

Every decision is made from shapes and host-side arguments; nothing reads device memory, so the ops can be captured
in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from ..runtime import replay
from ..runtime import rocm
from ..runtime.jit import scope as jit_scope
from ..runtime.log import log_once
from ..kernels.platform import triton_runs_on
from ..kernels.selection.problem import TOKEN_INDEX_LIMIT
from ..runtime.arguments import (
    check_index_out, check_int, check_tensor, check_topk_args, check_topk_budget, fail_argument,
)
from .scoring import describe_call, score_validated
from ..kernels.selection import expand, topk
from . import selection_plans as plans
from ..runtime.settings import ConfigurationError, get_settings
from .traced import through_custom_op

_INDEX_DTYPES = (torch.int32, torch.int64)


def _run_triton_or(fallback, triton_call, what: str, device: torch.device) -> None:
    """Run ``triton_call``; if it fails to compile or launch, log once and run ``fallback`` (unless strict)."""
    settings = get_settings()  # a bad variable is a ConfigurationError on every path, raised before any work
    if not triton_runs_on(device.type):
        fallback()
        return
    jit = jit_scope(device, settings)  # warmed variants load from the JIT cache, new ones are recorded in it
    try:
        with jit:
            triton_call()
    except ConfigurationError:
        raise
    except Exception as err:  # compile or launch failure: the torch path serves every shape
        if settings.strict:
            raise
        message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        log_once(logging.WARNING, ("selection-broken", what), f"{what} Triton kernel failed, using torch: {message}")
        fallback()


# ---------------------------------------------------------------------------------------------------------------
# Block top-k
# ---------------------------------------------------------------------------------------------------------------


def torch_block_topk(logits: torch.Tensor, visible: torch.Tensor, block_topk: int, out: torch.Tensor) -> None:
    """The torch path of ``qsa_block_topk`` (any device, graph-safe): a stable descending sort of the visible scores
    (ties keep the lower index first; masked columns sort after every visible one, ``-inf`` included, because they
    have higher indices), the first ``block_topk`` columns, then an ascending sort with ``-1`` last."""
    tokens, columns = logits.shape
    if tokens == 0:
        return
    cols = torch.arange(columns, device=logits.device)
    vis = visible.long()[:, None]
    masked = torch.where(cols[None, :] < vis, logits, torch.full_like(logits, float("-inf")))
    take = min(block_topk, columns)
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :take]
    rank = torch.arange(take, device=logits.device)[None, :]
    chosen = torch.where(rank < vis, order, columns)  # rows with fewer visible groups: the rest are empty
    chosen = torch.sort(chosen, dim=1).values
    out[:, :take] = torch.where(chosen < columns, chosen, -1).to(torch.int32)
    out[:, take:] = -1


@through_custom_op
def qsa_block_topk(logits: torch.Tensor, visible: torch.Tensor, block_topk: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Block top-k of scored rows: int32 ``[tokens, block_topk]``.

    Args:
        logits: fp32 ``[tokens, columns]`` (last dim contiguous); only ``[0, visible)`` of each row is read.
        visible: int32 ``[tokens]`` (as ``qsa_paged_mqa_logits`` returns it); read clamped to ``[0, columns]``, so no
            value makes a kernel read past its row.
        block_topk: groups to keep per row (``token_topk // R``).
        out: optional int32 ``[tokens, block_topk]`` (last dim contiguous).

    Returns:
        Per row the kept groups in ascending order, then ``-1``: the ``block_topk`` first columns by
        ``(-score, index)``, or every visible column when ``visible <= block_topk``.
    """
    settings = get_settings()
    key, addresses = plans.topk_signature(settings, logits, visible, block_topk, out)
    plan = replay.lookup(key)
    if plan is not None:
        return plan.run(addresses, logits, out)
    op = "qsa_block_topk"
    block_topk = check_topk_args(op, logits, visible, block_topk)
    out = check_index_out(op, out, (logits.shape[0], block_topk), logits.device, "logits")
    with replay.recording() as launches:
        _block_topk_into(logits, visible, block_topk, out)
    replay.store(key, plans.TopkPlan.of(logits, block_topk, launches), settings)
    return out


def _block_topk_into(logits, visible, block_topk: int, out: torch.Tensor) -> None:
    if _aiter_topk_serves(logits):
        rocm.aiter_block_topk(logits, visible, block_topk, out)
        return
    _run_triton_or(lambda: torch_block_topk(logits, visible, block_topk, out),
                   lambda: topk.launch(logits, visible, out, block_topk), "block top-k", logits.device)


def _aiter_topk_serves(logits: torch.Tensor) -> bool:
    """AITER's HIP top-k ranks the rows when the AITER path is forced (``QSA_AITER_BACKEND=aiter``) and it can run
    here (a ROCm GPU with ``aiter`` importable); the reason it cannot is logged once."""
    if get_settings().backend != "aiter":
        return False
    reasons = rocm.aiter_topk_reasons(logits)
    if reasons:
        log_once(logging.INFO, ("aiter-topk", *reasons), "AITER's HIP top-k does not serve: " + "; ".join(reasons))
    return not reasons


# ---------------------------------------------------------------------------------------------------------------
# Expansion
# ---------------------------------------------------------------------------------------------------------------


def torch_expand_block_indices(block_indices, query_positions, context_lens, token_to_request, compress_ratio: int,
                               token_topk: int, out: torch.Tensor) -> None:
    """The torch path of ``qsa_expand_block_indices`` (any device, graph-safe, vectorised over rows)."""
    tokens, groups = block_indices.shape
    if tokens == 0:
        return
    device, ratio = block_indices.device, compress_ratio
    width = token_topk + ratio - 1
    req = token_to_request.long()
    ok = (req >= 0) & (req < context_lens.shape[0])
    limit = torch.where(ok, context_lens.long()[req.clamp(0, max(context_lens.shape[0] - 1, 0))], 0)
    limit = limit.clamp_max(TOKEN_INDEX_LIMIT)
    pos = query_positions.long()
    g = block_indices.long()
    tok = g[:, :, None] * ratio + torch.arange(ratio, device=device)[None, None, :]  # [T, G, R]
    keep = (g[:, :, None] >= 0) & (g[:, :, None] < limit[:, None, None]) & (tok < limit[:, None, None])
    kept = keep.sum(dim=2)
    first = torch.cumsum(kept, dim=1) - kept  # [T, G]
    total = kept.sum(dim=1)
    slots = torch.arange(width, device=device)
    result = torch.full((tokens, width + 1), -1, dtype=torch.long, device=device)  # column `width`: a sink
    target = torch.where(keep, first[:, :, None] + torch.arange(ratio, device=device)[None, None, :], width)
    result.scatter_(1, target.reshape(tokens, -1), torch.where(keep, tok, -1).reshape(tokens, -1))
    tail_start = torch.where(pos >= 0, torch.div(pos + 1, ratio, rounding_mode="floor") * ratio, 0)
    tail_len = (torch.minimum(pos + 1, limit) - tail_start).clamp_min(0)
    rel = slots[None, :] - total[:, None]
    tail = torch.where((rel >= 0) & (rel < tail_len[:, None]), tail_start[:, None] + rel, -1)
    result = torch.where(slots[None, :] < total[:, None], result[:, :width], tail)
    out.copy_(result.to(torch.int32))


@through_custom_op
def qsa_expand_block_indices(block_indices: torch.Tensor, query_positions: torch.Tensor, context_lens: torch.Tensor,
                             token_to_request: torch.Tensor, compress_ratio: int, token_topk: int,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Token indices of the selected groups: int32 ``[tokens, token_topk + R - 1]``.

    Args:
        block_indices: ``[tokens, groups]`` int32/int64 (``groups * R <= token_topk``), ascending groups then ``-1``
            (as ``qsa_block_topk`` writes them); ``-1`` entries are skipped wherever they are.
        query_positions, token_to_request: ``[tokens]`` int32/int64; ``-1`` request marks a padded row.
        context_lens: ``[requests]`` int32/int64, in tokens.
        compress_ratio: tokens per group (R). token_topk: token budget (a multiple of R).
        out: optional int32 ``[tokens, token_topk + R - 1]`` (last dim contiguous).

    Returns:
        Per row the tokens ``g*R .. g*R+R-1`` of each selected group, then the causal tail ``((p+1)//R)*R .. p``,
        only tokens ``< context_len``, packed to the front, ``-1`` after them; padded rows all ``-1``.
    """
    settings = get_settings()
    key, addresses = plans.expand_signature(settings, block_indices, query_positions, context_lens,
                                             token_to_request, compress_ratio, token_topk, out)
    plan = replay.lookup(key)
    if plan is not None:
        return plan.run(addresses, block_indices, out)
    op = "qsa_expand_block_indices"
    check_tensor("block_indices", block_indices, ndim=2, dtypes=_INDEX_DTYPES, op=op)
    device = block_indices.device
    tokens = block_indices.shape[0]
    for name, t in (("query_positions", query_positions), ("token_to_request", token_to_request)):
        check_tensor(name, t, ndim=1, dtypes=_INDEX_DTYPES, device=device, op=op, like="block_indices")
        if t.shape[0] != tokens:
            fail_argument(ValueError, name, f"length {tokens} like block_indices' rows", t.shape[0], op)
    check_tensor("context_lens", context_lens, ndim=1, dtypes=_INDEX_DTYPES, device=device, op=op,
                 like="block_indices")
    ratio, token_topk = check_topk_budget(op, compress_ratio, token_topk)
    if block_indices.shape[1] * ratio > token_topk:
        fail_argument(ValueError, "block_indices", f"at most token_topk // R = {token_topk // ratio} groups per row",
                      block_indices.shape[1], op)
    if block_indices.stride(-1) != 1 and block_indices.shape[1] > 1:
        fail_argument(ValueError, "block_indices", "contiguous in its last dimension",
                      f"strides {block_indices.stride()}", op)
    out = check_index_out(op, out, (tokens, token_topk + ratio - 1), device, "block_indices")
    with replay.recording() as launches:
        _expand_into(block_indices, query_positions, context_lens, token_to_request, ratio, token_topk, out)
    replay.store(key, plans.ExpandPlan.of(token_topk + ratio - 1, launches), settings)
    return out


def _expand_into(block_indices, query_positions, context_lens, token_to_request, ratio, token_topk, out) -> None:
    args = (block_indices, query_positions, context_lens, token_to_request)
    _run_triton_or(lambda: torch_expand_block_indices(*args, ratio, token_topk, out),
                   lambda: expand.launch(*args, out, ratio, token_topk), "expansion", block_indices.device)


# ---------------------------------------------------------------------------------------------------------------
# Scoring + top-k + expansion
# ---------------------------------------------------------------------------------------------------------------


#: ``qsa_select_paged_tokens``'s default bound on a chunk's fp32 logits.
DEFAULT_LOGITS_WORKSPACE_BYTES = 128 << 20


def selection_problem(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, ratio: int,
                      max_seq_len: int | None, *, k_scale=None, phase=None, max_query_len=None):
    """The scoring problem of a ``qsa_select_paged_tokens`` call (its scoring arguments validated): its columns are
    the page table's capacity, or ``max_seq_len // R``, which must not exceed it."""
    problem = describe_call(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, ratio,
                            k_scale=k_scale, phase=phase, max_query_len=max_query_len)
    if max_seq_len is None:
        return problem
    op = "qsa_select_paged_tokens"
    max_columns = check_int("max_seq_len", max_seq_len, minimum=1, op=op) // ratio
    if max_columns > problem.num_columns:
        fail_argument(ValueError, "max_seq_len", f"at most the page table's {problem.num_columns * ratio} tokens",
                      max_seq_len, op)
    return dataclasses.replace(problem, num_columns=max_columns)  # nothing else in it depends on the columns


@through_custom_op
def qsa_select_paged_tokens(
    q: torch.Tensor,
    compressed_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_to_request: torch.Tensor,
    query_positions: torch.Tensor,
    context_lens: torch.Tensor,
    token_topk: int,
    compress_ratio: int = 4,
    out: torch.Tensor | None = None,
    logits_workspace_bytes: int = DEFAULT_LOGITS_WORKSPACE_BYTES,
    max_seq_len: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    phase: str | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """The tokens each query row's sparse attention reads: int32 ``[tokens, token_topk + R - 1]``.

    Scores every visible group (``qsa_paged_mqa_logits``), keeps the ``token_topk // R`` best per row
    (``qsa_block_topk``) and expands them to tokens plus the causal tail (``qsa_expand_block_indices``). Rows are
    scored in chunks whose fp32 logits fit ``logits_workspace_bytes`` (at least one row per chunk). ``max_seq_len``
    (tokens) fixes the logits width at ``max_seq_len // R`` columns whatever the page table's width, so a decode CUDA
    graph captured once serves every context up to it. Other arguments as ``qsa_paged_mqa_logits``; ``out`` is
    validated (int32, that shape, q's device, last dim contiguous) before anything is written.
    """
    settings = get_settings()
    key, addresses = plans.selection_signature(settings, q, compressed_k_cache, page_table, token_to_request,
                                                query_positions, context_lens, token_topk, compress_ratio, out,
                                                logits_workspace_bytes, max_seq_len, k_scale, phase, max_query_len)
    plan = replay.lookup(key)
    if plan is not None:
        return plan.run(addresses, q, out, k_scale is not None)
    op = "qsa_select_paged_tokens"
    ratio, token_topk = check_topk_budget(op, compress_ratio, token_topk)
    workspace = check_int("logits_workspace_bytes", logits_workspace_bytes, minimum=1, op=op)
    problem = selection_problem(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                                ratio, max_seq_len, k_scale=k_scale, phase=phase, max_query_len=max_query_len)
    tokens, columns = problem.num_tokens, problem.num_columns
    out = check_index_out(op, out, (tokens, token_topk + ratio - 1), q.device, "q")
    if tokens == 0:
        return out
    block_topk = token_topk // ratio
    rows = max(1, min(tokens, workspace // (4 * max(columns, 1))))
    logits = torch.empty((rows, columns), dtype=torch.float32, device=q.device)
    groups = torch.empty((rows, block_topk), dtype=torch.int32, device=q.device)
    with replay.recording() as launches:
        for r0 in range(0, tokens, rows):
            r1 = min(tokens, r0 + rows)
            # A chunk is the validated call narrowed to its rows: it keeps the whole call's dispatch (its phase).
            chunk = dataclasses.replace(problem, num_tokens=r1 - r0)
            chunk_logits = logits[: r1 - r0]
            visible = score_validated(chunk, math.sqrt(problem.head_dim), q[r0:r1], compressed_k_cache, page_table,
                                      token_to_request[r0:r1], query_positions[r0:r1], context_lens, k_scale,
                                      chunk_logits, settings)
            _topk_and_expand_into(chunk_logits, visible, block_topk, groups[: r1 - r0], query_positions[r0:r1],
                                  context_lens, token_to_request[r0:r1], ratio, token_topk, out[r0:r1])
    if rows == tokens:  # one chunk: the plan replays it (a call of several chunks is dominated by their kernels)
        replay.store(key, plans.SelectionPlan.of(problem, block_topk, token_topk, launches), settings)
    return out


def _topk_and_expand_into(logits, visible, block_topk: int, groups, query_positions, context_lens, token_to_request,
                          ratio: int, token_topk: int, out) -> None:
    """Block top-k into ``groups``, then their expansion into ``out``: one Triton launch (the top-k kernel expands
    its row when done), or the two torch paths."""
    expansion = (query_positions, context_lens, token_to_request)
    if _aiter_topk_serves(logits):
        rocm.aiter_block_topk(logits, visible, block_topk, groups)
        _expand_into(groups, *expansion, ratio, token_topk, out)
        return

    def torch_paths():
        torch_block_topk(logits, visible, block_topk, groups)
        torch_expand_block_indices(groups, *expansion, ratio, token_topk, out)

    _run_triton_or(torch_paths,
                   lambda: topk.launch(logits, visible, groups, block_topk,
                                       expand_into=(*expansion, out, ratio, token_topk)),
                   "block top-k and expansion", logits.device)

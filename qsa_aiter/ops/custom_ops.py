"""The indexer ops as PyTorch custom ops (``torch.library``), so ``torch.compile`` and CUDA graphs see opaque calls.

Registered under the ``qsa_aiter`` namespace when this module is imported (``import qsa_aiter`` imports it):

| op | returns | writes in place |
|---|---|---|
| ``torch.ops.qsa_aiter.paged_mqa_logits`` | ``(logits, visible_groups)`` | ``row_starts`` (zeros) |
| ``torch.ops.qsa_aiter.paged_mqa_logits_out`` | ``visible_groups`` | ``out`` (the logits), ``row_starts`` |
| ``torch.ops.qsa_aiter.block_topk`` / ``block_topk_out`` | int32 groups / nothing | ``out`` |
| ``torch.ops.qsa_aiter.expand_block_indices`` / ``expand_block_indices_out`` | int32 tokens / nothing | ``out`` |
| ``torch.ops.qsa_aiter.select_paged_tokens`` / ``select_paged_tokens_out`` | int32 tokens / nothing | ``out`` |
| ``torch.ops.qsa_aiter.write_index_cache`` | nothing | ``cache``, ``k_scale`` |

A custom op may not return one of its inputs, so every op that takes ``out=`` has an ``_out`` variant that declares
the mutation and returns nothing else of it. The functions below keep the public signatures (``qsa_aiter.*``) and
pick the variant: code that ``torch.compile(fullgraph=True)`` traces calls these instead of the eager functions,
whose dispatch logic (registry, settings, logging) dynamo cannot trace.

Each op has a fake (meta) implementation that derives output shapes and dtypes from the arguments without reading
tensor data; where every shape is static it also runs the eager validation, so a bad argument fails at trace time
with the same ``ValueError``/``TypeError``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import cache as writer
from ..runtime.arguments import check_int, check_topk_budget
from . import scoring as ops
from .scoring import describe_call
from . import selection
from .selection import DEFAULT_LOGITS_WORKSPACE_BYTES

NAMESPACE = "qsa_aiter"


def _static(*tensors: Optional[Tensor]) -> bool:
    """Whether every shape is concrete (no symbolic sizes): the eager validation can then run on the fakes."""
    return all(t is None or not any(isinstance(s, torch.SymInt) for s in t.shape) for t in tensors)


# ---------------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::paged_mqa_logits", mutates_args=("row_starts",))
def _paged_mqa_logits(q: Tensor, compressed_k_cache: Tensor, page_table: Tensor, token_to_request: Tensor,
                      query_positions: Tensor, context_lens: Tensor, compress_ratio: int,
                      score_divisor: Optional[float], max_columns: Optional[int], row_starts: Optional[Tensor],
                      k_scale: Optional[Tensor], phase: Optional[str],
                      max_query_len: Optional[int]) -> tuple[Tensor, Tensor]:
    return ops.qsa_paged_mqa_logits(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                    context_lens, compress_ratio, score_divisor, max_columns, row_starts,
                                    k_scale=k_scale, phase=phase, max_query_len=max_query_len)


@torch.library.custom_op(f"{NAMESPACE}::paged_mqa_logits_out", mutates_args=("out", "row_starts"))
def _paged_mqa_logits_out(q: Tensor, compressed_k_cache: Tensor, page_table: Tensor, token_to_request: Tensor,
                          query_positions: Tensor, context_lens: Tensor, compress_ratio: int,
                          score_divisor: Optional[float], max_columns: Optional[int], row_starts: Optional[Tensor],
                          k_scale: Optional[Tensor], phase: Optional[str], max_query_len: Optional[int],
                          out: Tensor) -> Tensor:
    return ops.qsa_paged_mqa_logits(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                    context_lens, compress_ratio, score_divisor, max_columns, row_starts,
                                    k_scale=k_scale, out=out, phase=phase, max_query_len=max_query_len)[1]


def _scoring_columns(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                     compress_ratio, score_divisor, max_columns, row_starts, k_scale, phase, max_query_len, out=None):
    """``num_columns`` of a scoring call, validating it like the eager op where the shapes are static."""
    if _static(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, row_starts,
               k_scale, out):
        return describe_call(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                             compress_ratio, score_divisor, max_columns, row_starts, k_scale=k_scale, out=out,
                             phase=phase, max_query_len=max_query_len).num_columns
    return page_table.shape[1] * compressed_k_cache.shape[1] if max_columns is None else max_columns


@_paged_mqa_logits.register_fake
def _(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, compress_ratio,
      score_divisor, max_columns, row_starts, k_scale, phase, max_query_len):
    columns = _scoring_columns(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                               compress_ratio, score_divisor, max_columns, row_starts, k_scale, phase, max_query_len)
    tokens = q.shape[0]
    return (q.new_empty((tokens, columns), dtype=torch.float32), q.new_empty((tokens,), dtype=torch.int32))


@_paged_mqa_logits_out.register_fake
def _(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, compress_ratio,
      score_divisor, max_columns, row_starts, k_scale, phase, max_query_len, out):
    _scoring_columns(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                     compress_ratio, score_divisor, max_columns, row_starts, k_scale, phase, max_query_len, out)
    return q.new_empty((q.shape[0],), dtype=torch.int32)


def qsa_paged_mqa_logits(q: Tensor, compressed_k_cache: Tensor, page_table: Tensor, token_to_request: Tensor,
                         query_positions: Tensor, context_lens: Tensor, compress_ratio: int = 4,
                         score_divisor: float | None = None, max_columns: int | None = None,
                         row_starts: Tensor | None = None, *, k_scale: Tensor | None = None,
                         out: Tensor | None = None, phase: str | None = None,
                         max_query_len: int | None = None) -> tuple[Tensor, Tensor]:
    """``qsa_aiter.qsa_paged_mqa_logits`` through the custom op (same arguments, shapes and dtypes): fp32 logits
    ``[tokens, num_columns]`` (``out`` itself when given) and int32 ``visible_groups`` ``[tokens]``."""
    args = (q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, compress_ratio,
            score_divisor, max_columns, row_starts, k_scale, phase, max_query_len)
    if out is None:
        return torch.ops.qsa_aiter.paged_mqa_logits(*args)
    return out, torch.ops.qsa_aiter.paged_mqa_logits_out(*args, out)


# ---------------------------------------------------------------------------------------------------------------
# Block top-k and expansion
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::block_topk", mutates_args=())
def _block_topk(logits: Tensor, visible: Tensor, block_topk: int) -> Tensor:
    return selection.qsa_block_topk(logits, visible, block_topk)


@torch.library.custom_op(f"{NAMESPACE}::block_topk_out", mutates_args=("out",))
def _block_topk_out(logits: Tensor, visible: Tensor, block_topk: int, out: Tensor) -> None:
    selection.qsa_block_topk(logits, visible, block_topk, out=out)


@_block_topk.register_fake
def _(logits, visible, block_topk):
    check_int("block_topk", block_topk, minimum=1, op="qsa_block_topk")
    return logits.new_empty((logits.shape[0], block_topk), dtype=torch.int32)


@_block_topk_out.register_fake
def _(logits, visible, block_topk, out):
    check_int("block_topk", block_topk, minimum=1, op="qsa_block_topk")


def qsa_block_topk(logits: Tensor, visible: Tensor, block_topk: int, out: Tensor | None = None) -> Tensor:
    """``qsa_aiter.qsa_block_topk`` through the custom op: int32 ``[tokens, block_topk]`` (``out`` when given)."""
    if out is None:
        return torch.ops.qsa_aiter.block_topk(logits, visible, block_topk)
    torch.ops.qsa_aiter.block_topk_out(logits, visible, block_topk, out)
    return out


def _expand_width(compress_ratio, token_topk) -> int:
    ratio, topk = check_topk_budget("qsa_expand_block_indices", compress_ratio, token_topk)
    return topk + ratio - 1


@torch.library.custom_op(f"{NAMESPACE}::expand_block_indices", mutates_args=())
def _expand_block_indices(block_indices: Tensor, query_positions: Tensor, context_lens: Tensor,
                          token_to_request: Tensor, compress_ratio: int, token_topk: int) -> Tensor:
    return selection.qsa_expand_block_indices(block_indices, query_positions, context_lens, token_to_request,
                                              compress_ratio, token_topk)


@torch.library.custom_op(f"{NAMESPACE}::expand_block_indices_out", mutates_args=("out",))
def _expand_block_indices_out(block_indices: Tensor, query_positions: Tensor, context_lens: Tensor,
                              token_to_request: Tensor, compress_ratio: int, token_topk: int, out: Tensor) -> None:
    selection.qsa_expand_block_indices(block_indices, query_positions, context_lens, token_to_request,
                                       compress_ratio, token_topk, out=out)


@_expand_block_indices.register_fake
def _(block_indices, query_positions, context_lens, token_to_request, compress_ratio, token_topk):
    width = _expand_width(compress_ratio, token_topk)
    return block_indices.new_empty((block_indices.shape[0], width), dtype=torch.int32)


@_expand_block_indices_out.register_fake
def _(block_indices, query_positions, context_lens, token_to_request, compress_ratio, token_topk, out):
    _expand_width(compress_ratio, token_topk)


def qsa_expand_block_indices(block_indices: Tensor, query_positions: Tensor, context_lens: Tensor,
                             token_to_request: Tensor, compress_ratio: int, token_topk: int,
                             out: Tensor | None = None) -> Tensor:
    """``qsa_aiter.qsa_expand_block_indices`` through the custom op: int32 ``[tokens, token_topk + R - 1]``."""
    args = (block_indices, query_positions, context_lens, token_to_request, compress_ratio, token_topk)
    if out is None:
        return torch.ops.qsa_aiter.expand_block_indices(*args)
    torch.ops.qsa_aiter.expand_block_indices_out(*args, out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Selection (scoring + top-k + expansion)
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::select_paged_tokens", mutates_args=())
def _select_paged_tokens(q: Tensor, compressed_k_cache: Tensor, page_table: Tensor, token_to_request: Tensor,
                         query_positions: Tensor, context_lens: Tensor, token_topk: int, compress_ratio: int,
                         logits_workspace_bytes: int, max_seq_len: Optional[int], k_scale: Optional[Tensor],
                         phase: Optional[str], max_query_len: Optional[int]) -> Tensor:
    return selection.qsa_select_paged_tokens(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                             context_lens, token_topk, compress_ratio, None, logits_workspace_bytes,
                                             max_seq_len, k_scale=k_scale, phase=phase, max_query_len=max_query_len)


@torch.library.custom_op(f"{NAMESPACE}::select_paged_tokens_out", mutates_args=("out",))
def _select_paged_tokens_out(q: Tensor, compressed_k_cache: Tensor, page_table: Tensor, token_to_request: Tensor,
                             query_positions: Tensor, context_lens: Tensor, token_topk: int, compress_ratio: int,
                             logits_workspace_bytes: int, max_seq_len: Optional[int], k_scale: Optional[Tensor],
                             phase: Optional[str], max_query_len: Optional[int], out: Tensor) -> None:
    selection.qsa_select_paged_tokens(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                      context_lens, token_topk, compress_ratio, out, logits_workspace_bytes,
                                      max_seq_len, k_scale=k_scale, phase=phase, max_query_len=max_query_len)


def _select_width(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, token_topk,
                  compress_ratio, logits_workspace_bytes, max_seq_len, k_scale, phase, max_query_len) -> int:
    """Output width ``token_topk + R - 1`` of a selection call, validating it like the eager op where static."""
    op = "qsa_select_paged_tokens"
    ratio, topk = check_topk_budget(op, compress_ratio, token_topk)
    check_int("logits_workspace_bytes", logits_workspace_bytes, minimum=1, op=op)
    if _static(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, k_scale):
        selection.selection_problem(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                    context_lens, ratio, max_seq_len, k_scale=k_scale, phase=phase,
                                    max_query_len=max_query_len)
    return topk + ratio - 1


@_select_paged_tokens.register_fake
def _(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, token_topk, compress_ratio,
      logits_workspace_bytes, max_seq_len, k_scale, phase, max_query_len):
    width = _select_width(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                          token_topk, compress_ratio, logits_workspace_bytes, max_seq_len, k_scale, phase,
                          max_query_len)
    return q.new_empty((q.shape[0], width), dtype=torch.int32)


@_select_paged_tokens_out.register_fake
def _(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, token_topk, compress_ratio,
      logits_workspace_bytes, max_seq_len, k_scale, phase, max_query_len, out):
    _select_width(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, token_topk,
                  compress_ratio, logits_workspace_bytes, max_seq_len, k_scale, phase, max_query_len)


def qsa_select_paged_tokens(q: Tensor, compressed_k_cache: Tensor, page_table: Tensor, token_to_request: Tensor,
                            query_positions: Tensor, context_lens: Tensor, token_topk: int, compress_ratio: int = 4,
                            out: Tensor | None = None, logits_workspace_bytes: int = DEFAULT_LOGITS_WORKSPACE_BYTES,
                            max_seq_len: int | None = None, *, k_scale: Tensor | None = None,
                            phase: str | None = None, max_query_len: int | None = None) -> Tensor:
    """``qsa_aiter.qsa_select_paged_tokens`` through the custom op: int32 ``[tokens, token_topk + R - 1]``."""
    args = (q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, token_topk,
            compress_ratio, logits_workspace_bytes, max_seq_len, k_scale, phase, max_query_len)
    if out is None:
        return torch.ops.qsa_aiter.select_paged_tokens(*args)
    torch.ops.qsa_aiter.select_paged_tokens_out(*args, out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Index-cache writer
# ---------------------------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::write_index_cache", mutates_args=("cache", "k_scale"))
def _write_index_cache(keys: Tensor, slot_mapping: Tensor, cache: Tensor, k_scale: Optional[Tensor]) -> None:
    writer.qsa_write_index_cache(keys, slot_mapping, cache, k_scale)


@_write_index_cache.register_fake
def _(keys, slot_mapping, cache, k_scale):
    return None


def qsa_write_index_cache(keys: Tensor, slot_mapping: Tensor, cache: Tensor, k_scale: Tensor | None = None) -> None:
    """``qsa_aiter.qsa_write_index_cache`` through the custom op (writes ``cache`` and ``k_scale`` in place)."""
    torch.ops.qsa_aiter.write_index_cache(keys, slot_mapping, cache, k_scale)


__all__ = ["NAMESPACE", "qsa_paged_mqa_logits", "qsa_block_topk", "qsa_expand_block_indices",
           "qsa_select_paged_tokens", "qsa_write_index_cache"]

"""Expansion of selected key groups back to token indices (``qsa_expand_block_indices``).

One program per row. Each selected group ``g >= 0`` contributes the tokens ``g*R .. g*R+R-1`` that are below the
request's context length (a prefix of the group: the tokens ascend); an exclusive prefix sum over the groups gives
each its first output slot, so skipped groups (``-1``) and cut tokens leave no holes. The causal tail
``((p+1)//R)*R .. p`` (capped by the context length) follows, then ``-1``. Indices are int32: tokens at or past
2**31 (an int64 context that long) are cut like tokens past the context. The three regions are disjoint, so the
stores need no ordering between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..platform import Platform
from .problem import TOKEN_INDEX_LIMIT
from ..spec import KernelSpec, next_pow2
from .problem import SelectionProblem, example_inputs

TOKEN_LIMIT = tl.constexpr(TOKEN_INDEX_LIMIT)


@triton.jit
def expand_row(t, blk_row, pos_ptr, ctx_ptr, t2r_ptr, out_row, num_requests,
               RATIO: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
               WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Expand row ``t``: its ``GROUPS`` groups at ``blk_row`` (any int dtype, ``-1`` skipped) to ``WIDTH`` int32
    token indices at ``out_row``. Also called by the top-k kernel to fuse the expansion into its launch."""
    req = tl.load(t2r_ptr + t)  # compared in its own dtype: an int64 id past 2**31 is out of range, not wrapped
    ok = (req >= 0) & (req < num_requests)
    limit = tl.load(ctx_ptr + tl.where(ok, req, 0), mask=ok, other=0).to(tl.int64)
    limit = tl.minimum(tl.where(ok, limit, 0), TOKEN_LIMIT)
    pos = tl.load(pos_ptr + t).to(tl.int64)

    i = tl.arange(0, BLOCK_G)
    g = tl.load(blk_row + i, mask=i < GROUPS, other=-1).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    tokens = g[:, None] * RATIO + j[None, :]
    # g < limit first: a huge group id would wrap g * R; limit <= 2**31 keeps the product in range.
    keep = (g[:, None] >= 0) & (g[:, None] < limit) & (j[None, :] < RATIO) & (tokens < limit)
    kept = tl.sum(keep.to(tl.int32), axis=1)
    first = tl.cumsum(kept, axis=0) - kept
    total = tl.sum(kept, axis=0)
    tl.store(out_row + first[:, None] + j[None, :], tokens.to(tl.int32), mask=keep)

    # The causal tail (the incomplete group the row's position sits in), then -1.
    w = tl.arange(0, BLOCK_W)
    tail_start = tl.where(pos >= 0, (pos + 1) // RATIO * RATIO, 0)
    tail_len = tl.maximum(tl.minimum(pos + 1, limit) - tail_start, 0)
    rel = w - total
    value = tl.where((rel >= 0) & (rel < tail_len), tail_start + rel, -1)
    tl.store(out_row + w, value.to(tl.int32), mask=(w >= total) & (w < WIDTH))


@triton.jit
def _expand_kernel(
    blk_ptr, pos_ptr, ctx_ptr, t2r_ptr, out_ptr, num_requests, blk_stride, out_stride,
    RATIO: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0)
    expand_row(t, blk_ptr + t.to(tl.int64) * blk_stride, pos_ptr, ctx_ptr, t2r_ptr,
               out_ptr + t.to(tl.int64) * out_stride, num_requests, RATIO, GROUPS, BLOCK_G, BLOCK_R, WIDTH, BLOCK_W)


def constexprs(compress_ratio: int, groups: int, token_topk: int) -> dict:
    """The kernel's specialisation for ``groups`` selected groups per row of ``compress_ratio`` tokens."""
    width = token_topk + compress_ratio - 1
    return dict(RATIO=compress_ratio, GROUPS=groups, BLOCK_G=next_pow2(max(groups, 1)),
                BLOCK_R=next_pow2(compress_ratio), WIDTH=width, BLOCK_W=next_pow2(width))


@dataclass(frozen=True)
class ExpandConfig:
    num_warps: int = 4


class ExpandSpec(KernelSpec):
    name = "expand"
    family = "selection"
    description = "expansion of selected groups to token indices (one program per row)"
    fn = _expand_kernel
    Config = ExpandConfig

    def default_config(self, problem, platform) -> ExpandConfig:
        return ExpandConfig()

    def constexprs(self, problem: SelectionProblem, platform, cfg) -> dict:
        return constexprs(problem.compress_ratio, problem.block_topk, problem.token_topk)

    def grid(self, problem: SelectionProblem, platform, cfg) -> tuple[int]:
        return (problem.rows,)

    def example_args(self, problem: SelectionProblem, index_dtype, device) -> tuple:
        x = example_inputs(problem, index_dtype, device)
        return (x.groups, x.positions, x.contexts, x.t2r, x.tokens, problem.num_requests, x.groups.stride(0),
                x.tokens.stride(0))

    def warm_problems(self, context):
        # The request count is specialised by value (1, a multiple of 16, or neither): one count of each kind.
        for requests in context.request_counts:
            yield f"expand {requests} requests", context.selection_problem(requests, fused=False)


SPEC = ExpandSpec()


def launch(block_indices: torch.Tensor, query_positions: torch.Tensor, context_lens: torch.Tensor,
           token_to_request: torch.Tensor, out: torch.Tensor, compress_ratio: int, token_topk: int) -> None:
    """Fill ``out`` (int32 ``[tokens, token_topk + R - 1]``, last dim contiguous) from ``block_indices``
    (``[tokens, groups]`` int32/int64, last dim contiguous, ``groups * R <= token_topk``)."""
    tokens, groups = block_indices.shape
    if tokens == 0:
        return
    problem = SelectionProblem(tokens, 0, groups, compress_ratio, token_topk, False, context_lens.shape[0])
    SPEC.plan(problem, Platform.of(block_indices.device)).launch(
        *kernel_args(block_indices, query_positions, context_lens, token_to_request, out))



def kernel_args(block_indices, query_positions, context_lens, token_to_request, out) -> tuple:
    """The kernel's positional arguments: the tensors (the pointer parameters), then the scalars."""
    return (block_indices, query_positions, context_lens, token_to_request, out, context_lens.shape[0],
            block_indices.stride(0), out.stride(0))

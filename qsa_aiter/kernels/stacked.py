"""Stacked verify/draft scorer.

A program's ``BLOCK_ROWS`` query rows x ``NUM_HEADS`` heads form one M operand (``q`` is ``[tokens * heads, D]`` in
memory, so the stack is a plain 2-D load), and one ``tl.dot`` per key tile scores every head of every row. ReLU is
applied per head, then the heads are summed out of M. With ``BLOCK_ROWS`` equal to the rows of one request (MTP
verify), the request's keys are read once per verify instead of once per row. Rows of different requests in one
block (draft: one row per request) are walked: each distinct request is scored with its own page-table row and only
its rows are stored. Several programs per row block (enough to fill the GPU once) stride over the column tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .dequant import KV_FP4, dot_dtype, kv_kind
from .common import (
    DYNAMIC_SCALARS, ScoreLaunch, cdiv, column_programs, is_pow2, load_keys, load_q_tile, next_pow2, pair_dot,
    row_visibility, stacked_head_scores, target_programs,
)


@triton.jit(do_not_specialize=DYNAMIC_SCALARS)
def _stacked_scorer_kernel(
    q_ptr, k_ptr, ks_ptr, pt_ptr, t2r_ptr, pos_ptr, ctx_ptr, out_ptr, vis_ptr,
    num_tokens, num_requests, num_pages, num_columns, pt_stride, out_stride, scale,
    RATIO: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, KV_KIND: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr,
):
    block = tl.program_id(0)
    col_prog = tl.program_id(1)
    col_progs = tl.num_programs(1)
    first_row = block * BLOCK_ROWS
    rows = first_row + tl.arange(0, BLOCK_ROWS)
    req, vis = row_visibility(t2r_ptr, pos_ptr, ctx_ptr, rows, num_tokens, num_requests, num_columns, RATIO)
    if col_prog == 0:
        tl.store(vis_ptr + rows, vis, mask=rows < num_tokens)

    M: tl.constexpr = BLOCK_ROWS * NUM_HEADS
    q_rows = first_row.to(tl.int64) * NUM_HEADS + tl.arange(0, M)
    q_first, q_second = load_q_tile(q_ptr, q_rows, q_rows < num_tokens * NUM_HEADS, HEAD_DIM, KV_KIND, DOT_DTYPE)
    out_rows = out_ptr + rows.to(tl.int64) * out_stride

    idx = tl.arange(0, BLOCK_ROWS)
    for i in tl.static_range(BLOCK_ROWS):
        # Row i's request, taken from registers; the block is walked once per distinct request (first occurrence).
        r_i = tl.sum(tl.where(idx == i, req, 0), axis=0)
        v_i = tl.sum(tl.where(idx == i, vis, 0), axis=0)
        seen = tl.sum(tl.where((idx < i) & (req == r_i) & (vis > 0), 1, 0), axis=0)
        if (v_i > 0) & (seen == 0):
            mine = (req == r_i) & (vis > 0)
            req_vis = tl.max(tl.where(mine, vis, 0), axis=0)
            pt_row = pt_ptr + r_i.to(tl.int64) * pt_stride
            for tile in range(col_prog, tl.cdiv(req_vis, BLOCK_N), col_progs):
                cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                k_first, k_second, page_ok, factor = load_keys(k_ptr, ks_ptr, pt_row, cols, cols < req_vis,
                                                               num_pages, scale, PAGE_SIZE, HEAD_DIM, KV_KIND,
                                                               DOT_DTYPE, FAST_DECODE)
                dots = pair_dot(q_first, q_second, k_first, k_second, KV_KIND)
                score = stacked_head_scores(dots, page_ok, factor, BLOCK_ROWS, NUM_HEADS, BLOCK_N)
                keep = mine[:, None] & (cols[None, :] < vis[:, None])
                tl.store(out_rows[:, None] + cols[None, :], score, mask=keep)


@dataclass(frozen=True)
class StackedConfig:
    block_rows: int = 4
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4


def unsupported_reason(problem) -> str | None:
    if not (is_pow2(problem.num_heads) and problem.num_heads >= 4):
        return f"needs a power-of-two head count >= 4 (got {problem.num_heads})"
    if not (is_pow2(problem.head_dim) and problem.head_dim >= 16):
        return f"needs a power-of-two head_dim >= 16 (got {problem.head_dim})"
    return None


def default_config(problem) -> StackedConfig:
    # One request's verify rows per block; M = rows x heads must reach the 16-row MMA tile.
    rows = next_pow2(problem.max_query_len or max(1, problem.num_tokens // max(problem.num_requests, 1)))
    rows = max(rows, 16 // problem.num_heads, 1)
    if kv_kind(problem.cache_dtype) == KV_FP4:
        # MXFP4 decodes more per byte: narrow tiles on 2 warps, many programs, to hide latency (H200, 64x4 @ 98K:
        # 133 us with the default tile, 101 us).
        return StackedConfig(block_rows=min(rows, 16), block_n=64, num_warps=2, programs_per_sm=16)
    return StackedConfig(block_rows=min(rows, 16))


def constexprs(problem, cfg: StackedConfig, upcast: bool, fast_decode: bool = False) -> dict:
    return dict(
        RATIO=problem.compress_ratio, NUM_HEADS=problem.num_heads, HEAD_DIM=problem.head_dim,
        PAGE_SIZE=problem.block_size, BLOCK_ROWS=cfg.block_rows, BLOCK_N=cfg.block_n,
        KV_KIND=kv_kind(problem.cache_dtype), DOT_DTYPE=dot_dtype(problem, upcast), FAST_DECODE=fast_decode,
    )


def grid(problem, cfg: StackedConfig, target: int) -> tuple[int, int]:
    blocks = cdiv(problem.num_tokens, cfg.block_rows)
    return blocks, column_programs(blocks, problem.num_columns, cfg.block_n, target)


def launch(problem, args: ScoreLaunch, cfg: StackedConfig | None = None) -> None:
    cfg = cfg or default_config(problem)
    _stacked_scorer_kernel[grid(problem, cfg, target_programs(args.q.device, cfg.programs_per_sm))](
        *args.common_args(), **constexprs(problem, cfg, args.upcast, args.fast_decode),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


#: The kernel object, for ahead-of-time compilation (``qsa_aiter.aot``).
KERNEL = _stacked_scorer_kernel

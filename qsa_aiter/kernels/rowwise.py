"""Row-wise "CUDA-core" scorer: the universal fallback.

One program scores one query row against a strided share of its visible column tiles (several programs per row, so
a few long rows still fill the GPU); no ``tl.dot``: products are fp32 FMAs on the CUDA cores. It serves every head
count, head dim, page size and dtype. Column tiles at or past the row's visible count are never visited, and nothing
past it is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .common import (
    DYNAMIC_SCALARS, ScoreLaunch, cdiv, column_programs, key_slots, row_visibility, target_programs,
)


@triton.jit(do_not_specialize=DYNAMIC_SCALARS)
def _rowwise_scorer_kernel(
    q_ptr, k_ptr, pt_ptr, t2r_ptr, pos_ptr, ctx_ptr, out_ptr, vis_ptr,
    num_tokens, num_requests, num_pages, num_columns, pt_stride, out_stride, scale,
    RATIO: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_CHUNK: tl.constexpr,
    N_CHUNKS: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0)
    col_prog = tl.program_id(1)
    col_progs = tl.num_programs(1)
    req, vis = row_visibility(t2r_ptr, pos_ptr, ctx_ptr, row, num_tokens, num_requests, num_columns, RATIO)
    if col_prog == 0:
        tl.store(vis_ptr + row, vis)
    q_row = q_ptr + row.to(tl.int64) * (NUM_HEADS * HEAD_DIM)
    pt_row = pt_ptr + req.to(tl.int64) * pt_stride
    out_row = out_ptr + row.to(tl.int64) * out_stride
    dc = tl.arange(0, D_CHUNK)
    for tile in tl.range(col_prog, tl.cdiv(vis, BLOCK_N), col_progs, num_stages=NUM_STAGES):
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < vis
        slot, page_ok = key_slots(pt_row, cols, col_ok, num_pages, PAGE_SIZE, HEAD_DIM)
        # Per head: elementwise partial products [BLOCK_N, D_CHUNK] summed over the head_dim chunks, then one
        # lane reduction over D_CHUNK (not over all of head_dim). Identical key loads across heads are merged by
        # the compiler, so each key chunk is read once per tile.
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for h in tl.static_range(NUM_HEADS):
            part = tl.zeros([BLOCK_N, D_CHUNK], dtype=tl.float32)
            for c in tl.static_range(N_CHUNKS):
                d = c * D_CHUNK + dc
                d_ok = d < HEAD_DIM
                keys = tl.load(k_ptr + slot[:, None] + d[None, :], mask=page_ok[:, None] & d_ok[None, :],
                               other=0.0)
                q_c = tl.load(q_row + h * HEAD_DIM + d, mask=d_ok, other=0.0)
                part += keys.to(tl.float32) * q_c.to(tl.float32)[None, :]
            acc += tl.maximum(tl.sum(part, axis=1), 0.0)
        score = tl.where(page_ok, acc * scale, float("-inf"))
        tl.store(out_row + cols, score, mask=col_ok)


@dataclass(frozen=True)
class RowwiseConfig:
    block_n: int = 64
    d_chunk: int = 64  # head_dim elements multiplied per step; the lane reduction spans only this many
    num_warps: int = 4
    num_stages: int = 1  # 1: keys go straight to registers (no async-copy staging); faster on H200
    programs_per_sm: int = 8  # total programs aimed at, per multiprocessor


def default_config(problem) -> RowwiseConfig:
    return RowwiseConfig()


def constexprs(problem, cfg: RowwiseConfig, upcast: bool) -> dict:
    # ``upcast`` is moot here: this kernel multiplies in fp32 on every platform.
    return dict(
        RATIO=problem.compress_ratio, NUM_HEADS=problem.num_heads, HEAD_DIM=problem.head_dim,
        D_CHUNK=cfg.d_chunk, N_CHUNKS=cdiv(problem.head_dim, cfg.d_chunk),
        PAGE_SIZE=problem.block_size, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
    )


def launch(problem, args: ScoreLaunch, cfg: RowwiseConfig | None = None) -> None:
    cfg = cfg or default_config(problem)
    target = target_programs(args.q.device, cfg.programs_per_sm)
    cols = column_programs(problem.num_tokens, problem.num_columns, cfg.block_n, target)
    _rowwise_scorer_kernel[(problem.num_tokens, cols)](
        *args.common_args(), **constexprs(problem, cfg, args.upcast),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


#: The kernel object, for ahead-of-time compilation (``qsa_aiter.aot``).
KERNEL = _rowwise_scorer_kernel

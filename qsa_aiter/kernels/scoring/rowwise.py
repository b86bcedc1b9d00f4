"""Row-wise "CUDA-core" scorer: the universal fallback.

One program scores one query row against a strided share of its visible column tiles (several programs per row, so
a few long rows still fill the GPU); no ``tl.dot``: products are fp32 FMAs on the CUDA cores. It serves every head
count, head dim, page size and cache dtype (fp8 and MXFP4 keys are decoded in registers, then widened to fp32).
Column tiles at or past the row's visible count are never visited, and nothing past it is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ..quant.dequant import (
    KIND_16BIT, KIND_E4M3FN, KIND_E4M3FNUZ, KIND_FP4, KV_16BIT, KV_FP4, fp4_pairs, fp8_keys, key_rows, key_slots,
    kv_kind,
)
from ..spec import cdiv
from .base import DYNAMIC_SCALARS, ScorerSpec, column_programs, key_stride_constexprs
from .histogram import BINS, count_scores
from .tiles import row_visibility


@triton.jit(do_not_specialize=DYNAMIC_SCALARS)
def _rowwise_scorer_kernel(
    q_ptr, k_ptr, ks_ptr, pt_ptr, t2r_ptr, pos_ptr, ctx_ptr, out_ptr, vis_ptr, hist_ptr,
    num_tokens, num_requests, num_pages, num_columns, pt_stride, out_stride, scale,
    RATIO: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_CHUNK: tl.constexpr,
    N_CHUNKS: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    KV_KIND: tl.constexpr, FAST_DECODE: tl.constexpr, HISTOGRAM: tl.constexpr,
    KEY_PAGE_STRIDE: tl.constexpr = 0, KEY_SLOT_STRIDE: tl.constexpr = 0,
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
        slot, page_ok = key_slots(pt_row, cols, col_ok, num_pages, PAGE_SIZE)
        if KV_KIND == KIND_FP4:
            k_rows = key_rows(slot, HEAD_DIM // 2, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
        else:
            k_rows = key_rows(slot, HEAD_DIM, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
        # Per head: elementwise partial products [BLOCK_N, D_CHUNK] summed over the head_dim chunks, then one
        # lane reduction over D_CHUNK (not over all of head_dim). Identical key loads (and their decoding) across
        # heads are merged by the compiler, so each key chunk is read once per tile.
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for h in tl.static_range(NUM_HEADS):
            part = tl.zeros([BLOCK_N, D_CHUNK], dtype=tl.float32)
            for c in tl.static_range(N_CHUNKS):
                if KV_KIND == KIND_FP4:
                    # MXFP4: a chunk is one 32-element block: D_CHUNK (16) bytes of element pairs, one exponent.
                    packed = tl.load(k_ptr + k_rows[:, None] + c * 16 + dc[None, :],
                                     mask=page_ok[:, None], other=0)
                    exps = tl.load(ks_ptr + slot * (HEAD_DIM // 32) + c, mask=page_ok, other=127)
                    even, odd = fp4_pairs(packed, exps[:, None], tl.bfloat16 if FAST_DECODE else tl.float32,
                                          FAST_DECODE)
                    even, odd = even.to(tl.float32), odd.to(tl.float32)
                    q_even = tl.load(q_row + h * HEAD_DIM + c * 32 + 2 * dc).to(tl.float32)
                    q_odd = tl.load(q_row + h * HEAD_DIM + c * 32 + 2 * dc + 1).to(tl.float32)
                    part += even * q_even[None, :] + odd * q_odd[None, :]
                else:
                    d = c * D_CHUNK + dc
                    d_ok = d < HEAD_DIM
                    raw = tl.load(k_ptr + k_rows[:, None] + d[None, :], mask=page_ok[:, None] & d_ok[None, :],
                                  other=0)
                    if KV_KIND == KIND_16BIT:
                        keys = raw.to(tl.float32)
                    else:
                        keys = fp8_keys(raw, KV_KIND, tl.bfloat16 if FAST_DECODE else tl.float32,
                                        FAST_DECODE).to(tl.float32)
                    q_c = tl.load(q_row + h * HEAD_DIM + d, mask=d_ok, other=0.0)
                    part += keys * q_c.to(tl.float32)[None, :]
            # ReLU keeping NaN (IEEE propagation, docs/kernels.md): max.NaN is one instruction, as max is.
            acc += tl.maximum(tl.sum(part, axis=1), 0.0, propagate_nan=tl.PropagateNan.ALL)
        if KV_KIND == KIND_E4M3FN or KV_KIND == KIND_E4M3FNUZ:
            acc *= tl.load(ks_ptr + slot, mask=page_ok, other=0.0)  # the fp8 scale, once per column
        score = tl.where(page_ok, acc * scale, float("-inf"))
        tl.store(out_row + cols, score, mask=col_ok)
        if HISTOGRAM:
            count_scores(hist_ptr + row.to(tl.int64) * BINS, score, col_ok)


@dataclass(frozen=True)
class RowwiseConfig:
    block_n: int = 64
    d_chunk: int = 64  # head_dim elements multiplied per step; the lane reduction spans only this many
    num_warps: int = 4
    num_stages: int = 1  # 1: keys go straight to registers (no async-copy staging)
    programs_per_sm: int = 8  # total programs aimed at, per multiprocessor


class RowwiseSpec(ScorerSpec):
    name = "rowwise"
    description = "row-wise CUDA-core scorer (universal fallback)"
    fn = _rowwise_scorer_kernel
    Config = RowwiseConfig
    ranks = {"prefill": 30, "verify": 30, "draft": 30, "decode": 20}
    universal = True
    tensor_cores = False
    tune_points = (("128x1@98K", "decode"), ("64x1@32K", "decode"), ("16x1@98K", "decode"), ("1x1@262K", "decode"))
    tune_grid = dict(block_n=(64, 128), d_chunk=(32, 64, 128), num_stages=(1, 2), programs_per_sm=(4, 8, 16))

    def default_config(self, problem, platform) -> RowwiseConfig:
        """Tile settings for ``problem`` (docs/kernels.md). Quantised keys are fewer bytes per tile: wider tiles
        (fp8) and more programs keep enough loads in flight."""
        kind = kv_kind(problem.cache_dtype)
        if kind == KV_FP4:
            return RowwiseConfig(programs_per_sm=16)
        if kind != KV_16BIT:
            return RowwiseConfig(block_n=128, programs_per_sm=16)
        return RowwiseConfig()

    def constexprs(self, problem, platform, cfg: RowwiseConfig) -> dict:
        # fp32 products on every platform, no MMA: nothing to upcast, no e4m3 path.
        kind = kv_kind(problem.cache_dtype)
        # MXFP4 is read one 32-element block (16 bytes) per chunk.
        d_chunk = 16 if kind == KV_FP4 else cfg.d_chunk
        n_chunks = problem.head_dim // 32 if kind == KV_FP4 else cdiv(problem.head_dim, cfg.d_chunk)
        return dict(
            RATIO=problem.compress_ratio, NUM_HEADS=problem.num_heads, HEAD_DIM=problem.head_dim,
            D_CHUNK=d_chunk, N_CHUNKS=n_chunks, PAGE_SIZE=problem.block_size, BLOCK_N=cfg.block_n,
            NUM_STAGES=cfg.num_stages, KV_KIND=kind, FAST_DECODE=kind != KV_16BIT and platform.fast_decode,
            HISTOGRAM=problem.histogram, **key_stride_constexprs(problem),
        )

    def grid(self, problem, platform, cfg: RowwiseConfig) -> tuple[int, int]:
        target = platform.programs(cfg.programs_per_sm)
        return problem.num_tokens, column_programs(problem.num_tokens, problem.num_columns, cfg.block_n, target)

    def key_reading(self, problem, platform, plan) -> str:
        if kv_kind(problem.cache_dtype) == KV_16BIT:
            return "as stored"
        return "decoded to fp32 in registers (CUDA-core products, no MMA)"


SPEC = RowwiseSpec()

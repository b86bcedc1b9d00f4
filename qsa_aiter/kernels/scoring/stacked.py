"""Stacked verify/draft scorer.

A program's ``BLOCK_ROWS`` query rows x ``NUM_HEADS`` heads form one M operand (``q`` is ``[tokens * heads, D]`` in
memory, so the stack is a plain 2-D load), and one ``tl.dot`` per key tile scores every head of every row. ReLU is
applied per head, then the heads are summed out of M. With ``BLOCK_ROWS`` equal to the rows of one request (MTP
verify), the request's keys are read once per verify instead of once per row. Rows of different requests in one
block (draft: one row per request) are walked: each distinct request is scored with its own page-table row and only
its rows are stored. Several programs per row block (enough to fill the GPU once) stride over the column tiles.

On an e4m3fn or MXFP4 cache with bf16 queries (``E4M3_MMA``, ``QSA_AITER_E4M3_MMA=1``) the operands swap: the e4m3 key
tile (stored, or unpacked from MXFP4 nibbles one 32-element block per MMA K-step, ``tiles.fp4_keys_major_dots``) is
the M operand of e4m3 tensor-core MMAs and q, split into two exact e4m3 terms, is N (``dequant.split_query_e4m3``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import triton
import triton.language as tl

from ..quant.dequant import KIND_FP4, KV_16BIT, KV_FP4, key_values, kv_kind
from ..spec import COUNT_OR_ZERO, FLAG, cdiv
from .base import (
    DYNAMIC_SCALARS, ScorerSpec, column_programs, e4m3_mma_serves, request_block_rows, stacked_constexprs,
    stacked_shape_reason,
)
from .histogram import BINS, count_scores
from .tiles import (
    block_request, fp4_mma_dots, fp4_tile_exponents, fp8_keys_major_dots, fp8_tile_scales, key_tile_slots,
    load_keys, load_q_tile, pair_dot, row_visibility, stacked_head_scores, store_keys_major,
)


@triton.jit(do_not_specialize=DYNAMIC_SCALARS)
def _stacked_scorer_kernel(
    q_ptr, k_ptr, ks_ptr, pt_ptr, t2r_ptr, pos_ptr, ctx_ptr, out_ptr, vis_ptr, hist_ptr,
    num_tokens, num_requests, num_pages, num_columns, pt_stride, out_stride, scale,
    RATIO: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, KV_KIND: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr, E4M3_MMA: tl.constexpr, SCALED_MMA: tl.constexpr,
    SCALAR_PAGES: tl.constexpr, SCALE_WORDS: tl.constexpr, HISTOGRAM: tl.constexpr,
    KEY_PAGE_STRIDE: tl.constexpr = 0, KEY_SLOT_STRIDE: tl.constexpr = 0,
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
    q_first, q_second, q_factor = load_q_tile(q_ptr, q_rows, q_rows < num_tokens * NUM_HEADS, HEAD_DIM, KV_KIND,
                                              DOT_DTYPE, E4M3_MMA, SCALED_MMA)
    out_rows = out_ptr + rows.to(tl.int64) * out_stride
    hist_rows = hist_ptr + rows.to(tl.int64) * BINS

    for i in tl.static_range(BLOCK_ROWS):
        # The block is walked once per distinct request (at its first row).
        r_i, starts, mine, req_vis = block_request(req, vis, i, BLOCK_ROWS)
        if starts:
            pt_row = pt_ptr + r_i.to(tl.int64) * pt_stride
            n_tiles = tl.cdiv(req_vis, BLOCK_N)
            if E4M3_MMA and (KV_KIND == KIND_FP4):
                # MXFP4 keys unpacked to e4m3 bytes, one MMA K-step per 32-element block; the block exponents are
                # loaded one tile ahead (fp4_tile_exponents). 1 / score_divisor (> 0) joins q's factor before the
                # ReLU: one multiply per dot instead of one more per score.
                q_scale = q_factor * scale
                exps = fp4_tile_exponents(ks_ptr, pt_row, col_prog, n_tiles, req_vis, num_pages, BLOCK_N, PAGE_SIZE,
                                          HEAD_DIM // 32, SCALAR_PAGES, SCALE_WORDS)
                for tile in range(col_prog, n_tiles, col_progs):
                    next_exps = fp4_tile_exponents(ks_ptr, pt_row, tile + col_progs, n_tiles, req_vis, num_pages,
                                                   BLOCK_N, PAGE_SIZE, HEAD_DIM // 32, SCALAR_PAGES, SCALE_WORDS)
                    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                    slot, page_ok = key_tile_slots(pt_row, tile, req_vis, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                    dots_t = fp4_mma_dots(k_ptr, slot, page_ok, exps, q_first, q_second, q_scale, HEAD_DIM,
                                                 DOT_DTYPE, FAST_DECODE, SCALE_WORDS, SCALED_MMA, PAGE_SIZE,
                                                 KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
                    store_keys_major(out_rows, cols, dots_t, page_ok, tl.full((BLOCK_N,), 1.0, tl.float32), mine,
                                     vis, hist_rows, BLOCK_N, BLOCK_ROWS, NUM_HEADS, HISTOGRAM)
                    exps = next_exps
            elif E4M3_MMA:
                # The stored e4m3 keys are the MMA's M operand, q's two e4m3 terms the N operand: dots and scores
                # come out keys x rows. The keys' fp32 scales are loaded one tile ahead (fp8_tile_scales).
                factor = fp8_tile_scales(ks_ptr, pt_row, col_prog, n_tiles, req_vis, num_pages, scale, BLOCK_N,
                                         PAGE_SIZE, SCALAR_PAGES)
                for tile in range(col_prog, n_tiles, col_progs):
                    next_factor = fp8_tile_scales(ks_ptr, pt_row, tile + col_progs, n_tiles, req_vis, num_pages,
                                                  scale, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                    slot, page_ok = key_tile_slots(pt_row, tile, req_vis, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                    keys = key_values(k_ptr, slot, page_ok, HEAD_DIM, KV_KIND, DOT_DTYPE, FAST_DECODE, PAGE_SIZE,
                                      KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
                    dots_t = fp8_keys_major_dots(keys, q_first, q_second, q_factor)
                    store_keys_major(out_rows, cols, dots_t, page_ok, factor, mine, vis, hist_rows, BLOCK_N,
                                     BLOCK_ROWS, NUM_HEADS, HISTOGRAM)
                    factor = next_factor
            else:
                for tile in range(col_prog, n_tiles, col_progs):
                    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                    k_first, k_second, page_ok, factor = load_keys(k_ptr, ks_ptr, pt_row, tile, req_vis, num_pages,
                                                                   scale, BLOCK_N, PAGE_SIZE, HEAD_DIM, KV_KIND,
                                                                   DOT_DTYPE, FAST_DECODE, SCALAR_PAGES,
                                                                   KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
                    dots = pair_dot(q_first, q_second, k_first, k_second, KV_KIND)
                    score = stacked_head_scores(dots, page_ok, factor, BLOCK_ROWS, NUM_HEADS, BLOCK_N)
                    keep = mine[:, None] & (cols[None, :] < vis[:, None])
                    tl.store(out_rows[:, None] + cols[None, :], score, mask=keep)
                    if HISTOGRAM:
                        count_scores(hist_rows[:, None], score, keep)


@dataclass(frozen=True)
class StackedConfig:
    block_rows: int = 4
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4
    scalar_pages: int = field(default=0, metadata=FLAG)  # 1: a key tile's page ids read as scalars (load_keys)
    # > 0: programs per row block, fixed (else from programs_per_sm)
    column_programs: int = field(default=0, metadata=COUNT_OR_ZERO)
    # > 0: registers per thread ptxas may use (``KernelSpec.options``), else its own choice
    max_registers: int = field(default=0, metadata=COUNT_OR_ZERO)


class StackedSpec(ScorerSpec):
    name = "stacked"
    description = "stacked verify/draft scorer (rows x heads in one M operand)"
    fn = _stacked_scorer_kernel
    Config = StackedConfig
    # Decode after the row-wise scorer: chosen there where the tuned tables measured it faster (registry).
    ranks = {"verify": 20, "draft": 20, "decode": 30}
    switch = "stacked_decode_scorer"
    e4m3_mma_path = True
    tune_points = (("9x4@64K-128K", "verify"), ("64x4@98K", "verify"), ("4x4@262K", "verify"),
                   ("128x1@98K", "draft"), ("64x1@32K", "decode"), ("16x1@98K", "decode"), ("1x1@262K", "decode"))
    tune_grid = dict(block_n=(64, 128), num_stages=(2, 3, 5), scalar_pages=(0, 1), programs_per_sm=(2, 4, 8))

    def shape_reason(self, problem) -> str | None:
        return stacked_shape_reason(problem)

    def default_config(self, problem, platform) -> StackedConfig:
        """Tile settings for ``problem`` on ``platform``, from the tuner's H200 measurements (docs/kernels.md)."""
        rows = request_block_rows(problem)
        kind = kv_kind(problem.cache_dtype)
        mma = e4m3_mma_serves(problem, platform)
        if kind == KV_FP4 and mma:
            # Every 32-element block keeps an fp32 accumulator [BLOCK_N, M] live until it is scaled: 64-key tiles
            # (the smallest wgmma M), one warpgroup, deep staging (the page-id indirection takes two stages), and
            # half the programs where rows x heads x blocks exceeds the model's 4 x 4 x 4.
            m_blocks = rows * problem.num_heads * (problem.head_dim // 32)
            return StackedConfig(block_rows=rows, block_n=64, num_stages=5, programs_per_sm=4 if m_blocks <= 64 else 2,
                                 scalar_pages=int(problem.block_size >= 64))
        if kind == KV_FP4:
            # Decoding MXFP4 costs more per byte: narrow tiles on 2 warps, many programs, to hide latency.
            return StackedConfig(block_rows=rows, block_n=64, num_warps=2, programs_per_sm=16)
        if mma:
            # e4m3 MMAs: 64-key tiles leave registers for 4 programs per SM at page 64; at page 16 the page ids
            # come as a vector and 128-key tiles win.
            if problem.block_size >= 64:
                return StackedConfig(block_rows=rows, block_n=64, num_stages=5, scalar_pages=1)
            return StackedConfig(block_rows=rows, block_n=128, num_stages=2, scalar_pages=0)
        return StackedConfig(block_rows=rows, scalar_pages=int(kind == KV_16BIT))

    def constexprs(self, problem, platform, cfg: StackedConfig) -> dict:
        return stacked_constexprs(problem, platform, cfg)

    def grid(self, problem, platform, cfg: StackedConfig) -> tuple[int, int]:
        blocks = cdiv(problem.num_tokens, cfg.block_rows)
        if cfg.column_programs:  # fixed per row block (at most the column tiles)
            return blocks, column_programs(1, problem.num_columns, cfg.block_n, cfg.column_programs)
        return blocks, column_programs(blocks, problem.num_columns, cfg.block_n, platform.programs(cfg.programs_per_sm))


SPEC = StackedSpec()

"""Stacked verify/draft scorer.

A program's ``BLOCK_ROWS`` query rows x ``NUM_HEADS`` heads form one M operand (``q`` is ``[tokens * heads, D]`` in
memory, so the stack is a plain 2-D load), and one ``tl.dot`` per key tile scores every head of every row. ReLU is
applied per head, then the heads are summed out of M. With ``BLOCK_ROWS`` equal to the rows of one request (MTP
verify), the request's keys are read once per verify instead of once per row. Rows of different requests in one
block (draft: one row per request) are walked: each distinct request is scored with its own page-table row and only
its rows are stored. Several programs per row block (enough to fill the GPU once) stride over the column tiles.

On an e4m3fn or MXFP4 cache with bf16 queries (``FP8_DOT``, ``QSA_AITER_FP8_MMA=1``) the operands swap: the e4m3 key
tile (stored, or unpacked from MXFP4 nibbles one 32-element block per MMA K-step, ``common.fp4_keys_major_dots``) is
the M operand of e4m3 tensor-core MMAs and q, split into two exact e4m3 terms, is N (``dequant.split_query_e4m3``).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .dequant import KV_16BIT, KV_FP4, dot_dtype, fp8_dot, key_values, kv_kind
from .common import (
    DYNAMIC_SCALARS, ScoreLaunch, block_request, cdiv, column_programs, fp4_keys_major_dots, fp4_tile_exponents,
    fp8_keys_major_dots, fp8_tile_scales, is_pow2, key_tile_slots, load_keys, load_q_tile, next_pow2, pair_dot,
    row_visibility, scale_words_fit, stacked_head_scores, store_keys_major, target_programs,
)


@triton.jit(do_not_specialize=DYNAMIC_SCALARS)
def _stacked_scorer_kernel(
    q_ptr, k_ptr, ks_ptr, pt_ptr, t2r_ptr, pos_ptr, ctx_ptr, out_ptr, vis_ptr,
    num_tokens, num_requests, num_pages, num_columns, pt_stride, out_stride, scale,
    RATIO: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, KV_KIND: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr, FP8_DOT: tl.constexpr,
    SCALAR_PAGES: tl.constexpr, SCALE_WORDS: tl.constexpr,
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
                                              DOT_DTYPE, FP8_DOT)
    out_rows = out_ptr + rows.to(tl.int64) * out_stride

    for i in tl.static_range(BLOCK_ROWS):
        # The block is walked once per distinct request (at its first row).
        r_i, starts, mine, req_vis = block_request(req, vis, i, BLOCK_ROWS)
        if starts:
            pt_row = pt_ptr + r_i.to(tl.int64) * pt_stride
            n_tiles = tl.cdiv(req_vis, BLOCK_N)
            if FP8_DOT and (KV_KIND == 3):
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
                    dots_t = fp4_keys_major_dots(k_ptr, slot, page_ok, exps, q_first, q_second, q_scale, HEAD_DIM,
                                                 DOT_DTYPE, FAST_DECODE, SCALE_WORDS)
                    store_keys_major(out_rows, cols, dots_t, page_ok, tl.full((BLOCK_N,), 1.0, tl.float32), mine,
                                     vis, BLOCK_N, BLOCK_ROWS, NUM_HEADS)
                    exps = next_exps
            elif FP8_DOT:
                # The stored e4m3 keys are the MMA's M operand, q's two e4m3 terms the N operand: dots and scores
                # come out keys x rows. The keys' fp32 scales are loaded one tile ahead (fp8_tile_scales).
                factor = fp8_tile_scales(ks_ptr, pt_row, col_prog, n_tiles, req_vis, num_pages, scale, BLOCK_N,
                                         PAGE_SIZE, SCALAR_PAGES)
                for tile in range(col_prog, n_tiles, col_progs):
                    next_factor = fp8_tile_scales(ks_ptr, pt_row, tile + col_progs, n_tiles, req_vis, num_pages,
                                                  scale, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                    slot, page_ok = key_tile_slots(pt_row, tile, req_vis, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                    keys = key_values(k_ptr, slot, page_ok, HEAD_DIM, KV_KIND, DOT_DTYPE, FAST_DECODE)
                    dots_t = fp8_keys_major_dots(keys, q_first, q_second, q_factor)
                    store_keys_major(out_rows, cols, dots_t, page_ok, factor, mine, vis, BLOCK_N, BLOCK_ROWS,
                                     NUM_HEADS)
                    factor = next_factor
            else:
                for tile in range(col_prog, n_tiles, col_progs):
                    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                    k_first, k_second, page_ok, factor = load_keys(k_ptr, ks_ptr, pt_row, tile, req_vis, num_pages,
                                                                   scale, BLOCK_N, PAGE_SIZE, HEAD_DIM, KV_KIND,
                                                                   DOT_DTYPE, FAST_DECODE, SCALAR_PAGES)
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
    scalar_pages: int = 0  # 1: a key tile's page ids read as scalars (load_keys)
    column_programs: int = 0  # > 0: programs per row block, fixed (else from programs_per_sm)


def unsupported_reason(problem) -> str | None:
    if not (is_pow2(problem.num_heads) and problem.num_heads >= 4):
        return f"needs a power-of-two head count >= 4 (got {problem.num_heads})"
    if not (is_pow2(problem.head_dim) and problem.head_dim >= 16):
        return f"needs a power-of-two head_dim >= 16 (got {problem.head_dim})"
    return None


def default_config(problem, e4m3_mma: bool | None = None) -> StackedConfig:
    """Tile settings for ``problem``; ``e4m3_mma``: whether the keys go to e4m3 tensor cores (``FP8_DOT``; None:
    wherever the cache and q dtypes allow it, as on an NVIDIA GPU of compute capability 8.9+ with
    ``QSA_AITER_FP8_MMA=1``)."""
    # One request's verify rows per block; M = rows x heads must reach the 16-row MMA tile.
    rows = next_pow2(problem.max_query_len or max(1, problem.num_tokens // max(problem.num_requests, 1)))
    rows = min(max(rows, 16 // problem.num_heads, 1), 16)
    kind = kv_kind(problem.cache_dtype)
    if e4m3_mma is None:
        e4m3_mma = fp8_dot(problem.q_dtype, problem.cache_dtype, problem.head_dim, True)
    if kind == KV_FP4 and e4m3_mma:
        # MXFP4 on e4m3 MMAs: each 32-element block has its own fp32 accumulator [BLOCK_N, M], all live until
        # they are scaled and summed, so registers grow with M = rows x heads (and the block count). 64-key tiles
        # (the smallest wgmma M), 4 warps (one warpgroup), 5 stages (the page-id indirection takes two stages per
        # buffer), 4 programs per SM; from the tuner on the H200 (64x4 @ 98K at page 64: 83.1 us with 128-key tiles,
        # 7 stages and 3 programs per SM, 73.5 us; 128x1 draft: 153.5 -> 131.4 us), page ids as scalars at page 64
        # and as a vector at page 16. Where rows x heads x blocks exceeds this model's 4 x 4 x 4, the accumulators
        # take twice the registers or more: 2 programs per SM.
        m_blocks = rows * problem.num_heads * (problem.head_dim // 32)
        return StackedConfig(block_rows=rows, block_n=64, num_stages=5, programs_per_sm=4 if m_blocks <= 64 else 2,
                             scalar_pages=int(problem.block_size >= 64))
    if kind == KV_FP4:
        # MXFP4 decodes more per byte: narrow tiles on 2 warps, many programs, to hide latency (H200, 64x4 @ 98K:
        # 133 us with the default tile, 101 us).
        return StackedConfig(block_rows=rows, block_n=64, num_warps=2, programs_per_sm=16)
    if e4m3_mma:
        # The e4m3 MMA path (FP8_DOT), from the tuner on the H200 (64x4 @ 98K) once the scales were loaded a tile
        # ahead: at page 64, 64-key tiles with their page id as a scalar and 5 stages (110 registers, 4 programs per
        # SM; 128-key tiles need 130 registers, which leaves room for 3: 97.9 us, against 63.5); at page 16, 128-key
        # tiles with the page ids as a vector and 2 stages (71.1 -> 66.6 us).
        if problem.block_size >= 64:
            return StackedConfig(block_rows=rows, block_n=64, num_stages=5, scalar_pages=1)
        return StackedConfig(block_rows=rows, block_n=128, num_stages=2, scalar_pages=0)
    # 16-bit keys: scalar page ids (H200, page 64: 9x4 20.8 -> 20.0 us, 128x1 @ 98K 208.7 -> 206.8 us).
    return StackedConfig(block_rows=rows, scalar_pages=int(kind == KV_16BIT))


def constexprs(problem, cfg: StackedConfig, upcast: bool, fast_decode: bool = False, fp8_dot: bool = False,
               scale_words: bool = True) -> dict:
    return dict(
        RATIO=problem.compress_ratio, NUM_HEADS=problem.num_heads, HEAD_DIM=problem.head_dim,
        PAGE_SIZE=problem.block_size, BLOCK_ROWS=cfg.block_rows, BLOCK_N=cfg.block_n,
        KV_KIND=kv_kind(problem.cache_dtype), DOT_DTYPE=dot_dtype(problem, upcast, fp8_dot), FAST_DECODE=fast_decode,
        SCALAR_PAGES=bool(cfg.scalar_pages),
        FP8_DOT=fp8_dot, SCALE_WORDS=scale_words and scale_words_fit(problem.head_dim),
    )


def grid(problem, cfg: StackedConfig, target: int) -> tuple[int, int]:
    blocks = cdiv(problem.num_tokens, cfg.block_rows)
    if cfg.column_programs:  # fixed per row block (at most the column tiles)
        return blocks, column_programs(1, problem.num_columns, cfg.block_n, cfg.column_programs)
    return blocks, column_programs(blocks, problem.num_columns, cfg.block_n, target)


def launch(problem, args: ScoreLaunch, cfg: StackedConfig | None = None) -> None:
    cfg = cfg or args.tile("stacked", problem, default_config(problem, args.fp8_dot))
    _stacked_scorer_kernel[grid(problem, cfg, target_programs(args.q.device, cfg.programs_per_sm))](
        *args.common_args(), **constexprs(problem, cfg, args.upcast, args.fast_decode, args.fp8_dot, args.scale_words),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


#: The kernel object, for ahead-of-time compilation (``qsa_aiter.aot``).
KERNEL = _stacked_scorer_kernel

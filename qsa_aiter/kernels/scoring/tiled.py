"""Tiled prefill scorer: ``BLOCK_M`` rows x ``BLOCK_N`` keys output tiles with tensor-core dots.

Rows are expected request-major (a prefill chunk is contiguous per request). A program owns one row tile and a
strided share of its column tiles. The query tile is loaded once per program: with the model's 4 heads as four
per-head ``[BLOCK_M, D]`` operands (four dots per key tile, ReLU'd and summed in registers); with other power-of-two
head counts as one rows x heads stacked M operand (one dot, ReLU per head, heads summed out of M). A row tile
that spans requests walks them (in any order), one page-table row at a time, storing only the rows of the request in
hand; column tiles past a request's visible range are never visited.

With ``keys_major`` the operands swap: each key tile is the M operand and q the N one, and the scores
``[BLOCK_N, BLOCK_M]`` are stored transposed. q is N per head (4 heads: four dots per key tile) or, with
``stack_heads`` (any power-of-two head count), as one head-major stack of ``heads x BLOCK_M`` columns: one MMA per
key tile at N = 256 for the model's 4 heads and 64-row tiles, and since a row's heads lie ``BLOCK_M`` columns apart,
the head sum stays inside each thread's registers. Decoded quantised keys go to the tensor cores from registers
rather than through shared memory, and e4m3fn keys with bf16 queries go to e4m3 MMAs as stored, against q split into
two e4m3 terms (``dequant.split_query_e4m3``), read from shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import triton
import triton.language as tl

from ..quant.dequant import KV_16BIT, KV_FP4, dot_dtype, key_values, kv_kind
from ..spec import FLAG, cdiv, is_pow2
from .base import (
    DYNAMIC_SCALARS, ScorerSpec, column_programs, e4m3_mma_refusal, e4m3_mma_serves, key_stride_constexprs,
    scaled_mma_serves,
)
from .histogram import BINS, count_scores
from .tiles import (
    fp4_scaled_dots, fp8_keys_major_dots, fp8_tile_scales, key_tile_slots, keys_major_pair_dot, load_fp4_packed,
    load_keys, load_q_tile, pair_dot, row_visibility, stacked_head_scores,
)

_NO_REQUEST = tl.constexpr(2147483647)  # larger than any request id


@triton.jit
def _head_scores(q_first, q_second, q_factor, k_first, k_second, KV_KIND: tl.constexpr, KEYS_MAJOR: tl.constexpr,
                 E4M3_MMA: tl.constexpr, SCALED_MMA: tl.constexpr, NAN_RELU: tl.constexpr):
    """One head's ReLU'd dots of a key tile: ``[BLOCK_N, BLOCK_M]`` keys-major, or ``[BLOCK_M, BLOCK_N]``. With
    ``E4M3_MMA`` the stored e4m3 keys against q's two terms (``tiles.fp8_keys_major_dots``); with ``SCALED_MMA`` the
    packed MXFP4 keys (``k_first``) and their e8m0 exponents (``k_second``) against them (``tiles.fp4_scaled_dots``).
    Operands as ``load_q_tile`` and ``load_keys`` give them. ``NAN_RELU``: the ReLU keeps a NaN dot (one ``max.NaN``
    on NVIDIA); off on AMD, where its NaN test overflows the keys-major e4m3 tiles' registers (docs/kernels.md)."""
    if SCALED_MMA:
        dots = fp4_scaled_dots(k_first, k_second, q_first, q_second, q_factor)
    elif E4M3_MMA:
        dots = fp8_keys_major_dots(k_first, q_first, q_second, q_factor)
    elif KEYS_MAJOR:
        dots = keys_major_pair_dot(q_first, q_second, k_first, k_second, KV_KIND)
    else:
        dots = pair_dot(q_first, q_second, k_first, k_second, KV_KIND)
    if NAN_RELU:
        relu = tl.maximum(dots, 0.0, propagate_nan=tl.PropagateNan.ALL)  # a NaN dot stays NaN (docs/kernels.md)
    else:
        relu = tl.maximum(dots, 0.0)
    return relu


@triton.jit
def _store_tile(out_rows, cols, score, mine, vis, unmasked, hist_rows, KEYS_MAJOR: tl.constexpr,
                HISTOGRAM: tl.constexpr):
    """Store a tile's scores (``[BLOCK_M, BLOCK_N]``, keys-major ``[BLOCK_N, BLOCK_M]``: transposed, ``BLOCK_N``
    contiguous columns per row) for the rows that are ``mine``, below each row's ``vis``; ``unmasked``: every
    element is wanted, so no mask is built. With ``HISTOGRAM`` each stored score is counted in its row's histogram
    at ``hist_rows`` (``histogram.count_scores``)."""
    if KEYS_MAJOR:
        ptrs = out_rows[None, :] + cols[:, None]
        bins = hist_rows[None, :]
    else:
        ptrs = out_rows[:, None] + cols[None, :]
        bins = hist_rows[:, None]
    if unmasked:
        tl.store(ptrs, score)
        if HISTOGRAM:
            count_scores(bins, score, None)
    else:
        if KEYS_MAJOR:
            keep = mine[None, :] & (cols[:, None] < vis[None, :])
        else:
            keep = mine[:, None] & (cols[None, :] < vis[:, None])
        tl.store(ptrs, score, mask=keep)
        if HISTOGRAM:
            count_scores(bins, score, keep)


@triton.jit(do_not_specialize=DYNAMIC_SCALARS)
def _tiled_prefill_kernel(
    q_ptr, k_ptr, ks_ptr, pt_ptr, t2r_ptr, pos_ptr, ctx_ptr, out_ptr, vis_ptr, hist_ptr,
    num_tokens, num_requests, num_pages, num_columns, pt_stride, out_stride, scale,
    RATIO: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PER_HEAD: tl.constexpr,
    KV_KIND: tl.constexpr, DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr,
    SCALAR_PAGES: tl.constexpr, KEYS_MAJOR: tl.constexpr, E4M3_MMA: tl.constexpr, SCALED_MMA: tl.constexpr,
    HISTOGRAM: tl.constexpr, KEY_PAGE_STRIDE: tl.constexpr = 0, KEY_SLOT_STRIDE: tl.constexpr = 0,
    NAN_RELU: tl.constexpr = True,
):
    row_tile = tl.program_id(0)
    col_prog = tl.program_id(1)
    col_progs = tl.num_programs(1)
    first_row = row_tile * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    req, vis = row_visibility(t2r_ptr, pos_ptr, ctx_ptr, rows, num_tokens, num_requests, num_columns, RATIO)
    if col_prog == 0:
        tl.store(vis_ptr + rows, vis, mask=rows < num_tokens)
    if PER_HEAD:
        # Four per-head [BLOCK_M, D] operands, loaded once (q is [tokens * 4, D]): each head's scores land in the
        # same accumulator layout, so ReLU and the head sum are plain register arithmetic.
        q_ok = rows < num_tokens
        q_head = rows.to(tl.int64) * 4
        q0a, q0b, q0f = load_q_tile(q_ptr, q_head, q_ok, HEAD_DIM, KV_KIND, DOT_DTYPE, E4M3_MMA, SCALED_MMA)
        q1a, q1b, q1f = load_q_tile(q_ptr, q_head + 1, q_ok, HEAD_DIM, KV_KIND, DOT_DTYPE, E4M3_MMA, SCALED_MMA)
        q2a, q2b, q2f = load_q_tile(q_ptr, q_head + 2, q_ok, HEAD_DIM, KV_KIND, DOT_DTYPE, E4M3_MMA, SCALED_MMA)
        q3a, q3b, q3f = load_q_tile(q_ptr, q_head + 3, q_ok, HEAD_DIM, KV_KIND, DOT_DTYPE, E4M3_MMA, SCALED_MMA)
    elif KEYS_MAJOR:
        # Rows x heads stacked as one N operand, head-major (column h * BLOCK_M + r): one MMA per key tile at
        # N = heads x BLOCK_M, and a row's heads lie BLOCK_M columns apart, in the same thread of the result.
        n = tl.arange(0, NUM_HEADS * BLOCK_M)
        n_rows = first_row + n % BLOCK_M
        qa, qb, qf = load_q_tile(q_ptr, n_rows.to(tl.int64) * NUM_HEADS + n // BLOCK_M, n_rows < num_tokens,
                                 HEAD_DIM, KV_KIND, DOT_DTYPE, E4M3_MMA, SCALED_MMA)
    else:
        # Rows x heads stacked into one M operand.
        q_rows = first_row.to(tl.int64) * NUM_HEADS + tl.arange(0, BLOCK_M * NUM_HEADS)
        qa, qb, _ = load_q_tile(q_ptr, q_rows, q_rows < num_tokens * NUM_HEADS, HEAD_DIM, KV_KIND, DOT_DTYPE,
                                False, False)
    out_rows = out_ptr + rows.to(tl.int64) * out_stride
    hist_rows = hist_ptr + rows.to(tl.int64) * BINS

    # Walk the requests present in the tile (one pass for a tile inside one request); a request's column loop
    # stops at its rows' widest visible count, so tiles past every row's visible range are never visited.
    cur = tl.min(tl.where(vis > 0, req, _NO_REQUEST), axis=0)
    while cur != _NO_REQUEST:
        mine = (req == cur) & (vis > 0)
        req_vis = tl.max(tl.where(mine, vis, 0), axis=0)
        pt_row = pt_ptr + cur.to(tl.int64) * pt_stride
        # Column tiles below every row's visible count, in a tile whose rows all belong to this request, are
        # stored without a per-element mask (most tiles of a prefill chunk).
        whole_tile = tl.sum(mine.to(tl.int32), axis=0) == BLOCK_M
        min_vis = tl.min(tl.where(mine, vis, _NO_REQUEST), axis=0)
        n_tiles = tl.cdiv(req_vis, BLOCK_N)
        if E4M3_MMA and not SCALED_MMA:
            # The fp8 scales a tile ahead (tiles.fp8_tile_scales); the stored key bytes are the MMA's M operand.
            ahead = fp8_tile_scales(ks_ptr, pt_row, col_prog, n_tiles, req_vis, num_pages, scale, BLOCK_N, PAGE_SIZE,
                                    SCALAR_PAGES)
        for tile in range(col_prog, n_tiles, col_progs):
            cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            if SCALED_MMA:
                # MXFP4 as stored: packed nibbles (the MMA's M operand) and their e8m0 exponents (its scales).
                slot, page_ok = key_tile_slots(pt_row, tile, req_vis, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                ka = load_fp4_packed(k_ptr, slot, page_ok, HEAD_DIM, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
                kb = tl.load(ks_ptr + slot[:, None] * (HEAD_DIM // 32) + tl.arange(0, HEAD_DIM // 32)[None, :],
                             mask=page_ok[:, None], other=0)
                factor = tl.full((BLOCK_N,), scale, tl.float32)
            elif E4M3_MMA:
                factor = ahead
                ahead = fp8_tile_scales(ks_ptr, pt_row, tile + col_progs, n_tiles, req_vis, num_pages, scale,
                                        BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                slot, page_ok = key_tile_slots(pt_row, tile, req_vis, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                ka = key_values(k_ptr, slot, page_ok, HEAD_DIM, KV_KIND, DOT_DTYPE, FAST_DECODE, PAGE_SIZE,
                                KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
                kb = ka
            else:
                ka, kb, page_ok, factor = load_keys(k_ptr, ks_ptr, pt_row, tile, req_vis, num_pages, scale, BLOCK_N,
                                                    PAGE_SIZE, HEAD_DIM, KV_KIND, DOT_DTYPE, FAST_DECODE,
                                                    SCALAR_PAGES, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
            if PER_HEAD:
                acc = _head_scores(q0a, q0b, q0f, ka, kb, KV_KIND, KEYS_MAJOR, E4M3_MMA, SCALED_MMA, NAN_RELU)
                acc += _head_scores(q1a, q1b, q1f, ka, kb, KV_KIND, KEYS_MAJOR, E4M3_MMA, SCALED_MMA, NAN_RELU)
                acc += _head_scores(q2a, q2b, q2f, ka, kb, KV_KIND, KEYS_MAJOR, E4M3_MMA, SCALED_MMA, NAN_RELU)
                acc += _head_scores(q3a, q3b, q3f, ka, kb, KV_KIND, KEYS_MAJOR, E4M3_MMA, SCALED_MMA, NAN_RELU)
                if KEYS_MAJOR:
                    score = tl.where(page_ok[:, None], acc * factor[:, None], float("-inf"))
                else:
                    score = tl.where(page_ok[None, :], acc * factor[None, :], float("-inf"))
            elif KEYS_MAJOR:
                dots = _head_scores(qa, qb, qf, ka, kb, KV_KIND, KEYS_MAJOR, E4M3_MMA, SCALED_MMA, NAN_RELU)
                acc = tl.sum(tl.reshape(dots, (BLOCK_N, NUM_HEADS, BLOCK_M)), axis=1)
                score = tl.where(page_ok[:, None], acc * factor[:, None], float("-inf"))
            else:
                score = stacked_head_scores(pair_dot(qa, qb, ka, kb, KV_KIND), page_ok, factor, BLOCK_M, NUM_HEADS,
                                            BLOCK_N)
            _store_tile(out_rows, cols, score, mine, vis, whole_tile & (tile * BLOCK_N + BLOCK_N <= min_vis),
                        hist_rows, KEYS_MAJOR, HISTOGRAM)
        cur = tl.min(tl.where((vis > 0) & (req > cur), req, _NO_REQUEST), axis=0)


@dataclass(frozen=True)
class TiledConfig:
    block_m: int = 64  # query rows per tile (with stacked heads, the dot's M is block_m * heads)
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2
    # 1: one stacked rows x heads q operand even with 4 heads (M, or with keys_major N, head-major)
    stack_heads: int = field(default=0, metadata=FLAG)
    scalar_pages: int = field(default=0, metadata=FLAG)  # 1: a key tile's page ids read as scalars (load_keys)
    # 1: key tiles as the MMA's M operand and q as N; fp8 (e4m3fn) keys then go to e4m3 MMAs
    keys_major: int = field(default=0, metadata=FLAG)


class TiledSpec(ScorerSpec):
    name = "tiled"
    description = "tiled tensor-core prefill scorer (rows x keys tiles)"
    fn = _tiled_prefill_kernel
    Config = TiledConfig
    ranks = {"prefill": 20}
    tune_points = (("prefill 4096@32K", "prefill"), ("prefill 16K@96K", "prefill"))
    tune_grid = dict(block_m=(32, 64), block_n=(64, 128), num_stages=(2, 3), keys_major=(0, 1), stack_heads=(0, 1))

    def shape_reason(self, problem) -> str | None:
        if not is_pow2(problem.num_heads):
            return f"needs a power-of-two head count (got {problem.num_heads})"
        if not (is_pow2(problem.head_dim) and problem.head_dim >= 16):
            return f"needs a power-of-two head_dim >= 16 (got {problem.head_dim})"
        return None

    def default_config(self, problem, platform) -> TiledConfig:
        """Tile settings for ``problem`` (docs/kernels.md). Quantised keys are decoded once per key tile: wider key
        tiles halve the decodes per row tile; 16-bit keys read a tile's page ids as scalars. On AMD, and wherever MXFP4
        goes to block-scaled MMAs, keys-major tiles with every head stacked as N (``heads x block_m = 128``): the
        quantised keys reach the MFMAs as stored, and the four per-head accumulators of the NVIDIA tiles, which spill
        on gfx942/gfx950 (docs/kernels.md), become one."""
        if platform.backend == "hip" or scaled_mma_serves(problem, platform):
            return TiledConfig(block_m=max(1, 128 // problem.num_heads), block_n=64, keys_major=1, stack_heads=1)
        if problem.num_heads == 4:
            return TiledConfig(block_n=128) if kv_kind(problem.cache_dtype) != KV_16BIT else TiledConfig(scalar_pages=1)
        # Stacked heads: keep M = block_m * heads at 128.
        return TiledConfig(block_m=max(1, 128 // problem.num_heads), block_n=128, stack_heads=1)

    def constexprs(self, problem, platform, cfg: TiledConfig) -> dict:
        # With q as the M operand quantised keys are decoded to q's dtype: e4m3 MMAs against a split q need two
        # terms per head, which overflowed the registers with four heads (docs/kernels.md). Keys-major tiles read q's
        # terms from shared memory as N, so there e4m3fn keys go to e4m3 MMAs (MXFP4 keys are still decoded).
        kind = kv_kind(problem.cache_dtype)
        per_head = problem.num_heads == 4 and not cfg.stack_heads
        keys_major = bool(cfg.keys_major)
        # MXFP4 keys go to matrix instructions only where they are block-scaled (one e4m3 K-step per 32-element
        # block would keep a live accumulator per block and head).
        scaled = keys_major and scaled_mma_serves(problem, platform)
        e4m3_mma = keys_major and (kind != KV_FP4 or scaled) and e4m3_mma_serves(problem, platform)
        return dict(
            RATIO=problem.compress_ratio, NUM_HEADS=problem.num_heads, HEAD_DIM=problem.head_dim,
            PAGE_SIZE=problem.block_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            PER_HEAD=per_head,
            KV_KIND=kind, DOT_DTYPE=dot_dtype(problem, platform.upcast, e4m3_mma),
            FAST_DECODE=kind != KV_16BIT and platform.fast_decode, SCALAR_PAGES=bool(cfg.scalar_pages),
            KEYS_MAJOR=keys_major, E4M3_MMA=e4m3_mma, SCALED_MMA=scaled, HISTOGRAM=problem.histogram,
            **key_stride_constexprs(problem),
            # AMD: the plain max (the NaN-keeping one spills the keys-major e4m3 tiles); elsewhere the default.
            **({"NAN_RELU": False} if platform.backend == "hip" else {}),
        )

    def grid(self, problem, platform, cfg: TiledConfig) -> tuple[int, int]:
        row_tiles = cdiv(problem.num_tokens, cfg.block_m)
        return row_tiles, column_programs(row_tiles, problem.num_columns, cfg.block_n,
                                          platform.programs(cfg.programs_per_sm))

    def decoding_reason(self, problem, platform) -> str:
        why = e4m3_mma_refusal(problem, platform)
        if why:
            return why
        if kv_kind(problem.cache_dtype) == KV_FP4 and not platform.block_scaled_mma:
            return "the prefill tiles decode MXFP4 where it has no block-scaled MMAs"
        return ("the prefill tiles decode unless keys-major (TiledConfig.keys_major), which feeds e4m3 keys (and MXFP4 "
                "where block-scaled MMAs exist) to the MMAs")


SPEC = TiledSpec()

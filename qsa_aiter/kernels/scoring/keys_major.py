"""Keys-major decode/verify scorer: many small programs, the keys as the MMA's M operand.

Each program takes ``TILES`` consecutive key tiles of ``BLOCK_N`` columns of one row block and computes, per tile,
``dot(keys [BLOCK_N, D], q^T [D, BLOCK_ROWS * NUM_HEADS])``: the key tile is the M operand (read by the tensor cores
from shared memory, no register pass over the keys) and the block's rows x heads are N. ReLU per head, heads summed,
``BLOCK_N`` contiguous stores per row. The grid is ``(row blocks, cdiv(column tiles, TILES))``, sized from the
logits width (never from device lengths); programs whose first tile lies past every row of their block's visible
range return at once. There is no serial walk over a row: a verify batch of 9 requests over 32K columns is a few
thousand programs of one tile each, where the stacked scorer (``stacked.py``) runs a few hundred programs that each
stride over several tiles with rows x heads as M.

Rows of different requests in one block (decode and draft: one row per request) are walked as in the stacked
scorer (``tiles.block_request``). Every cache format is served: 16-bit keys as stored, fp8 and MXFP4 decoded in
registers, or with ``E4M3_MMA`` the e4m3 bytes (stored, or unpacked from MXFP4 nibbles) fed to e4m3 MMAs as in the
stacked scorer's keys-major path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import triton
import triton.language as tl

from ..quant.dequant import KIND_FP4, key_values
from ..spec import COUNT_OR_ZERO, FLAG, cdiv
from .base import DYNAMIC_SCALARS, ScorerSpec, request_block_rows, stacked_constexprs, stacked_shape_reason
from .histogram import BINS
from .tiles import (
    block_request, fp4_mma_dots, fp4_tile_exponents, fp8_keys_major_dots, fp8_tile_scales, key_tile_slots,
    keys_major_pair_dot, load_keys, load_q_tile, row_visibility, store_keys_major,
)


@triton.jit(do_not_specialize=DYNAMIC_SCALARS)
def _keys_major_scorer_kernel(
    q_ptr, k_ptr, ks_ptr, pt_ptr, t2r_ptr, pos_ptr, ctx_ptr, out_ptr, vis_ptr, hist_ptr,
    num_tokens, num_requests, num_pages, num_columns, pt_stride, out_stride, scale,
    RATIO: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, KV_KIND: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr, E4M3_MMA: tl.constexpr, SCALED_MMA: tl.constexpr,
    SCALAR_PAGES: tl.constexpr, SCALE_WORDS: tl.constexpr, HISTOGRAM: tl.constexpr,
    KEY_PAGE_STRIDE: tl.constexpr = 0, KEY_SLOT_STRIDE: tl.constexpr = 0,
):
    block = tl.program_id(0)
    span = tl.program_id(1)
    first_row = block * BLOCK_ROWS
    rows = first_row + tl.arange(0, BLOCK_ROWS)
    req, vis = row_visibility(t2r_ptr, pos_ptr, ctx_ptr, rows, num_tokens, num_requests, num_columns, RATIO)
    if span == 0:
        tl.store(vis_ptr + rows, vis, mask=rows < num_tokens)
    first_tile = span * TILES
    # Programs past the block's visible range leave before they load q.
    if first_tile * BLOCK_N < tl.max(vis, axis=0):
        M: tl.constexpr = BLOCK_ROWS * NUM_HEADS
        q_rows = first_row.to(tl.int64) * NUM_HEADS + tl.arange(0, M)
        q_first, q_second, q_factor = load_q_tile(q_ptr, q_rows, q_rows < num_tokens * NUM_HEADS, HEAD_DIM,
                                                  KV_KIND, DOT_DTYPE, E4M3_MMA, SCALED_MMA)
        out_rows = out_ptr + rows.to(tl.int64) * out_stride
        hist_rows = hist_ptr + rows.to(tl.int64) * BINS
        for i in tl.static_range(BLOCK_ROWS):
            r_i, starts, mine, req_vis = block_request(req, vis, i, BLOCK_ROWS)
            if starts:
                pt_row = pt_ptr + r_i.to(tl.int64) * pt_stride
                # This program's tiles of the request: [first_tile, last_tile), possibly none.
                last_tile = tl.minimum(first_tile + TILES, tl.cdiv(req_vis, BLOCK_N))
                if E4M3_MMA and (KV_KIND == KIND_FP4):
                    q_scale = q_factor * scale
                    exps = fp4_tile_exponents(ks_ptr, pt_row, first_tile, last_tile, req_vis, num_pages, BLOCK_N,
                                              PAGE_SIZE, HEAD_DIM // 32, SCALAR_PAGES, SCALE_WORDS)
                    for tile in range(first_tile, last_tile):
                        next_exps = fp4_tile_exponents(ks_ptr, pt_row, tile + 1, last_tile, req_vis, num_pages,
                                                       BLOCK_N, PAGE_SIZE, HEAD_DIM // 32, SCALAR_PAGES, SCALE_WORDS)
                        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                        slot, page_ok = key_tile_slots(pt_row, tile, req_vis, num_pages, BLOCK_N, PAGE_SIZE,
                                                       SCALAR_PAGES)
                        dots_t = fp4_mma_dots(k_ptr, slot, page_ok, exps, q_first, q_second, q_scale,
                                                     HEAD_DIM, DOT_DTYPE, FAST_DECODE, SCALE_WORDS, SCALED_MMA,
                                                     PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
                        store_keys_major(out_rows, cols, dots_t, page_ok, tl.full((BLOCK_N,), 1.0, tl.float32), mine,
                                         vis, hist_rows, BLOCK_N, BLOCK_ROWS, NUM_HEADS, HISTOGRAM)
                        exps = next_exps
                elif E4M3_MMA:
                    factor = fp8_tile_scales(ks_ptr, pt_row, first_tile, last_tile, req_vis, num_pages, scale,
                                             BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                    for tile in range(first_tile, last_tile):
                        next_factor = fp8_tile_scales(ks_ptr, pt_row, tile + 1, last_tile, req_vis, num_pages, scale,
                                                      BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                        slot, page_ok = key_tile_slots(pt_row, tile, req_vis, num_pages, BLOCK_N, PAGE_SIZE,
                                                       SCALAR_PAGES)
                        keys = key_values(k_ptr, slot, page_ok, HEAD_DIM, KV_KIND, DOT_DTYPE, FAST_DECODE,
                                          PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
                        dots_t = fp8_keys_major_dots(keys, q_first, q_second, q_factor)
                        store_keys_major(out_rows, cols, dots_t, page_ok, factor, mine, vis, hist_rows, BLOCK_N,
                                         BLOCK_ROWS, NUM_HEADS, HISTOGRAM)
                        factor = next_factor
                else:
                    for tile in range(first_tile, last_tile):
                        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                        k_first, k_second, page_ok, factor = load_keys(k_ptr, ks_ptr, pt_row, tile, req_vis,
                                                                       num_pages, scale, BLOCK_N, PAGE_SIZE, HEAD_DIM,
                                                                       KV_KIND, DOT_DTYPE, FAST_DECODE, SCALAR_PAGES,
                                                                       KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
                        dots_t = keys_major_pair_dot(q_first, q_second, k_first, k_second, KV_KIND)
                        store_keys_major(out_rows, cols, dots_t, page_ok, factor, mine, vis, hist_rows, BLOCK_N,
                                         BLOCK_ROWS, NUM_HEADS, HISTOGRAM)


#: Tiles per program by the grid's size when the config leaves it derived (0): one tile while that gives fewer than
#: ``programs`` programs, then wider spans so the grid stays a few waves deep.
TILE_STEPS = ((16384, 1), (32768, 2), (131072, 4))
WIDEST_SPAN = 8


def tiles_per_program(row_blocks: int, column_tiles: int) -> int:
    """Key tiles per program of a grid of ``row_blocks`` x ``column_tiles`` (one tile per program)."""
    programs = row_blocks * column_tiles
    return next((tiles for limit, tiles in TILE_STEPS if programs < limit), WIDEST_SPAN)


@dataclass(frozen=True)
class KeysMajorConfig:
    block_rows: int = 4
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    scalar_pages: int = field(default=1, metadata=FLAG)  # 1: a key tile's page ids read as scalars
    # > 0: key tiles per program, fixed (else from the grid's size: tiles_per_program)
    tiles_per_program: int = field(default=0, metadata=COUNT_OR_ZERO)


class KeysMajorSpec(ScorerSpec):
    name = "keys_major"
    description = "keys-major decode/verify scorer (key tiles as the MMA's M operand, one small program per span)"
    fn = _keys_major_scorer_kernel
    Config = KeysMajorConfig
    # After the stacked scorer in the order: chosen where the tuned tables measured it faster (registry).
    ranks = {"verify": 25, "draft": 25, "decode": 35}
    switch = "stacked_decode_scorer"
    e4m3_mma_path = True
    tune_points = (("9x4@64K-128K", "verify"), ("16x4@32K", "verify"), ("64x4@32K", "verify"),
                   ("64x4@98K", "verify"), ("4x4@262K", "verify"), ("128x1@98K", "draft"), ("64x1@32K", "decode"),
                   ("16x1@98K", "decode"), ("1x1@262K", "decode"))
    tune_grid = dict(block_n=(64, 128), num_warps=(2, 4), num_stages=(2, 3), tiles_per_program=(0, 1, 2, 4))

    def shape_reason(self, problem) -> str | None:
        return stacked_shape_reason(problem)

    def default_config(self, problem, platform) -> KeysMajorConfig:
        return KeysMajorConfig(block_rows=request_block_rows(problem), scalar_pages=int(problem.block_size >= 64))

    def constexprs(self, problem, platform, cfg: KeysMajorConfig) -> dict:
        return {**stacked_constexprs(problem, platform, cfg), "TILES": self._tiles(problem, cfg)}

    def _tiles(self, problem, cfg: KeysMajorConfig) -> int:
        if cfg.tiles_per_program:
            return cfg.tiles_per_program
        return tiles_per_program(cdiv(problem.num_tokens, cfg.block_rows), cdiv(max(problem.num_columns, 1),
                                                                                cfg.block_n))

    def grid(self, problem, platform, cfg: KeysMajorConfig) -> tuple[int, int]:
        column_tiles = cdiv(max(problem.num_columns, 1), cfg.block_n)
        return cdiv(problem.num_tokens, cfg.block_rows), cdiv(column_tiles, self._tiles(problem, cfg))


SPEC = KeysMajorSpec()

"""``@triton.jit`` helpers shared by the scoring kernels, inlined into each: the visibility rule (README, what the op
computes), the request walk of a row block, query and key tile loads, the stacked head sum, and the keys-major
low-precision MMA paths: e4m3 keys as stored, MXFP4 as e4m3 bytes per 32-element block or block-scaled (the paged,
dequantising key gather itself lives in ``quant.dequant``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..quant.dequant import (
    KIND_FP4, e4m3_row_scale, fp4_block_order, fp4_e4m3_block, key_rows, key_slots, load_fp4_key_tile, load_key_tile,
    nan_rows_scale, row_has_nan, split_e4m3, split_query_e4m3, tile_slots,
)
from .histogram import count_scores

#: Largest position and context length the visibility rule needs: past them every count is ``num_columns`` anyway,
#: because the host refuses ``num_columns * R >= 2**31`` (``problem.MAX_CONTEXT_TOKENS``).
_POS_MAX = tl.constexpr(2**31 - 2)
_CTX_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def row_visibility(t2r_ptr, pos_ptr, ctx_ptr, rows, num_tokens, num_requests, num_columns, RATIO: tl.constexpr):
    """Request id and visible group count of ``rows`` (scalar or vector), both int32. Padded rows give ``(-1, 0)``.

    The metadata is compared and clamped in its own dtype before it is narrowed: int64 request ids, positions and
    context lengths past 2**31 are honoured, never wrapped, and ``p + 1`` cannot overflow. The clamps change no count
    (a position or context past them sees all ``num_columns``). The arithmetic after them is 32-bit, and the int64
    context clamp is compiled only for int64 metadata: with int32 metadata the kernels build exactly as before (a
    clamp there moved the row-wise kernel's scalars off the uniform datapath, which measured slower)."""
    in_range = rows < num_tokens
    req = tl.load(t2r_ptr + rows, mask=in_range, other=-1)
    pos = tl.load(pos_ptr + rows, mask=in_range, other=-1)
    req_ok = (req >= 0) & (req < num_requests)
    ctx = tl.load(ctx_ptr + req, mask=req_ok, other=0)
    if ctx.dtype == tl.int64:
        ctx = tl.minimum(tl.maximum(ctx, 0), _CTX_MAX)
    pos = tl.minimum(tl.maximum(pos, -1), _POS_MAX).to(tl.int32)
    ctx = ctx.to(tl.int32)  # an int32 context needs no clamp: a negative one clamps the count to 0 below
    # Negative positions give 0 (C-style division) and clamp to 0 below.
    vis = tl.minimum((pos + 1) // RATIO, ctx // RATIO)
    vis = tl.minimum(tl.maximum(vis, 0), num_columns)
    vis = tl.where(req_ok, vis, 0)
    req = tl.where(req_ok, req, -1).to(tl.int32)
    return req, vis


@triton.jit
def block_request(req, vis, i, BLOCK_ROWS: tl.constexpr):
    """The request walk of a row block (``row_visibility``'s ``req``, ``vis``, ``[BLOCK_ROWS]``) at its row ``i``:
    ``(request, starts, mine, request_visible)``. ``starts``: row ``i`` is the first row of its request in the block
    that sees anything, so the block walks that request now (once per distinct request); ``mine``: the block's rows of
    that request that see anything; ``request_visible``: the largest visible count among them (the tile loop's
    bound). Taken from the row vectors in registers: no scalar reloads of ``token_to_request``."""
    idx = tl.arange(0, BLOCK_ROWS)
    r_i = tl.sum(tl.where(idx == i, req, 0), axis=0)
    v_i = tl.sum(tl.where(idx == i, vis, 0), axis=0)
    seen = tl.sum(tl.where((idx < i) & (req == r_i) & (vis > 0), 1, 0), axis=0)
    mine = (req == r_i) & (vis > 0)
    return r_i, (v_i > 0) & (seen == 0), mine, tl.max(tl.where(mine, vis, 0), axis=0)


@triton.jit
def stacked_head_scores(dots, page_ok, factor, ROWS: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scores ``[ROWS, BLOCK_N]`` from the dot products ``[ROWS * NUM_HEADS, BLOCK_N]`` of a rows x heads stacked query.

    ReLU is applied per head, then the heads are summed out of M and each column is multiplied by its ``factor``
    (``load_key_tile``). Columns whose page is bad score ``-inf``.
    """
    relu = tl.maximum(dots, 0.0, propagate_nan=tl.PropagateNan.ALL)  # a NaN dot stays NaN (docs/kernels.md)
    s = tl.sum(tl.reshape(relu, (ROWS, NUM_HEADS, BLOCK_N)), axis=1)
    return tl.where(page_ok[None, :], s * factor[None, :], float("-inf"))


@triton.jit
def load_q_tile(q_ptr, q_rows, q_ok, HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr, DOT_DTYPE: tl.constexpr,
                E4M3_MMA: tl.constexpr, SCALED_MMA: tl.constexpr):
    """Query rows ``q_rows`` (of ``q`` viewed as ``[rows, HEAD_DIM]``) as dot operands ``(first, second, factor)``
    for ``pair_dot``: ``(q, q, 1)``, each ``[len(q_rows), HEAD_DIM]``; for an MXFP4 cache q's even and odd elements,
    each ``[len(q_rows), HEAD_DIM // 2]`` (to meet ``load_fp4_key_tile``'s even and odd keys); with ``E4M3_MMA`` the
    two e4m3 terms of q and the fp32 row scale ``[len(q_rows)]`` to multiply their dots by (``split_query_e4m3``):
    in ``DOT_DTYPE`` (e4m3fnuz: ``e4m3_operands``), or e4m3fn for ``SCALED_MMA`` (whatever ``DOT_DTYPE``: the
    block-scaled dot takes e4m3 operands under the interpreter too); with ``E4M3_MMA`` on an MXFP4 cache without
    ``SCALED_MMA`` those terms per 32-element block (``load_q_fp4_blocks``)."""
    row = q_ptr + q_rows.to(tl.int64)[:, None] * HEAD_DIM
    factor = tl.full(q_rows.shape, 1.0, tl.float32)
    if E4M3_MMA and (KV_KIND == KIND_FP4) and not SCALED_MMA:
        first, second, factor = load_q_fp4_blocks(q_ptr, q_rows, q_ok, HEAD_DIM, DOT_DTYPE)
    elif E4M3_MMA:
        q = tl.load(row + tl.arange(0, HEAD_DIM)[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)
        # gfx950's block-scaled prefill tiles are at the register limit: no NaN test of q there (docs/kernels.md)
        hi, lo, factor = split_query_e4m3(q, not SCALED_MMA)
        if SCALED_MMA:
            first = hi.to(tl.float8e4nv)
            second = lo.to(tl.float8e4nv)
        else:
            first, second, factor = e4m3_operands(hi, lo, factor, DOT_DTYPE)
    elif KV_KIND == KIND_FP4:
        j = 2 * tl.arange(0, HEAD_DIM // 2)
        first = tl.load(row + j[None, :], mask=q_ok[:, None], other=0.0).to(DOT_DTYPE)
        second = tl.load(row + j[None, :] + 1, mask=q_ok[:, None], other=0.0).to(DOT_DTYPE)
    else:
        first = tl.load(row + tl.arange(0, HEAD_DIM)[None, :], mask=q_ok[:, None], other=0.0).to(DOT_DTYPE)
        second = first
    return first, second, factor


@triton.jit
def e4m3_operands(hi, lo, factor, DOT_DTYPE: tl.constexpr):
    """``split_query_e4m3``'s terms (fp32 values on e4m3fn's grid) and row scale as MMA operands in ``DOT_DTYPE``:
    e4m3fnuz (``float8e4b8``, exponent bias 8) holds every e4m3fn value halved (the terms stay below 256, so below
    128 halved, under its 240), so the terms are halved and the scale doubled; any other dtype takes them as they
    are."""
    if DOT_DTYPE == tl.float8e4b8:
        first = (hi * 0.5).to(DOT_DTYPE)
        second = (lo * 0.5).to(DOT_DTYPE)
        scale = factor * 2.0
    else:
        first = hi.to(DOT_DTYPE)
        second = lo.to(DOT_DTYPE)
        scale = factor
    return first, second, scale


@triton.jit
def load_q_fp4_blocks(q_ptr, q_rows, q_ok, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Query rows ``q_rows`` split for the MXFP4 e4m3 MMA path: ``(hi, lo, factor)``, where ``hi`` and ``lo`` are
    tuples of ``HEAD_DIM // 32`` operands ``[len(q_rows), 32]`` (in ``DOT_DTYPE``), block ``b``'s two e4m3 terms in the
    block's MMA order (``fp4_block_order``), and ``factor`` ``[len(q_rows)]`` fp32 is the row scale times ``2**6``
    (undoing the ``2**-6`` of the keys' e4m3 bytes, ``fp4_e4m3_block``). One row scale for all blocks, taken from the
    whole row's largest magnitude (``split_query_e4m3``), so the blocks' dots add up before it is applied."""
    row = q_ptr + q_rows.to(tl.int64)[:, None] * HEAD_DIM
    order = fp4_block_order()
    blocks = ()
    amax = tl.zeros(q_rows.shape, tl.float32)
    has_nan = tl.zeros(q_rows.shape, tl.int1)
    for b in tl.static_range(HEAD_DIM // 32):
        x = tl.load(row + b * 32 + order[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        has_nan = has_nan | row_has_nan(x)
        blocks = blocks + (x,)
    inverse, row_scale = e4m3_row_scale(amax)
    row_scale = nan_rows_scale(row_scale, has_nan)
    his = ()
    los = ()
    for b in tl.static_range(HEAD_DIM // 32):
        hi, lo = split_e4m3(blocks[b] * inverse[:, None])
        his = his + (hi.to(DOT_DTYPE),)
        los = los + (lo.to(DOT_DTYPE),)
    return his, los, row_scale * 64.0


@triton.jit
def key_tile_slots(pt_row_ptr, tile, valid, num_pages, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   SCALAR_PAGES: tl.constexpr):
    """Cache slots ``[BLOCK_N]`` int64 and ``page_ok`` of key tile ``tile`` (columns ``tile * BLOCK_N + [0,
    BLOCK_N)``, those ``< valid`` wanted) of one request. The tile's page ids are read as scalars (``tile_slots``)
    with ``SCALAR_PAGES``, else as one vector (``key_slots``): a tile setting, which is faster depends on the kernel
    and cache kind. Scalar page ids need tiles and pages that nest (one divides the other); any other page size
    reads them as a vector whatever ``SCALAR_PAGES`` says."""
    if SCALAR_PAGES and ((BLOCK_N % PAGE_SIZE == 0) or (PAGE_SIZE % BLOCK_N == 0)):
        slot, page_ok = tile_slots(pt_row_ptr, tile, valid, num_pages, BLOCK_N, PAGE_SIZE)
    else:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        slot, page_ok = key_slots(pt_row_ptr, cols, cols < valid, num_pages, PAGE_SIZE)
    return slot, page_ok


@triton.jit
def load_keys(k_ptr, ks_ptr, pt_row_ptr, tile, valid, num_pages, scale, BLOCK_N: tl.constexpr,
              PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr, DOT_DTYPE: tl.constexpr,
              FAST_DECODE: tl.constexpr, SCALAR_PAGES: tl.constexpr, KEY_PAGE_STRIDE: tl.constexpr,
              KEY_SLOT_STRIDE: tl.constexpr):
    """Key tile ``tile`` (columns ``tile * BLOCK_N + [0, BLOCK_N)``, those ``< valid`` wanted) of one request as dot
    operands ``(first, second, page_ok, factor)``: for an MXFP4 cache the even and odd elements
    (``load_fp4_key_tile``), else the keys twice (``load_key_tile``); pair them with ``load_q_tile``. Slots and
    ``page_ok`` as ``key_tile_slots``; the keys' addresses as ``key_rows``."""
    slot, page_ok = key_tile_slots(pt_row_ptr, tile, valid, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
    if KV_KIND == KIND_FP4:
        first, second, factor = load_fp4_key_tile(k_ptr, ks_ptr, slot, page_ok, scale, HEAD_DIM, DOT_DTYPE,
                                                  FAST_DECODE, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
    else:
        first, factor = load_key_tile(k_ptr, ks_ptr, slot, page_ok, scale, HEAD_DIM, KV_KIND, DOT_DTYPE, FAST_DECODE,
                                      PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
        second = first
    return first, second, page_ok, factor


@triton.jit
def pair_dot(q_first, q_second, k_first, k_second, KV_KIND: tl.constexpr):
    """``q . k`` over head_dim for operands from ``load_q_tile`` and ``load_keys``: ``[M, BLOCK_N]`` fp32. MXFP4 is
    two half-K dots (even, then odd elements) into one accumulator."""
    if KV_KIND == KIND_FP4:
        dots = tl.dot(q_second, tl.trans(k_second), tl.dot(q_first, tl.trans(k_first)))
    else:
        dots = tl.dot(q_first, tl.trans(k_first))
    return dots


@triton.jit
def keys_major_pair_dot(q_first, q_second, k_first, k_second, KV_KIND: tl.constexpr):
    """``pair_dot`` with the keys as the M operand: ``[BLOCK_N, M]`` fp32 (``store_keys_major`` scores it)."""
    if KV_KIND == KIND_FP4:
        dots = tl.dot(k_second, tl.trans(q_second), tl.dot(k_first, tl.trans(q_first)))
    else:
        dots = tl.dot(k_first, tl.trans(q_first))
    return dots


@triton.jit
def fp8_keys_major_dots(keys, q_hi, q_lo, q_factor):
    """``E4M3_MMA`` dots, keys major: e4m3 keys ``[BLOCK_N, D]`` (as stored) against q's two e4m3 terms ``[M, D]``
    (``load_q_tile``), one fp32 accumulator ``[BLOCK_N, M]`` times q's row scales ``[M]``. With the keys as the M
    operand the tensor cores read them straight from shared memory: no register pass over the keys at all."""
    dots = tl.dot(keys, tl.trans(q_lo), tl.dot(keys, tl.trans(q_hi)))
    return dots * q_factor[None, :]


@triton.jit
def ahead_slots(pt_row_ptr, tile, n_tiles, valid, num_pages, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                SCALAR_PAGES: tl.constexpr):
    """``key_tile_slots`` of a tile loaded ahead of the loop that uses it, which may be past the request's last tile
    (``n_tiles >= 1``): the last tile's slots, with nothing to read."""
    slot, ok = key_tile_slots(pt_row_ptr, tl.minimum(tile, n_tiles - 1), valid, num_pages, BLOCK_N, PAGE_SIZE,
                              SCALAR_PAGES)
    # tl.where, not `ok & (tile < n_tiles)`: Triton 3.9's interpreter rejects a vector & scalar mask.
    return slot, tl.where(tile < n_tiles, ok, False)


@triton.jit
def fp4_tile_exponents(ks_ptr, pt_row_ptr, tile, n_tiles, valid, num_pages, BLOCK_N: tl.constexpr,
                       PAGE_SIZE: tl.constexpr, NB: tl.constexpr, SCALAR_PAGES: tl.constexpr,
                       SCALE_WORDS: tl.constexpr):
    """The e8m0 block exponents of MXFP4 key tile ``tile`` of one request (columns as ``key_tile_slots``; nothing is
    read for a tile at or past ``n_tiles``, ``n_tiles >= 1``), for ``fp4_block_factors``: with ``SCALE_WORDS``
    ``[BLOCK_N]`` integers holding a key's ``NB`` exponent bytes (one load per key: NB of 1, 2, 4 or 8 and the scale
    tensor aligned to NB bytes), else ``[BLOCK_N, NB]`` bytes. Zeros where a column is not read. The tile loops load
    a tile's exponents one iteration ahead: the key bytes are staged ahead by the compiler's pipelining because they
    feed the MMA, the exponents are not."""
    slot, ok = ahead_slots(pt_row_ptr, tile, n_tiles, valid, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
    if SCALE_WORDS:
        if NB == 8:
            exps = tl.load(ks_ptr.to(tl.pointer_type(tl.uint64)) + slot, mask=ok, other=0)
        elif NB == 4:
            exps = tl.load(ks_ptr.to(tl.pointer_type(tl.uint32)) + slot, mask=ok, other=0)
        elif NB == 2:
            exps = tl.load(ks_ptr.to(tl.pointer_type(tl.uint16)) + slot, mask=ok, other=0)
        else:
            exps = tl.load(ks_ptr + slot, mask=ok, other=0)
    else:
        exps = tl.load(ks_ptr + slot[:, None] * NB + tl.arange(0, NB)[None, :], mask=ok[:, None], other=0)
    return exps


@triton.jit
def fp8_tile_scales(ks_ptr, pt_row_ptr, tile, n_tiles, valid, num_pages, scale, BLOCK_N: tl.constexpr,
                    PAGE_SIZE: tl.constexpr, SCALAR_PAGES: tl.constexpr):
    """The per-key factors ``[BLOCK_N]`` fp32 (the fp8 cache's scale times ``scale``) of key tile ``tile`` of one
    request (columns as ``key_tile_slots``; zeros where a column is not read, and nothing is read for a tile at or
    past ``n_tiles``, ``n_tiles >= 1``). The tile loops load them one iteration ahead: the key bytes feed the MMA and
    are staged ahead by the compiler's pipelining, these are not, and a plain load issued in the iteration that uses
    it leaves its whole memory latency exposed (on the H200 it was most of the fp8 kernel's stalls)."""
    slot, ok = ahead_slots(pt_row_ptr, tile, n_tiles, valid, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
    return tl.load(ks_ptr + slot, mask=ok, other=0.0) * scale


@triton.jit
def stack_last(parts):
    """A tuple of ``N`` tensors ``[BLOCK_N, M]`` (``N`` a power of two up to 64) stacked along a new last dim:
    ``[BLOCK_N, M, N]`` with ``x[..., i] = parts[i]``. Pairwise ``tl.join``s: the new dims stay in registers."""
    x = parts
    for _ in tl.static_range(6):
        if len(x) > 1:
            # Level l joins part i with part i + N / 2**l: the flattened trailing dims count up in part order.
            joined = ()
            for i in tl.static_range(len(x) // 2):
                joined = joined + (tl.join(x[i], x[i + len(x) // 2]),)
            x = joined
    N: tl.constexpr = len(parts)
    return tl.reshape(x[0], (parts[0].shape[0], parts[0].shape[1], N))


@triton.jit
def fp4_block_factors(exps, NB: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """``fp4_tile_exponents``'s exponents as fp32 factors ``2**(e - 127)``, ``[BLOCK_N, NB]``. The factor's bits are
    ``e << 23``, or ``0x00400000`` (the subnormal ``2**-127``) for ``e = 0``: the larger of the two, so one integer
    max covers both."""
    if SCALE_WORDS:
        e = ((exps[:, None] >> (8 * tl.arange(0, NB))[None, :]) & 0xFF).to(tl.int32)
    else:
        e = exps.to(tl.int32)
    return tl.maximum(e << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def fp4_keys_major_dots(k_ptr, slot, page_ok, exps, q_hi, q_lo, q_factor, HEAD_DIM: tl.constexpr,
                        DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr, SCALE_WORDS: tl.constexpr,
                        PAGE_SIZE: tl.constexpr, KEY_PAGE_STRIDE: tl.constexpr, KEY_SLOT_STRIDE: tl.constexpr):
    """``E4M3_MMA`` dots of an MXFP4 key tile, keys major: ``[BLOCK_N, M]`` fp32 for the keys at cache slots ``slot``
    (``[BLOCK_N]``; zeros where not ``page_ok``) with block exponents ``exps`` (``fp4_tile_exponents``) against q's
    per-block e4m3 terms (``load_q_fp4_blocks``).

    The e8m0 exponent differs per 32-element block and has no place in an e4m3 operand, so each block is one MMA
    K-step of its own (k32 for e4m3): its nibbles become e4m3 bytes (``fp4_e4m3_block``), its two dots (q's ``hi``
    and ``lo`` terms) go into a fresh accumulator, and the blocks' results are multiplied per key by ``2**(e -
    127)`` (``fp4_block_factors``) and summed in fp32; q's factor (row scale times ``2**6``) is applied once at the
    end. The block results are stacked into one ``[BLOCK_N, M, NB]`` tensor so that the factors are one tensor too
    (one move into the MMA result's layout per tile, not one per block).
    """
    NB: tl.constexpr = HEAD_DIM // 32
    pair = tl.arange(0, 16)
    rows = key_rows(slot, HEAD_DIM // 2, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
    block_dots = ()
    for b in tl.static_range(NB):
        packed = tl.load(k_ptr + rows[:, None] + b * 16 + pair[None, :], mask=page_ok[:, None], other=0)
        keys = fp4_e4m3_block(packed, DOT_DTYPE, FAST_DECODE)
        block_dots = block_dots + (tl.dot(keys, tl.trans(q_lo[b]), tl.dot(keys, tl.trans(q_hi[b]))),)
    factors = fp4_block_factors(exps, NB, SCALE_WORDS)
    dots = tl.sum(stack_last(block_dots) * factors[:, None, :], axis=2)
    return dots * q_factor[None, :]


#: ``tl.dot_scaled``'s operand formats, as constexprs (Triton 3.9's interpreter reads the format's ``.value``).
E2M1 = tl.constexpr("e2m1")
E4M3 = tl.constexpr("e4m3")


@triton.jit
def fp4_scale_bytes(exps, NB: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """``fp4_tile_exponents``'s exponents as the e8m0 bytes of a block-scaled dot: uint8 ``[BLOCK_N, NB]``."""
    if SCALE_WORDS:
        e = ((exps[:, None] >> (8 * tl.arange(0, NB))[None, :]) & 0xFF).to(tl.uint8)
    else:
        e = exps
    return e


@triton.jit
def load_fp4_packed(k_ptr, slot, page_ok, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    KEY_PAGE_STRIDE: tl.constexpr, KEY_SLOT_STRIDE: tl.constexpr):
    """MXFP4 keys at cache slots ``slot`` (addresses as ``key_rows``) as stored: uint8 ``[BLOCK_N, HEAD_DIM // 2]``
    (element ``2j`` in the low nibble of byte ``j``), zeros where not ``page_ok``."""
    d = tl.arange(0, HEAD_DIM // 2)
    rows = key_rows(slot, HEAD_DIM // 2, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
    return tl.load(k_ptr + rows[:, None] + d[None, :], mask=page_ok[:, None], other=0)


@triton.jit
def fp4_scaled_dots(packed, scales, q_hi, q_lo, q_factor):
    """``SCALED_MMA`` dots of an MXFP4 key tile, keys major: ``[BLOCK_N, M]`` fp32 for the packed keys (uint8
    ``[BLOCK_N, D // 2]``, ``load_fp4_packed``) with their e8m0 exponents (uint8 ``[BLOCK_N, D // 32]``,
    ``fp4_scale_bytes``) against q's two e4m3 terms (``[M, D]`` e4m3fn, ``load_q_tile``), one accumulator, times q's
    row scales ``[M]``. The keys and exponents go to block-scaled MMAs as stored (gfx950's
    ``v_mfma_scale_f32_*_f8f6f4``, one instruction per 128 elements of head_dim): no decode, no per-block fp32
    pass. Each product of an e4m3 term and an e2m1 value is exact; the sums round inside the instruction."""
    dots = tl.dot_scaled(packed, scales, E2M1, tl.trans(q_lo), None, E4M3,
                         acc=tl.dot_scaled(packed, scales, E2M1, tl.trans(q_hi), None, E4M3))
    return dots * q_factor[None, :]


@triton.jit
def fp4_mma_dots(k_ptr, slot, page_ok, exps, q_hi, q_lo, q_factor, HEAD_DIM: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr, SCALE_WORDS: tl.constexpr,
                 SCALED_MMA: tl.constexpr, PAGE_SIZE: tl.constexpr, KEY_PAGE_STRIDE: tl.constexpr,
                 KEY_SLOT_STRIDE: tl.constexpr):
    """The keys-major dots ``[BLOCK_N, M]`` of an MXFP4 key tile on low-precision matrix instructions: block-scaled
    (``SCALED_MMA``, ``fp4_scaled_dots``) or one e4m3 K-step per 32-element block (``fp4_keys_major_dots``). Operands
    as ``load_q_tile`` gives them for the same ``SCALED_MMA``; ``exps`` from ``fp4_tile_exponents``."""
    if SCALED_MMA:
        packed = load_fp4_packed(k_ptr, slot, page_ok, HEAD_DIM, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
        dots = fp4_scaled_dots(packed, fp4_scale_bytes(exps, HEAD_DIM // 32, SCALE_WORDS), q_hi, q_lo, q_factor)
    else:
        dots = fp4_keys_major_dots(k_ptr, slot, page_ok, exps, q_hi, q_lo, q_factor, HEAD_DIM, DOT_DTYPE,
                                   FAST_DECODE, SCALE_WORDS, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
    return dots


@triton.jit
def store_keys_major(out_rows, cols, dots_t, page_ok, factor, mine, vis, hist_rows, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr, NUM_HEADS: tl.constexpr, HISTOGRAM: tl.constexpr):
    """Score and store keys-major dots ``[BLOCK_N, ROWS * NUM_HEADS]`` (``fp8_keys_major_dots``,
    ``fp4_keys_major_dots``): ReLU per head, heads summed, times the per-key ``factor`` (``-inf`` where not
    ``page_ok``), stored transposed at ``out_rows[r] + cols`` for the rows that are ``mine`` and columns below each
    row's ``vis``; with ``HISTOGRAM`` each stored score is counted in its row's histogram at ``hist_rows``
    (``histogram.count_scores``)."""
    relu = tl.maximum(dots_t, 0.0, propagate_nan=tl.PropagateNan.ALL)  # a NaN dot stays NaN (docs/kernels.md)
    s_t = tl.sum(tl.reshape(relu, (BLOCK_N, ROWS, NUM_HEADS)), axis=2)
    score_t = tl.where(page_ok[:, None], s_t * factor[:, None], float("-inf"))
    keep_t = mine[None, :] & (cols[:, None] < vis[None, :])
    tl.store(out_rows[None, :] + cols[:, None], score_t, mask=keep_t)
    if HISTOGRAM:
        count_scores(hist_rows[None, :], score_t, keep_t)

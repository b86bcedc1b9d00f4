"""Reading an index cache of any kind inside a scoring kernel: paged gather plus in-register dequantisation.

The scoring kernels specialise on ``KV_KIND`` (a constexpr, one of the codes below). The tensor-core kernels call
``load_key_tile`` (16-bit and fp8: a ``[BLOCK_N, HEAD_DIM]`` tile) or ``load_fp4_key_tile`` (MXFP4: even and odd
elements, each ``[BLOCK_N, HEAD_DIM // 2]``); the row-wise kernel decodes head_dim chunks with the same decoders.
Each returns the keys and a per-column factor that the caller applies once per column after the ReLU'd head sum:

- 16-bit caches: keys as stored; factor = ``1 / score_divisor``.
- fp8 (e4m3fn / e4m3fnuz, ``[pages, P, 1, D]`` bytes, fp32 scale ``[pages, P]``): keys are the fp8 values; factor =
  ``scale[column] / score_divisor``. Scales are positive, so ``sum_h relu(q_h . s k) = s * sum_h relu(q_h . k)``.
- fp4 (MXFP4, ``[pages, P, 1, D // 2]`` bytes, e8m0 ``[pages, P, 1, D // 32]``): keys are fully dequantised
  (``e2m1 * 2**(e - 127)``, the exponent differs per 32-element block, so it cannot wait for the head sum);
  factor = ``1 / score_divisor``.

With ``E4M3_MMA`` (where ``scoring.base.e4m3_mma_serves``: e4m3fn or MXFP4 keys, bf16 q, a head_dim of at least
``E4M3_MIN_HEAD_DIM``, e4m3 tensor cores) the keys go to e4m3 MMAs against q split into two exact e4m3 terms
(``split_query_e4m3``): e4m3fn keys as stored, MXFP4 nibbles placed as exact e4m3 bytes one 32-element block at a
time (``fp4_e4m3_block``), their exponents applied to each block's fp32 dot.

Two exact decoders per format:

- portable (the interpreter, which has no fp4 type and whose fp8 support differs from the GPUs', AMD targets):
  integer bit placement into fp32 plus power-of-two multiplies. An e4m3 byte ``s eeee mmm`` placed as fp32 bits
  ``s`` / ``eeee`` (low exponent bits) / ``mmm`` (top mantissa bits) is the fp8 value times ``2**-(127 - bias)``,
  subnormals included (both formats' subnormals line up); an e2m1 nibble ``s ee m`` placed the same way is the e2m1
  value times ``2**-126``.
- PTX (NVIDIA, compute capability 9.0+, ``Platform.fast_decode``): four cache bytes per 32-bit register, decoded with byte
  permutes and one packed 16-bit FMA per pair of elements (the portable decoders cost about 17 instructions per
  element on the H200, these 2.5 for fp8 and 4 for MXFP4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: ``KV_KIND`` codes: how the scoring kernels read the cache.
KV_16BIT, KV_FP8_E4M3FN, KV_FP8_E4M3FNUZ, KV_FP4 = 0, 1, 2, 3
#: The same codes for ``@triton.jit`` code, which may read only globals that are constexprs.
KIND_16BIT, KIND_E4M3FN, KIND_E4M3FNUZ, KIND_FP4 = (tl.constexpr(code) for code in (KV_16BIT, KV_FP8_E4M3FN,
                                                                                   KV_FP8_E4M3FNUZ, KV_FP4))
_KV_KIND_OF_DTYPE = {
    torch.bfloat16: KV_16BIT, torch.float16: KV_16BIT,
    torch.float8_e4m3fn: KV_FP8_E4M3FN, torch.float8_e4m3fnuz: KV_FP8_E4M3FNUZ,
    torch.float4_e2m1fn_x2: KV_FP4,
}


def kv_kind(cache_dtype: torch.dtype) -> int:
    """The ``KV_KIND`` code of an index-cache dtype."""
    return _KV_KIND_OF_DTYPE[cache_dtype]


def kernel_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """A cache or scale tensor as the kernels address it: one-byte float dtypes (fp8, fp4, e8m0) as raw bytes
    (uint8: Triton has no fp4 or e8m0 type, and the decoders work on bits), everything else as it is."""
    if t is None or t.dtype.itemsize != 1 or not t.dtype.is_floating_point:
        return t
    return t.view(torch.uint8)


def dot_dtype(problem, upcast: bool, e4m3_mma: bool = False):
    """Operand dtype of the ``tl.dot`` in the tensor-core kernels (a ``DOT_DTYPE`` constexpr).

    fp32 under the interpreter (it computes bf16 on raw bits); e4m3 when ``e4m3_mma`` (``E4M3_MMA``: the fp8 keys go
    to the tensor cores as stored, against q split into two e4m3 terms, ``split_query_e4m3``), in the cache's
    flavour (e4m3fnuz: ``float8e4b8``, gfx942's MFMAs; e4m3fn, and MXFP4 nibbles placed as e4m3fn: ``float8e4nv``);
    otherwise q's dtype, except fp16 queries on an MXFP4 cache: dequantised fp4 keys can leave fp16's range, and
    fp32 (tf32) operands hold both exactly. Every fp8 value is exact in bf16 and fp16, and so is every dequantised
    fp4 key in bf16.
    """
    if e4m3_mma and not upcast:
        return tl.float8e4b8 if kv_kind(problem.cache_dtype) == KV_FP8_E4M3FNUZ else tl.float8e4nv
    if upcast or (problem.q_dtype == torch.float16 and kv_kind(problem.cache_dtype) == KV_FP4):
        return tl.float32
    return tl.bfloat16 if problem.q_dtype == torch.bfloat16 else tl.float16


@triton.jit
def key_slots(pt_row_ptr, cols, col_ok, num_pages, PAGE_SIZE: tl.constexpr):
    """Cache slots (``page * PAGE_SIZE + offset``, int64) of logical columns ``cols`` through one page-table row.

    ``page_ok``: the column is wanted and its physical page id lies in ``[0, num_pages)``. A bad page id is never
    dereferenced: callers mask their loads with ``page_ok``.
    """
    page = tl.load(pt_row_ptr + cols // PAGE_SIZE, mask=col_ok, other=-1)
    page_ok = col_ok & (page >= 0) & (page < num_pages)
    return page.to(tl.int64) * PAGE_SIZE + (cols % PAGE_SIZE), page_ok


@triton.jit
def key_rows(slot, ROW: tl.constexpr, PAGE_SIZE: tl.constexpr, KEY_PAGE_STRIDE: tl.constexpr,
             KEY_SLOT_STRIDE: tl.constexpr):
    """Element offsets (int64, in the cache's kernel view) of the keys at cache slots ``slot``, each ``ROW`` elements
    wide (``HEAD_DIM``, or ``HEAD_DIM // 2`` bytes of MXFP4). ``KEY_SLOT_STRIDE`` 0: a dense cache, ``slot * ROW``
    (the address math of a dense cache, unchanged); else a strided view of a larger buffer
    (``ScoreProblem.key_strides``): slots ``KEY_SLOT_STRIDE`` apart, pages ``KEY_PAGE_STRIDE`` apart. Both are constexprs, so a view whose pages
    are whole runs of slots costs one multiply by a constant, like a dense cache."""
    if KEY_SLOT_STRIDE == 0:
        rows = slot * ROW
    elif KEY_PAGE_STRIDE == PAGE_SIZE * KEY_SLOT_STRIDE:
        rows = slot * KEY_SLOT_STRIDE
    else:
        rows = (slot // PAGE_SIZE) * KEY_PAGE_STRIDE + (slot % PAGE_SIZE) * KEY_SLOT_STRIDE
    return rows


#: e4m3 MMAs take head_dim in K-steps of 32: a smaller head_dim cannot be one.
E4M3_MIN_HEAD_DIM = 32


@triton.jit
def round_to_e4m3(x):
    """fp32 ``x`` (``|x| < 448``) rounded to the nearest e4m3 value (ties to even), held in fp32: 4 significant
    bits for normal magnitudes, the subnormal grid ``2**-9`` below ``2**-6``. Converting the result to e4m3 is
    exact, so no platform's conversion rounding is relied on (the interpreter's truncates subnormals and mishandles
    a carry into the exponent). Integer rounding of the bits: float tricks such as a Veltkamp split are undone by
    the compiler's FMA contraction."""
    b = x.to(tl.int32, bitcast=True)
    # Round the 23-bit mantissa to 3 bits, to nearest even; a carry rolls into the exponent as it should.
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0  # 1.5 * 2**14: rounds to multiples of 2**-9
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def e4m3_row_scale(amax):
    """Power-of-two scales of rows whose largest magnitude is ``amax`` (fp32 ``[M]``): ``(inverse, row_scale)``,
    ``amax * inverse`` in ``[128, 256)`` (e4m3 tops out at 448) and ``row_scale = 1 / inverse``, both normal fp32."""
    # Exponent field of the row maximum, at least 8 so that both the scale and its inverse are normal fp32.
    e = tl.maximum((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF, 8)
    inverse = ((261 - e) << 23).to(tl.float32, bitcast=True)  # 2**(134 - e)
    row_scale = ((e - 7) << 23).to(tl.float32, bitcast=True)  # 2**(e - 134)
    return inverse, row_scale


@triton.jit
def split_e4m3(x):
    """fp32 ``x`` (bf16 values scaled by ``e4m3_row_scale``'s inverse) as two e4m3 terms ``(hi, lo)``, ``x == hi +
    lo`` exactly for every element of at least ``2**-9`` of its row's largest (``split_query_e4m3``). The terms are
    held in fp32, exact in e4m3fn (and halved, in e4m3fnuz): the caller converts them to its operand's flavour."""
    hi = round_to_e4m3(x)
    lo = round_to_e4m3(x - hi)
    return hi, lo


@triton.jit
def split_query_e4m3(q, KEEP_NAN: tl.constexpr):
    """bf16 query rows (held in fp32, ``[M, D]``) as two e4m3 terms and a power-of-two row scale:
    ``(hi, lo, row_scale)`` with ``q == (hi + lo) * row_scale[:, None]``.

    The scale maps each row's largest magnitude into ``[128, 256)`` (e4m3 tops out at 448). ``hi`` is q rounded to
    e4m3; the remainder is a multiple of q's last bit no larger than half of ``hi``'s last bit, so it has at most 4
    significant bits and ``lo`` holds it exactly while that last bit is on e4m3's grid: for every element of at least
    ``2**-9`` of its row's largest magnitude. Smaller elements are rounded to e4m3's subnormal grid, an error under
    ``2**-17`` of the row's largest. Products with e4m3 keys are exact; what remains is the rounding of the sums
    (inside the tensor cores on a GPU).
    """
    inverse, row_scale = e4m3_row_scale(tl.max(tl.abs(q), axis=1))
    hi, lo = split_e4m3(q * inverse[:, None])
    if KEEP_NAN:  # off only where the registers are full (docs/kernels.md, "NaN")
        row_scale = nan_rows_scale(row_scale, row_has_nan(q))
    return hi, lo, row_scale


@triton.jit
def row_has_nan(x):
    """Whether each row of ``x`` (fp32 ``[M, K]``) holds a NaN: ``[M]`` bool."""
    return tl.max((x != x).to(tl.int32), axis=1) > 0


@triton.jit
def nan_rows_scale(row_scale, has_nan):
    """``row_scale`` NaN where the row held a NaN: the e4m3 terms cannot carry one (the rounding to e4m3's grid and a
    GPU's conversion saturate it), so the row's dots take it from their scale, as IEEE propagation would give
    (docs/kernels.md, "NaN")."""
    return tl.where(has_nan, float("nan"), row_scale)


@triton.jit
def tile_slots(pt_row_ptr, tile, valid, num_pages, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """``key_slots`` of key tile ``tile`` (columns ``tile * BLOCK_N + [0, BLOCK_N)``, those ``< valid`` wanted; the
    tile must start below ``valid``), with the page ids of the tile read as scalars and selected per column. Tiles
    and pages must nest: ``PAGE_SIZE`` a multiple of ``BLOCK_N``, or ``BLOCK_N`` a multiple of ``PAGE_SIZE``.

    Same result as ``key_slots``; no vector of page ids is loaded, so nothing has to be moved between the layouts
    of the key gather and of the MMA result (each such move costs a shared-memory round trip and a barrier).
    """
    local = tl.arange(0, BLOCK_N)
    if BLOCK_N <= PAGE_SIZE:
        first_col = tile * BLOCK_N
        page = tl.load(pt_row_ptr + first_col // PAGE_SIZE)
        pages = tl.full((BLOCK_N,), 0, tl.int64) + page
        offset = first_col % PAGE_SIZE + local
    else:
        first_page = tile * (BLOCK_N // PAGE_SIZE)
        pages = tl.full((BLOCK_N,), 0, tl.int64) + tl.load(pt_row_ptr + first_page)
        for j in tl.static_range(1, BLOCK_N // PAGE_SIZE):
            page_j = tl.load(pt_row_ptr + first_page + j, mask=(first_page + j) * PAGE_SIZE < valid, other=-1)
            pages = tl.where(local >= j * PAGE_SIZE, page_j, pages)
        offset = local % PAGE_SIZE
    page_ok = (tile * BLOCK_N + local < valid) & (pages >= 0) & (pages < num_pages)
    return pages * PAGE_SIZE + offset, page_ok


@triton.jit
def fp8_to_f32(raw, FNUZ: tl.constexpr):
    """Exact fp32 values of e4m3 bytes (uint8): e4m3fn, or e4m3fnuz (exponent bias 8) when ``FNUZ``."""
    b = raw.to(tl.int32)
    bits = ((b & 0x7F) << 20) | ((b & 0x80) << 24)
    # The placed bits are the value times 2**-(127 - bias): 2**-120 for e4m3fn, 2**-119 for e4m3fnuz.
    return bits.to(tl.float32, bitcast=True) * (6.64613997892457936e35 if FNUZ else 1.329227995784915872e36)


@triton.jit
def e2m1_times_2_126(nibble):
    """``e2m1(nibble) * 2**-126`` as fp32 for 4-bit codes held in int32 (sign in bit 3)."""
    return (((nibble & 7) << 22) | ((nibble & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_factor(exps):
    """``2**(e - 127)`` as fp32 for e8m0 bytes ``e`` (uint8), the block scale of MXFP4.

    ``e2m1_times_2_126`` values are multiplied by ``2**126`` and then by this: one fp32 factor cannot hold
    ``2**(e - 1)`` for e > 128.
    """
    e = exps.to(tl.int32)
    # 2**(e - 127) from its bits; e = 0 gives the subnormal 2**-127.
    return tl.where(e > 0, e << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def fp4_pairs_to_f32(packed, factor):
    """MXFP4 byte pairs to fp32: ``packed`` uint8 ``[..., n]`` with per-byte block factor ``factor`` (``e8m0_factor``,
    broadcastable). Returns ``(even, odd)`` element values, each ``[..., n]`` (element ``2i`` is the low nibble)."""
    p = packed.to(tl.int32)
    even = e2m1_times_2_126(p) * 8.507059173023461586e37 * factor  # x 2**126 then x 2**(e-127): both exact
    odd = e2m1_times_2_126(p >> 4) * 8.507059173023461586e37 * factor
    return even, odd


# PTX decoders (NVIDIA sm_90+, ``FAST_DECODE``): four cache bytes per 32-bit register, decoded with byte permutes
# and one packed 16-bit FMA per element pair, instead of one fp32 pipeline per element. Both are exact.
#
# fp8 -> bf16 (fp16): the bytes are spread into 16-bit halves (sign to bit 15, the 7 magnitude bits below the
# exponent's top bits), which is the value times 2**-120 (2**-8) for e4m3fn, subnormals included, then one
# ``fma.rn`` by 2**120 (2**8) per pair. e4m3fnuz (bias 8) is the same placement with half the multiplier.
# (Constants go through registers: packed 16-bit operands take no immediates.)
_FP8_PAIR_ASM = """
prmt.b32 x, $2, z, SELECT;
shr.b32 y, x, SHIFT;
and.b32 y, y, MAGMASK;
and.b32 x, x, 0x80008000;
or.b32 x, x, y;
fma.rn.TYPE OUT, x, m, c;
"""
# Bytes 0, 1 to the high bytes of the two halves of $0 (selector 0x1404), bytes 2, 3 to those of $1 (0x3424).
_FP8_PAIRS_ASM = (
    "{\n.reg .b32 x, y, z, m, c;\nmov.b32 z, 0;\nmov.b32 m, SCALE;\nmov.b32 c, 0x80008000;\n"
    + _FP8_PAIR_ASM.replace("SELECT", "0x1404").replace("OUT", "$0")
    + _FP8_PAIR_ASM.replace("SELECT", "0x3424").replace("OUT", "$1")
    + "}"
)


def _fp8_asm(to_bf16: bool, fnuz: bool) -> str:
    if to_bf16:  # 2**120 = 0x7B80 (2**119 = 0x7B00) in bf16
        fields = dict(SHIFT="4", MAGMASK="0x07F007F0", TYPE="bf16x2", SCALE="0x7B007B00" if fnuz else "0x7B807B80")
    else:  # fp16: 2**8 = 0x5C00 (2**7 = 0x5800)
        fields = dict(SHIFT="1", MAGMASK="0x3F803F80", TYPE="f16x2", SCALE="0x58005800" if fnuz else "0x5C005C00")
    text = _FP8_PAIRS_ASM
    for key, value in fields.items():
        text = text.replace(key, value)
    return text


FP8_TO_BF16_ASM = tl.constexpr(_fp8_asm(True, False))
FNUZ_TO_BF16_ASM = tl.constexpr(_fp8_asm(True, True))
FP8_TO_F16_ASM = tl.constexpr(_fp8_asm(False, False))
FNUZ_TO_F16_ASM = tl.constexpr(_fp8_asm(False, True))

# MXFP4 -> bf16: per register of 4 packed bytes (and their 4 block exponents), the 4 low nibbles (even elements)
# and the 4 high nibbles (odd elements). Magnitudes index an 8-entry table of the e2m1 values' bf16 high and low
# bytes with ``prmt`` (4 lookups per instruction), bytes are interleaved into bf16 pairs, signs are moved to bit 15
# of each half, and one ``fma.rn.bf16x2`` by ``2**(e - 127)`` (e8m0 ``e`` placed as a bf16 exponent; ``e = 0`` is the
# subnormal ``2**-127``) scales each pair.
_FP4_HALF_ASM = """
and.b32 s, SRC, 0x07070707;
shr.b32 t, s, 12;
or.b32 s, s, t;
prmt.b32 h, lh0, lh1, s;
prmt.b32 l, ll0, ll1, s;
prmt.b32 a, l, h, 0x6240;
prmt.b32 b, l, h, 0x7351;
and.b32 u, SIGNSRC, 0x80808080;
prmt.b32 t, u, z, 0x1404;
or.b32 a, a, t;
prmt.b32 t, u, z, 0x3424;
or.b32 b, b, t;
fma.rn.bf16x2 OUT0, a, e01, c;
fma.rn.bf16x2 OUT1, b, e23, c;
"""
FP4_TO_BF16_ASM = tl.constexpr(
    "{\n.reg .b32 s, t, h, l, a, b, u, z, c, e01, e23, hi, sg, lh0, lh1, ll0, ll1, emin;\n"
    "mov.b32 z, 0;\nmov.b32 c, 0x80008000;\nmov.b32 emin, 0x00400040;\n"
    # The e2m1 magnitudes' bf16 high bytes (0, 0.5, 1, 1.5 | 2, 3, 4, 6) and low bytes, as prmt tables.
    "mov.b32 lh0, 0x3F3F3F00;\nmov.b32 lh1, 0x40404040;\nmov.b32 ll0, 0xC0800000;\nmov.b32 ll1, 0xC0804000;\n"
    # Exponent pairs: bytes e0, e1 (e2, e3) to the low bytes of each half, shifted into the bf16 exponent field.
    "prmt.b32 e01, $5, z, 0x4140;\nshl.b32 e01, e01, 7;\nmax.u16x2 e01, e01, emin;\n"
    "prmt.b32 e23, $5, z, 0x4342;\nshl.b32 e23, e23, 7;\nmax.u16x2 e23, e23, emin;\n"
    # Even elements: the low nibbles; their signs sit at bit 3 of each byte (moved to bit 7 first).
    "shl.b32 sg, $4, 4;\n"
    + _FP4_HALF_ASM.replace("SIGNSRC", "sg").replace("SRC", "$4").replace("OUT0", "$0").replace("OUT1", "$1")
    # Odd elements: the high nibbles, signs already at bit 7.
    + "shr.b32 hi, $4, 4;\n"
    + _FP4_HALF_ASM.replace("SIGNSRC", "$4").replace("SRC", "hi").replace("OUT0", "$2").replace("OUT1", "$3")
    + "}"
)


# MXFP4 -> e4m3, for the e4m3 MMA path (``E4M3_MMA``): a nibble ``s eem`` placed as the e4m3 byte ``s 000 eem 00``
# (sign to bit 7, the magnitude bits to bits 4..2) is exactly ``e2m1 * 2**-6``: exponent field 0 with mantissa 100 is
# the subnormal 2**-7 = 0.5 * 2**-6, fields 1..3 hold 1 .. 6 times 2**-6, and zero stays zero. Pure bit placement on
# four bytes per 32-bit register: the low nibbles (even elements) to $0, the high nibbles (odd elements) to $1.
E2M1_TO_E4M3_ASM = tl.constexpr(
    "{\n.reg .b32 t, u;\n"
    "shl.b32 t, $2, 4;\nand.b32 t, t, 0x80808080;\nshl.b32 u, $2, 2;\nand.b32 u, u, 0x1C1C1C1C;\nor.b32 $0, t, u;\n"
    "and.b32 t, $2, 0x80808080;\nshr.b32 u, $2, 2;\nand.b32 u, u, 0x1C1C1C1C;\nor.b32 $1, t, u;\n}"
)


@triton.jit
def e2m1_to_e4m3_bits(nibbles):
    """The e4m3 byte (int32, ``0 .. 255``) whose value is ``e2m1(nibble) * 2**-6``, for 4-bit codes in the low bits of
    int32 ``nibbles`` (sign in bit 3; higher bits ignored)."""
    return ((nibbles & 8) << 4) | ((nibbles & 7) << 2)


@triton.jit
def fp4_e4m3_block(packed, DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr):
    """One 32-element MXFP4 block of each key as an e4m3 MMA operand, block exponent not applied.

    ``packed``: uint8 ``[N, 16]``, byte ``j`` holding elements ``2j`` (low nibble) and ``2j + 1``. Returns ``[N, 32]``
    valued ``e2m1 * 2**-6`` (exact in e4m3), in the block's MMA order: the 16 even elements, then the 16 odd ones
    (``fp4_block_order``; q is loaded in the same order). In that order the low-nibble and the high-nibble bytes of
    one 32-bit word land in the two registers a thread holds of an 8-bit MMA operand row (K offsets ``4t`` and
    ``16 + 4t``), so no byte has to move between registers. As e4m3 (``DOT_DTYPE`` float8e4nv), or as exact fp32
    for the interpreter's emulation (``DOT_DTYPE`` float32).
    """
    if FAST_DECODE:
        even, odd = tl.inline_asm_elementwise(E2M1_TO_E4M3_ASM, "=r,=r,r", [packed],
                                              dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        p = packed.to(tl.int32)
        even = e2m1_to_e4m3_bits(p).to(tl.uint8)
        odd = e2m1_to_e4m3_bits(p >> 4).to(tl.uint8)
    raw = tl.reshape(tl.permute(tl.join(even, odd), (0, 2, 1)), (packed.shape[0], 32))
    if DOT_DTYPE == tl.float8e4nv:
        keys = raw.to(tl.float8e4nv, bitcast=True)
    else:
        keys = fp8_to_f32(raw, False).to(DOT_DTYPE)
    return keys


@triton.jit
def fp4_block_order():
    """Element index (within a 32-element block) at each position of the MMA order of ``fp4_e4m3_block``:
    ``0, 2, .., 30, 1, 3, .., 31``."""
    p = tl.arange(0, 32)
    return 2 * (p % 16) + p // 16


@triton.jit
def fp8_keys(raw, KV_KIND: tl.constexpr, DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr):
    """fp8 bytes (uint8) -> exact keys in ``DOT_DTYPE`` (the fp8 values, scale not applied)."""
    if FAST_DECODE and (DOT_DTYPE == tl.bfloat16):
        asm: tl.constexpr = FNUZ_TO_BF16_ASM if KV_KIND == KIND_E4M3FNUZ else FP8_TO_BF16_ASM
        keys = tl.inline_asm_elementwise(asm, "=r,=r,r", [raw], dtype=tl.bfloat16, is_pure=True, pack=4)
    elif FAST_DECODE and (DOT_DTYPE == tl.float16):
        asm: tl.constexpr = FNUZ_TO_F16_ASM if KV_KIND == KIND_E4M3FNUZ else FP8_TO_F16_ASM
        keys = tl.inline_asm_elementwise(asm, "=r,=r,r", [raw], dtype=tl.float16, is_pure=True, pack=4)
    else:
        keys = fp8_to_f32(raw, KV_KIND == KIND_E4M3FNUZ).to(DOT_DTYPE)
    return keys


@triton.jit
def fp4_pairs(packed, exps, OUT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr):
    """MXFP4 bytes (uint8 ``packed``) and their blocks' e8m0 exponents (uint8, broadcastable to ``packed``) ->
    ``(even, odd)`` dequantised elements in ``OUT_DTYPE``, each shaped like ``packed``."""
    if FAST_DECODE and (OUT_DTYPE == tl.bfloat16):
        even, odd = tl.inline_asm_elementwise(FP4_TO_BF16_ASM, "=r,=r,=r,=r,r,r",
                                              [packed, tl.broadcast_to(exps, packed.shape)],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        even, odd = fp4_pairs_to_f32(packed, e8m0_factor(exps))
        even, odd = even.to(OUT_DTYPE), odd.to(OUT_DTYPE)
    return even, odd


@triton.jit
def load_key_tile(k_ptr, ks_ptr, slot, page_ok, scale, HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr,
                  DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  KEY_PAGE_STRIDE: tl.constexpr, KEY_SLOT_STRIDE: tl.constexpr):
    """Keys ``[BLOCK_N, HEAD_DIM]`` at cache slots ``slot`` (``key_slots`` or ``tile_slots``) in ``DOT_DTYPE``
    (zeros where not ``page_ok``) and the per-column factor ``[BLOCK_N]`` fp32 to apply after the head sum. 16-bit
    and fp8 caches (MXFP4: ``load_fp4_key_tile``). ``HEAD_DIM`` must be a power of two (the tensor-core kernels
    require it). The keys' addresses as ``key_rows``; the scales are read densely at ``slot``.
    """
    keys = key_values(k_ptr, slot, page_ok, HEAD_DIM, KV_KIND, DOT_DTYPE, FAST_DECODE, PAGE_SIZE, KEY_PAGE_STRIDE,
                      KEY_SLOT_STRIDE)
    if KV_KIND == KIND_16BIT:
        factor = tl.full(slot.shape, scale, tl.float32)
    else:
        factor = tl.load(ks_ptr + slot, mask=page_ok, other=0.0) * scale
    return keys, factor


@triton.jit
def key_values(k_ptr, slot, page_ok, HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr, DOT_DTYPE: tl.constexpr,
               FAST_DECODE: tl.constexpr, PAGE_SIZE: tl.constexpr, KEY_PAGE_STRIDE: tl.constexpr,
               KEY_SLOT_STRIDE: tl.constexpr):
    """``load_key_tile``'s keys alone, for loops that load the fp8 scales themselves (``fp8_tile_scales``)."""
    d = tl.arange(0, HEAD_DIM)
    rows = key_rows(slot, HEAD_DIM, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
    raw = tl.load(k_ptr + rows[:, None] + d[None, :], mask=page_ok[:, None], other=0)
    if KV_KIND == KIND_16BIT:
        keys = raw.to(DOT_DTYPE)
    elif (DOT_DTYPE == tl.float8e4nv) or (DOT_DTYPE == tl.float8e4b8):
        keys = raw.to(DOT_DTYPE, bitcast=True)  # E4M3_MMA: the stored bytes are the MMA operand
    else:
        keys = fp8_keys(raw, KV_KIND, DOT_DTYPE, FAST_DECODE)
    return keys


@triton.jit
def load_fp4_key_tile(k_ptr, ks_ptr, slot, page_ok, scale, HEAD_DIM: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      FAST_DECODE: tl.constexpr, PAGE_SIZE: tl.constexpr, KEY_PAGE_STRIDE: tl.constexpr,
                      KEY_SLOT_STRIDE: tl.constexpr):
    """MXFP4 keys at cache slots ``slot`` (``key_slots`` or ``tile_slots``) as even and odd elements, each
    ``[BLOCK_N, HEAD_DIM // 2]`` in ``DOT_DTYPE`` (element ``2j`` and ``2j + 1`` of head_dim: the low and high nibble
    of byte ``j``), fully dequantised (zeros where not ``page_ok``); plus the per-column factor (``scale``). Callers
    dot them with the even and odd halves of q, so the nibbles are never interleaved in registers.
    """
    NB: tl.constexpr = HEAD_DIM // 32
    blk = tl.arange(0, NB)
    pair = tl.arange(0, 16)
    rows = key_rows(slot, HEAD_DIM // 2, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
    packed = tl.load(k_ptr + rows[:, None, None] + blk[None, :, None] * 16 + pair[None, None, :],
                     mask=page_ok[:, None, None], other=0)
    exps = tl.load(ks_ptr + slot[:, None] * NB + blk[None, :], mask=page_ok[:, None], other=127)
    even, odd = fp4_pairs(packed, exps[:, :, None], DOT_DTYPE, FAST_DECODE)
    shape: tl.constexpr = (slot.shape[0], HEAD_DIM // 2)
    return tl.reshape(even, shape), tl.reshape(odd, shape), tl.full(slot.shape, scale, tl.float32)

"""Index-cache writer: quantise new keys and scatter them into a paged cache by slot (layouts:
docs/cache_formats.md).

One program per new token: ``slot = page * P + offset`` (``-1``, or a slot outside the cache, writes nothing; a slot
named twice is written by its last key). The encodings are done with integer arithmetic (no hardware fp8/fp4
conversion), so the bytes are the same on every target and under the interpreter, and equal those of the torch
reference (``cache.reference``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..platform import Platform
from ..quant.dequant import (
    KIND_16BIT, KIND_E4M3FNUZ, KIND_FP4, KV_16BIT, KV_FP4, KV_FP8_E4M3FN, KV_FP8_E4M3FNUZ, kernel_view, key_rows,
)
from ..quant.formats import allocate_index_cache, view_strides
from ..spec import KernelSpec, next_pow2
from .reference import last_writer_slots

#: Calls of at most this many keys find the slots a later key names again inside the kernel (each program reads
#: the slots after its own, ``LATER_BLOCK`` at a time): no sort and no extra launches on the host. Longer calls
#: (prefill chunks), where that reading grows with the square of the count, drop those entries with torch first.
SCAN_MAX_TOKENS = 4096
LATER_BLOCK = 256

# Kinds: the scorers' ``KV_KIND`` codes (a 16-bit copy, fp8 e4m3fn, fp8 e4m3fnuz, MXFP4).
KIND_CODES = {"bf16": KV_16BIT, "fp8": KV_FP8_E4M3FN, "fp8_fnuz": KV_FP8_E4M3FNUZ, "fp4": KV_FP4}


@triton.jit
def _pow2(e):
    """``2**e`` as fp32 for integer ``e`` in [-126, 127], built from its bits (exact)."""
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _floor_log2(a):
    """Exact ``floor(log2(a))`` for positive finite fp32 ``a`` (subnormals scaled up by 2**64 first)."""
    tiny = a < 1.0e-30
    a = tl.where(tiny, a * 18446744073709551616.0, a)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.where(tiny, e - 64, e)


@triton.jit
def _rne(x):
    """Round fp32 ``0 <= x < 2**22`` to the nearest integer, ties to even (the fp32 add does the rounding)."""
    return (x + 8388608.0) - 8388608.0


@triton.jit
def _bf16_rne(x):
    """fp32 ``x`` rounded to the nearest bf16, ties to even, by integer rounding of its bits (NaN stays a quiet NaN):
    the same value as a GPU's conversion, and the interpreter's conversion truncates instead."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp8_codes(v, FNUZ: tl.constexpr):
    """e4m3 codes (uint8) of fp32 ``v`` already clamped to the format's range; nearest-even."""
    BIAS: tl.constexpr = 8 if FNUZ else 7
    a = tl.abs(v)
    exp = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, 1 - BIAS)  # subnormals: min-normal quantum
    m = _rne(a * _pow2(3 - exp)).to(tl.int32)  # 8..16 for normals (16 carries into the exponent), 0..8 below
    code = ((exp + BIAS) << 3) + m - 8
    if FNUZ:
        code = tl.where((v < 0) & (code != 0), code | 0x80, code)  # fnuz has no negative zero (0x80 is NaN)
    else:
        code = tl.where(v < 0, code | 0x80, code)
    return code.to(tl.uint8)


@triton.jit
def _e2m1_codes(x):
    """Signed e2m1 codes (0..15) of fp32 ``x``: nearest-even between 0, 0.5, 1, 1.5, 2, 3, 4, 6; saturated at 6."""
    a = tl.abs(x)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    code += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return tl.where((x < 0) & (code > 0), code | 8, code)


@triton.jit
def not_named_later(slot_ptr, token, slot, scan_tokens, LATER_BLOCK: tl.constexpr):
    """Whether none of the tokens after ``token`` among the first ``scan_tokens`` names ``slot`` (int64, >= 0) in
    ``slot_ptr``'s ``[tokens]`` slot mapping: ``LATER_BLOCK`` slots read at a time."""
    free = slot >= 0
    for start in range(token + 1, scan_tokens, LATER_BLOCK):
        later = start + tl.arange(0, LATER_BLOCK)
        named = tl.load(slot_ptr + later, mask=later < scan_tokens, other=-1).to(tl.int64)
        free = free & (tl.max((named == slot).to(tl.int32), axis=0) == 0)
    return free


@triton.jit(do_not_specialize=("scan_tokens",))
def _write_index_cache_kernel(
    keys_ptr, slot_ptr, cache_ptr, scale_ptr, num_slots, keys_stride, scan_tokens,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KIND: tl.constexpr, FP8_MAX: tl.constexpr,
    N_BLOCKS: tl.constexpr, LATER_BLOCK: tl.constexpr, PAGE_SIZE: tl.constexpr = 1,
    KEY_PAGE_STRIDE: tl.constexpr = 0, KEY_SLOT_STRIDE: tl.constexpr = 0,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    write = (slot >= 0) & (slot < num_slots)
    if write:
        # The last key naming a slot is the one written (0 tokens scanned: the host dropped the others first).
        write = not_named_later(slot_ptr, token, slot, scan_tokens, LATER_BLOCK)
    if write:
        src = keys_ptr + token.to(tl.int64) * keys_stride
        if KIND == KIND_FP4:
            # MXFP4: [blocks of 32] x [16 element pairs] x (even, odd); one e8m0 exponent per block.
            blk = tl.arange(0, N_BLOCKS)
            pair = tl.arange(0, 16)
            ok = (blk < HEAD_DIM // 32)[:, None]
            elem = blk[:, None] * 32 + pair[None, :] * 2
            even = tl.load(src + elem, mask=ok, other=0.0).to(tl.float32)
            odd = tl.load(src + elem + 1, mask=ok, other=0.0).to(tl.float32)
            amax = tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=1)
            exp = tl.where(amax > 0, _floor_log2(amax) - 2 + 127, 0)
            exp = tl.minimum(tl.maximum(exp, 0), 254)
            # A block holding a NaN or an infinity (x - x is then NaN) stores e8m0's NaN, 0xFF, and zero codes: it
            # dequantises to NaN (0 x 2**128) on every path (docs/cache_formats.md, "NaN").
            bad = tl.max((((even - even) != 0) | ((odd - odd) != 0)).to(tl.int32), axis=1) > 0
            exp = tl.where(bad, 255, exp)
            shift = 127 - exp  # in [-127, 127]; 2**-127 is applied as 2**-126 * 0.5
            factor = _pow2(tl.maximum(shift, -126)) * tl.where(shift < -126, 0.5, 1.0)
            lo = tl.where(bad[:, None], 0, _e2m1_codes(even * factor[:, None]))
            hi = tl.where(bad[:, None], 0, _e2m1_codes(odd * factor[:, None]))
            packed = (lo | (hi << 4)).to(tl.uint8)
            row = key_rows(slot, HEAD_DIM // 2, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
            tl.store(cache_ptr + row + blk[:, None] * 16 + pair[None, :], packed, mask=ok)
            tl.store(scale_ptr + slot * (HEAD_DIM // 32) + blk, exp.to(tl.uint8), mask=blk < HEAD_DIM // 32)
        else:
            d = tl.arange(0, BLOCK_D)
            ok = d < HEAD_DIM
            k = tl.load(src + d, mask=ok, other=0.0)
            if KIND == KIND_16BIT:
                if (cache_ptr.dtype.element_ty == tl.bfloat16) and (keys_ptr.dtype.element_ty != tl.bfloat16):
                    value = _bf16_rne(k.to(tl.float32))  # fp16 widens exactly, then one rounding
                else:
                    value = k.to(cache_ptr.dtype.element_ty)
                tl.store(cache_ptr + key_rows(slot, HEAD_DIM, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE) + d, value,
                         mask=ok)
            else:
                kf = k.to(tl.float32)
                # A key holding a NaN or an infinity (x - x is then NaN) gets a NaN scale and the format's NaN code
                # in every byte, as the torch path (docs/cache_formats.md, "NaN"); tl.max alone would drop a NaN.
                bad = tl.max(((kf - kf) != 0).to(tl.int32), axis=0) > 0
                scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(kf), axis=0), 1.0e-4), FP8_MAX)
                scale = tl.where(bad, float("nan"), scale)
                v = tl.minimum(tl.maximum(tl.math.div_rn(kf, scale), -FP8_MAX), FP8_MAX)
                codes = tl.where(bad, 0x80 if KIND == KIND_E4M3FNUZ else 0x7F, _fp8_codes(v, KIND == KIND_E4M3FNUZ))
                row = key_rows(slot, HEAD_DIM, PAGE_SIZE, KEY_PAGE_STRIDE, KEY_SLOT_STRIDE)
                tl.store(cache_ptr + row + d, codes.to(tl.uint8), mask=ok)
                tl.store(scale_ptr + slot, scale)


_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_fnuz": torch.float8_e4m3fnuz}


def kind_of(cache: torch.Tensor, kind: str) -> str:
    """The ``KIND_CODES`` key of ``cache`` (its cache-format name, both 16-bit formats written alike as ``bf16``),
    whose ``quant.formats.cache_kind`` is ``kind``: fp8 split by dtype."""
    if kind != "fp8":
        return kind
    return "fp8_fnuz" if cache.dtype == torch.float8_e4m3fnuz else "fp8"


def constexprs(kind: str, head_dim: int, layout: tuple[int, int, int] | None = None) -> dict:
    """The kernel's specialisation for a cache ``kind`` (a ``KIND_CODES`` key) and ``head_dim``; ``layout``
    ``(page_size, page stride, slot stride)`` of a cache that is a strided view (``WriterProblem.layout``), whose
    keys go where ``dequant.key_rows`` says (the scorers read them there). A dense cache passes none of the three:
    its build is the one it always was."""
    fp8_max = float(torch.finfo(_FP8_DTYPES[kind]).max) if kind in _FP8_DTYPES else 1.0
    strided = {} if layout is None else dict(PAGE_SIZE=layout[0], KEY_PAGE_STRIDE=layout[1],
                                             KEY_SLOT_STRIDE=layout[2])
    return dict(HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), KIND=KIND_CODES[kind], FP8_MAX=fp8_max,
                N_BLOCKS=next_pow2(max(1, head_dim // 32)), LATER_BLOCK=LATER_BLOCK, **strided)


@dataclass(frozen=True)
class WriterProblem:
    """A writer launch: ``tokens`` new keys of ``head_dim`` (``keys_dtype``) into a cache of ``kind`` (a
    ``KIND_CODES`` key)."""

    tokens: int
    kind: str
    head_dim: int
    keys_dtype: torch.dtype = torch.bfloat16
    #: ``(page_size, page stride, slot stride)`` in elements when the cache is a strided view of a larger buffer
    #: (``quant.formats.view_strides``), None when it is dense.
    layout: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class WriterConfig:
    num_warps: int = 4


class WriterSpec(KernelSpec):
    name = "cache_writer"
    family = "cache"
    description = "index-cache writer: quantise new keys, scatter them by slot (one program per key)"
    fn = _write_index_cache_kernel
    Config = WriterConfig

    def default_config(self, problem, platform) -> WriterConfig:
        return WriterConfig()

    def constexprs(self, problem: WriterProblem, platform, cfg) -> dict:
        return constexprs(problem.kind, problem.head_dim, problem.layout)

    def grid(self, problem: WriterProblem, platform, cfg) -> tuple[int]:
        return (problem.tokens,)

    def example_args(self, problem: WriterProblem, index_dtype, device) -> tuple:
        # The 16-bit kind stands for both 16-bit formats: the cache takes the keys' dtype.
        cache_format = "fp16" if problem.kind == "bf16" and problem.keys_dtype == torch.float16 else problem.kind
        pages, page_size = 2, 16
        cache, scale = allocate_index_cache(cache_format, pages, page_size, problem.head_dim, device=device)
        keys = torch.zeros(problem.tokens, problem.head_dim, dtype=problem.keys_dtype, device=device)
        slots = torch.arange(problem.tokens, dtype=index_dtype, device=device)
        cache = kernel_view(cache)
        return (keys, slots, cache, kernel_view(scale) if scale is not None else cache, pages * page_size,
                keys.stride(0), problem.tokens)

    def warm_problems(self, context):
        for name, keys_dtype, kind in context.writer_kinds():
            yield f"cache_writer {name}", WriterProblem(4, kind, context.head_dim, keys_dtype)


SPEC = WriterSpec()


def launch(keys, slot_mapping, cache_bytes, scale, kind: str, head_dim: int, num_slots: int) -> None:
    """keys: ``[tokens, D]`` (last dim contiguous); slot_mapping: ``[tokens]`` int32/int64, a slot named more than
    once written by its last key; cache_bytes: the cache (uint8 view for fp8/fp4); scale: fp32 ``[pages, P]``
    (fp8), uint8 ``[pages, P, 1, D // 32]`` (fp4) or None. The cache may be a strided view (dense last dim, keys
    that do not overlap): the keys are written into it in place."""
    tokens = keys.shape[0]
    scan = tokens <= SCAN_MAX_TOKENS
    slots = slot_mapping if scan else last_writer_slots(slot_mapping)
    strides = view_strides(cache_bytes)
    layout = None if strides is None else (cache_bytes.shape[1], *strides)
    problem = WriterProblem(tokens, kind, head_dim, keys.dtype, layout)
    SPEC.plan(problem, Platform.of(keys.device)).launch(
        keys, slots, cache_bytes, scale if scale is not None else cache_bytes, num_slots, keys.stride(0),
        tokens if scan else 0)

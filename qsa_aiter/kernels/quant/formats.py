"""Index-cache formats (docs/cache_formats.md): their names, allocation, torch quantisers and the dequantiser.

| format | cache | scale | kind |
|---|---|---|---|
| ``bf16`` / ``fp16`` | ``[pages, P, 1, D]`` as is | none | ``bf16`` |
| ``fp8`` / ``fp8_fnuz`` | ``[pages, P, 1, D]`` ``float8_e4m3fn`` / ``_e4m3fnuz`` | ``[pages, P]`` fp32 | ``fp8`` |
| ``fp4`` | ``[pages, P, 1, D // 2]`` ``float4_e2m1fn_x2`` | ``[pages, P, 1, D // 32]`` ``float8_e8m0fnu`` | ``fp4`` |

A format's name is the one spelling the API and every command-line option use (``canonical_format`` maps the
spellings of earlier releases to it); its kind is the registry's and the tuned tables' kv axis, which a format's
layout decides (``cache_kind``).

fp8: ``scale = max(amax(k), 1e-4) / finfo.max``, ``value = round_to_fp8(k / scale)``, key = ``value * scale``.
fp4 (OCP MX): per block of 32 elements along ``D`` the e8m0 exponent is ``floor(log2(amax)) - 2`` (biased by 127,
clamped to the representable ``[0, 254]``; an all-zero block stores 0); elements are e2m1 (0, 0.5, 1, 1.5, 2, 3, 4, 6
and negatives) of ``k / 2**exponent``, rounded to nearest-even and saturated at 6; element ``2i`` is the low nibble of
byte ``i``.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass

import torch

FP4_BLOCK = 32
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
#: Representable e2m1 magnitudes, indexed by the 3-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: Midpoints between consecutive e2m1 magnitudes; a tie goes to the even code (round to nearest-even).
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass(frozen=True)
class CacheFormat:
    """One index-cache format: ``name`` (its one spelling), ``dtype`` (the cache tensor's) and ``kind`` (the
    registry's and the tuned tables' kv axis: ``bf16`` for both 16-bit formats, ``fp8`` for both e4m3 ones)."""

    name: str
    dtype: torch.dtype
    kind: str

    @property
    def query_dtype(self) -> torch.dtype:
        """The query dtype that goes with the format by default: a 16-bit cache has q's dtype, q is bf16 otherwise."""
        return self.dtype if self.kind == "bf16" else torch.bfloat16


#: Every index-cache format, by name (docs/cache_formats.md).
CACHE_FORMATS = {fmt.name: fmt for fmt in (
    CacheFormat("bf16", torch.bfloat16, "bf16"),
    CacheFormat("fp16", torch.float16, "bf16"),
    CacheFormat("fp8", torch.float8_e4m3fn, "fp8"),
    CacheFormat("fp8_fnuz", torch.float8_e4m3fnuz, "fp8"),
    CacheFormat("fp4", torch.float4_e2m1fn_x2, "fp4"),
)}
#: Spellings of earlier releases, still accepted with a ``DeprecationWarning``: the warm-up's fp8 names, and the
#: demo's ``16bit`` (a cache of q's dtype: ``bf16`` or ``fp16``).
FORMER_SPELLINGS = {"fp8_e4m3fn": "fp8", "fp8_e4m3fnuz": "fp8_fnuz", "16bit": "bf16 or fp16"}


def canonical_format(spelling: str, *, q_dtype: torch.dtype = torch.bfloat16, stacklevel: int = 1) -> str:
    """The format name (a key of ``CACHE_FORMATS``) that ``spelling`` means.

    A former spelling (``FORMER_SPELLINGS``) gives its name with a ``DeprecationWarning`` that names it; ``16bit``
    is the 16-bit format of ``q_dtype``. Anything else raises ``ValueError`` naming the accepted spellings.
    ``stacklevel`` counts from the caller (1: the warning names the line that called this function).
    """
    if spelling in CACHE_FORMATS:
        return spelling
    if spelling not in FORMER_SPELLINGS:
        raise ValueError(f"index-cache format must be one of {', '.join(CACHE_FORMATS)} (former spellings, still "
                         f"accepted: {', '.join(FORMER_SPELLINGS)}); got {spelling!r}")
    name = ("fp16" if q_dtype == torch.float16 else "bf16") if spelling == "16bit" else FORMER_SPELLINGS[spelling]
    warnings.warn(f"index-cache format {spelling!r} is now spelled {name!r} (docs/cache_formats.md)",
                  DeprecationWarning, stacklevel=stacklevel + 1)
    return name


def cache_kind(cache: torch.Tensor) -> str:
    """``bf16`` (bf16 and fp16), ``fp8`` or ``fp4`` for an index-cache tensor; ``TypeError`` for anything else."""
    if cache.dtype in SIXTEEN_BIT:
        return "bf16"
    if cache.dtype in FP8_DTYPES:
        return "fp8"
    if cache.dtype == torch.float4_e2m1fn_x2:
        return "fp4"
    raise TypeError(f"index cache dtype must be bf16, fp16, float8_e4m3fn(uz) or float4_e2m1fn_x2; got {cache.dtype}")


def cache_width(kind: str, head_dim: int) -> int:
    """Last dim of a ``kind`` (``cache_kind``) cache: MXFP4 packs two elements per byte."""
    return head_dim // 2 if kind == "fp4" else head_dim


def view_strides(cache: torch.Tensor) -> tuple[int, int] | None:
    """``(page stride, slot stride)`` in elements of an index cache ``[pages, P, 1, width]`` whose pages or slots
    lie further apart than a dense cache's (a strided view of a larger buffer, ``buffer[..., :width]``), or None when
    it is laid out densely (a dim of size 1 counts as dense whatever its stride). The last dim's stride is not
    looked at: the callers require it to be 1 (``runtime.arguments.index_cache_strides``)."""
    pages, page_size, _, width = cache.shape
    slot = cache.stride(1) if page_size > 1 else width
    page = cache.stride(0) if pages > 1 else page_size * slot
    return None if (slot, page) == (width, page_size * width) else (page, slot)


def scale_layout(kind: str, num_pages: int, page_size: int, head_dim: int):
    """``(shape, dtype)`` of the scale tensor a ``kind`` (``cache_kind``) cache needs, or None for 16-bit caches."""
    if kind == "fp8":
        return (num_pages, page_size), torch.float32
    if kind == "fp4":
        return (num_pages, page_size, 1, head_dim // FP4_BLOCK), torch.float8_e8m0fnu
    return None


def allocate_index_cache(cache_format: str, num_pages: int, page_size: int, head_dim: int, *,
                         device: torch.device | str | int = "cpu",
                         fp8_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zeroed ``(cache, scale)`` of ``cache_format`` (a ``CACHE_FORMATS`` name: ``bf16``, ``fp16``, ``fp8``,
    ``fp8_fnuz`` or ``fp4``; a former spelling is accepted with a ``DeprecationWarning``); scale is None for 16-bit
    formats. ``fp8_dtype`` picks the e4m3 dtype of an ``fp8`` cache (``float8_e4m3fnuz`` makes it ``fp8_fnuz``).

    The cache is ``[num_pages, page_size, 1, head_dim]`` (``head_dim // 2`` bytes for ``fp4``), the scale as
    ``scale_layout`` says. A bad argument raises ``ValueError``/``TypeError`` starting ``allocate_index_cache:`` and
    naming it, before anything is allocated."""
    if not isinstance(cache_format, str) or (cache_format not in CACHE_FORMATS
                                             and cache_format not in FORMER_SPELLINGS):
        _allocation_error(TypeError if not isinstance(cache_format, str) else ValueError, "cache_format",
                          f"one of {', '.join(CACHE_FORMATS)} (former spellings, still accepted: "
                          f"{', '.join(FORMER_SPELLINGS)})", repr(cache_format))
    name = canonical_format(cache_format, stacklevel=2)
    for arg, value in (("num_pages", num_pages), ("page_size", page_size), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            _allocation_error(TypeError, arg, "an int", type(value).__name__)
        if value < 1:
            _allocation_error(ValueError, arg, ">= 1", value)
    fmt = CACHE_FORMATS[name]
    cache_dtype = fmt.dtype
    if fp8_dtype is not None:
        if fp8_dtype not in FP8_DTYPES:
            _allocation_error(TypeError, "fp8_dtype", "None, float8_e4m3fn or float8_e4m3fnuz", fp8_dtype)
        if fmt.kind != "fp8":
            _allocation_error(ValueError, "fp8_dtype", f"None for the {name} format (it picks an fp8 cache's dtype)",
                              fp8_dtype)
        if name == "fp8_fnuz" and fp8_dtype != torch.float8_e4m3fnuz:
            _allocation_error(ValueError, "fp8_dtype", "float8_e4m3fnuz (or None) for the fp8_fnuz format", fp8_dtype)
        cache_dtype = fp8_dtype
    if fmt.kind == "fp4" and head_dim % FP4_BLOCK:
        _allocation_error(ValueError, "head_dim", f"divisible by {FP4_BLOCK} for the fp4 format", head_dim)
    device = _allocation_device(device)
    if fmt.kind == "bf16":
        return torch.zeros(num_pages, page_size, 1, head_dim, dtype=cache_dtype, device=device), None
    scale_shape, scale_dtype = scale_layout(fmt.kind, num_pages, page_size, head_dim)
    cache = _zeros((num_pages, page_size, 1, cache_width(fmt.kind, head_dim)), cache_dtype, device)
    return cache, _zeros(scale_shape, scale_dtype, device)


def _allocation_error(kind: type[Exception], name: str, expected: str, got: object) -> None:
    """Raise ``kind`` naming ``allocate_index_cache``, the argument, what was expected and what came."""
    raise kind(f"allocate_index_cache: `{name}` must be {expected}; got {got}")


def _allocation_device(device) -> torch.device:
    """``device`` as a ``torch.device`` the process can allocate on (a GPU that exists), else the op's error."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        _allocation_error(TypeError, "device", "a torch.device, a str or an int", type(device).__name__)
    try:
        device = torch.device(device)
    except (RuntimeError, ValueError) as err:
        _allocation_error(ValueError, "device", "a device torch knows", f"{device!r} ({err})")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count or count == 0:
            _allocation_error(ValueError, "device", f"a GPU of this process ({count} visible)", str(device))
    return device


def _zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros of any dtype: one-byte dtypes are allocated as uint8 and viewed (torch cannot fill fp4/e8m0 tensors)."""
    if dtype.itemsize == 1:
        return torch.zeros(shape, dtype=torch.uint8, device=device).view(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def quantize_fp8(keys: torch.Tensor, fp8_dtype: torch.dtype = torch.float8_e4m3fn):
    """``keys [n, D]`` (any float) -> ``(values [n, D] fp8, scale [n] fp32)``, round-to-nearest-even. A key holding
    a NaN or an infinity gets a NaN scale and the format's NaN in every value (it dequantises to NaN)."""
    fmax = torch.finfo(fp8_dtype).max
    k = keys.float()
    bad = ~torch.isfinite(k).all(dim=-1)
    scale = torch.where(bad, float("nan"), k.abs().amax(dim=-1).clamp_min(1e-4) / fmax)
    values = torch.where(bad[:, None], float("nan"), (k / scale[:, None]).clamp(-fmax, fmax)).to(fp8_dtype)
    return values, scale


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ``floor(log2(x))`` for positive finite fp32 ``x`` (``frexp``: ``x = m * 2**e`` with ``m`` in [0.5, 1))."""
    return torch.frexp(x)[1] - 1


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit e2m1 codes (uint8, 0..15) of fp32 ``x``: nearest-even, saturated at 6, sign in bit 3."""
    a = x.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for i, mid in enumerate(E2M1_MIDPOINTS):
        # Between code i and i + 1 a tie goes to the even one: up when i is odd, down when i is even.
        code += (a >= mid if i % 2 else a > mid).to(torch.uint8)
    return code | ((x < 0) & (code > 0)).to(torch.uint8) << 3


def quantize_fp4(keys: torch.Tensor):
    """``keys [n, D]`` -> ``(packed [n, D // 2] uint8, exponents [n, D // 32] uint8 e8m0)``. A block holding a NaN
    or an infinity stores e8m0's NaN (255) and zero codes: it dequantises to NaN (``0 * 2**128``)."""
    n, d = keys.shape
    if d % FP4_BLOCK:
        raise ValueError(f"fp4 needs head_dim divisible by {FP4_BLOCK}; got {d}")
    blocks = keys.float().reshape(n, d // FP4_BLOCK, FP4_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exp = torch.where(amax > 0, _floor_log2(amax.clamp_min(torch.finfo(torch.float32).tiny)) - 2 + 127,
                      torch.zeros_like(amax, dtype=torch.int32))
    bad = ~torch.isfinite(blocks).all(dim=-1)
    exp = torch.where(bad, 255, exp.clamp(0, 254))
    codes = e2m1_codes(blocks * torch.exp2(127.0 - exp.float())[..., None])
    codes = torch.where(bad[..., None], 0, codes).reshape(n, d)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, exp.to(torch.uint8)


def dequantize_fp4(packed: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """MXFP4 to fp32: ``packed [..., D // 2]`` (uint8 or ``float4_e2m1fn_x2``), ``exponents [..., D // 32]``.

    Returns fp32 ``[..., D]``.
    """
    packed = packed.view(torch.uint8)
    exponents = exponents.view(torch.uint8)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = lut[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = torch.exp2(exponents.float() - 127.0).repeat_interleave(FP4_BLOCK, dim=-1)
    return values * scale


def dequantize_cache(cache: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The keys a cache holds, fp32 ``[..., 1, D]`` (16-bit caches are upcast as they are).

    ``cache`` is a whole cache ``[pages, P, 1, width]`` with its ``scale``, or any gather of both over the leading
    dims (``cache[slots]`` with ``scale[slots]``): fp8 scales are ``[...]`` (any float dtype), fp4 exponents
    ``[..., 1, D // 32]`` (``float8_e8m0fnu`` or uint8); a 16-bit cache takes no scale. A bad argument raises
    ``ValueError``/``TypeError`` starting ``dequantize_cache:`` and naming it.
    """
    op = "dequantize_cache"
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{op}: `cache` must be a torch.Tensor; got {type(cache).__name__}")
    try:
        kind = cache_kind(cache)
    except TypeError:
        raise TypeError(f"{op}: `cache` must be bf16, fp16, float8_e4m3fn(uz) or float4_e2m1fn_x2; got "
                        f"{cache.dtype}") from None
    if cache.dim() < 2 or cache.shape[-2] != 1:
        raise ValueError(f"{op}: `cache` must be [..., 1, width]; got shape {tuple(cache.shape)}")
    if kind == "bf16":
        if scale is not None:
            raise ValueError(f"{op}: `scale` must be None for a 16-bit cache; got {type(scale).__name__}")
        return cache.float()
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{op}: `scale` must be the scale tensor of the {kind} cache; got {type(scale).__name__}")
    if kind == "fp8":
        want, dtype_ok = tuple(cache.shape[:-2]), scale.is_floating_point()
    else:
        want = (*cache.shape[:-1], cache.shape[-1] * 2 // FP4_BLOCK)
        dtype_ok = scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
    if tuple(scale.shape) != want or not dtype_ok or scale.device != cache.device:
        expected = "float" if kind == "fp8" else "float8_e8m0fnu (or uint8)"
        raise ValueError(f"{op}: `scale` must be {expected} of shape {want} on {cache.device} like `cache`; got "
                         f"{scale.dtype} {tuple(scale.shape)} on {scale.device}")
    if kind == "fp8":
        return cache.float() * scale.float()[..., None, None]
    return dequantize_fp4(cache, scale)

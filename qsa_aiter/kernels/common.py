"""Device helpers and launch arguments shared by the scoring kernels.

The helpers are ``@triton.jit`` functions inlined into each kernel: the visibility rule of SPEC section 1 and the
stacked head sum live here once (the paged, dequantising key gather lives in ``dequant``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .dequant import (
    KV_16BIT, KV_FP4, fast_decode, fp8_dot, fp8_tensor_cores, kernel_view, kv_kind, load_fp4_key_tile, load_key_tile,
    key_slots, split_query_e4m3, tile_slots,
)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def triton_runs_on(device_type: str) -> bool:
    """Whether the Triton kernels can run on tensors of ``device_type``: GPU tensors, or CPU tensors under the
    interpreter."""
    return device_type == "cuda" or (device_type == "cpu" and interpreting())


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a jit function: slow to call from Python per launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    """SM (CU) count of a CUDA/HIP device: a host-side property query, cached."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device, per_sm: int) -> int:
    """How many programs fill the device: ``per_sm`` per multiprocessor (a fixed 64 under the interpreter)."""
    if device.type != "cuda":
        return 64
    return multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device()) * per_sm


def column_programs(row_blocks: int, num_columns: int, block_n: int, target: int) -> int:
    """Programs per row block: the column tiles split so the whole grid fills ``target`` programs at most once.

    Rounded down (one wave, no straggling partial wave), at least 1, never more than the column tiles.
    """
    tiles = cdiv(max(num_columns, 1), block_n)
    return max(1, min(tiles, target // max(row_blocks, 1)))


@dataclass(frozen=True)
class ScoreLaunch:
    """Tensors and scalars every scoring kernel receives.

    q: ``[tokens, heads, head_dim]`` bf16/fp16, contiguous; k_cache: the index cache (SPEC section 3), contiguous;
    k_scale: its scale tensor (fp8: fp32 ``[pages, page_size]``; fp4: e8m0 ``[pages, page_size, 1, head_dim // 32]``)
    or None for 16-bit caches; page_table: ``[requests, width]`` int32/int64 (last dim contiguous);
    token_to_request, query_positions: ``[tokens]``; context_lens: ``[requests]``; logits: fp32
    ``[tokens, num_columns]`` (last dim contiguous); visible: int32 ``[tokens]``, written by the kernel.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    page_table: torch.Tensor
    token_to_request: torch.Tensor
    query_positions: torch.Tensor
    context_lens: torch.Tensor
    logits: torch.Tensor
    visible: torch.Tensor
    num_columns: int
    compress_ratio: int
    scale: float  # 1 / score_divisor
    k_scale: torch.Tensor | None = None
    fp8_mma: bool = True  # QSA_AITER_FP8_MMA: e4m3 tensor cores may score an e4m3fn cache (``fp8_dot``)

    @property
    def fast_decode(self) -> bool:
        """Quantised keys are decoded with the PTX decoders (``dequant.fast_decode``), never under the interpreter."""
        return kv_kind(self.k_cache.dtype) != KV_16BIT and not self.upcast and fast_decode(self.q.device)

    @property
    def fp8_dot(self) -> bool:
        """fp8 keys go to e4m3 tensor cores against a split q (``dequant.fp8_dot``); the interpreter emulates it."""
        hardware = self.upcast or fp8_tensor_cores(self.q.device)
        return fp8_dot(self.q.dtype, self.k_cache.dtype, self.fp8_mma and hardware)

    @property
    def upcast(self) -> bool:
        """The interpreter computes bf16 on raw bits: upcast 16-bit operands to fp32 there, never on a GPU."""
        return interpreting()

    def common_args(self) -> tuple:
        """Positional arguments shared by every kernel, in the order of their signatures."""
        num_tokens, num_heads, head_dim = self.q.shape
        cache = kernel_view(self.k_cache)
        # 16-bit caches have no scale tensor: the cache stands in for the never-read pointer.
        k_scale = cache if self.k_scale is None else kernel_view(self.k_scale)
        return (
            self.q, cache, k_scale, self.page_table, self.token_to_request, self.query_positions, self.context_lens,
            self.logits, self.visible,
            num_tokens, self.page_table.shape[0], self.k_cache.shape[0], self.num_columns,
            self.page_table.stride(0), self.logits.stride(0), self.scale,
        )


#: Signature of the arguments ``ScoreLaunch.common_args`` passes, for ahead-of-time compilation.
COMMON_SIGNATURE = {
    "q_ptr": "*{q}", "k_ptr": "*{k}", "ks_ptr": "*{ks}", "pt_ptr": "*{idx}", "t2r_ptr": "*{idx}", "pos_ptr": "*{idx}",
    "ctx_ptr": "*{idx}", "out_ptr": "*fp32", "vis_ptr": "*i32",
    "num_tokens": "i32", "num_requests": "i32", "num_pages": "i32", "num_columns": "i32",
    "pt_stride": "i32", "out_stride": "i32", "scale": "fp32",
}
#: Scalars that change from call to call: never specialised (no recompiles when they hit 1 or a multiple of 16).
DYNAMIC_SCALARS = ["num_tokens", "num_requests", "num_pages", "num_columns"]


def common_signature(q_dtype: str, index_dtype: str, kv: int = KV_16BIT) -> dict[str, str]:
    """Triton signature of the common arguments for ``q_dtype`` (bf16/fp16), ``index_dtype`` and a ``KV_KIND``."""
    k = q_dtype if kv == KV_16BIT else "u8"
    ks = {KV_16BIT: k, KV_FP4: "u8"}.get(kv, "fp32")
    return {name: kind.format(q=q_dtype, idx=index_dtype, k=k, ks=ks) for name, kind in COMMON_SIGNATURE.items()}


@triton.jit
def row_visibility(t2r_ptr, pos_ptr, ctx_ptr, rows, num_tokens, num_requests, num_columns, RATIO: tl.constexpr):
    """Request id and visible group count of ``rows`` (scalar or vector). Padded rows give ``(-1, 0)``."""
    in_range = rows < num_tokens
    req = tl.load(t2r_ptr + rows, mask=in_range, other=-1).to(tl.int32)
    pos = tl.load(pos_ptr + rows, mask=in_range, other=-1).to(tl.int32)
    req_ok = (req >= 0) & (req < num_requests)
    ctx = tl.load(ctx_ptr + req, mask=req_ok, other=0).to(tl.int32)
    # Negative operands only arise for padded or empty rows and clamp to 0 below, so C-style division is fine.
    vis = tl.minimum((pos + 1) // RATIO, ctx // RATIO)
    vis = tl.minimum(tl.maximum(vis, 0), num_columns)
    vis = tl.where(req_ok, vis, 0)
    req = tl.where(req_ok, req, -1)
    return req, vis


@triton.jit
def stacked_head_scores(dots, page_ok, factor, ROWS: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scores ``[ROWS, BLOCK_N]`` from the dot products ``[ROWS * NUM_HEADS, BLOCK_N]`` of a rows x heads stacked query.

    ReLU is applied per head, then the heads are summed out of M and each column is multiplied by its ``factor``
    (``load_key_tile``). Columns whose page is bad score ``-inf``.
    """
    s = tl.sum(tl.reshape(tl.maximum(dots, 0.0), (ROWS, NUM_HEADS, BLOCK_N)), axis=1)
    return tl.where(page_ok[None, :], s * factor[None, :], float("-inf"))


@triton.jit
def load_q_tile(q_ptr, q_rows, q_ok, HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr, DOT_DTYPE: tl.constexpr,
                FP8_DOT: tl.constexpr):
    """Query rows ``q_rows`` (of ``q`` viewed as ``[rows, HEAD_DIM]``) as dot operands ``(first, second, factor)``
    for ``pair_dot``: ``(q, q, 1)``, each ``[len(q_rows), HEAD_DIM]``; for an MXFP4 cache q's even and odd elements,
    each ``[len(q_rows), HEAD_DIM // 2]`` (to meet ``load_fp4_key_tile``'s even and odd keys); with ``FP8_DOT`` the
    two e4m3 terms of q and the fp32 row scale ``[len(q_rows)]`` to multiply their dots by (``split_query_e4m3``)."""
    row = q_ptr + q_rows.to(tl.int64)[:, None] * HEAD_DIM
    factor = tl.full(q_rows.shape, 1.0, tl.float32)
    if KV_KIND == 3:
        j = 2 * tl.arange(0, HEAD_DIM // 2)
        first = tl.load(row + j[None, :], mask=q_ok[:, None], other=0.0).to(DOT_DTYPE)
        second = tl.load(row + j[None, :] + 1, mask=q_ok[:, None], other=0.0).to(DOT_DTYPE)
    elif FP8_DOT:
        q = tl.load(row + tl.arange(0, HEAD_DIM)[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)
        hi, lo, factor = split_query_e4m3(q)
        first = hi.to(DOT_DTYPE)
        second = lo.to(DOT_DTYPE)
    else:
        first = tl.load(row + tl.arange(0, HEAD_DIM)[None, :], mask=q_ok[:, None], other=0.0).to(DOT_DTYPE)
        second = first
    return first, second, factor


@triton.jit
def load_keys(k_ptr, ks_ptr, pt_row_ptr, tile, valid, num_pages, scale, BLOCK_N: tl.constexpr,
              PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr, DOT_DTYPE: tl.constexpr,
              FAST_DECODE: tl.constexpr, SCALAR_PAGES: tl.constexpr):
    """Key tile ``tile`` (columns ``tile * BLOCK_N + [0, BLOCK_N)``, those ``< valid`` wanted) of one request as dot
    operands ``(first, second, page_ok, factor)``: for an MXFP4 cache the even and odd elements
    (``load_fp4_key_tile``), else the keys twice (``load_key_tile``); pair them with ``load_q_tile``. The tile's
    page ids are read as scalars (``tile_slots``) with ``SCALAR_PAGES``, else as one vector (``key_slots``): a tile
    setting, which is faster depends on the kernel and cache kind."""
    if SCALAR_PAGES:
        slot, page_ok = tile_slots(pt_row_ptr, tile, valid, num_pages, BLOCK_N, PAGE_SIZE)
    else:
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        slot, page_ok = key_slots(pt_row_ptr, cols, cols < valid, num_pages, PAGE_SIZE)
    if KV_KIND == 3:
        first, second, factor = load_fp4_key_tile(k_ptr, ks_ptr, slot, page_ok, scale, HEAD_DIM, DOT_DTYPE,
                                                  FAST_DECODE)
    else:
        first, factor = load_key_tile(k_ptr, ks_ptr, slot, page_ok, scale, HEAD_DIM, KV_KIND, DOT_DTYPE, FAST_DECODE)
        second = first
    return first, second, page_ok, factor


@triton.jit
def pair_dot(q_first, q_second, k_first, k_second, KV_KIND: tl.constexpr):
    """``q . k`` over head_dim for operands from ``load_q_tile`` and ``load_keys``: ``[M, BLOCK_N]`` fp32. MXFP4 is
    two half-K dots (even, then odd elements) into one accumulator."""
    if KV_KIND == 3:
        dots = tl.dot(q_second, tl.trans(k_second), tl.dot(q_first, tl.trans(k_first)))
    else:
        dots = tl.dot(q_first, tl.trans(k_first))
    return dots


@triton.jit
def fp8_keys_major_dots(keys, q_hi, q_lo, q_factor):
    """``FP8_DOT`` dots, keys major: e4m3 keys ``[BLOCK_N, D]`` (as stored) against q's two e4m3 terms ``[M, D]``
    (``load_q_tile``), one fp32 accumulator ``[BLOCK_N, M]`` times q's row scales ``[M]``. With the keys as the M
    operand the tensor cores read them straight from shared memory: no register pass over the keys at all."""
    dots = tl.dot(keys, tl.trans(q_lo), tl.dot(keys, tl.trans(q_hi)))
    return dots * q_factor[None, :]

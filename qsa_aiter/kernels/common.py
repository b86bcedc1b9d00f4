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

from .. import tuned

from .dequant import (
    E4M3_MIN_HEAD_DIM, KV_16BIT, KV_FP4, KV_FP8_E4M3FN, dot_dtype, e4m3_row_scale, fast_decode, fp4_block_order,
    fp4_e4m3_block, fp8_dot, fp8_tensor_cores, kernel_view, kv_kind, load_fp4_key_tile, load_key_tile, key_slots,
    split_e4m3, split_query_e4m3, tile_slots,
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
    fp8_mma: bool = True  # QSA_AITER_FP8_MMA: e4m3 tensor cores may score e4m3fn and MXFP4 caches (``fp8_dot``)
    tuned_config: tuple[str, ...] | None = None  # QSA_AITER_TUNED_CONFIG as read with the call's settings (None: now)

    @property
    def arch(self) -> str:
        """The arch whose tuned rows the launch uses (``tuned.device_arch`` of q's device)."""
        return tuned.device_arch(self.q.device)

    def tile(self, kernel: str, problem, default):
        """The kernel's tile for ``problem``: ``default`` with this arch's tuned row applied (``tuned.config_for``)."""
        return tuned.config_for(kernel, problem, self.q.device, default, arch=self.arch, extra=self.tuned_config)

    @property
    def fast_decode(self) -> bool:
        """Quantised keys are decoded with the PTX decoders (``dequant.fast_decode``), never under the interpreter."""
        return kv_kind(self.k_cache.dtype) != KV_16BIT and not self.upcast and fast_decode(self.q.device)

    @property
    def fp8_dot(self) -> bool:
        """e4m3fn or MXFP4 keys go to e4m3 tensor cores against a split q (``e4m3_mma_serves``); the interpreter
        emulates it."""
        return e4m3_mma_serves(self.q.dtype, self.k_cache.dtype, self.q.shape[2], self.q.device, self.fp8_mma)

    @property
    def scale_words(self) -> bool:
        """An MXFP4 scale tensor's rows can be read as one integer per key (``fp4_block_factors``): its address is a
        multiple of the bytes per key (always so for a tensor of its own; a view into a larger buffer may not be)."""
        if self.k_scale is None or kv_kind(self.k_cache.dtype) != KV_FP4:
            return True
        return self.k_scale.data_ptr() % (self.q.shape[2] // 32) == 0

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


def e4m3_mma_serves(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, device: torch.device,
                    enabled: bool) -> bool:
    """Whether the stacked scorer reads the keys with e4m3 tensor-core MMAs (``FP8_DOT``): ``enabled``
    (``QSA_AITER_FP8_MMA``), an e4m3fn or MXFP4 cache with bf16 queries (``dequant.fp8_dot``), and e4m3 tensor cores
    on ``device`` (``dequant.fp8_tensor_cores``) or the interpreter, which emulates them with exact fp32 dots."""
    hardware = interpreting() or fp8_tensor_cores(device)
    return fp8_dot(q_dtype, cache_dtype, head_dim, enabled and hardware)


def describe_key_reading(kernel: str, problem, e4m3_mma: bool, enabled: bool) -> str:
    """One line for ``explain``: how ``kernel`` (rowwise/stacked/tiled) reads ``problem``'s keys, given whether the
    e4m3 MMA path serves (``e4m3_mma_serves``) and ``QSA_AITER_FP8_MMA`` (``enabled``)."""
    kind = kv_kind(problem.cache_dtype)
    emulated = " (emulated with exact fp32 dots under TRITON_INTERPRET=1)" if interpreting() else ""
    if kind == KV_16BIT:
        return "as stored"
    if kernel == "rowwise":
        return "decoded to fp32 in registers (CUDA-core products, no MMA)"
    if kernel == "stacked" and e4m3_mma:
        keys = ("MXFP4 nibbles placed as exact e4m3 bytes, one k32 MMA step per 32-element block, scaled by its e8m0 "
                "exponent in fp32" if kind == KV_FP4 else "the stored e4m3fn bytes as the MMA operand")
        return f"e4m3 tensor cores (QSA_AITER_FP8_MMA=1): {keys}; q split into two e4m3 terms{emulated}"
    dtype = "fp32" if interpreting() else str(dot_dtype(problem, False))
    if kernel == "tiled":
        why = "the prefill tiles always decode"
    elif not enabled:
        why = "QSA_AITER_FP8_MMA=0"
    elif problem.q_dtype != torch.bfloat16:
        why = "fp16 queries: two e4m3 terms cannot hold them"
    elif kind not in (KV_FP8_E4M3FN, KV_FP4):
        why = "an e4m3fnuz cache"
    elif problem.head_dim < E4M3_MIN_HEAD_DIM:
        why = f"head_dim {problem.head_dim} < {E4M3_MIN_HEAD_DIM}: e4m3 MMAs step head_dim by 32"
    else:
        why = "no e4m3 tensor cores on this device"
    return f"decoded to {dtype} in registers ({why})"


def scale_words_fit(head_dim: int) -> bool:
    """Whether an MXFP4 key's ``head_dim // 32`` exponent bytes form one integer (1, 2, 4 or 8 bytes) that
    ``fp4_block_factors`` can load at once (``SCALE_WORDS``, with an aligned scale tensor)."""
    return head_dim // 32 in (1, 2, 4, 8)


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
    s = tl.sum(tl.reshape(tl.maximum(dots, 0.0), (ROWS, NUM_HEADS, BLOCK_N)), axis=1)
    return tl.where(page_ok[None, :], s * factor[None, :], float("-inf"))


@triton.jit
def load_q_tile(q_ptr, q_rows, q_ok, HEAD_DIM: tl.constexpr, KV_KIND: tl.constexpr, DOT_DTYPE: tl.constexpr,
                FP8_DOT: tl.constexpr):
    """Query rows ``q_rows`` (of ``q`` viewed as ``[rows, HEAD_DIM]``) as dot operands ``(first, second, factor)``
    for ``pair_dot``: ``(q, q, 1)``, each ``[len(q_rows), HEAD_DIM]``; for an MXFP4 cache q's even and odd elements,
    each ``[len(q_rows), HEAD_DIM // 2]`` (to meet ``load_fp4_key_tile``'s even and odd keys); with ``FP8_DOT`` the
    two e4m3 terms of q and the fp32 row scale ``[len(q_rows)]`` to multiply their dots by (``split_query_e4m3``),
    and with ``FP8_DOT`` on an MXFP4 cache those terms per 32-element block (``load_q_fp4_blocks``)."""
    row = q_ptr + q_rows.to(tl.int64)[:, None] * HEAD_DIM
    factor = tl.full(q_rows.shape, 1.0, tl.float32)
    if FP8_DOT and (KV_KIND == 3):
        first, second, factor = load_q_fp4_blocks(q_ptr, q_rows, q_ok, HEAD_DIM, DOT_DTYPE)
    elif KV_KIND == 3:
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
    for b in tl.static_range(HEAD_DIM // 32):
        x = tl.load(row + b * 32 + order[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        blocks = blocks + (x,)
    inverse, row_scale = e4m3_row_scale(amax)
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
              FAST_DECODE: tl.constexpr, SCALAR_PAGES: tl.constexpr):
    """Key tile ``tile`` (columns ``tile * BLOCK_N + [0, BLOCK_N)``, those ``< valid`` wanted) of one request as dot
    operands ``(first, second, page_ok, factor)``: for an MXFP4 cache the even and odd elements
    (``load_fp4_key_tile``), else the keys twice (``load_key_tile``); pair them with ``load_q_tile``. Slots and
    ``page_ok`` as ``key_tile_slots``."""
    slot, page_ok = key_tile_slots(pt_row_ptr, tile, valid, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
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
                        DOT_DTYPE: tl.constexpr, FAST_DECODE: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """``FP8_DOT`` dots of an MXFP4 key tile, keys major: ``[BLOCK_N, M]`` fp32 for the keys at cache slots ``slot``
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
    block_dots = ()
    for b in tl.static_range(NB):
        packed = tl.load(k_ptr + slot[:, None] * (HEAD_DIM // 2) + b * 16 + pair[None, :], mask=page_ok[:, None],
                         other=0)
        keys = fp4_e4m3_block(packed, DOT_DTYPE, FAST_DECODE)
        block_dots = block_dots + (tl.dot(keys, tl.trans(q_lo[b]), tl.dot(keys, tl.trans(q_hi[b]))),)
    factors = fp4_block_factors(exps, NB, SCALE_WORDS)
    dots = tl.sum(stack_last(block_dots) * factors[:, None, :], axis=2)
    return dots * q_factor[None, :]


@triton.jit
def store_keys_major(out_rows, cols, dots_t, page_ok, factor, mine, vis, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr, NUM_HEADS: tl.constexpr):
    """Score and store keys-major dots ``[BLOCK_N, ROWS * NUM_HEADS]`` (``fp8_keys_major_dots``,
    ``fp4_keys_major_dots``): ReLU per head, heads summed, times the per-key ``factor`` (``-inf`` where not
    ``page_ok``), stored transposed at ``out_rows[r] + cols`` for the rows that are ``mine`` and columns below each
    row's ``vis``."""
    s_t = tl.sum(tl.reshape(tl.maximum(dots_t, 0.0), (BLOCK_N, ROWS, NUM_HEADS)), axis=2)
    score_t = tl.where(page_ok[:, None], s_t * factor[:, None], float("-inf"))
    keep_t = mine[None, :] & (cols[:, None] < vis[None, :])
    tl.store(out_rows[None, :] + cols[:, None], score_t, mask=keep_t)

"""Device helpers and launch arguments shared by the scoring kernels.

The helpers are ``@triton.jit`` functions inlined into each kernel: the visibility rule of SPEC section 1 and the
paged key-tile gather with its bad-page mask live here once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


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

    q: ``[tokens, heads, head_dim]`` bf16/fp16, contiguous; k_cache: ``[pages, page_size, 1, head_dim]``, contiguous;
    page_table: ``[requests, width]`` int32/int64 (last dim contiguous); token_to_request, query_positions:
    ``[tokens]``; context_lens: ``[requests]``; logits: fp32 ``[tokens, num_columns]`` (last dim contiguous);
    visible: int32 ``[tokens]``, written by the kernel.
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

    @property
    def upcast(self) -> bool:
        """The interpreter computes bf16 on raw bits: upcast 16-bit operands to fp32 there, never on a GPU."""
        return interpreting()

    def common_args(self) -> tuple:
        """Positional arguments shared by every kernel, in the order of their signatures."""
        num_tokens, num_heads, head_dim = self.q.shape
        return (
            self.q, self.k_cache, self.page_table, self.token_to_request, self.query_positions, self.context_lens,
            self.logits, self.visible,
            num_tokens, self.page_table.shape[0], self.k_cache.shape[0], self.num_columns,
            self.page_table.stride(0), self.logits.stride(0), self.scale,
        )


#: Signature of the arguments ``ScoreLaunch.common_args`` passes, for ahead-of-time compilation.
COMMON_SIGNATURE = {
    "q_ptr": "*{q}", "k_ptr": "*{q}", "pt_ptr": "*{idx}", "t2r_ptr": "*{idx}", "pos_ptr": "*{idx}",
    "ctx_ptr": "*{idx}", "out_ptr": "*fp32", "vis_ptr": "*i32",
    "num_tokens": "i32", "num_requests": "i32", "num_pages": "i32", "num_columns": "i32",
    "pt_stride": "i32", "out_stride": "i32", "scale": "fp32",
}
#: Scalars that change from call to call: never specialised (no recompiles when they hit 1 or a multiple of 16).
DYNAMIC_SCALARS = ["num_tokens", "num_requests", "num_pages", "num_columns"]


def common_signature(q_dtype: str, index_dtype: str) -> dict[str, str]:
    return {name: kind.format(q=q_dtype, idx=index_dtype) for name, kind in COMMON_SIGNATURE.items()}


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
def key_slots(pt_row_ptr, cols, col_ok, num_pages, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Element offsets of the keys of logical columns ``cols`` through one request's page-table row.

    Returns 64-bit offsets (caches beyond 2 GiB work) and ``page_ok``: the column is wanted and its physical page id
    lies in ``[0, num_pages)``. A bad page id is never dereferenced: callers mask their loads with ``page_ok``.
    """
    page = tl.load(pt_row_ptr + cols // PAGE_SIZE, mask=col_ok, other=-1)
    page_ok = col_ok & (page >= 0) & (page < num_pages)
    return (page.to(tl.int64) * PAGE_SIZE + (cols % PAGE_SIZE)) * HEAD_DIM, page_ok


@triton.jit
def load_key_tile(k_ptr, pt_row_ptr, cols, col_ok, num_pages, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Gather keys ``[BLOCK_N, HEAD_DIM]`` of logical columns ``cols`` (zeros where masked) and their ``page_ok``.

    ``HEAD_DIM`` must be a power of two (the tensor-core kernels require it).
    """
    slot, page_ok = key_slots(pt_row_ptr, cols, col_ok, num_pages, PAGE_SIZE, HEAD_DIM)
    d = tl.arange(0, HEAD_DIM)
    keys = tl.load(k_ptr + slot[:, None] + d[None, :], mask=page_ok[:, None], other=0.0)
    return keys, page_ok


@triton.jit
def stacked_head_scores(q_stack, keys, page_ok, scale, ROWS: tl.constexpr, NUM_HEADS: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """Scores ``[ROWS, BLOCK_N]`` of a rows x heads stacked query ``[ROWS * NUM_HEADS, D]`` against keys ``[BLOCK_N, D]``.

    One ``tl.dot`` scores every head of every row; ReLU is applied per head, then the heads are summed out of M.
    Columns whose page is bad score ``-inf``.
    """
    s = tl.maximum(tl.dot(q_stack, tl.trans(keys)), 0.0)
    s = tl.sum(tl.reshape(s, (ROWS, NUM_HEADS, BLOCK_N)), axis=1)
    return tl.where(page_ok[None, :], s * scale, float("-inf"))

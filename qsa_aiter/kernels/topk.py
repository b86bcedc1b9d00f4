"""Block top-k over each row's visible logits: a radix select, deterministic, with ties to the lower group.

One program per row. A row with ``visible <= K`` takes groups ``0 .. visible-1`` without reading a score. Otherwise
the scores are mapped to order-preserving 32-bit keys and the K-th largest key is found by a radix select: four
passes, one byte per pass (a 256-bin histogram of the keys that match the bytes found so far, then the bin where the
count from the top reaches what is still needed). A last pass writes, in ascending column order, every column whose
key is above that key and the first columns (lowest indices) equal to it, as many as are still needed: exactly the
first K columns by ``(-score, index)``, in ascending order, then ``-1``. Nothing is sorted.

A long row is not scanned five times: a threshold is taken from every ``STRIDE``-th column (a radix select over
the samples), one pass keeps the columns at or above it (in column order, in a per-row candidate buffer), and the
select and the output pass run over those candidates only. When the threshold keeps fewer than K or more than
``CAPACITY`` columns (heavy ties, adversarial orders) the row is selected whole instead, with the same result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import next_pow2


@triton.jit
def _order_key(scores):
    """fp32 -> uint32 whose unsigned order is the float order (-inf lowest; -0.0 keyed as +0.0, they compare equal)."""
    bits = scores.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    flipped = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reverse the magnitude order
    return flipped.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _columns(j, count, buf_row, MODE: tl.constexpr, STRIDE: tl.constexpr):
    """Columns of elements ``j`` of a view of the row: the row itself (MODE 0), every STRIDE-th column (MODE 1), or
    the candidate columns stored in ``buf_row`` (MODE 2). Elements ``>= count`` are masked by the callers."""
    if MODE == 1:
        cols = j * STRIDE
    elif MODE == 2:
        cols = tl.load(buf_row + j, mask=j < count, other=0)
    else:
        cols = j
    return cols


@triton.jit
def _kth_largest_key(src, buf_row, count, k, CHUNK: tl.constexpr, MODE: tl.constexpr, STRIDE: tl.constexpr):
    """Radix select over a view of the row (``_columns``) of ``count >= k`` elements: ``(key, need)``, the k-th
    largest order key and how many elements equal to it belong to the top k (the others are above it)."""
    offs = tl.arange(0, CHUNK)
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), tl.uint32)
    prefix_mask = tl.zeros((), tl.uint32)
    need = k  # how many of the keys matching `prefix` are still to be taken
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros((256,), tl.int32)
        for start in range(0, count, CHUNK):
            j = start + offs
            cols = _columns(j, count, buf_row, MODE, STRIDE)
            key = _order_key(tl.load(src + cols, mask=j < count, other=0.0))
            match = (j < count) & ((key & prefix_mask) == prefix)
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=match)
        # Bin b where the count of matching keys from the top first reaches `need`.
        from_top = tl.cumsum(hist, axis=0, reverse=True)
        b = tl.max(tl.where(from_top >= need, bins, -1), axis=0)
        need -= tl.sum(tl.where(bins > b, hist, 0), axis=0)
        prefix = prefix | (b.to(tl.uint32) << shift)
        prefix_mask = prefix_mask | (tl.full((), 0xFF, tl.uint32) << shift)
    return prefix, need


@triton.jit
def _write_top(src, buf_row, out_row, count, threshold, need, CHUNK: tl.constexpr, MODE: tl.constexpr):
    """Write, in view order (ascending columns), every column of the view whose key is above ``threshold`` and the
    first ``need`` whose key equals it."""
    offs = tl.arange(0, CHUNK)
    taken = tl.zeros((), tl.int32)
    equal_seen = tl.zeros((), tl.int32)
    for start in range(0, count, CHUNK):
        j = start + offs
        in_view = j < count
        cols = _columns(j, count, buf_row, MODE, 1)
        key = _order_key(tl.load(src + cols, mask=in_view, other=0.0))
        equal = in_view & (key == threshold)
        equal_rank = equal_seen + tl.cumsum(equal.to(tl.int32), axis=0) - 1
        chosen = in_view & ((key > threshold) | (equal & (equal_rank < need)))
        slot = taken + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, cols, mask=chosen)
        taken += tl.sum(chosen.to(tl.int32), axis=0)
        equal_seen += tl.sum(equal.to(tl.int32), axis=0)


@triton.jit
def _block_topk_kernel(
    logits_ptr, vis_ptr, out_ptr, buf_ptr, logits_stride, out_stride, buf_stride,
    K: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, CAPACITY: tl.constexpr, STRIDE: tl.constexpr,
    SAMPLE_RANK: tl.constexpr,
):
    row = tl.program_id(0)
    n = tl.load(vis_ptr + row)
    out_row = out_ptr + row.to(tl.int64) * out_stride
    kk = tl.arange(0, BLOCK_K)
    if n <= K:
        # Short rows take every visible group, scores unread.
        tl.store(out_row + kk, tl.where(kk < n, kk, -1), mask=kk < K)
    else:
        src = logits_ptr + row.to(tl.int64) * logits_stride
        buf_row = buf_ptr + row.to(tl.int64) * buf_stride
        candidates = n
        if n > CAPACITY:
            # A threshold from every STRIDE-th column (the SAMPLE_RANK-th largest sample), then one pass that keeps
            # the columns at or above it, in column order. It is used when it keeps between K and CAPACITY columns:
            # then every column of the top K is among them.
            samples = tl.cdiv(n, STRIDE)
            floor_key, _ = _kth_largest_key(src, buf_row, samples, tl.minimum(samples, SAMPLE_RANK), CHUNK, 1, STRIDE)
            offs = tl.arange(0, CHUNK)
            kept = tl.zeros((), tl.int32)
            for start in range(0, n, CHUNK):
                cols = start + offs
                key = _order_key(tl.load(src + cols, mask=cols < n, other=0.0))
                keep = (cols < n) & (key >= floor_key)
                slot = kept + tl.cumsum(keep.to(tl.int32), axis=0) - 1
                tl.store(buf_row + slot, cols, mask=keep & (slot < CAPACITY))
                kept += tl.sum(keep.to(tl.int32), axis=0)
            # The candidates are read back by other threads of the program: make their stores visible first.
            tl.debug_barrier()
            candidates = kept
        if (candidates >= K) & (candidates <= CAPACITY) & (n > CAPACITY):
            threshold, need = _kth_largest_key(src, buf_row, candidates, K, CHUNK, 2, 1)
            _write_top(src, buf_row, out_row, candidates, threshold, need, CHUNK, 2)
        else:
            # Short rows, and rows whose sample threshold kept too few or too many columns: the whole row.
            threshold, need = _kth_largest_key(src, buf_row, n, K, CHUNK, 0, 1)
            _write_top(src, buf_row, out_row, n, threshold, need, CHUNK, 0)


@dataclass(frozen=True)
class TopkConfig:
    chunk: int = 1024  # columns per step of each pass
    num_warps: int = 4
    capacity: int = 4096  # candidate columns kept per row (rows up to this long are selected directly)
    stride: int = 16  # every stride-th column is a sample
    oversample: int = 2  # the sample threshold aims at about oversample x K candidates


def launch(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int,
           cfg: TopkConfig | None = None) -> None:
    """Fill ``out`` (int32 ``[tokens, block_topk]``) from fp32 ``logits`` ``[tokens, columns]`` (last dim contiguous)
    and int32 ``visible`` ``[tokens]`` (each ``<= columns``)."""
    cfg = cfg or TopkConfig()
    tokens = logits.shape[0]
    if tokens == 0:
        return
    candidates = torch.empty((tokens, cfg.capacity), dtype=torch.int32, device=logits.device)
    _block_topk_kernel[(tokens,)](
        logits, visible, out, candidates, logits.stride(0), out.stride(0), candidates.stride(0),
        **constexprs(block_topk, cfg), num_warps=cfg.num_warps,
    )


def constexprs(block_topk: int, cfg: TopkConfig) -> dict:
    """The kernel's specialisation for ``block_topk`` groups per row under ``cfg``."""
    return dict(K=block_topk, BLOCK_K=next_pow2(block_topk), CHUNK=cfg.chunk, CAPACITY=cfg.capacity,
                STRIDE=cfg.stride, SAMPLE_RANK=sample_rank(block_topk, cfg))


def sample_rank(block_topk: int, cfg: TopkConfig) -> int:
    """Which sample sets the candidate threshold: about ``oversample * K`` columns are expected at or above the
    ``oversample * K / stride``-th largest of every ``stride``-th column (plus a margin of 8 samples)."""
    return cfg.oversample * block_topk // cfg.stride + 8


#: The kernel object, for ahead-of-time compilation.
KERNEL = _block_topk_kernel

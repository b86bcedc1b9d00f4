"""The scorers' per-row histogram of the scores they store, which the native top-k can start from.

A scorer built with ``HISTOGRAM`` (``ScoreProblem.histogram``) adds every score it stores, ``logits[r, c]`` for
``c < visible[r]``, to ``histogram[r, key(score) >> 21]``: int32 ``[tokens, HISTOGRAM_BINS]``, zeroed by the caller,
where ``key`` is the native top-k's order-preserving map of an fp32 score to 32 bits (``-0.0`` as ``+0.0``). The
top-k then finds the bin of its ``block_topk``-th best score from the histogram instead of counting the row's top bits
itself (``native_topk.cu``, ``runtime.native_topk.native_block_topk(..., histogram=)``). The adds are relaxed global atomics:
they only count, so the histogram, like the logits, is the same on every run. Measured on the H200 they cost the
scorer more than the top-k gains, so the ops do not ask for it (docs/selection.md, "The quad classify, the scorers'
histogram, and where the time goes"; ``benchmarks/score_histogram.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..selection.native_topk import HISTOGRAM_BINS
from ..selection.topk import order_key

#: ``HISTOGRAM_BINS`` for the kernels.
BINS = tl.constexpr(HISTOGRAM_BINS)
#: The bits of the key below a bin: a bin is the key's top 11 bits (sign, exponent, two mantissa bits of the score).
BIN_SHIFT = 21
_SHIFT = tl.constexpr(BIN_SHIFT)


@triton.jit
def count_scores(hist_rows, score, keep):
    """Add each ``score`` where ``keep`` (None: every one) to its bin of the histogram row at ``hist_rows``
    (pointers to the rows' first bins, broadcast to ``score``'s shape; ``score`` fp32)."""
    bins = (order_key(score) >> _SHIFT).to(tl.int32)
    tl.atomic_add(hist_rows + bins, 1, mask=keep, sem="relaxed")


def score_keys(scores: torch.Tensor) -> torch.Tensor:
    """The order-preserving 32-bit keys of fp32 ``scores`` (as int64 in ``[0, 2**32)``), ``topk.order_key``'s:
    ``-0.0`` maps as ``+0.0``, every NaN to one key just above ``+inf``'s, negative scores to ``~bits``, the others
    to ``bits | 2**31``."""
    bits = scores.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    magnitude = (bits & 0x7FFFFFFF).clamp_max(0x7F800001)
    return torch.where(scores < 0, magnitude ^ 0x7FFFFFFF, magnitude | 0x80000000)


def torch_score_histogram(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The reference histogram: int32 ``[tokens, HISTOGRAM_BINS]`` of the keys' top 11 bits over each row's
    ``[0, clamp(visible, 0, columns))`` of fp32 ``logits [tokens, columns]``."""
    tokens, columns = logits.shape
    n = visible.to(torch.int64).clamp(0, columns)
    keep = torch.arange(columns, device=logits.device)[None, :] < n[:, None]
    bins = score_keys(logits) >> BIN_SHIFT
    index = bins + torch.arange(tokens, device=logits.device)[:, None] * HISTOGRAM_BINS
    flat = torch.zeros(tokens * HISTOGRAM_BINS, dtype=torch.int64, device=logits.device)
    flat.index_add_(0, index[keep], torch.ones_like(index[keep]))
    return flat.view(tokens, HISTOGRAM_BINS).to(torch.int32)

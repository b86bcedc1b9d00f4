"""Quantisation quality: how much of the bf16 cache's top-k selection an fp8 or MXFP4 cache keeps.

Keys get a realistic spread: per-channel scales drawn log-normally (some channels carry far more energy than
others) and a few outlier channels, as normalised-then-rotated index keys show. Selection is the block top-k of the
scores of ``reference_paged_mqa_logits``; overlap is ``|top_k(quantised) & top_k(bf16)| / k`` per row.
"""

from __future__ import annotations

import torch

from ..kernels.cache.reference import write_reference
from ..kernels.scoring.reference import reference_paged_mqa_logits
from ..kernels.quant.formats import allocate_index_cache, dequantize_cache


def realistic_keys(n: int, head_dim: int, generator: torch.Generator, outlier_channels: int = 4) -> torch.Tensor:
    """bf16 keys ``[n, head_dim]`` with log-normal channel scales and a few 8x outlier channels."""
    channel_scale = torch.exp(0.75 * torch.randn(head_dim, generator=generator))
    outliers = torch.randperm(head_dim, generator=generator)[:outlier_channels]
    channel_scale[outliers] *= 8.0
    return (torch.randn(n, head_dim, generator=generator) * channel_scale).to(torch.bfloat16)


def selection_overlap(cache_format: str, *, rows: int = 16, groups: int = 8192, topk: int = 512, heads: int = 4,
                      head_dim: int = 128, page_size: int = 64, seed: int = 0, **alloc) -> torch.Tensor:
    """Per-row top-``topk`` overlap (fraction in [0, 1]) of a ``cache_format`` cache (a format name,
    docs/cache_formats.md) against the bf16 cache of the same keys.

    One request of ``groups`` compressed keys; ``rows`` query rows that all see every group. Runs on the CPU.
    """
    gen = torch.Generator().manual_seed(seed)
    pages = -(-groups // page_size)
    keys = realistic_keys(pages * page_size, head_dim, gen)
    q = realistic_keys(rows * heads, head_dim, gen).reshape(rows, heads, head_dim)
    slots = torch.arange(pages * page_size, dtype=torch.int32)
    table = torch.arange(pages, dtype=torch.int32)[None]
    t2r = torch.zeros(rows, dtype=torch.int32)
    pos = torch.full((rows,), groups * 4 - 1, dtype=torch.int32)
    ctx = torch.tensor([groups * 4], dtype=torch.int32)

    def top(name: str) -> torch.Tensor:
        cache, scale = allocate_index_cache(name, pages, page_size, head_dim, **alloc)
        write_reference(keys, slots, cache, scale)  # the quantisation itself; the writer kernel is tested apart
        dequant = dequantize_cache(cache, scale).to(torch.float32)
        logits, _ = reference_paged_mqa_logits(q.float(), dequant, table, t2r, pos, ctx, 4, max_columns=groups)
        return logits.topk(topk, dim=1).indices

    base, other = top("bf16"), top(cache_format)
    hits = (base[:, :, None] == other[:, None, :]).any(dim=2).sum(dim=1)
    return hits.float() / topk

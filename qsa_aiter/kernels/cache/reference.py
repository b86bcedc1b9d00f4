"""Torch reference of the index-cache writer (``write_reference``), and the rule every writer path shares for a
slot named twice in one call (``last_writer_slots``)."""

from __future__ import annotations

import torch

from ..quant.formats import cache_kind, quantize_fp4, quantize_fp8


def last_writer_slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    """``slot_mapping`` ``[n]`` with every entry whose slot a later entry also names replaced by ``-1``: when one call
    writes a slot twice, the last key wins, on every path (a scatter's order among duplicates is undefined).

    A stable sort brings equal slots together in call order; all but the last of each run are dropped. No host sync,
    so the writer stays capturable in a CUDA graph.
    """
    n = slot_mapping.numel()
    if n < 2:
        return slot_mapping
    ordered, order = torch.sort(slot_mapping, stable=True)
    superseded_sorted = torch.zeros(n, dtype=torch.bool, device=slot_mapping.device)
    superseded_sorted[:-1] = ordered[1:] == ordered[:-1]
    superseded = torch.empty_like(superseded_sorted).scatter_(0, order, superseded_sorted)
    return torch.where(superseded, torch.full_like(slot_mapping, -1), slot_mapping)


def write_reference(keys: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor,
                    scale: torch.Tensor | None = None) -> None:
    """Torch reference of the cache writer: quantise ``keys [n, D]``, scatter them to ``slot_mapping`` (-1 skips).

    Slots outside ``[0, pages * P)`` are skipped as well; a slot named twice takes the later key
    (``last_writer_slots``). 16-bit caches take the keys rounded to nearest-even.
    """
    pages, page_size = cache.shape[:2]
    slots = last_writer_slots(slot_mapping).long()
    keep = (slots >= 0) & (slots < pages * page_size)
    slots, keys = slots[keep], keys[keep]
    page, offset = slots // page_size, slots % page_size
    kind = cache_kind(cache)
    if kind == "bf16":
        cache[page, offset, 0] = keys.to(cache.dtype)
    elif kind == "fp8":
        values, s = quantize_fp8(keys, cache.dtype)
        cache[page, offset, 0] = values
        scale[page, offset] = s
    else:
        packed, exps = quantize_fp4(keys)
        cache.view(torch.uint8)[page, offset, 0] = packed
        scale.view(torch.uint8)[page, offset, 0] = exps

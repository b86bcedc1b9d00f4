"""The native top-k's test cases, shared by its GPU tests and its emulated ones (tests/kernels/selection): score
kinds, visible counts at the edges, NaN past them, and every plan a shape can take."""

from __future__ import annotations

import dataclasses

import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import native_topk as nt

from helpers import random_logits


def native_case_logits(gen, tokens: int, columns: int, kind: str, device: str = "cuda") -> torch.Tensor:
    """The selection tests' score kinds, plus ReLU scores (long runs of exact 0.0), constant rows and -inf-heavy
    rows."""
    if kind in ("random", "ties", "equal"):
        return random_logits(gen, tokens, columns, kind).to(device)
    logits = torch.randn(tokens, columns, generator=gen)
    if kind == "relu":
        logits = logits.clamp_min(0.0)
        logits[0, : columns // 2] = 0.0
    elif kind == "relu_sparse":
        logits = (logits - 1.8).clamp_min(0.0)
    elif kind == "constant":
        logits = torch.full((tokens, columns), -2.5)
        logits[1::2] = 0.0
    elif kind == "neg_inf":
        logits[torch.rand(tokens, columns, generator=gen) < 0.8] = float("-inf")
        logits[0] = float("-inf")
    return logits.to(device)


def nan_past_visible(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """NaN past each row's visible count: never read."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    return torch.where(cols[None, :] < visible[:, None].long(), logits, torch.full_like(logits, float("nan")))


def edge_visible(gen, tokens: int, columns: int, k: int, device: str = "cuda") -> torch.Tensor:
    """int32 visible counts: the edges first (full, one short, K, K + 1, 0, 3, negative, past the columns, K - 1),
    then random."""
    vis = torch.randint(0, columns + 1, (tokens,), generator=gen)
    edges = torch.tensor([columns, columns - 1, k, k + 1, 0, 3, -4, columns + 7, k - 1])[:tokens]
    vis[: edges.numel()] = edges
    return vis.to(torch.int32).to(device)


def native_plans(rows: int, columns: int, k: int, platform: Platform | None = None) -> list[nt.Plan]:
    """Every plan that can serve the shape on ``platform`` (default this GPU): both row kernels cached (and with an
    8-entry candidate list, which forces the full-scan path), uncached with the full and an 8-key buffer, every
    cluster size."""
    platform = platform or Platform.of(torch.device("cuda"))
    plans = []
    for threads in (256, 512):
        cached = nt.rows_plan(threads, columns, platform)
        plans += [cached, dataclasses.replace(cached, candidates=8)]
        plans += [nt.rows_plan(threads, columns, platform, cached=False),
                  nt.rows_plan(threads, columns, platform, cached=False, buffer=8)]
    if platform.capability >= (9, 0):
        for size in (2, 4, 8, 16):
            plan = nt.cluster_plan(size, columns, platform)
            plans += [plan, dataclasses.replace(plan, candidates=8)]
    return [p for p in plans if p.shared_bytes <= platform.shared_memory_per_block
            and (not p.cached or p.buffer <= nt.MAX_CACHED_COLUMNS)]

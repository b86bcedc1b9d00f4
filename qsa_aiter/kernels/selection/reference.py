"""The selection ops in torch: the row-by-row oracles of block top-k (``reference_block_topk``) and of the expansion
of groups to tokens (``reference_expand_block_indices``), and the vectorised, graph-safe torch paths that serve where
no kernel does (``torch_block_topk``, ``torch_expand_block_indices``: the ``torch`` candidates of their registries)."""

from __future__ import annotations

import torch

from .problem import TOKEN_INDEX_LIMIT


def _check_int(op: str, name: str, value, minimum: int) -> None:
    """The oracles' integer arguments: an int (not a bool) of at least ``minimum``, else the error naming ``op``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: `{name}` must be an int; got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{op}: `{name}` must be >= {minimum}; got {value}")


def _check_2d(op: str, name: str, t) -> None:
    """An oracle's 2-D tensor argument, else the error naming ``op``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: `{name}` must be a 2-D tensor; got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{op}: `{name}` must be a 2-D tensor; got shape {tuple(t.shape)}")


def reference_block_topk(logits: torch.Tensor, visible: torch.Tensor, block_topk: int) -> torch.Tensor:
    """The oracle of block top-k: int32 ``[tokens, block_topk]``, row by row.

    Row ``t`` ranks its columns ``[0, visible[t])`` by ``(-score, index)`` (ties to the lower group; ``-inf`` scores of
    bad pages rank last but are still groups; a NaN ranks above ``+inf``, whatever its sign, as in ``torch.sort``,
    NaNs among themselves by index), keeps the first ``block_topk`` (all of them when ``visible <=
    block_topk``, without looking at the scores), and lists the kept groups in ascending order, ``-1`` after them.
    Columns at or past ``visible`` are never read; ``visible`` is clamped to ``[0, columns]``.
    """
    _check_int("reference_block_topk", "block_topk", block_topk, 1)
    _check_2d("reference_block_topk", "logits", logits)
    tokens = logits.shape[0]
    out = torch.full((tokens, block_topk), -1, dtype=torch.int32)
    scores, vis = logits.detach().float().cpu(), visible.cpu().long()
    for t in range(tokens):
        n = min(max(int(vis[t]), 0), scores.shape[1])
        if n <= block_topk:
            chosen = list(range(n))
        else:
            row = scores[t, :n].tolist()
            chosen = sorted(sorted(range(n), key=lambda c: (row[c] == row[c], -row[c] if row[c] == row[c] else 0.0,
                                                            c))[:block_topk])
        out[t, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out.to(logits.device)


def reference_expand_block_indices(block_indices: torch.Tensor, query_positions: torch.Tensor,
                                   context_lens: torch.Tensor, token_to_request: torch.Tensor, compress_ratio: int,
                                   token_topk: int) -> torch.Tensor:
    """The oracle of expansion: int32 ``[tokens, token_topk + R - 1]``, row by row.

    For row ``t`` (request ``r``, position ``p``): the tokens ``g*R .. g*R+R-1`` of each selected group ``g >= 0`` in
    the order given, then the causal tail ``((p+1)//R)*R .. p``, keeping only tokens ``< context_lens[r]`` (and below
    ``TOKEN_INDEX_LIMIT``: the indices are int32), and ``-1``
    in every remaining slot. Padded rows (request outside ``[0, requests)``) are all ``-1``.
    """
    op = "reference_expand_block_indices"
    _check_int(op, "compress_ratio", compress_ratio, 1)
    _check_int(op, "token_topk", token_topk, 1)
    _check_2d(op, "block_indices", block_indices)
    tokens, width = block_indices.shape[0], token_topk + compress_ratio - 1
    out = torch.full((tokens, width), -1, dtype=torch.int32)
    groups, pos = block_indices.cpu().long(), query_positions.cpu().long()
    req, ctx = token_to_request.cpu().long(), context_lens.cpu().long()
    for t in range(tokens):
        r = int(req[t])
        if r < 0 or r >= ctx.numel():
            continue
        limit, p = min(int(ctx[r]), TOKEN_INDEX_LIMIT), int(pos[t])
        kept = [g * compress_ratio + j for g in groups[t].tolist() if g >= 0 for j in range(compress_ratio)]
        kept += list(range((p + 1) // compress_ratio * compress_ratio, p + 1))
        kept = [tok for tok in kept if 0 <= tok < limit][:width]
        out[t, : len(kept)] = torch.tensor(kept, dtype=torch.int32)
    return out.to(block_indices.device)


def torch_block_topk(logits: torch.Tensor, visible: torch.Tensor, block_topk: int, out: torch.Tensor) -> None:
    """The torch path of ``qsa_block_topk`` (any device, graph-safe): a stable descending sort of the visible scores
    (ties keep the lower index first; masked columns sort after every visible one, ``-inf`` included, because they
    have higher indices; a NaN of either sign sorts first: NaNs are made positive, which ``torch.sort`` ranks above
    ``+inf`` on every device, where a CUDA sort ranks a negative NaN below ``-inf``), the first ``block_topk``
    columns, then an ascending sort with ``-1`` last."""
    tokens, columns = logits.shape
    if tokens == 0:
        return
    cols = torch.arange(columns, device=logits.device)
    vis = visible.long()[:, None]
    scores = torch.where(logits.isnan(), float("nan"), logits)  # one NaN, positive (a literal NaN is)
    masked = torch.where(cols[None, :] < vis, scores, torch.full_like(logits, float("-inf")))
    take = min(block_topk, columns)
    order = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :take]
    rank = torch.arange(take, device=logits.device)[None, :]
    chosen = torch.where(rank < vis, order, columns)  # rows with fewer visible groups: the rest are empty
    chosen = torch.sort(chosen, dim=1).values
    out[:, :take] = torch.where(chosen < columns, chosen, -1).to(torch.int32)
    out[:, take:] = -1


def torch_expand_block_indices(block_indices, query_positions, context_lens, token_to_request, compress_ratio: int,
                               token_topk: int, out: torch.Tensor) -> None:
    """The torch path of ``qsa_expand_block_indices`` (any device, graph-safe, vectorised over rows)."""
    tokens, groups = block_indices.shape
    if tokens == 0:
        return
    device, ratio = block_indices.device, compress_ratio
    width = token_topk + ratio - 1
    req = token_to_request.long()
    ok = (req >= 0) & (req < context_lens.shape[0])
    limit = torch.where(ok, context_lens.long()[req.clamp(0, max(context_lens.shape[0] - 1, 0))], 0)
    limit = limit.clamp_max(TOKEN_INDEX_LIMIT)
    pos = query_positions.long()
    g = block_indices.long()
    tok = g[:, :, None] * ratio + torch.arange(ratio, device=device)[None, None, :]  # [T, G, R]
    keep = (g[:, :, None] >= 0) & (g[:, :, None] < limit[:, None, None]) & (tok < limit[:, None, None])
    kept = keep.sum(dim=2)
    first = torch.cumsum(kept, dim=1) - kept  # [T, G]
    total = kept.sum(dim=1)
    slots = torch.arange(width, device=device)
    result = torch.full((tokens, width + 1), -1, dtype=torch.long, device=device)  # column `width`: a sink
    target = torch.where(keep, first[:, :, None] + torch.arange(ratio, device=device)[None, None, :], width)
    result.scatter_(1, target.reshape(tokens, -1), torch.where(keep, tok, -1).reshape(tokens, -1))
    tail_start = torch.where(pos >= 0, torch.div(pos + 1, ratio, rounding_mode="floor") * ratio, 0)
    tail_len = (torch.minimum(pos + 1, limit) - tail_start).clamp_min(0)
    rel = slots[None, :] - total[:, None]
    tail = torch.where((rel >= 0) & (rel < tail_len[:, None]), tail_start[:, None] + rel, -1)
    result = torch.where(slots[None, :] < total[:, None], result[:, :width], tail)
    out.copy_(result.to(torch.int32))

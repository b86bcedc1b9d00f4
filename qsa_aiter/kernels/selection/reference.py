"""Row-by-row torch oracles of the selection ops: block top-k (``reference_block_topk``) and the expansion of
groups to tokens (``reference_expand_block_indices``)."""

from __future__ import annotations

import torch

from .problem import TOKEN_INDEX_LIMIT


def reference_block_topk(logits: torch.Tensor, visible: torch.Tensor, block_topk: int) -> torch.Tensor:
    """The oracle of block top-k: int32 ``[tokens, block_topk]``, row by row.

    Row ``t`` ranks its columns ``[0, visible[t])`` by ``(-score, index)`` (ties to the lower group; ``-inf`` scores of
    bad pages rank last but are still groups), keeps the first ``block_topk`` (all of them when ``visible <=
    block_topk``, without looking at the scores), and lists the kept groups in ascending order, ``-1`` after them.
    Columns at or past ``visible`` are never read; ``visible`` is clamped to ``[0, columns]``.
    """
    tokens = logits.shape[0]
    out = torch.full((tokens, block_topk), -1, dtype=torch.int32)
    scores, vis = logits.detach().float().cpu(), visible.cpu().long()
    for t in range(tokens):
        n = min(max(int(vis[t]), 0), scores.shape[1])
        if n <= block_topk:
            chosen = list(range(n))
        else:
            row = scores[t, :n].tolist()
            chosen = sorted(sorted(range(n), key=lambda c: (-row[c], c))[:block_topk])
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

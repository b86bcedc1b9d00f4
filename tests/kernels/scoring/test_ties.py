"""Exact ties break the same way on every path (the reference's rule: README, what the op computes).

A (row, column) score must not depend on which other rows share the call or how the work is chunked, so identical
keys score identically and a tie goes to the lower group: a row of identical keys selects groups ``0 .. k-1``, alone
and inside a verify batch, with every kernel and the torch path.
"""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits
from qsa_aiter.kernels.selection.reference import reference_expand_block_indices
from qsa_aiter.tools.workloads import make_batch

from helpers import KERNELS, force_backend, skip_unless_serves, visible_bits

TOKEN_TOPK, RATIO = 256, 4  # 64 groups of the rows' 150-200
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _one_key_batch(rng, heads: int, device: str):
    """An MTP-verify batch whose cache holds one key in every slot: each row's visible scores are all equal."""
    batch = make_batch([800, 650, 720], 4, heads=heads, head_dim=64, page_size=16, padded_rows=1, generator=rng,
                       device=device)
    key = torch.randn(64, generator=rng).to(torch.bfloat16).to(device)
    batch.compressed_k_cache.copy_(key.expand_as(batch.compressed_k_cache))
    return batch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [4, 8])
@pytest.mark.parametrize("backend", KERNELS + ("torch", "auto"))
def test_identical_keys_select_the_lowest_groups_alone_and_in_a_batch(monkeypatch, rng, heads, backend, device):
    batch = _one_key_batch(rng, heads, device)
    args = batch.args()
    hints = dict(max_query_len=4)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args, **hints)
    for t in range(logits.shape[0]):
        bits = logits[t, : int(visible[t])].view(torch.int32)
        assert (bits == bits[0]).all() if bits.numel() else True, f"row {t}: identical keys score differently"
    together = qsa_aiter.qsa_select_paged_tokens(*args[:6], TOKEN_TOPK, RATIO, **hints)
    block_topk = TOKEN_TOPK // RATIO
    lowest = torch.arange(block_topk, dtype=torch.int32, device=device).expand(visible.shape[0], -1)
    lowest = torch.where(lowest < visible.long()[:, None], lowest, -1)
    expected = reference_expand_block_indices(lowest, batch.query_positions, batch.context_lens,
                                              batch.token_to_request, RATIO, TOKEN_TOPK)
    assert torch.equal(together, expected)
    q, cache, table, t2r, pos, ctx = args[:6]
    for t in (0, 5, 11, 12):  # rows of each request, and the padded row
        alone = qsa_aiter.qsa_select_paged_tokens(q[t : t + 1], cache, table, t2r[t : t + 1], pos[t : t + 1], ctx,
                                                  TOKEN_TOPK, RATIO)
        assert torch.equal(alone[0], together[t]), f"row {t} alone selects other tokens than in the batch"


@pytest.mark.parametrize("heads", [4, 8])
def test_reference_scores_do_not_depend_on_chunking_or_the_batch(rng, heads):
    batch = make_batch([700, 1500, 90, 333], [3, 5, 2, 1], heads=heads, head_dim=96, page_size=16, padded_rows=2,
                       generator=rng)
    args = batch.args()
    whole, vis = reference_paged_mqa_logits(*args)
    chunked, vis_c = reference_paged_mqa_logits(*args, row_chunk=2, col_chunk=7)
    assert torch.equal(vis, vis_c)
    assert torch.equal(visible_bits(whole, vis), visible_bits(chunked, vis))
    q, cache, table, t2r, pos, ctx, ratio = args
    for t in range(q.shape[0]):
        alone, vis_a = reference_paged_mqa_logits(q[t : t + 1], cache, table, t2r[t : t + 1], pos[t : t + 1], ctx,
                                                  ratio)
        n = int(vis[t])
        assert int(vis_a[0]) == n
        assert torch.equal(alone[0, :n].view(torch.int32), whole[t, :n].view(torch.int32)), f"row {t}"

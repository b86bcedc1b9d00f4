"""Metadata at the edges of its dtype, and device-side values no host check can see.

int32 and int64 metadata are honoured over their whole range (the visibility rule): positions, context lengths, request
and page ids past 2**31 are never truncated, and a page id past the cache is a bad page. Values that live on the
device (visible counts, positions, context lengths, request and group ids) cannot be validated on the host, so every
kernel clamps them: each is run far out of range here and compared with the torch path and the oracle.
"""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.selection import topk
from qsa_aiter.kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from qsa_aiter.kernels.selection.reference import reference_block_topk, reference_expand_block_indices
from qsa_aiter.tools.workloads import make_batch

from helpers import KERNELS, check_forced_call

CHOICES = KERNELS + ("torch", "auto")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _edge_batch(rng, index_dtype: torch.dtype, device: str):
    batch = make_batch([700, 1300, 222, 500, 900], [2, 3, 2, 1, 2], page_size=16, head_dim=64, padded_rows=2,
                       generator=rng, device=device)
    q, cache, *idx = batch.args()[:6]
    table, t2r, pos, ctx = [t.to(index_dtype) for t in idx]
    return batch, q, cache, table, t2r, pos, ctx


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", CHOICES)
def test_int64_values_past_2_to_31_are_not_truncated(monkeypatch, rng, backend, device):
    batch, q, cache, table, t2r, pos, ctx = _edge_batch(rng, torch.int64, device)
    pos[0] = 2**32 + 3  # truncated to 32 bits: position 3, one group; honoured: past the context, ctx // R
    ctx[1] = 2**31 + 8  # truncated: negative, sees nothing; honoured: the rows see up to their positions
    pos[4] = 2**33  # request 1's last row: sees the whole table (columns past its pages are bad pages)
    ctx[3] = -(2**40)  # a negative context sees nothing
    t2r[-1] = 2**32  # truncated: request 0; honoured: out of range, a padded row
    table[2, 0] = 2**32 + 1  # truncated: page 1, a good page; honoured: a bad page (-inf)
    table[2, 1] = -(2**32) + 2
    logits, visible = check_forced_call(monkeypatch, backend, (q, cache, table, t2r, pos, ctx), max_query_len=3)
    columns = table.shape[1] * 16
    assert int(visible[0]) == 700 // 4
    assert visible[2:5].tolist() == [(1300 - 3) // 4, (1300 - 2) // 4, columns]
    assert int(visible[7]) == 0 and int(visible[-1]) == 0
    rows_of_2 = torch.nonzero(batch.token_to_request.cpu() == 2).flatten()
    assert torch.isneginf(logits[rows_of_2, :32]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", CHOICES)
def test_int32_values_at_the_top_of_their_range(monkeypatch, rng, backend, device):
    batch, q, cache, table, t2r, pos, ctx = _edge_batch(rng, torch.int32, device)
    top = 2**31 - 1
    pos[0] = top  # (p + 1) // R overflows 32-bit arithmetic: the count must still be ctx // R
    ctx[1] = top  # visible = (p + 1) // R for request 1's rows
    pos[4] = top  # and the whole table for its last row
    t2r[-1] = top
    table[2, 0] = top
    table[2, 1] = -(2**31)
    logits, visible = check_forced_call(monkeypatch, backend, (q, cache, table, t2r, pos, ctx), max_query_len=3)
    assert int(visible[0]) == 700 // 4
    assert int(visible[4]) == table.shape[1] * 16 and int(visible[-1]) == 0
    rows_of_2 = torch.nonzero(batch.token_to_request.cpu() == 2).flatten()
    assert torch.isneginf(logits[rows_of_2, :32]).all()


def _wide_rows(rng, rows: int, columns: int, device: str) -> torch.Tensor:
    """fp32 logits ``[rows, columns]`` inside a larger buffer: a read past a row reads its neighbour, past the last
    row other data, so an out-of-range read shows in the result."""
    buffer = (torch.randn(rows + 1, columns + 37, generator=rng) + 100.0).to(device)
    logits = buffer[:rows, :columns]
    logits.copy_(torch.randn(rows, columns, generator=rng))
    return logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_topk", [8, 40, 300])
def test_block_topk_clamps_visible_counts_outside_the_row(rng, block_topk, device):
    logits = _wide_rows(rng, 6, 250, device)
    visible = torch.tensor([1000, 2**31 - 1, -5, 250, -(2**31), 251], dtype=torch.int32, device=device)
    expected = reference_block_topk(logits, visible, block_topk)
    kernel = qsa_aiter.qsa_block_topk(logits, visible, block_topk)
    torch_path = torch.full_like(kernel, 7)
    torch_block_topk(logits, visible, block_topk, torch_path)
    assert torch.equal(torch_path.cpu(), expected.cpu())
    assert torch.equal(kernel.cpu(), expected.cpu())
    assert int(kernel.max()) < 250


def _expansion_args(index_dtype: torch.dtype):
    wide = index_dtype == torch.int64
    huge_group = 2**40 if wide else 2**31 - 1
    blocks = torch.tensor([[0, 3, huge_group, -1], [-5, 2, 9, 10**6], [1, 2, -1, -1], [0, 1, 2, 3],
                           [4, 5, 6, 7], [0, 2**31 - 1, -(2**31), 8]], dtype=index_dtype)
    pos = torch.tensor([40, 2**32 + 3 if wide else 2**31 - 1, -7, 30, 57, 1000], dtype=index_dtype)
    ctx = torch.tensor([50, 2**31 + 8 if wide else 2**31 - 1, -(2**40) if wide else -(2**31)], dtype=index_dtype)
    t2r = torch.tensor([0, 1, 2, 2**32 if wide else 2**31 - 1, -(2**31), 1], dtype=index_dtype)
    return blocks, pos, ctx, t2r


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_expansion_with_values_far_out_of_range(index_dtype, device):
    blocks, pos, ctx, t2r = (t.to(device) for t in _expansion_args(index_dtype))
    ratio, token_topk = 4, 16
    expected = reference_expand_block_indices(blocks, pos, ctx, t2r, ratio, token_topk)
    kernel = qsa_aiter.qsa_expand_block_indices(blocks, pos, ctx, t2r, ratio, token_topk)
    torch_path = torch.full_like(kernel, 7)
    torch_expand_block_indices(blocks, pos, ctx, t2r, ratio, token_topk, torch_path)
    assert torch.equal(torch_path.cpu(), expected.cpu())
    assert torch.equal(kernel.cpu(), expected.cpu())
    assert (kernel >= -1).all()
    # A context past 2**31 keeps the tokens an int32 can hold, no more (the row of request 1 at 2**32 + 3: no tail).
    if index_dtype == torch.int64:
        assert kernel[1].tolist() == [8, 9, 10, 11, 36, 37, 38, 39, 4000000, 4000001, 4000002, 4000003] + [-1] * 7


@pytest.mark.parametrize("device", DEVICES)
def test_fused_topk_and_expansion_clamp_device_values(rng, device):
    """The selection launch (top-k with the expansion fused) with visible counts and metadata out of range."""
    logits = _wide_rows(rng, 6, 64, device)
    visible = torch.tensor([1000, 64, -3, 2**31 - 1, 5, 0], dtype=torch.int32, device=device)
    _, pos, ctx, t2r = (t.to(device) for t in _expansion_args(torch.int64))
    ratio, token_topk, block_topk = 4, 16, 4
    groups = torch.empty((6, block_topk), dtype=torch.int32, device=device)
    tokens = torch.empty((6, token_topk + ratio - 1), dtype=torch.int32, device=device)
    topk.launch(logits, visible, groups, block_topk, expand_into=(pos, ctx, t2r, tokens, ratio, token_topk))
    expected_groups = reference_block_topk(logits, visible, block_topk)
    assert torch.equal(groups.cpu(), expected_groups.cpu())
    expected_tokens = reference_expand_block_indices(expected_groups, pos, ctx, t2r, ratio, token_topk)
    assert torch.equal(tokens.cpu(), expected_tokens.cpu())

"""``benchmarks/traffic_floor.py``'s traffic-only kernel moves the stacked scorer's bytes: it stores exactly the cells
the scorer stores (``[0, visible)`` of each row, nothing else) and reads every visible key word and scale word once
per request, for each cache format, page size, tile width and phase (verify rows of one request, draft rows of
several). On a GPU where there is one, else under the Triton interpreter."""

import math

import pytest
import torch

from qsa_aiter.kernels.scoring.base import ScoreArgs
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.tools.workloads import make_batch

import benchmark_scripts

traffic_floor = benchmark_scripts.load("traffic_floor")


def _word_sums(batch, page_size: int, columns: int) -> torch.Tensor:
    """Per (row, column): the int32 sum the traffic kernel computes for the key (and scale) words of that column."""
    cache = batch.compressed_k_cache.cpu().view(torch.uint8).reshape(-1, batch.compressed_k_cache[0, 0].numel()
                                                                * batch.compressed_k_cache.element_size())
    words = cache.view(torch.int32).to(torch.int64).sum(dim=1)
    if batch.k_scale is not None:
        words += batch.k_scale.cpu().reshape(-1).view(torch.uint8).view(torch.int32).to(torch.int64)
    words = ((words + 2**31) % 2**32 - 2**31).to(torch.float32)  # int32 wrap-around, then the kernel's cast
    pages = batch.page_table.cpu().to(torch.int64)
    cols = torch.arange(columns)
    slots = pages[:, cols // page_size] * page_size + cols % page_size
    return words[slots.clamp(min=0)]


@pytest.mark.parametrize("cache", ("bf16", "fp8", "fp4"))
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("phase, rows", (("verify", 4), ("draft", 1)))
def test_traffic_kernel_writes_the_scorers_cells(rng, cache, page_size, phase, rows):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = make_batch([300, 517, 9], rows, page_size=page_size, cache=cache, generator=rng, padded_rows=1,
                       device=device)
    problem = describe_call(*batch.args(), **batch.kwargs(), phase=phase, max_query_len=rows)
    for block_n in (64, 128):
        logits = torch.full((batch.q.shape[0], problem.num_columns), float("nan"), device=device)
        visible = torch.full((batch.q.shape[0],), -5, dtype=torch.int32, device=device)
        args = ScoreArgs(batch.q, batch.compressed_k_cache, batch.page_table, batch.token_to_request,
                           batch.query_positions, batch.context_lens, logits, visible, problem.num_columns,
                           batch.compress_ratio, 1.0 / math.sqrt(batch.q.shape[2]), batch.k_scale)
        traffic_floor.launch_traffic(problem, args, traffic_floor.Tile(block_n, 2, 4, int(block_n <= page_size)))
        logits, visible = logits.cpu(), visible.cpu()
        expect_vis = _expected_visible(batch, problem.num_columns)
        assert torch.equal(visible, expect_vis)
        written = ~torch.isnan(logits)
        region = torch.arange(problem.num_columns)[None, :] < expect_vis[:, None]
        assert torch.equal(written, region), f"block_n {block_n}"
        sums = _word_sums(batch, page_size, problem.num_columns)
        req = batch.token_to_request.cpu().to(torch.int64)
        for t in range(batch.q.shape[0]):
            n = int(expect_vis[t])
            if n:
                torch.testing.assert_close(logits[t, :n], sums[req[t], :n], rtol=0, atol=0)


def _expected_visible(batch, num_columns: int) -> torch.Tensor:
    """The visible group count of every row (README.md, "What the op computes")."""
    r = batch.compress_ratio
    req = batch.token_to_request.cpu().to(torch.int64)
    pos = batch.query_positions.cpu().to(torch.int64)
    ctx = batch.context_lens.cpu().to(torch.int64)[req.clamp(min=0)]
    vis = torch.minimum((pos + 1) // r, ctx // r).clamp(min=0, max=num_columns)
    return torch.where(req >= 0, vis, 0).to(torch.int32)

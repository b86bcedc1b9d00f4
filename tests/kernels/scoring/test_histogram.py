"""The scorers' per-row histogram (``kernels/scoring/histogram.py``): each Triton scorer built with
``ScoreProblem.histogram`` counts exactly the scores it stores, bin for bin as the torch reference counts them from
the logits, and stores the same logits as without it. Phases' small batches (padded rows, rows with nothing
visible, uneven contexts, a bad page id) on every cache format and both page sizes, logits poisoned first."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from helpers import phase_batch
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring import SPECS
from qsa_aiter.kernels.scoring.base import ScoreArgs
from qsa_aiter.kernels.scoring.histogram import BIN_SHIFT, score_keys, torch_score_histogram
from qsa_aiter.kernels.selection.native_topk import HISTOGRAM_BINS
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.tools.testing import POISON

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: (scorer, phase, config overrides): every Triton scorer, the tiled one with both tile orders.
CASES = (("rowwise", "decode", {}), ("stacked", "verify", {}), ("keys_major", "verify", {}),
         ("tiled", "prefill", {}), ("tiled", "prefill", {"keys_major": 1}))


def _run(spec, problem, batch, histogram, config):
    tokens = batch.q.shape[0]
    logits = torch.full((tokens, problem.num_columns), POISON, device=batch.q.device)
    visible = torch.full((tokens,), -5, dtype=torch.int32, device=batch.q.device)
    args = ScoreArgs(batch.q, batch.compressed_k_cache, batch.page_table, batch.token_to_request,
                     batch.query_positions, batch.context_lens, logits, visible, problem.num_columns,
                     batch.compress_ratio, 1.0 / math.sqrt(batch.q.shape[2]), batch.k_scale, histogram)
    platform = Platform.of(batch.q.device)
    cfg = replace(spec.default_config(problem, platform), **config) if config else None
    spec.plan(problem, platform, config=cfg).launch(*args.kernel_args())
    return logits, visible


@pytest.mark.parametrize("cache", ("bf16", "fp8", "fp4"))
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("name, phase, config", CASES, ids=[f"{c[0]}{'-km' if c[2] else ''}" for c in CASES])
def test_the_scorer_counts_what_it_stores(rng, cache, page_size, name, phase, config):
    spec = next(s for s in SPECS if s.name == name)
    batch, hints = phase_batch(phase, page_size, rng, cache=cache, device=DEVICE)
    batch.page_table[0, 1] = 10**6  # a bad page id: its columns score -inf, and are counted
    problem = describe_call(*batch.args(), **hints)
    if spec.reasons(problem, Platform.of(batch.q.device)):
        pytest.skip(f"{name} does not serve this problem")
    plain_logits, plain_visible = _run(spec, problem, batch, None, config)
    histogram = torch.zeros((batch.q.shape[0], HISTOGRAM_BINS), dtype=torch.int32, device=batch.q.device)
    logits, visible = _run(spec, replace(problem, histogram=True), batch, histogram, config)
    assert torch.equal(visible, plain_visible)
    n = visible.long().clamp(min=0)
    stored = torch.arange(logits.shape[1], device=logits.device)[None, :] < n[:, None]
    # the same scores stored (bitwise), then the histogram the reference counts from them
    assert torch.equal(torch.where(stored, logits, 0.0), torch.where(stored, plain_logits, 0.0))
    assert torch.isinf(logits[0]).any() or visible[0] == 0
    expected = torch_score_histogram(logits, visible)
    assert torch.equal(histogram.cpu(), expected.cpu())
    assert torch.equal(histogram.sum(dim=1).cpu(), n.cpu().int())


def test_keys_order_scores_and_merge_the_zeros():
    scores = torch.tensor([float("-inf"), -3.5, -1e-38, -0.0, 0.0, 1e-38, 2.0, 2.2, 2.5, float("inf")])
    keys = score_keys(scores)
    assert keys[3] == keys[4] == 0x80000000
    assert torch.all(keys[1:] >= keys[:-1]) and torch.all((keys[1:] > keys[:-1]) | (scores[1:] == scores[:-1]))
    assert int(keys.max()) < 2**32 and int(keys.min()) >= 0
    # a bin is the key's top 11 bits (sign, exponent, two mantissa bits): 2.0 and 2.2 share one, 2.5 is the next;
    # 0.0 is bin 1024
    bins = keys >> BIN_SHIFT
    assert bins[6] == bins[7] and bins[8] == bins[7] + 1 and bins[4] == 1024


def test_the_reference_counts_only_the_visible_columns():
    logits = torch.tensor([[1.0, 1.0, -2.0, 7.0], [0.5, float("nan"), float("nan"), float("nan")]])
    histogram = torch_score_histogram(logits, torch.tensor([3, 1], dtype=torch.int32))
    assert histogram.shape == (2, HISTOGRAM_BINS) and histogram.dtype == torch.int32
    assert histogram[0].sum() == 3 and histogram[1].sum() == 1
    assert histogram[0, int(score_keys(torch.tensor([1.0]))[0]) >> BIN_SHIFT] == 2

"""Selection quality of quantised index caches: top-512 overlap with the bf16 cache on keys with a realistic spread.

Thresholds come from a measurement (seeds 0-9, 16 rows each, 8192 groups, 4 heads, head_dim 128): fp8 e4m3fn kept
97.9% of the bf16 top-512 on average (worst row 94.7%), e4m3fnuz 98.0% (95.5%), MXFP4 82.7% (70.5%). The test runs
seeds 0-2 and fails if a format falls clearly below that: fp8 mean >= 0.96 and every row >= 0.93; MXFP4 mean >= 0.78
and every row >= 0.65.
"""

from __future__ import annotations

import pytest
import torch

from qsa_aiter.tools.quality import score_error, selection_overlap, split_query_terms

CASES = [
    ("fp8", 0.96, 0.93),
    ("fp8_fnuz", 0.96, 0.93),
    ("fp4", 0.78, 0.65),
]


@pytest.mark.parametrize("cache_format,mean_floor,row_floor", CASES, ids=[case[0] for case in CASES])
def test_top512_overlap_with_bf16(cache_format, mean_floor, row_floor):
    overlap = torch.cat([selection_overlap(cache_format, seed=seed) for seed in range(3)])
    print(f"{cache_format}: mean {overlap.mean():.4f}, worst row {overlap.min():.4f}")
    assert overlap.mean() >= mean_floor
    assert overlap.min() >= row_floor


def test_bf16_cache_overlaps_itself_fully():
    assert bool((selection_overlap("bf16", rows=4, groups=2048) == 1.0).all())


@pytest.mark.parametrize("cache_format,mean_floor,row_floor", CASES, ids=[case[0] for case in CASES])
def test_e4m3_mma_numerics_keep_the_selection(cache_format, mean_floor, row_floor):
    """q split into two e4m3 terms (the e4m3 tensor cores' and the AMD f8f6f4 / block-scaled MFMAs' operands) keeps
    the decoded path's selection: the same floors, the overlap within 0.5% of the decoded one's, and scores within
    1e-4 of the fp32 reference (relative to the row's largest score; measured: under 2e-5)."""
    mma = torch.cat([selection_overlap(cache_format, seed=seed, numerics="e4m3_mma") for seed in range(2)])
    decoded = torch.cat([selection_overlap(cache_format, seed=seed) for seed in range(2)])
    assert mma.mean() >= mean_floor and mma.min() >= row_floor
    assert abs(float(mma.mean() - decoded.mean())) <= 0.005
    error = score_error(cache_format, seed=0, rows=8, groups=2048)
    assert 0.0 < error <= 1e-4, error  # not zero: the split does round q's smallest elements


def test_split_query_terms_rebuilds_bf16_rows_and_unknown_numerics_are_refused():
    q = torch.randn(16, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).float()
    rebuilt = split_query_terms(q)
    big = q.abs() >= q.abs().amax(dim=1, keepdim=True) * 2**-9
    assert torch.equal(rebuilt[big], q[big])  # exact for every element of at least 2**-9 of its row's largest
    with pytest.raises(ValueError, match="numerics must be one of decoded, e4m3_mma"):
        selection_overlap("fp8", rows=2, groups=256, numerics="tf32")

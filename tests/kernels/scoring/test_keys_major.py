"""The keys-major decode/verify scorer's own settings: spans of several tiles per program (the contiguous tile loop,
the fp8 scales and MXFP4 exponents loaded one tile ahead and stopped at the span's end), both key-tile widths and
both page-id readings, on every cache format, against the reference with the output poisoned. The kernel also runs
through every generic scorer test (``helpers.KERNELS``)."""

from __future__ import annotations

import math

import pytest
import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring import keys_major
from qsa_aiter.kernels.scoring.base import ScoreArgs
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits
from qsa_aiter.tools.testing import POISON, assert_matches_reference, mma_atol
from qsa_aiter.tools.workloads import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEVICE == "cuda" else 1e-5


def _run(batch, phase: str, rows: int, cfg: keys_major.KeysMajorConfig):
    """Launch the kernel with ``cfg`` into poisoned outputs; returns ``(logits, visible, problem)``."""
    problem = describe_call(*batch.args(), **batch.kwargs(), phase=phase, max_query_len=rows)
    logits = torch.full((batch.q.shape[0], problem.num_columns), POISON, device=batch.q.device)
    visible = torch.full((batch.q.shape[0],), -5, dtype=torch.int32, device=batch.q.device)
    args = ScoreArgs(batch.q, batch.compressed_k_cache, batch.page_table, batch.token_to_request,
                     batch.query_positions, batch.context_lens, logits, visible, problem.num_columns,
                     batch.compress_ratio, 1.0 / math.sqrt(batch.q.shape[2]), batch.k_scale)
    keys_major.SPEC.plan(problem, Platform.of(batch.q.device), config=cfg).launch(*args.kernel_args())
    return logits, visible, problem


@pytest.mark.parametrize("cache", ("bf16", "fp8", "fp8_fnuz", "fp4"))
@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("phase, rows", (("verify", 4), ("draft", 1)))
@pytest.mark.parametrize("tiles", (2, pytest.param(3, marks=pytest.mark.slow)))
def test_spans_of_several_tiles(monkeypatch, rng, cache, page_size, phase, rows, tiles):
    """Uneven requests (one shorter than a span, one ending inside a tile), a padded row and a bad page id: the
    span's tiles past a request's end are not visited and ``[0, visible)`` equals the reference."""
    batch = make_batch([900, 517, 37, 2200], rows, page_size=page_size, cache=cache, generator=rng, padded_rows=1,
                       device=DEVICE, head_dim=64)
    batch.page_table[1, 1] = 10**6  # past the cache: that page scores -inf
    for block_n, scalar_pages in ((16, 0), (32, 1)):
        cfg = keys_major.KeysMajorConfig(block_rows=max(rows, 4), block_n=block_n, scalar_pages=scalar_pages,
                                         tiles_per_program=tiles)
        for mma in ("1", "0"):
            monkeypatch.setenv("QSA_AITER_E4M3_MMA", mma)
            logits, visible, problem = _run(batch, phase, rows, cfg)
            ref_logits, ref_visible = reference_paged_mqa_logits(*batch.args(), k_scale=batch.k_scale)
            atol = mma_atol(batch.args(), TOL, **batch.kwargs(), phase=phase, max_query_len=rows)
            assert_matches_reference(logits.cpu(), visible.cpu(), ref_logits.cpu(), ref_visible.cpu(), rtol=TOL,
                                     atol=atol if isinstance(atol, float) else atol.cpu(),
                                     label=f"{cache}/page{page_size}/{phase}/tiles{tiles}/n{block_n}/mma{mma}")
            if cache == "bf16":
                break  # the MMA switch only concerns quantised caches


def test_tiles_per_program_follows_the_grid_size():
    """Derived spans: one tile below 16K programs, then 2, 4 and 8 as the grid grows; the grid covers every tile."""
    assert [keys_major.tiles_per_program(1, t) for t in (16383, 16384, 32767, 32768, 131071, 131072)] == [
        1, 2, 2, 4, 4, 8]
    from qsa_aiter.kernels.scoring.base import example_problem

    problem = example_problem(num_tokens=36, num_requests=9, num_columns=32768, max_query_len=4)
    platform = Platform.named("sm_90")
    plan = keys_major.SPEC.plan(problem, platform)
    tiles = plan.constexprs["TILES"]
    assert plan.grid == (9, math.ceil(32768 // plan.config.block_n / tiles))
    assert tiles == keys_major.tiles_per_program(9, 32768 // plan.config.block_n)

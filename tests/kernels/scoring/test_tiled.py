"""The tiled prefill scorer's keys-major tiles (``TiledConfig.keys_major``): key tiles as the MMA's M operand, each
head's q as N (or, with ``stack_heads``, every head's rows stacked as one N operand), scores stored transposed,
e4m3fn keys fed to e4m3 MMAs. Row tiles spanning requests, a padded row, a bad page id and uneven contexts, on every
cache format and both page sizes, with the output poisoned first; the default (q-major) tiles run through every
generic scorer test (``helpers.KERNELS``)."""

from __future__ import annotations

import math

import pytest
import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring import tiled
from qsa_aiter.kernels.scoring.base import ScoreArgs
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits
from qsa_aiter.tools.testing import POISON, assert_matches_reference, e4m3_mma_atol
from qsa_aiter.tools.workloads import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEVICE == "cuda" else 1e-5


@pytest.mark.parametrize("cache", ("bf16", "fp8", "fp8_fnuz", "fp4"))
@pytest.mark.parametrize("page_size", (16, pytest.param(64, marks=pytest.mark.slow)))
@pytest.mark.parametrize("heads,stack_heads", ((4, 0), (4, 1), (2, 1)), ids=("per-head", "stacked", "2-heads"))
def test_keys_major_tiles(monkeypatch, rng, cache, page_size, heads, stack_heads):
    rows = 20  # row tiles of 32 (16) rows hold two or three requests
    batch = make_batch([700, 261, 37, 1500], rows, page_size=page_size, cache=cache, generator=rng, padded_rows=1,
                       device=DEVICE, head_dim=64, heads=heads)
    batch.page_table[3, 2] = 10**6  # past the cache: that page scores -inf
    cfg = tiled.TiledConfig(block_m=32 if heads == 4 else 16, block_n=32, keys_major=1, stack_heads=stack_heads,
                            scalar_pages=int(page_size >= 64))
    for mma in ("1", "0"):
        monkeypatch.setenv("QSA_AITER_E4M3_MMA", mma)
        problem = describe_call(*batch.args(), **batch.kwargs(), phase="prefill", max_query_len=rows)
        logits = torch.full((batch.q.shape[0], problem.num_columns), POISON, device=batch.q.device)
        visible = torch.full((batch.q.shape[0],), -5, dtype=torch.int32, device=batch.q.device)
        args = ScoreArgs(batch.q, batch.compressed_k_cache, batch.page_table, batch.token_to_request,
                         batch.query_positions, batch.context_lens, logits, visible, problem.num_columns,
                         batch.compress_ratio, 1.0 / math.sqrt(batch.q.shape[2]), batch.k_scale)
        plan = tiled.SPEC.plan(problem, Platform.of(batch.q.device), config=cfg)
        assert plan.constexprs["KEYS_MAJOR"] and plan.constexprs["PER_HEAD"] == (not stack_heads)
        # e4m3 keys go to the MMA in a flavour the platform multiplies (the interpreter emulates both).
        flavour = {"fp8": "e4m3fn", "fp8_fnuz": "e4m3fnuz"}.get(cache)
        platform = Platform.of(batch.q.device)
        assert plan.constexprs["E4M3_MMA"] == (flavour in platform.e4m3_mma and mma == "1")
        plan.launch(*args.kernel_args())
        ref_logits, ref_visible = reference_paged_mqa_logits(*batch.args(), k_scale=batch.k_scale)
        # The registry's choice (q-major tiles) decodes: the allowance for e4m3 MMAs is this plan's own.
        atol = e4m3_mma_atol(batch.args(), TOL, **batch.kwargs()) if (
            plan.constexprs["E4M3_MMA"] and DEVICE == "cuda") else TOL
        assert_matches_reference(logits.cpu(), visible.cpu(), ref_logits.cpu(), ref_visible.cpu(), rtol=TOL,
                                 atol=atol if isinstance(atol, float) else atol.cpu(),
                                 label=f"{cache}/page{page_size}/mma{mma}")
        if flavour not in platform.e4m3_mma:
            break  # the MMA switch changes only the e4m3 paths here

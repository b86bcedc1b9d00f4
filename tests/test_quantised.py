"""The scoring kernels on fp8 (e4m3fn, e4m3fnuz) and MXFP4 index caches, against the reference run on the same cache.

The reference dequantises the keys it gathers exactly (``qsa_aiter.cache_formats``), so kernel and reference differ
only in summation order: rtol = atol = 1e-5 under the interpreter (fp32 throughout), 1e-4 on a GPU (16-bit operands
on tensor cores, fp32 accumulation; every fp8 value and dequantised fp4 key is exact in bf16). Besides caches written
from realistic keys, one test fills caches with random bytes, so every fp8 code (subnormals included) and every e2m1
code under exponents from 0 (2**-127) to 200 is decoded; there the tolerance is relative to the sum of the
magnitudes of the products, since random codes make large terms cancel.
"""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.cache_formats import dequantize_cache
from qsa_aiter.reference import reference_paged_mqa_logits

from helpers import (
    BACKENDS, KERNELS, PREFERRED, check_call, check_forced, force_backend, phase_batch, run_poisoned,
    skip_unless_serves,
)

QUANTISED = ("fp8", "fp8_fnuz", "fp4")
PAGES = (16, 64)
PHASES = ("prefill", "verify", "draft", "decode")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = 1e-4 if ON_GPU else 1e-5


def quantised_batch(phase: str, cache: str, page_size: int, gen, **kwargs):
    """``phase_batch`` with a ``cache`` index cache, on the GPU when there is one."""
    return phase_batch(phase, page_size, gen, cache=cache, device=DEVICE, **kwargs)


def fill_random_codes(batch, cache: str, gen) -> None:
    """Overwrite the cache with random bytes (every code but NaN) and the scales with random positive values."""
    raw = batch.compressed_k_cache.view(torch.uint8)
    codes = torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.int32)
    if cache == "fp8":
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)  # 0x7F / 0xFF are NaN in e4m3fn
    elif cache == "fp8_fnuz":
        codes = torch.where(codes == 0x80, 0, codes)  # 0x80 is NaN in e4m3fnuz
    raw.copy_(codes.to(torch.uint8))
    if cache == "fp4":
        # Exponents around 2**0, with 0 (the subnormal 2**-127), 1 and 200 among them.
        exps = torch.randint(110, 140, batch.k_scale.shape, generator=gen)
        exps.view(-1)[::7] = 0
        exps.view(-1)[3::11] = 1
        exps.view(-1)[5::13] = 200
        batch.k_scale.view(torch.uint8).copy_(exps.to(torch.uint8))
    else:
        batch.k_scale.copy_(torch.rand(batch.k_scale.shape, generator=gen) * 0.01 + 1e-4)


def magnitude_bound(batch, **hints):
    """Per logit, ``sum_h sum_d |q| |k| / divisor``: the scale of the rounding error of any summation order."""
    keys = dequantize_cache(batch.compressed_k_cache, batch.k_scale).abs()
    args = (batch.q.float().abs(), keys) + batch.args()[2:]
    return reference_paged_mqa_logits(*args, max_columns=hints.get("max_columns"),
                                      score_divisor=hints.get("score_divisor"))[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("cache", QUANTISED)
def test_quantised_kernel_matrix(monkeypatch, rng, cache, page_size, phase, backend):
    batch, hints = quantised_batch(phase, cache, page_size, rng)
    check_forced(monkeypatch, backend, batch, hints, label=f"{backend}/{phase}/{cache}/page{page_size}", tol=TOL)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("phase", ("prefill", "verify", "decode"))
@pytest.mark.parametrize("cache", ("fp8", "fp4"))
def test_fp16_queries(monkeypatch, rng, cache, phase, backend):
    batch, hints = quantised_batch(phase, cache, 16, rng, dtype=torch.float16)
    check_forced(monkeypatch, backend, batch, hints, label=f"fp16/{backend}/{phase}/{cache}", tol=TOL)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("phase", ("prefill", "verify", "decode"))
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("cache", QUANTISED)
def test_every_code_decodes_exactly(monkeypatch, rng, cache, page_size, phase, backend):
    """Random bytes in the cache: every code, subnormal fp8 values and extreme fp4 exponents included."""
    batch, hints = quantised_batch(phase, cache, page_size, rng, head_dim=128)
    fill_random_codes(batch, cache, rng)
    args = batch.args()
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    logits, visible = run_poisoned(args, **hints)
    ref_logits, ref_visible = reference_paged_mqa_logits(*args, k_scale=batch.k_scale)
    bound = magnitude_bound(batch)
    # Scores within 1e-5 of the magnitude sum (fp32 summation in another order), compared on [0, visible).
    mask = torch.arange(logits.shape[1], device=logits.device)[None, :] < visible.long()[:, None]
    assert torch.equal(visible, ref_visible.to(visible.device))
    got, exp, lim = logits[mask], ref_logits[mask], bound[mask]
    finite = torch.isfinite(exp)
    assert torch.equal(torch.isneginf(got), torch.isneginf(exp))
    err = (got[finite] - exp[finite]).abs()
    assert bool((err <= 1e-5 * lim[finite] + 1e-30).all()), (
        f"{backend}/{phase}/{cache}: max error {err.max().item():.3g} over bound "
        f"{(err / lim[finite].clamp_min(1e-30)).max().item():.3g} (x magnitude sum)")


@pytest.mark.parametrize("cache", QUANTISED)
def test_auto_choice_per_phase_and_explain(rng, cache):
    for phase in PHASES:
        batch, hints = quantised_batch(phase, cache, 64, rng)
        text = qsa_aiter.explain(*batch.args(), **hints)
        kv = "fp4" if cache == "fp4" else "fp8"
        assert f"kv={kv}(" in text and f"registry row ('{kv}', 64, '{phase}')" in text, text
        assert qsa_aiter.selected_kernel(*batch.args(), **hints) == PREFERRED[phase], text


def test_bad_page_ids_and_padded_rows_on_a_quantised_cache(monkeypatch, rng):
    for cache in ("fp8", "fp4"):
        batch, hints = quantised_batch("verify", cache, 16, rng)
        batch.page_table[0, 1] = batch.compressed_k_cache.shape[0] + 5  # out of range: -inf columns
        batch.page_table[1, 0] = -7
        for backend in KERNELS:
            force_backend(monkeypatch, backend)
            logits, visible = check_call(batch.args(), rtol=TOL, atol=TOL, label=f"{cache}/{backend}", **hints)
            assert bool(torch.isneginf(logits[0, 16:32]).all())

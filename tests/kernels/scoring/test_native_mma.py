"""The AMD Instinct GPUs' own low-precision matrix paths, run where they can be: on the CPU through the interpreter
and on the H200, with a platform that has them.

- Block-scaled MXFP4 (``SCALED_MMA``, gfx950's ``v_mfma_scale_f32_*_f8f6f4`` through ``tl.dot_scaled``): the packed
  nibbles and e8m0 exponents as stored against q's two e4m3 terms. Triton 3.9's interpreter runs ``tl.dot_scaled``
  (3.6's does not: skipped there); on the H200 ``tl.dot_scaled`` upcasts to bf16 MMAs. Either way the kernel's code
  around the instruction (operand layout, scale bytes, q's terms, the scores) is the one gfx950 runs.
- e4m3fnuz keys as stored (gfx942's ``v_mfma_f32_*_fp8_fp8``): the interpreter's platform takes both e4m3 flavours,
  so every fnuz test of the suite runs the MMA path; here its plans are checked.

Which instructions the AMD builds use is read from their assembly in ``tests/tools/test_isa.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels import platform as platform_module
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring import keys_major, stacked, tiled
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.runtime import dispatch, replay
from qsa_aiter.runtime.jit.triton_compat import interpreter_has_dot_scaled

from helpers import E4M3_MMA_TOL, check_forced, force_backend, magnitude_bound, phase_batch, run_poisoned
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = 1e-4 if ON_GPU else 1e-5
SPECS = {"stacked": stacked.SPEC, "keys_major": keys_major.SPEC, "tiled": tiled.SPEC}


@pytest.fixture
def block_scaled(monkeypatch):
    """The platform of the device the tests run on, with block-scaled MXFP4 MMAs (as gfx950 has them)."""
    if not ON_GPU and not interpreter_has_dot_scaled():
        pytest.skip("this Triton's interpreter has no tl.dot_scaled (Triton 3.9's has; CI runs this file on it)")
    live = platform_module._live

    def with_block_scaled(device_type, index, interpreter):
        return dataclasses.replace(live(device_type, index, interpreter), block_scaled_mma=True)

    monkeypatch.setattr(platform_module, "_live", with_block_scaled)
    replay.clear()
    dispatch.clear_decisions()
    yield
    replay.clear()
    dispatch.clear_decisions()


def plan_of(kernel: str, batch, hints: dict):
    """``kernel``'s launch plan for ``batch`` on the current platform."""
    problem = describe_call(*batch.args(), **hints)
    return SPECS[kernel].plan(problem, Platform.of(batch.q.device))


def fill_random_fp4(batch, gen) -> None:
    """Every nibble code (-0 included) under exponents from 2**-127 (e = 0) to 2**73."""
    raw = batch.compressed_k_cache.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.int32).to(torch.uint8))
    exps = torch.randint(110, 140, batch.k_scale.shape, generator=gen)
    flat = exps.view(-1)
    flat[::97] = 0
    flat[1::89] = 1
    flat[2::83] = 200
    batch.k_scale.view(torch.uint8).copy_(exps.to(torch.uint8))


@pytest.mark.parametrize("page_size", (16, 64))
@pytest.mark.parametrize("kernel,phase", [("stacked", "verify"), ("stacked", "draft"), ("keys_major", "verify"),
                                          ("keys_major", "decode"), ("tiled", "prefill")])
@pytest.mark.parametrize("codes", ("written", "random"))
def test_block_scaled_mxfp4_matches_the_reference(monkeypatch, rng, block_scaled, kernel, phase, page_size, codes):
    """Each MFMA scorer on an MXFP4 cache through block-scaled dots (its plan says ``SCALED_MMA``) equals the
    reference on ``[0, visible)``: caches written from keys, and random bytes with extreme exponents."""
    check_block_scaled(monkeypatch, rng, kernel, phase, page_size, codes)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,phase", [("stacked", "verify"), ("keys_major", "decode"), ("tiled", "prefill")])
@pytest.mark.parametrize("codes", ("written", "random"))
def test_block_scaled_mxfp4_on_the_gpu(monkeypatch, rng, block_scaled, kernel, phase, codes):
    """The block-scaled path compiled for this GPU (on the H200 ``tl.dot_scaled`` upcasts to bf16 MMAs) equals the
    reference, page 64."""
    if not ON_GPU:
        pytest.skip("needs a CUDA GPU")
    check_block_scaled(monkeypatch, rng, kernel, phase, 64, codes)


def check_block_scaled(monkeypatch, rng, kernel: str, phase: str, page_size: int, codes: str) -> None:
    """``kernel`` on an MXFP4 cache of ``codes`` (written from keys, or random bytes) through block-scaled dots,
    against the reference."""
    batch, hints = phase_batch(phase, page_size, rng, cache="fp4", device=DEVICE, head_dim=128)
    if codes == "random":
        fill_random_fp4(batch, rng)
    plan = plan_of(kernel, batch, hints)
    assert plan.constexprs["SCALED_MMA"] and plan.constexprs["E4M3_MMA"], plan
    text = qsa_aiter.explain(*batch.args(), **hints)
    if qsa_aiter.selected_kernel(*batch.args(), **hints) in SPECS:
        assert "e8m0 exponents as the operand and scales of block-scaled MMAs" in text, text
    if codes == "written":
        check_forced(monkeypatch, kernel, batch, hints, label=f"{kernel}/{phase}/fp4 block-scaled/page{page_size}",
                     tol=TOL)
    else:
        check_within_magnitude(monkeypatch, kernel, batch, hints)


def check_within_magnitude(monkeypatch, kernel: str, batch, hints: dict) -> None:
    """``kernel``'s scores on ``[0, visible)`` within 1e-5 of the magnitude sum of their products (random codes make
    large terms cancel, so the error scale is that sum), plus ``E4M3_MMA_TOL`` of it on a GPU; ``-inf`` alike."""
    force_backend(monkeypatch, kernel)
    args = batch.args()
    logits, visible = run_poisoned(args, **hints)
    ref_logits, ref_visible = reference_paged_mqa_logits(*args, k_scale=batch.k_scale)
    bound = magnitude_bound(args, k_scale=batch.k_scale)
    rel = 1e-5 + (E4M3_MMA_TOL if ON_GPU else 0.0)
    assert torch.equal(visible, ref_visible.to(visible.device))
    mask = torch.arange(logits.shape[1], device=logits.device)[None, :] < visible.long()[:, None]
    got, exp, lim = logits[mask], ref_logits.to(logits.device)[mask], bound.to(logits.device)[mask]
    assert torch.equal(torch.isneginf(got), torch.isneginf(exp))
    finite = torch.isfinite(exp)
    err = (got[finite] - exp[finite]).abs()
    assert bool((err <= rel * lim[finite] + 1e-30).all()), (
        f"{kernel}: error over the bound by {(err / lim[finite].clamp_min(1e-30)).max().item():.3g} x magnitude sum")


def test_block_scaled_mxfp4_head_dims(monkeypatch, rng, block_scaled):
    """One and eight exponent bytes per key (``SCALE_WORDS`` as a byte and as a 64-bit word), and the scales as bytes
    when the scale tensor is not aligned to a word."""
    for head_dim in (32, 256):
        batch, hints = phase_batch("verify", 16, rng, cache="fp4", device=DEVICE, head_dim=head_dim)
        assert plan_of("stacked", batch, hints).constexprs["SCALE_WORDS"]
        check_forced(monkeypatch, "stacked", batch, hints, label=f"stacked/fp4 block-scaled/head_dim {head_dim}",
                     tol=TOL)
    batch, hints = phase_batch("verify", 16, rng, cache="fp4", device=DEVICE, head_dim=128)
    shifted = torch.empty(batch.k_scale.numel() + 1, dtype=batch.k_scale.dtype, device=DEVICE)[1:]
    shifted.copy_(batch.k_scale.view(-1))
    batch.k_scale = shifted.view(batch.k_scale.shape)
    hints = dict(hints, k_scale=batch.k_scale)
    assert not plan_of("keys_major", batch, hints).constexprs["SCALE_WORDS"]
    check_forced(monkeypatch, "keys_major", batch, hints, label="keys_major/fp4 block-scaled/unaligned scales",
                 tol=TOL)


@pytest.mark.parametrize("kernel,phase", [("stacked", "verify"), ("keys_major", "decode")])
def test_e4m3fnuz_keys_go_to_the_mma_as_stored(rng, kernel, phase):
    """An e4m3fnuz cache takes the e4m3 MMA path wherever the platform multiplies e4m3fnuz (gfx942, and the
    interpreter, which emulates both flavours), with the fnuz operand dtype on the GPU that has it; the suite's
    fnuz tests (``test_quantised.py``) check its scores."""
    batch, hints = phase_batch(phase, 64, rng, cache="fp8_fnuz", device="cpu", head_dim=128)
    problem = describe_call(*batch.args(), **hints)
    # The interpreter's operands are fp32 (its exact emulation); gfx942's are e4m3fnuz.
    for platform, dtype in ((Platform.of(torch.device("cpu")), "fp32"), (Platform.named("gfx942"), "fp8e4b8")):
        constexprs = SPECS[kernel].plan(problem, platform).constexprs
        assert constexprs["E4M3_MMA"] and not constexprs["SCALED_MMA"]
        assert constexprs["DOT_DTYPE"].name == dtype

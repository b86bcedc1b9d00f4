"""Shared checks of the kernel tests: poison the output, run the op, compare ``[0, visible)`` with the reference."""

from __future__ import annotations

import math

import pytest
import torch

import qsa_aiter
from qsa_aiter import registry
from qsa_aiter.cache_formats import dequantize_cache
from qsa_aiter.kernels.dequant import fp8_dot, fp8_tensor_cores
from qsa_aiter.ops import describe_call
from qsa_aiter.reference import reference_paged_mqa_logits
from qsa_aiter.settings import get_settings
from qsa_aiter.workloads import make_batch

#: Triton kernels of the registry, by candidate name.
KERNELS = ("tiled", "stacked", "rowwise")
#: What a test may force through ``QSA_AITER_BACKEND``: every candidate, plus ``auto`` (the registry decides).
BACKENDS = KERNELS + ("torch", "auto")
#: The kernel the registry prefers for each phase when every candidate can serve (SPEC section 4).
PREFERRED = {"prefill": "tiled", "verify": "stacked", "draft": "stacked", "decode": "rowwise"}

POISON = float("nan")

#: e4m3 tensor cores (``QSA_AITER_FP8_MMA``: the stacked scorer on an e4m3fn or MXFP4 cache with bf16 queries, on a
#: GPU) round inside their sums. Their error is measured against ``magnitude_bound`` (the size of the terms summed):
#: on the H200 it reached 3.2e-4 of it for e4m3fn caches (six batches, written and random-code caches), which sum
#: 8 MMA K-steps (two q terms x 128 elements) in one accumulator; the tests allow FP8_MMA_TOL of it on top of the
#: usual tolerance. MXFP4 sums only 2 K-steps (two q terms x one 32-element block) per accumulator and adds the
#: blocks in fp32, so its rounding is a part of that and the same allowance holds for it
#: (``benchmarks/fp8_mma_error.py --kv fp4`` measures it).
FP8_MMA_TOL = 1e-3


def write_new_lengths(gen, context_lens, query_positions, low: int, high: int, rows_per_request: int) -> None:
    """A new decode/verify step in place (for graph replays): each request's length drawn from ``[low, high]`` and
    its rows placed at the last ``rows_per_request`` positions (the first row last); padded rows after them keep
    theirs."""
    n = context_lens.shape[0]
    lens = torch.randint(low, high + 1, (n,), generator=gen)
    context_lens.copy_(lens.to(context_lens.dtype))
    positions = lens.repeat_interleave(rows_per_request) - torch.arange(rows_per_request).repeat(n) - 1
    query_positions[: n * rows_per_request].copy_(positions.to(query_positions.dtype))


def force_backend(monkeypatch, name: str) -> None:
    """Force ``name`` for every phase (``auto`` leaves the choice to the registry)."""
    if name == "auto":
        monkeypatch.delenv("QSA_AITER_BACKEND", raising=False)
    else:
        monkeypatch.setenv("QSA_AITER_BACKEND", name)


def skip_unless_serves(name: str, args: tuple, **kwargs):
    """Skip the test when candidate ``name`` does not serve this call (the check the registry itself makes).

    Returns the validated ``ScoreProblem``.
    """
    problem = describe_call(*args, **kwargs)
    if name != "auto":
        reasons = registry.CANDIDATES[name].reasons(problem)
        if reasons:
            pytest.skip(f"{name} does not serve {problem.summary()}: " + "; ".join(reasons))
    return problem


def num_columns_of(args: tuple, max_columns: int | None = None) -> int:
    page_table, cache = args[2], args[1]
    return page_table.shape[1] * cache.shape[1] if max_columns is None else max_columns


def poisoned_out(args: tuple, max_columns: int | None = None) -> torch.Tensor:
    q = args[0]
    return torch.full((q.shape[0], num_columns_of(args, max_columns)), POISON, dtype=torch.float32, device=q.device)


def run_poisoned(args: tuple, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the op into a NaN-poisoned ``out`` and check it was written in place and returned."""
    out = poisoned_out(args, kwargs.get("max_columns"))
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args, out=out, **kwargs)
    assert logits is out, "the op must return the `out` tensor it was given"
    assert visible.dtype == torch.int32 and tuple(visible.shape) == (args[0].shape[0],)
    return logits, visible


def reference_of(args: tuple, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference for the same call (fp32 accumulation, same device)."""
    extra = {k: kwargs[k] for k in ("score_divisor", "max_columns", "k_scale") if k in kwargs}
    return reference_paged_mqa_logits(*args, **extra)


def uses_fp8_mma(args: tuple, **kwargs) -> bool:
    """Whether the call would score with e4m3 tensor cores on a GPU (not the interpreter's exact emulation): the
    stacked scorer on an e4m3fn or MXFP4 cache with bf16 queries (``fp8_dot``), ``QSA_AITER_FP8_MMA=1``."""
    q, cache = args[0], args[1]
    if not (q.is_cuda and get_settings().fp8_mma and fp8_dot(q.dtype, cache.dtype, fp8_tensor_cores(q.device))):
        return False
    return registry.select(describe_call(*args, **kwargs)).chosen == "stacked"


def magnitude_args(args: tuple, k_scale=None) -> tuple:
    """The call's arguments with ``|q|`` and the absolute dequantised keys (fp32): the reference of them is the
    magnitude bound."""
    return (args[0].float().abs(), dequantize_cache(args[1], k_scale).abs()) + tuple(args[2:])


def magnitude_bound(args: tuple, **kwargs) -> torch.Tensor:
    """Per logit, ``sum_h sum_d |q| |k| / divisor`` (the reference on absolute values): the scale of the rounding
    error of any summation order."""
    extra = {k: kwargs[k] for k in ("score_divisor", "max_columns") if k in kwargs}
    return reference_paged_mqa_logits(*magnitude_args(args, kwargs.get("k_scale")), **extra)[0]


def mma_atol(args: tuple, atol: float, **kwargs):
    """``atol``, plus ``FP8_MMA_TOL`` of the magnitude bound where the call scores with e4m3 tensor cores."""
    if not uses_fp8_mma(args, **kwargs):
        return atol
    return atol + FP8_MMA_TOL * magnitude_bound(args, **kwargs)


def visible_mask(visible: torch.Tensor, num_columns: int) -> torch.Tensor:
    cols = torch.arange(num_columns, device=visible.device)
    return cols[None, :] < visible.long()[:, None]


def _fmt_rows(rows: torch.Tensor, limit: int = 8) -> str:
    shown = rows[:limit].tolist()
    return str(shown) + (f" ... ({rows.numel()} rows)" if rows.numel() > limit else "")


def assert_matches_reference(logits, visible, ref_logits, ref_visible, *, rtol=1e-5, atol=1e-5, rows=None,
                             label: str = "") -> None:
    """``visible`` equals the reference exactly; ``logits`` match it on ``[0, visible)`` (``-inf`` exactly).

    ``rows`` (optional index tensor) restricts the comparison to those rows; ``ref_*`` are then the reference of
    those rows only. ``atol`` may be a tensor shaped like ``ref_logits`` (a per-logit bound, ``mma_atol``).
    Columns at or past ``visible`` are not compared: kernels need not write them.
    """
    prefix = f"{label}: " if label else ""
    if rows is not None:
        logits, visible = logits[rows], visible[rows]
    visible = visible.to(ref_visible.device)
    if not torch.equal(visible, ref_visible.to(visible.dtype)):
        bad = torch.nonzero(visible != ref_visible.to(visible.dtype)).flatten()
        raise AssertionError(
            f"{prefix}visible differs on {bad.numel()} of {visible.numel()} rows {_fmt_rows(bad)}: "
            f"got {visible[bad[:8]].tolist()}, expected {ref_visible[bad[:8]].tolist()}"
        )
    assert tuple(logits.shape) == tuple(ref_logits.shape), f"{prefix}shape {tuple(logits.shape)} != reference"
    mask = visible_mask(visible, logits.shape[1])
    got, exp = logits.float()[mask], ref_logits.to(logits.device)[mask]
    exp_ninf = torch.isneginf(exp)
    got_ninf = torch.isneginf(got)
    finite = ~exp_ninf
    close = torch.zeros_like(exp_ninf)
    close[exp_ninf] = got_ninf[exp_ninf]
    if torch.is_tensor(atol):
        atol = atol.to(exp.device)[mask][finite]
    g, e = got[finite], exp[finite]
    close[finite] = torch.isfinite(g) & ((g - e).abs() <= atol + rtol * e.abs())
    if bool(close.all()):
        return
    where = torch.nonzero(mask)  # [n, 2] row/col of every compared entry, in the order of got/exp
    bad = torch.nonzero(~close).flatten()
    diff = (g - e).abs()
    diff = diff[torch.isfinite(diff)]
    lines = [
        f"{prefix}{bad.numel()} of {exp.numel()} visible logits differ from the reference "
        f"(rtol={rtol}, atol={'a per-logit bound' if torch.is_tensor(atol) else atol}; max |err| over finite entries "
        f"{(diff.max().item() if diff.numel() else math.nan):.3g})"
    ]
    for i in bad[:10].tolist():
        r, c = where[i].tolist()
        lines.append(f"  row {r} col {c} (visible {int(visible[r])}): got {got[i].item()!r}, "
                     f"expected {exp[i].item()!r}")
    raise AssertionError("\n".join(lines))


def check_call(args: tuple, *, rtol=1e-5, atol=1e-5, label: str = "", **kwargs):
    """Poison, run, and compare with the reference. Returns ``(logits, visible)``."""
    logits, visible = run_poisoned(args, **kwargs)
    ref_logits, ref_visible = reference_of(args, **kwargs)
    atol = mma_atol(args, atol, **kwargs)
    assert_matches_reference(logits, visible, ref_logits, ref_visible, rtol=rtol, atol=atol, label=label)
    return logits, visible


def visible_bits(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The bit patterns of the ``[0, visible)`` logits, for bitwise comparisons."""
    return logits[visible_mask(visible, logits.shape[1])].view(torch.int32)


def phase_batch(phase: str, page_size: int, gen, *, dtype=torch.bfloat16, cache: str = "16bit", heads=4, head_dim=64,
                device="cpu"):
    """A small batch of the kind each phase sees, and the host hints the engine would pass (``k_scale`` included)."""
    common = dict(heads=heads, head_dim=head_dim, page_size=page_size, dtype=dtype, cache=cache, device=device,
                  generator=gen)
    if phase == "prefill":
        # A chunk of four short requests in one row tile; the last starts at position 0 (rows with visible 0).
        batch = make_batch([300, 522, 801, 9], [3, 4, 3, 9], **common)
        return batch, dict(phase="prefill", **batch.kwargs())
    if phase == "verify":
        # MTP verify, uneven rows per request (row blocks straddle requests) and CUDA-graph padding.
        batch = make_batch([700, 1201, 403], [4, 3, 4], padded_rows=2, **common)
        return batch, dict(phase="verify", max_query_len=batch.max_query_len, **batch.kwargs())
    # draft / decode: one row per request, padded rows at the end.
    batch = make_batch([900, 301, 1700, 650, 1203], 1, padded_rows=3, **common)
    return batch, dict(phase=phase, max_query_len=1, **batch.kwargs())


def check_forced(monkeypatch, backend: str, batch, hints: dict, *, label: str, tol: float = 1e-5,
                 auto_is_preferred: bool = True):
    """Force ``backend`` (skip where it does not serve), check the registry picks it (or, for ``auto``, the phase's
    preferred kernel when ``auto_is_preferred``), and compare the call with the reference."""
    args = batch.args()
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    chosen = qsa_aiter.selected_kernel(*args, **hints)
    if backend != "auto":
        assert chosen == backend
    elif auto_is_preferred:
        assert chosen == PREFERRED[hints["phase"]], qsa_aiter.explain(*args, **hints)
    return check_call(args, rtol=tol, atol=tol, label=label, **hints)

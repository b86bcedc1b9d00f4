"""Oracle comparisons shared by the test suite and the fuzzer (``qsa_aiter.fuzz``): poisoned outputs, the exact
``[0, visible)`` region, and tolerances scaled by the terms each score sums.

Columns at or past a row's visible count are never compared: kernels need not write them (docs/kernels.md).
"""

from __future__ import annotations

import math

import torch

from ..runtime import dispatch, registries
from ..kernels.platform import Platform
from ..kernels.quant.formats import dequantize_cache
from ..ops.scoring import describe_call
from ..kernels.scoring.reference import reference_paged_mqa_logits

#: What an output is filled with before a kernel writes it: a column the kernel should have written stays NaN.
POISON = float("nan")

#: e4m3 tensor cores (``QSA_AITER_E4M3_MMA``: the stacked scorer on an e4m3fn or MXFP4 cache with bf16 queries, on a
#: GPU) round inside their sums. Their error is measured against ``magnitude_bound`` (the size of the terms summed):
#: on the H200 it reached 3.2e-4 of it for e4m3fn caches (six batches, written and random-code caches), which sum
#: 8 MMA K-steps (two q terms x 128 elements) in one accumulator; the tests allow E4M3_MMA_TOL of it on top of the
#: usual tolerance. MXFP4 sums only 2 K-steps (two q terms x one 32-element block) per accumulator and adds the
#: blocks in fp32, so its rounding is a part of that and the same allowance holds for it
#: (``benchmarks/e4m3_mma_error.py --cache fp4`` measures it).
E4M3_MMA_TOL = 1e-3


def poisoned_logits(args: tuple, max_columns: int | None = None) -> torch.Tensor:
    """A NaN-filled fp32 ``[tokens, num_columns]`` output for the scoring call ``args`` (positional arguments)."""
    q, cache, page_table = args[0], args[1], args[2]
    columns = page_table.shape[1] * cache.shape[1] if max_columns is None else max_columns
    return torch.full((q.shape[0], columns), POISON, dtype=torch.float32, device=q.device)


def uses_e4m3_mma(args: tuple, **kwargs) -> bool:
    """Whether the call would score with e4m3 tensor cores on a GPU (not the interpreter's exact emulation): the
    chosen kernel's launch plan has ``E4M3_MMA`` on (an e4m3fn or MXFP4 cache with bf16 queries,
    ``QSA_AITER_E4M3_MMA=1``)."""
    if not args[0].is_cuda:
        return False
    problem = describe_call(*args, **kwargs)
    chosen = registries.SCORING.select(problem).chosen
    spec = registries.SCORING.candidates[chosen].spec if chosen else None
    if spec is None:
        return False
    return bool(dispatch.plan_for(spec, problem, Platform.of(args[0].device)).constexprs.get("E4M3_MMA"))


def magnitude_args(args: tuple, k_scale=None) -> tuple:
    """The call's arguments with ``|q|`` and the absolute dequantised keys (fp32): the reference of them is the
    magnitude bound."""
    return (args[0].float().abs(), dequantize_cache(args[1], k_scale).abs()) + tuple(args[2:])


def magnitude_bound(args: tuple, **kwargs) -> torch.Tensor:
    """Per logit, ``sum_h sum_d |q| |k| / divisor`` (the reference on absolute values): the scale of the rounding
    error of any summation order."""
    extra = {k: kwargs[k] for k in ("score_divisor", "max_columns") if k in kwargs}
    return reference_paged_mqa_logits(*magnitude_args(args, kwargs.get("k_scale")), **extra)[0]


def e4m3_mma_atol(args: tuple, atol: float, **kwargs) -> torch.Tensor:
    """Per logit, ``atol`` plus ``E4M3_MMA_TOL`` of the magnitude bound: the tolerance of scores from e4m3 tensor
    cores."""
    return atol + E4M3_MMA_TOL * magnitude_bound(args, **kwargs)


def mma_atol(args: tuple, atol: float, **kwargs):
    """``atol``, plus ``E4M3_MMA_TOL`` of the magnitude bound where the call scores with e4m3 tensor cores."""
    if not uses_e4m3_mma(args, **kwargs):
        return atol
    return e4m3_mma_atol(args, atol, **kwargs)


def visible_mask(visible: torch.Tensor, num_columns: int) -> torch.Tensor:
    """bool ``[tokens, num_columns]``: the ``[0, visible)`` region of each row."""
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


def visible_bits(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The bit patterns of the ``[0, visible)`` logits, for bitwise comparisons."""
    return logits[visible_mask(visible, logits.shape[1])].view(torch.int32)

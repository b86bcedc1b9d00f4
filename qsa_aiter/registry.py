"""Kernel registry: ``(kv_dtype, block_size, phase)`` -> ordered candidates, and the choice among them.

Each candidate answers "do you serve this problem?" with a list of human-readable reasons (empty = serves); the
ordered table says which is preferred. ``select`` walks the order and takes the first candidate with no reasons,
returning a ``Decision`` that records why every other candidate was passed over; ``explain`` prints it. A forced
backend (``QSA_AITER_BACKEND``) goes through the same reasons. A candidate that raises while compiling or launching
is marked broken for the problem's specialisation and the next candidate runs (``QSA_AITER_STRICT=1`` raises); a
configuration error (``settings.ConfigurationError``: a bad variable or tuned-config file) is always raised.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import jit_cache, rocm, tuned
from .kernels import rowwise, stacked, tiled
from .kernels.common import describe_key_reading, e4m3_mma_serves, triton_runs_on
from .log import log_once
from .problem import ScoreProblem
from .reference import reference_paged_mqa_logits
from .settings import ConfigurationError, QsaSettings, get_settings

KV_DTYPES = ("bf16", "fp8", "fp4")
BLOCK_SIZES = (16, 64)


@dataclass(frozen=True)
class Candidate:
    """One kernel that may serve a scoring call."""

    name: str
    description: str
    reasons: Callable[..., list[str]]  # reasons(problem, settings=None) -> list of sentences; empty = serves
    run: Callable  # run(problem, launch_args) -> None


def _device_reasons(problem: ScoreProblem) -> list[str]:
    if triton_runs_on(problem.device_type):
        return []
    return [f"Triton kernels need a CUDA/HIP tensor or TRITON_INTERPRET=1 (tensors are on {problem.device_type})"]


def _common_reasons(problem: ScoreProblem, kv_dtypes: tuple[str, ...]) -> list[str]:
    reasons = _device_reasons(problem)
    if problem.kv_dtype not in kv_dtypes:
        reasons.append(f"kv dtype {problem.kv_dtype} is not served (serves {', '.join(kv_dtypes)})")
    return reasons


def _rowwise_reasons(problem: ScoreProblem, settings: QsaSettings | None = None) -> list[str]:
    return _common_reasons(problem, KV_DTYPES)


def _stacked_reasons(problem: ScoreProblem, settings: QsaSettings | None = None) -> list[str]:
    reasons = _common_reasons(problem, KV_DTYPES)
    if not (settings or get_settings()).stacked_decode_scorer:
        reasons.append("disabled by ATOM_QSA_STACKED_DECODE_SCORER=0")
    why = stacked.unsupported_reason(problem)
    if why:
        reasons.append(why)
    return reasons


def _tiled_reasons(problem: ScoreProblem, settings: QsaSettings | None = None) -> list[str]:
    reasons = _common_reasons(problem, KV_DTYPES)
    why = tiled.unsupported_reason(problem)
    if why:
        reasons.append(why)
    return reasons


def _torch_reasons(problem: ScoreProblem, settings: QsaSettings | None = None) -> list[str]:
    return []


def _run_torch(problem, args) -> None:
    logits, vis = reference_paged_mqa_logits(
        args.q, args.k_cache, args.page_table, args.token_to_request, args.query_positions, args.context_lens,
        args.compress_ratio, 1.0 / args.scale, args.num_columns, k_scale=args.k_scale,
    )
    args.logits.copy_(logits)
    args.visible.copy_(vis)


CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        Candidate("tiled", "tiled tensor-core prefill scorer (rows x keys tiles)", _tiled_reasons, tiled.launch),
        Candidate("stacked", "stacked verify/draft scorer (rows x heads in one M operand)", _stacked_reasons,
                  stacked.launch),
        Candidate("rowwise", "row-wise CUDA-core scorer (universal fallback)", _rowwise_reasons,
                  rowwise.launch),
        Candidate("torch", "torch reference (CPU, or last resort)", _torch_reasons, _run_torch),
        # ROCm libraries (qsa_aiter/rocm.py): each imports its library only where everything else says it serves.
        Candidate("aiter", rocm.AITER_DESCRIPTION, rocm.aiter_reasons, rocm.run_aiter),
        Candidate("flydsl", rocm.FLYDSL_DESCRIPTION, rocm.flydsl_reasons, rocm.run_flydsl),
    )
}
#: The candidates that wrap ROCm libraries rather than this project's kernels.
ROCM_CANDIDATES = ("aiter", "flydsl")

# FlyDSL leads prefill because it is opt-in (ROCM_QSA_FLYDSL): asking for it means preferring it. AITER's op scores
# every column of the page table, so it follows the row-wise scorer: it runs when forced, or on a ROCm stack where
# this project's kernels failed and were marked broken.
_PHASE_ORDER = {
    "prefill": ("flydsl", "tiled", "rowwise", "aiter", "torch"),
    "verify": ("stacked", "rowwise", "aiter", "torch"),
    "draft": ("stacked", "rowwise", "aiter", "torch"),
    "decode": ("rowwise", "aiter", "torch"),
}
#: The registry table. Every kv dtype and block size the project ships has a row per phase.
TABLE: dict[tuple[str, int, str], tuple[str, ...]] = {
    (kv, bs, phase): order for kv in KV_DTYPES for bs in BLOCK_SIZES for phase, order in _PHASE_ORDER.items()
}
_TILE_MODULES = {"tiled": tiled, "stacked": stacked, "rowwise": rowwise}
#: For page sizes outside the table: the universal scorer first.
FALLBACK_ORDER = ("rowwise", "aiter", "torch")

_broken: dict[tuple, str] = {}
_decisions: dict[tuple, "Decision"] = {}
_MAX_DECISIONS = 256


def _broken_key(name: str, problem: ScoreProblem) -> tuple:
    return (name, problem.device_type, str(problem.cache_dtype), problem.block_size, problem.num_heads,
            problem.head_dim, problem.compress_ratio)


@dataclass
class Decision:
    """Which candidate serves a problem, and why each other one does not."""

    problem: ScoreProblem
    chosen: str | None
    order: tuple[str, ...]
    rejected: dict[str, list[str]] = field(default_factory=dict)
    forced: bool = False
    table_note: str = ""

    def report(self) -> str:
        p = self.problem
        lines = [f"qsa_paged_mqa_logits: {p.summary()}", f"  phase {p.phase} ({p.phase_source})"]
        if self.table_note:
            lines.append("  " + self.table_note)
        how = "forced by QSA_AITER_BACKEND" if self.forced else "order " + " > ".join(self.order)
        lines.append(f"  candidates ({how}):")
        for name in self.order:
            if name == self.chosen:
                lines.append(f"    * {name}: serves ({CANDIDATES[name].description})")
            elif name in self.rejected:
                lines.append(f"    - {name}: " + "; ".join(self.rejected[name]))
            else:
                lines.append(f"    . {name}: not consulted (an earlier candidate serves)")
        if self.chosen is None:
            lines.append("  no candidate serves this call")
        return "\n".join(lines)


def candidate_order(problem: ScoreProblem) -> tuple[tuple[str, ...], str]:
    key = (problem.kv_dtype, problem.block_size, problem.phase)
    if key in TABLE:
        return TABLE[key], f"registry row {key}"
    return FALLBACK_ORDER, f"no registry row for {key}: universal fallback order"


def _reasons(name: str, problem: ScoreProblem, settings: QsaSettings) -> list[str]:
    reasons = list(CANDIDATES[name].reasons(problem, settings))
    broken = _broken.get(_broken_key(name, problem))
    if broken:
        reasons.append(f"marked broken in this process: {broken}")
    return reasons


def select(problem: ScoreProblem, *, skip: tuple[str, ...] = (), settings: QsaSettings | None = None) -> Decision:
    """Choose the kernel for ``problem`` (no device access). ``skip`` names candidates that failed this call.

    Decisions without ``skip`` are memoised per (problem, settings) until a kernel is marked broken, so a steady
    stream of calls pays one dictionary lookup here.
    """
    settings = settings or get_settings()
    key = (problem, settings)
    if not skip and key in _decisions:
        return _decisions[key]
    forced = settings.backend != "auto"
    order, note = ((settings.backend,), "") if forced else candidate_order(problem)
    decision = Decision(problem, None, order, forced=forced, table_note=note)
    for name in order:
        reasons = _reasons(name, problem, settings)
        if name in skip:
            reasons.append("failed on this call")
        if reasons:
            decision.rejected[name] = reasons
            continue
        decision.chosen = name
        break
    if not skip:
        if len(_decisions) >= _MAX_DECISIONS:
            _decisions.pop(next(iter(_decisions)))  # oldest first: a bounded memo, not a cache of every shape
        _decisions[key] = decision
    return decision


def explain(problem: ScoreProblem) -> str:
    """The full report for ``problem``: every candidate in order, with its reasons."""
    settings = get_settings()
    decision = select(problem, settings=settings)
    full = Decision(problem, decision.chosen, decision.order, forced=decision.forced, table_note=decision.table_note)
    for name in decision.order:
        if name != decision.chosen:
            full.rejected[name] = (_reasons(name, problem, settings)
                                   or ["serves, but an earlier candidate is preferred"])
    return full.report() + _tile_note(problem, decision.chosen, settings)


def _tile_note(problem: ScoreProblem, chosen: str | None, settings: QsaSettings) -> str:
    """Where the chosen Triton kernel's tile settings come from (a tuned row, or its defaults), and how it reads the
    keys (for quantised caches: e4m3 tensor cores or decoding, ``QSA_AITER_FP8_MMA``)."""
    if chosen not in _TILE_MODULES:
        return ""
    device = torch.device("cuda") if problem.device_type == "cuda" else torch.device("cpu")
    arch = tuned.device_arch(device)
    e4m3 = chosen == "stacked" and e4m3_mma_serves(problem.q_dtype, problem.cache_dtype, problem.head_dim, device,
                                                   settings.fp8_mma)
    cfg, row = tuned.resolve(chosen, problem, arch, _TILE_MODULES[chosen].default_config(problem, e4m3),
                             tuple(settings.tuned_config))
    keys = f"\n  keys: {describe_key_reading(chosen, problem, e4m3, settings.fp8_mma)}"
    if row is None:
        return f"\n  tile (arch {arch}): {chosen} defaults {cfg}" + keys
    return f"\n  tile (arch {arch}): tuned row rows={row.rows} context={row.context} ({row.source}): {cfg}" + keys


def run(problem: ScoreProblem, args, settings: QsaSettings | None = None) -> str:
    """Run the chosen candidate, falling back past ones that raise. Returns the name of the kernel that ran."""
    settings = settings or get_settings()
    # Configuration is read before any kernel runs, on every path (the torch one too): a bad QSA_AITER_TUNED_CONFIG
    # file or QSA_AITER_JIT_DIR is the caller's error (ConfigurationError), not a kernel failure to fall back from.
    tuned.load_tables(tuple(settings.tuned_config))
    # This library's Triton kernels launch inside the JIT cache's scope (docs/jit_and_configs.md).
    jit = jit_cache.scope(args.q.device, settings)
    failed: tuple[str, ...] = ()
    while True:
        decision = select(problem, skip=failed, settings=settings)
        if decision.chosen is None:
            raise ValueError(decision.report())
        name = decision.chosen
        if not failed:
            log_once(logging.INFO, ("dispatch", problem, name), decision.report)
        try:
            with jit if name in _TILE_MODULES else contextlib.nullcontext():
                CANDIDATES[name].run(problem, args)
            return name
        except ConfigurationError:
            raise
        except Exception as err:  # compile or launch failure: fall back unless strict
            if settings.strict or decision.forced:
                raise
            message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            _broken[_broken_key(name, problem)] = message
            _decisions.clear()
            log_once(logging.WARNING, ("broken", _broken_key(name, problem)),
                     f"kernel {name} failed for {problem.summary()} and is marked broken: {message}")
            failed = failed + (name,)


def clear_broken() -> None:
    """Forget kernels marked broken (tests)."""
    _broken.clear()
    _decisions.clear()


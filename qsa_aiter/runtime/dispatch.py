"""Kernel registry: ``(kv_dtype, block_size, phase)`` -> ordered candidates, and the choice among them.

The candidates are the scoring kernels' specs (``scoring.SPECS``), the ROCm libraries' scorers and the torch
reference; each declares its rank per phase, and the table orders them by it. Each candidate answers "do you serve
this problem?" with a list of human-readable reasons (empty = serves). ``select`` takes, among the serving kernels
of this project, the one the tuned tables measured fastest at the problem's shape bucket on this arch
(``measured_choice``: only kernels measured at the same bucket are compared), and otherwise the first serving
candidate in the order; it returns a ``Decision`` that records the rule and why every other candidate was passed
over; ``explain`` prints it with the chosen kernel's ``LaunchPlan``. A forced backend (``QSA_AITER_BACKEND``) goes
through the same reasons. A candidate that raises while compiling or launching is marked broken for the problem's
specialisation and the next candidate runs (``QSA_AITER_STRICT=1`` raises); a configuration error
(``settings.ConfigurationError``: a bad variable or tuned-config file) is always raised.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable

from . import replay
from . import rocm
from .jit import scope as jit_scope
from .log import log_once
from ..kernels.platform import Platform
from ..kernels.scoring.problem import PHASES, ScoreProblem
from ..kernels.scoring import SPECS
from ..kernels.scoring.base import KV_DTYPES, ScoreArgs
from ..kernels.scoring.reference import reference_paged_mqa_logits
from .settings import ConfigurationError, QsaSettings, get_settings
from ..kernels.spec import KernelSpec, LaunchPlan
from . import tuned

BLOCK_SIZES = (16, 64)


@dataclass(frozen=True)
class Candidate:
    """One way to serve a scoring call: a kernel spec, a ROCm library, or the torch reference."""

    name: str
    description: str
    reasons: Callable[[ScoreProblem, Platform, QsaSettings], list[str]]  # empty: serves
    run: Callable[[ScoreProblem, ScoreArgs, QsaSettings], None]
    ranks: dict  # phase -> rank in the order (lower first)
    universal: bool = False  # in the order of page sizes outside the table
    spec: KernelSpec | None = None


def _spec_candidate(spec) -> Candidate:
    def reasons(problem, platform, settings):
        found = spec.reasons(problem, platform)
        if spec.switch and not getattr(settings, spec.switch):
            variable = QsaSettings.model_fields[spec.switch].alias
            found.append(f"disabled by {variable}=0")
        return found

    def run(problem, args, settings):
        plan_for(spec, problem, Platform.of(args.q.device), settings).launch(*args.kernel_args())

    return Candidate(spec.name, spec.description, reasons, run, spec.ranks, spec.universal, spec)


def _run_torch(problem, args, settings) -> None:
    logits, vis = reference_paged_mqa_logits(
        args.q, args.k_cache, args.page_table, args.token_to_request, args.query_positions, args.context_lens,
        args.compress_ratio, 1.0 / args.scale, args.num_columns, k_scale=args.k_scale,
    )
    args.logits.copy_(logits)
    args.visible.copy_(vis)


# FlyDSL leads prefill because it is opt-in (ROCM_QSA_FLYDSL): asking for it means preferring it. AITER's op scores
# every column of the page table, so it follows the row-wise scorer: it runs when forced, or on a ROCm stack where
# this project's kernels failed and were marked broken.
_OTHERS = (
    Candidate("torch", "torch reference (CPU, or last resort)", lambda problem, platform, settings: [],
              _run_torch, dict.fromkeys(PHASES, 90), universal=True),
    Candidate("aiter", rocm.AITER_DESCRIPTION,
              lambda problem, platform, settings: rocm.aiter_reasons(problem, settings),
              lambda problem, args, settings: rocm.run_aiter(problem, args), dict.fromkeys(PHASES, 40),
              universal=True),
    Candidate("flydsl", rocm.FLYDSL_DESCRIPTION,
              lambda problem, platform, settings: rocm.flydsl_reasons(problem, settings),
              lambda problem, args, settings: rocm.run_flydsl(problem, args), {"prefill": 10}),
)
CANDIDATES: dict[str, Candidate] = {c.name: c for c in tuple(map(_spec_candidate, SPECS)) + _OTHERS}
#: The candidates that are this project's scoring kernels.
SCORER_KERNELS = frozenset(c.name for c in CANDIDATES.values() if c.spec is not None)
#: The candidates that wrap ROCm libraries rather than this project's kernels.
ROCM_CANDIDATES = ("aiter", "flydsl")


def _order(phase: str | None) -> tuple[str, ...]:
    ranked = [c for c in CANDIDATES.values() if (phase in c.ranks if phase else c.universal)]
    return tuple(c.name for c in sorted(ranked, key=lambda c: c.ranks[phase] if phase else min(c.ranks.values())))


#: The registry table. Every kv dtype and block size the project ships has a row per phase.
TABLE: dict[tuple[str, int, str], tuple[str, ...]] = {
    (kv, bs, phase): _order(phase) for kv in KV_DTYPES for bs in BLOCK_SIZES for phase in PHASES
}
#: For page sizes outside the table: the universal candidates.
FALLBACK_ORDER = _order(None)

_broken: dict[tuple, str] = {}
_decisions: dict[tuple, "Decision"] = {}
_MAX_DECISIONS = 256


def _broken_key(name: str, problem: ScoreProblem) -> tuple:
    return (name, problem.device_type, str(problem.cache_dtype), problem.block_size, problem.num_heads,
            problem.head_dim, problem.compress_ratio)


def plan_for(spec: KernelSpec, problem, platform: Platform, settings: QsaSettings | None = None) -> LaunchPlan:
    """``spec``'s launch plan for ``problem`` on ``platform`` with the tuned tables of ``settings``: what the kernel
    launch, ``explain``, warm-up and the benchmark use (``KernelSpec.plan`` memoises it); a shape with no tuned row
    is logged once."""
    settings = settings or get_settings()
    plan = spec.plan(problem, platform, tuned.load_tables(tuple(settings.tuned_config)))
    if spec.tune_grid and plan.config_source.startswith("defaults"):
        log_once(logging.INFO, ("untuned", platform.arch, spec.name, problem.kv_dtype, problem.block_size,
                                problem.num_heads, problem.head_dim),
                 f"no tuned {spec.name} config for arch={platform.arch} kv={problem.kv_dtype} "
                 f"page={problem.block_size} heads={problem.num_heads} head_dim={problem.head_dim}: using the "
                 "kernel's defaults")
    return plan


@dataclass
class Decision:
    """Which candidate serves a problem, and why each other one does not."""

    problem: ScoreProblem
    chosen: str | None
    order: tuple[str, ...]
    rejected: dict[str, list[str]] = field(default_factory=dict)
    forced: bool = False
    table_note: str = ""
    rule: str = ""  # how the choice was made among the serving candidates
    compared: tuple[str, ...] = ()  # the kernels the measurement rule compared

    def report(self) -> str:
        p = self.problem
        lines = [f"qsa_paged_mqa_logits: {p.summary()}", f"  phase {p.phase} ({p.phase_source})"]
        if self.table_note:
            lines.append("  " + self.table_note)
        how = "forced by QSA_AITER_BACKEND" if self.forced else "order " + " > ".join(self.order)
        lines.append(f"  candidates ({how}):")
        if self.rule:
            lines.insert(-1, f"  chosen by {self.rule}")
        for name in self.order:
            if name == self.chosen:
                lines.append(f"    * {name}: serves ({CANDIDATES[name].description})")
            elif name in self.rejected:
                lines.append(f"    - {name}: " + "; ".join(self.rejected[name]))
            elif name in self.compared:
                lines.append(f"    - {name}: serves, but {self.chosen} measured faster")
            else:
                lines.append(f"    . {name}: serves, not chosen")
        if self.chosen is None:
            lines.append("  no candidate serves this call")
        return "\n".join(lines)


def candidate_order(problem: ScoreProblem) -> tuple[tuple[str, ...], str]:
    key = (problem.kv_dtype, problem.block_size, problem.phase)
    if key in TABLE:
        return TABLE[key], f"registry row {key}"
    return FALLBACK_ORDER, f"no registry row for {key}: universal fallback order"


def _platform(problem: ScoreProblem) -> Platform:
    """The platform ``problem`` runs on: the current GPU for GPU tensors (the interpreter's for a problem that only
    says ``cuda``, as the tests build them on a machine without one)."""
    import torch

    on_gpu = problem.device_type == "cuda" and torch.cuda.is_available()
    return Platform.of(torch.device("cuda") if on_gpu else torch.device("cpu"))


def reasons(name: str, problem: ScoreProblem, settings: QsaSettings | None = None) -> list[str]:
    """Why candidate ``name`` does not serve ``problem`` (empty: it serves), as ``select`` asks it, marks of a
    kernel broken in this process included."""
    settings = settings or get_settings()
    found = list(CANDIDATES[name].reasons(problem, _platform(problem), settings))
    broken = _broken.get(_broken_key(name, problem))
    if broken:
        found.append(f"marked broken in this process: {broken}")
    return found


def _forced(settings: QsaSettings) -> str | None:
    if settings.backend == "auto":
        return None
    if settings.backend not in CANDIDATES:
        raise ConfigurationError(f"environment variable QSA_AITER_BACKEND={settings.backend!r} is invalid: allowed: "
                                 "auto, " + ", ".join(CANDIDATES))
    return settings.backend


def measured_choice(problem: ScoreProblem, serving: list[str], platform: Platform,
                    settings: QsaSettings) -> tuple[str, str, tuple[str, ...]] | None:
    """``(kernel, rule, compared)``: the kernel of ``serving`` (this project's kernels that serve ``problem``, in
    table order) the tuned tables measured fastest on ``platform``'s arch at the shape bucket nearest ``problem``;
    None when the table order's choice (``serving[0]``) or every other kernel lacks a measured row at that bucket.
    Each kernel's row is the one its own launch plan uses (``TunedTable.lookup``); kernels whose nearest row lies at
    another bucket are not compared."""
    table = tuned.load_tables(tuple(settings.tuned_config))
    found = {}
    for name in serving:
        row = table.lookup(platform.arch, name, problem)
        if row is not None and row.measured and row.us is not None:
            found[name] = row
    if len(found) < 2:
        return None
    nearest = min(((r.rows, r.context) for r in found.values()), key=lambda b: tuned.bucket_distance(*b, problem))
    timed = [(row.us, serving.index(name), name) for name, row in found.items() if (row.rows, row.context) == nearest]
    if len(timed) < 2 or serving[0] not in {name for _, _, name in timed}:
        return None
    timed.sort()  # equal times: the earlier in the table order
    times = " < ".join(f"{name} {us:.2f} us" for us, _, name in timed)
    return timed[0][2], (f"measurement: {times} (tuned rows at {nearest[0]} rows x {nearest[1]} tokens, "
                         f"arch {platform.arch})"), tuple(name for _, _, name in timed)


def select(problem: ScoreProblem, *, skip: tuple[str, ...] = (), settings: QsaSettings | None = None) -> Decision:
    """Choose the kernel for ``problem`` (no device access). ``skip`` names candidates that failed this call.

    Decisions without ``skip`` are memoised per (problem, settings) until a kernel is marked broken, so a steady
    stream of calls pays one dictionary lookup here.
    """
    settings = settings or get_settings()
    key = (problem, settings)
    if not skip and key in _decisions:
        return _decisions[key]
    forced = _forced(settings)
    order, note = ((forced,), "") if forced else candidate_order(problem)
    decision = Decision(problem, None, order, forced=forced is not None, table_note=note)
    serving = []
    for name in order:
        why = reasons(name, problem, settings)
        if name in skip:
            why.append("failed on this call")
        if why:
            decision.rejected[name] = why
        else:
            serving.append(name)
    if serving:
        decision.chosen, decision.rule = serving[0], "" if forced else "table order"
        # This project's kernels up to the first one that is not (a ROCm library preferred by the order wins).
        ours = list(itertools.takewhile(lambda name: CANDIDATES[name].spec is not None, serving))
        measured = measured_choice(problem, ours, _platform(problem), settings) if not forced else None
        if measured:
            decision.chosen, decision.rule, decision.compared = measured
    if not skip:
        if len(_decisions) >= _MAX_DECISIONS:
            _decisions.pop(next(iter(_decisions)))  # oldest first: a bounded memo, not a cache of every shape
        _decisions[key] = decision
    return decision


def explain(problem: ScoreProblem) -> str:
    """The full report for ``problem``: every candidate in order, with its reasons, and the chosen kernel's launch
    plan (its config and where the config came from) and how it reads the keys."""
    settings = get_settings()
    decision = select(problem, settings=settings)
    full = Decision(problem, decision.chosen, decision.order, forced=decision.forced, table_note=decision.table_note,
                    rule=decision.rule, compared=decision.compared)
    for name in decision.order:
        if name != decision.chosen and name not in decision.compared:
            later = decision.chosen is None or decision.order.index(name) > decision.order.index(decision.chosen)
            full.rejected[name] = (reasons(name, problem, settings)
                                   or ["serves, but an earlier candidate is preferred" if later
                                       else "serves, but has no measured row at the bucket compared"])
    report = full.report()
    spec = CANDIDATES[decision.chosen].spec if decision.chosen else None
    if spec is None:
        return report
    platform = _platform(problem)
    plan = plan_for(spec, problem, platform, settings)
    return (report + f"\n  plan (arch {platform.arch}): grid {plan.grid}, {plan.config_source}: {plan.config}"
            + f"\n  keys: {spec.key_reading(problem, platform)}")


def run(problem: ScoreProblem, args: ScoreArgs, settings: QsaSettings | None = None) -> str:
    """Run the chosen candidate, falling back past ones that raise. Returns the name of the kernel that ran."""
    settings = settings or get_settings()
    # Configuration is read before any kernel runs, on every path (the torch one too): a bad QSA_AITER_TUNED_CONFIG
    # file or QSA_AITER_JIT_DIR is the caller's error (ConfigurationError), not a kernel failure to fall back from.
    tuned.load_tables(tuple(settings.tuned_config))
    # This library's Triton kernels launch inside the JIT cache's scope (docs/jit_and_configs.md).
    jit = jit_scope(args.q.device, settings)
    failed: tuple[str, ...] = ()
    while True:
        decision = select(problem, skip=failed, settings=settings)
        if decision.chosen is None:
            raise ValueError(decision.report())
        name = decision.chosen
        candidate = CANDIDATES[name]
        if not failed:
            log_once(logging.INFO, ("dispatch", problem, name), decision.report)
        try:
            if candidate.spec is not None:
                with jit:
                    candidate.run(problem, args, settings)
            else:
                candidate.run(problem, args, settings)
            return name
        except ConfigurationError:
            raise
        except Exception as err:  # compile or launch failure: fall back unless strict
            if settings.strict or decision.forced:
                raise
            message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            _broken[_broken_key(name, problem)] = message
            _decisions.clear()
            replay.clear()
            log_once(logging.WARNING, ("broken", _broken_key(name, problem)),
                     f"kernel {name} failed for {problem.summary()} and is marked broken: {message}")
            failed = failed + (name,)


def clear_broken() -> None:
    """Forget kernels marked broken and the decisions made (tests)."""
    _broken.clear()
    _decisions.clear()
    replay.clear()

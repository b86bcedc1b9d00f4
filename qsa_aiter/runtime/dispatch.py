"""The one dispatch mechanism of every op family with more than one implementation (scoring, top-k, expansion, the
cache writer): a ``Registry`` of ``Candidate``s per family (``runtime/registries.py`` declares them).

Each candidate answers "do you serve this problem?" with a list of human-readable reasons (empty = serves). ``select``
takes, among the serving candidates with tuned rows (this project's kernels: a candidate's ``measurement``), the one
the tuned tables measured fastest at the problem's shape bucket on this arch (``measured_choice``: only candidates
measured at the same bucket are compared), and otherwise the first serving candidate in the family's order; it
returns a ``Decision`` that records the rule and why every other candidate was passed over; ``explain`` prints it
with the chosen kernel's ``LaunchPlan``. A forced candidate (the family's environment variable: ``QSA_AITER_BACKEND``
for scoring, ``QSA_AITER_TOPK_BACKEND`` for the top-k) goes through the same reasons. A candidate that raises while
compiling or launching is marked broken for the problem's specialisation and the next candidate runs
(``QSA_AITER_STRICT=1`` or a forced candidate raises); a configuration error (``settings.ConfigurationError``: a bad
variable or tuned-config file) is always raised.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..kernels.platform import Platform
from ..kernels.spec import KernelSpec, LaunchPlan
from . import replay, tuned
from .jit import scope as jit_scope
from .log import log_once
from .settings import ConfigurationError, QsaSettings, get_settings

#: The ``ranks`` key of a family whose order does not depend on a phase.
ANY_PHASE = "any"
#: What ``explain`` adds where a candidate without a launch plan serves: where the Triton kernels' plans are shown.
NO_PLAN_HINT = ("the Triton kernels run on GPU tensors, or on CPU tensors in a process started with "
                "TRITON_INTERPRET=1, where explain shows their plan")


@dataclass(frozen=True)
class Measurement:
    """A candidate's measured time for a problem, from its tuned row: ``us`` at ``bucket`` (the row's buckets, in the
    units ``bucket_text`` names them), ``distance`` from the problem's own (the nearest bucket's candidates are
    compared) and ``plan``: which of the candidate's plans it is (empty: it has one)."""

    us: float
    bucket: tuple
    distance: tuple
    bucket_text: str
    plan: str = ""


def measured_name(name: str, measurement: Measurement | None) -> str:
    """Candidate ``name`` as a measurement names it: with its plan where it has several (``native rows_256``)."""
    return f"{name} {measurement.plan}" if measurement is not None and measurement.plan else name


@dataclass(frozen=True)
class Candidate:
    """One way to serve an op family's call: a kernel of this project (``spec``), a ROCm library, or a torch path.

    ``reasons(problem, platform, settings)``: why it does not serve (empty: it serves). ``launch(problem, args,
    settings)``: run it on the call's arguments. ``ranks``: its place in the order per phase (lower first;
    ``ANY_PHASE`` for families without phases); ``universal``: in the order of problems outside the family's table.
    A candidate with a ``spec`` launches inside the JIT cache's scope, and its tuned rows may decide the choice.
    ``describe_plan(problem, platform)``: the plan ``explain`` prints for a chosen candidate that has no ``spec`` (a
    native kernel's). ``final``: its errors are raised, never marked broken (a candidate made of steps that dispatch
    through registries of their own, which already fell back where they could: selection's ``composite``).
    ``measurement(problem, platform, settings)``: its measured time for the problem from the tuned tables (None: no
    measured row); a candidate without one has no tuned rows and stops the measured choice (a library the order
    prefers wins). ``plan_names``: the plans its tuned rows may name (empty: one plan); ``plans(problem,
    platform)``: those that serve a problem, by name, for the tuner (None: the one launch ``launch`` makes)."""

    name: str
    description: str
    reasons: Callable[[Any, Platform, QsaSettings], list[str]]
    launch: Callable[[Any, Any, QsaSettings], None]
    ranks: Mapping[str, int]
    universal: bool = False
    spec: KernelSpec | None = None
    describe_plan: Callable[[Any, Platform], str] | None = None
    final: bool = False
    measurement: Callable[[Any, Platform, QsaSettings], Measurement | None] | None = None
    plan_names: tuple[str, ...] = ()
    plans: Callable[[Any, Platform], Mapping[str, Any]] | None = None


def spec_measurement(spec: KernelSpec) -> Callable[[Any, Platform, QsaSettings], Measurement | None]:
    """The ``measurement`` of a candidate that is this project's kernel ``spec``: ``table_measurement`` of its name
    where the tuner measures it (a spec with a candidate grid), else always None."""
    return table_measurement(spec.name if spec.tune_grid else None)


def table_measurement(kernel: str | None) -> Callable[[Any, Platform, QsaSettings], Measurement | None]:
    """The ``measurement`` of a candidate whose tuned rows in the scoring table name ``kernel`` (a tunable Triton
    spec, or a native family of ``catalog.timed_native_specs``): the measured time of the row its launch uses
    (``TunedTable.lookup``: exact key, nearest (rows, context) bucket), where that row is measured (None without a
    row, for a row with ``measured=0``, and for every problem where ``kernel`` is None)."""

    def measurement(problem, platform: Platform, settings: QsaSettings) -> Measurement | None:
        if kernel is None:
            return None
        row = tuned.load_tables(tuple(settings.tuned_config)).lookup(platform.arch, kernel, problem)
        if row is None or not row.measured or row.us is None:
            return None
        return Measurement(row.us, (row.rows, row.context), tuned.bucket_distance(row.rows, row.context, problem),
                           f"{row.rows} rows x {row.context} tokens")

    return measurement


def spec_candidate(spec: KernelSpec, launch: Callable[[Any, Any, QsaSettings], None], *, name: str | None = None,
                   ranks: Mapping[str, int] | None = None, universal: bool | None = None,
                   measurement: Callable[[Any, Platform, QsaSettings], Measurement | None] | None = None,
                   ) -> Candidate:
    """The candidate of this project's kernel ``spec``: its reasons (plus "disabled by <variable>=0" where the spec
    names a settings switch that is off), ``launch``, its ranks (the spec's own unless given) and its
    ``measurement`` (``spec_measurement`` unless given)."""

    def reasons(problem, platform, settings):
        found = spec.reasons(problem, platform)
        switch = getattr(spec, "switch", None)
        if switch and not getattr(settings, switch):
            found.append(f"disabled by {QsaSettings.model_fields[switch].alias}=0")
        return found

    return Candidate(name or spec.name, spec.description, reasons, launch,
                     ranks if ranks is not None else spec.ranks,
                     universal if universal is not None else getattr(spec, "universal", False), spec,
                     measurement=measurement or spec_measurement(spec))


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


def platform_of(problem) -> Platform:
    """The platform ``problem`` runs on: the current GPU for GPU tensors (the interpreter's for a problem that only
    says ``cuda``, as the tests build them on a machine without one)."""
    import torch

    on_gpu = problem.device_type == "cuda" and torch.cuda.is_available()
    return Platform.of(torch.device("cuda") if on_gpu else torch.device("cpu"))


@dataclass
class Decision:
    """Which candidate of ``registry`` serves a problem, and why each other one does not."""

    registry: "Registry"
    problem: Any
    chosen: str | None
    order: tuple[str, ...]
    rejected: dict[str, list[str]] = field(default_factory=dict)
    forced: bool = False
    table_note: str = ""
    rule: str = ""  # how the choice was made among the serving candidates
    compared: tuple[str, ...] = ()  # the kernels the measurement rule compared
    measured: dict[str, Measurement] = field(default_factory=dict)  # their measurements, by name

    def measured_text(self, name: str) -> str:
        """``name`` as the measurement rule names it (``measured_name``)."""
        return measured_name(name, self.measured.get(name))

    def report(self) -> str:
        p, candidates = self.problem, self.registry.candidates
        lines = [f"{self.registry.op}: {p.summary()}"]
        if getattr(p, "phase", None):
            lines.append(f"  phase {p.phase} ({p.phase_source})")
        if self.table_note:
            lines.append("  " + self.table_note)
        if self.rule:
            lines.append(f"  chosen by {self.rule}")
        how = f"forced by {self.registry.forced_variable}" if self.forced else "order " + " > ".join(self.order)
        lines.append(f"  candidates ({how}):")
        for name in self.order:
            if name == self.chosen:
                lines.append(f"    * {name}: serves ({candidates[name].description})")
            elif name in self.rejected:
                lines.append(f"    - {name}: " + "; ".join(self.rejected[name]))
            elif name in self.compared:
                lines.append(f"    - {name}: serves, but {self.chosen} measured faster ("
                             f"{self.measured_text(name)} {self.measured[name].us:.2f} us against "
                             f"{self.measured_text(self.chosen)} {self.measured[self.chosen].us:.2f} us)")
            else:
                lines.append(f"    . {name}: serves, not chosen")
        if self.chosen is None:
            lines.append("  no candidate serves this call")
        return "\n".join(lines)


#: Broken marks of every registry: (family, candidate name, the problem's broken key) -> the error's first line.
_broken: dict[tuple, str] = {}
_MAX_DECISIONS = 256


class Registry:
    """The candidates of one op family and the choice among them.

    ``op``: the name reports start with; ``candidates``: in declaration order; ``order_of(problem)``: the candidate
    names in order and a note on where the order came from (default: by rank for the problem's phase, or
    ``ANY_PHASE``); ``forced_setting``: the settings field naming a forced candidate (None: none can be forced);
    ``broken_key(problem)``: what a failure is remembered under (the specialisation it depends on)."""

    def __init__(self, family: str, op: str, candidates: tuple[Candidate, ...], *,
                 broken_key: Callable[[Any], tuple], forced_setting: str | None = None,
                 order_of: Callable[[Any], tuple[tuple[str, ...], str]] | None = None):
        self.family = family
        self.op = op
        self.candidates: dict[str, Candidate] = {c.name: c for c in candidates}
        self.forced_setting = forced_setting
        self.broken_key = broken_key
        self._order_of = order_of
        self._decisions: dict[tuple, Decision] = {}

    @property
    def shows_plans(self) -> bool:
        """Whether ``explain`` ends with the chosen kernel's launch plan (a family whose kernels say how they read
        the keys: scoring)."""
        return any(hasattr(c.spec, "key_reading") for c in self.candidates.values() if c.spec is not None)

    @property
    def forced_variable(self) -> str:
        return QsaSettings.model_fields[self.forced_setting].alias if self.forced_setting else ""

    def ranked(self, phase: str | None) -> tuple[str, ...]:
        """The candidates ranked for ``phase`` (``None``: the universal ones), lower rank first."""
        chosen = [c for c in self.candidates.values() if (phase in c.ranks if phase else c.universal)]
        return tuple(c.name for c in sorted(chosen, key=lambda c: c.ranks[phase] if phase else min(c.ranks.values())))

    def order(self, problem) -> tuple[tuple[str, ...], str]:
        """``(candidate names in order, note)`` for ``problem``."""
        if self._order_of is not None:
            return self._order_of(problem)
        return self.ranked(getattr(problem, "phase", None) or ANY_PHASE), ""

    def forced(self, settings: QsaSettings) -> str | None:
        """The candidate the family's variable forces (None: ``auto``); ``ConfigurationError`` for an unknown name."""
        if self.forced_setting is None:
            return None
        value = getattr(settings, self.forced_setting)
        if value == "auto":
            return None
        if value not in self.candidates:
            raise ConfigurationError(f"environment variable {self.forced_variable}={value!r} is invalid: allowed: "
                                     "auto, " + ", ".join(self.candidates))
        return value

    def reasons(self, name: str, problem, settings: QsaSettings | None = None) -> list[str]:
        """Why candidate ``name`` does not serve ``problem`` (empty: it serves), as ``select`` asks it, marks of a
        kernel broken in this process included."""
        settings = settings or get_settings()
        found = list(self.candidates[name].reasons(problem, platform_of(problem), settings))
        broken = _broken.get((self.family, name, self.broken_key(problem)))
        if broken:
            found.append(f"marked broken in this process: {broken}")
        return found

    def measured_choice(self, problem, serving: list[str], platform: Platform,
                        settings: QsaSettings) -> tuple[str, str, tuple[str, ...], dict[str, Measurement]] | None:
        """``(candidate, rule, compared, measurements)``: the candidate of ``serving`` (the serving candidates with
        tuned rows, in order) the tuned tables measured fastest on ``platform``'s arch at the shape bucket nearest
        ``problem``; None when the order's choice (``serving[0]``) or every other candidate lacks a measured row at
        that bucket. Each candidate's measurement is the one its own launch uses (its ``measurement``: a scoring
        kernel's tuned row, the top-k's row of the plan it runs); candidates measured at another bucket are not
        compared."""
        found = {}
        for name in serving:
            measured = self.candidates[name].measurement(problem, platform, settings)
            if measured is not None:
                found[name] = measured
        if len(found) < 2:
            return None
        nearest = min(found.values(), key=lambda m: m.distance)
        timed = [(m.us, serving.index(name), name) for name, m in found.items() if m.bucket == nearest.bucket]
        if len(timed) < 2 or serving[0] not in {name for _, _, name in timed}:
            return None
        timed.sort()  # equal times: the earlier in the order
        compared = {name: found[name] for _, _, name in timed}
        times = " < ".join(f"{measured_name(name, found[name])} {us:.2f} us" for us, _, name in timed)
        return timed[0][2], (f"measurement: {times} (tuned rows at {nearest.bucket_text}, arch {platform.arch})"), \
            tuple(compared), compared

    def select(self, problem, *, skip: tuple[str, ...] = (), settings: QsaSettings | None = None) -> Decision:
        """Choose the candidate for ``problem`` (no device access). ``skip`` names candidates that failed this call.

        Decisions without ``skip`` are memoised per (problem, settings) until a kernel is marked broken, so a steady
        stream of calls pays one dictionary lookup here."""
        settings = settings or get_settings()
        key = (problem, settings)
        if not skip and key in self._decisions:
            return self._decisions[key]
        forced = self.forced(settings)
        order, note = ((forced,), "") if forced else self.order(problem)
        decision = Decision(self, problem, None, order, forced=forced is not None, table_note=note)
        serving = []
        for name in order:
            why = self.reasons(name, problem, settings)
            if name in skip:
                why.append("failed on this call")
            if why:
                decision.rejected[name] = why
            else:
                serving.append(name)
        if serving:
            decision.chosen, decision.rule = serving[0], "" if forced else "table order"
            # The candidates with tuned rows up to the first one without (a library preferred by the order wins).
            ours = list(itertools.takewhile(lambda name: self.candidates[name].measurement is not None, serving))
            measured = None if forced else self.measured_choice(problem, ours, platform_of(problem), settings)
            if measured:
                decision.chosen, decision.rule, decision.compared, decision.measured = measured
        if not skip:
            if len(self._decisions) >= _MAX_DECISIONS:
                self._decisions.pop(next(iter(self._decisions)))  # oldest first: bounded, not a cache of every shape
            self._decisions[key] = decision
        return decision

    def explain(self, problem) -> str:
        """The full report for ``problem``: every candidate in order, with its reasons, and for a kernel of this
        project the chosen kernel's launch plan (its config and where the config came from) and how it reads the
        keys where the kernel says; in a family that shows plans, a chosen candidate without one (the torch path, a
        ROCm library) gets a ``plan: none (...)`` line saying why."""
        settings = get_settings()
        decision = self.select(problem, settings=settings)
        full = Decision(self, problem, decision.chosen, decision.order, forced=decision.forced,
                        table_note=decision.table_note, rule=decision.rule, compared=decision.compared,
                        measured=decision.measured)
        for name in decision.order:
            if name != decision.chosen and name not in decision.compared:
                later = decision.chosen is None or decision.order.index(name) > decision.order.index(decision.chosen)
                full.rejected[name] = (self.reasons(name, problem, settings)
                                       or ["serves, but an earlier candidate is preferred" if later
                                           else "serves, but has no measured row at the bucket compared"])
        report = full.report()
        spec = self.candidates[decision.chosen].spec if decision.chosen else None
        describe = self.candidates[decision.chosen].describe_plan if decision.chosen else None
        if describe is not None:
            platform = platform_of(problem)
            return report + f"\n  plan (arch {platform.arch}): {describe(problem, platform)}"
        if decision.chosen and spec is None and self.shows_plans:
            # Said outright, so that a report without a plan (the torch path on a CPU) is not taken for a cut one.
            return report + (f"\n  plan: none ({decision.chosen} is not one of this project's Triton kernels; "
                             f"{NO_PLAN_HINT})")
        if spec is None or not hasattr(spec, "key_reading"):
            return report
        platform = platform_of(problem)
        plan = plan_for(spec, problem, platform, settings)
        return (report + f"\n  plan (arch {platform.arch}): grid {plan.grid}, {plan.config_source}: {plan.config}"
                + f"\n  keys: {spec.key_reading(problem, platform, plan)}")

    def dispatch(self, problem, args, settings: QsaSettings | None = None) -> str:
        """Launch the chosen candidate on ``args`` (which have a ``device``), falling back past ones that raise.
        Returns the name of the candidate that ran."""
        settings = settings or get_settings()
        # Configuration is read before any kernel runs, on every path (the torch one too): a bad QSA_AITER_TUNED_CONFIG
        # file or QSA_AITER_JIT_DIR is the caller's error (ConfigurationError), not a kernel failure to fall back from.
        tuned.load_tables(tuple(settings.tuned_config))
        # This library's Triton kernels launch inside the JIT cache's scope (docs/jit_and_configs.md).
        jit = jit_scope(args.device, settings)
        failed: tuple[str, ...] = ()
        while True:
            decision = self.select(problem, skip=failed, settings=settings)
            if decision.chosen is None:
                raise ValueError(decision.report())
            name = decision.chosen
            candidate = self.candidates[name]
            if not failed:
                log_once(logging.INFO, ("dispatch", self.family, problem, name), decision.report)
            try:
                if candidate.spec is not None:
                    with jit:
                        candidate.launch(problem, args, settings)
                else:
                    candidate.launch(problem, args, settings)
                return name
            except ConfigurationError:
                raise
            except Exception as err:  # compile or launch failure: fall back unless strict
                if settings.strict or decision.forced or candidate.final:
                    raise
                message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                key = (self.family, name, self.broken_key(problem))
                _broken[key] = message
                clear_decisions()
                log_once(logging.WARNING, ("broken", key),
                         f"{self.family} kernel {name} failed for {problem.summary()} and is marked broken: {message}")
                failed = failed + (name,)


_registries: list[Registry] = []


def register(registry: Registry) -> Registry:
    """Keep ``registry`` among those whose decisions a broken mark or ``clear_broken`` forgets."""
    _registries.append(registry)
    return registry


def clear_decisions() -> None:
    """Forget every registry's memoised decisions and the cached-call plans (a kernel was marked broken)."""
    for registry in _registries:
        registry._decisions.clear()
    replay.clear()


def clear_broken() -> None:
    """Forget kernels marked broken and the decisions made (tests)."""
    _broken.clear()
    clear_decisions()

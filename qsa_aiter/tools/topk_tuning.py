"""The top-k mode of the tuner (``python -m qsa_aiter tune --op topk``): times every top-k candidate that has tuned
rows, and each plan of the native one, at work points on the present GPU, and writes one row per (candidate, plan)
into a top-k table (``runtime/tuned.TopkRow``), from which the dispatcher takes the fastest candidate and the native
top-k its plan (``registries.TOPK``, ``runtime/native_topk.plan_choice``).

A sweep is one work point (``work_points``): ``rows`` = requests x rows per request, ``columns`` = its longest
context // R (the logits width an engine's ``max_seq_len`` gives), ``block_topk`` groups kept per row. The
candidates are those of ``registries.TOPK`` with a ``measurement`` (tuned rows), their plans what the candidate
lists for the shape on this GPU (``Candidate.plans``: the native top-k's ``plans_for``; one launch otherwise); a
candidate that does not serve here (no NVRTC, a forced ROCm library ...) is reported with its reasons and skipped.
Each (candidate, plan) is run once on the first input set and its groups and tokens compared with the torch path's
(a plan that differs is reported and dropped), then timed as the scoring sweeps are (``timing.time_launcher``:
random fp32 logits rotated past L2, CUDA-graph replay, the median of ``--replays``), with the expansion fused, as
``qsa_select_paged_tokens`` runs the step. ``visible`` is each row's (its position and its request's context): all
columns at the uniform points, mixed at 9x4 @ 64K-128K and 128x1 @ 8K-200K.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels.platform import Platform
from ..kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from ..runtime import native_topk, registries
from ..runtime.settings import QsaSettings
from .inputs import L2_ROTATE_BYTES
from .timing import time_launcher
from .work_points import COMPRESS_RATIO, TOKEN_TOPK, WorkPoint, work_points

#: The block top-k the model keeps (2048 tokens: 512 groups), the default of ``--block-topk``.
BLOCK_TOPK = TOKEN_TOPK // COMPRESS_RATIO


def tuned_candidates() -> tuple[str, ...]:
    """The top-k candidates with tuned rows (``Candidate.measurement``), in the registry's order: those the top-k
    mode times."""
    return tuple(name for name in registries.TOPK.ranked(registries.ANY_PHASE)
                 if registries.TOPK.candidates[name].measurement is not None)


@dataclass(frozen=True)
class TopkSweep:
    """One work point of the top-k mode: its ``rows`` x ``columns`` logits, ``block_topk`` kept per row."""

    point: WorkPoint
    block_topk: int
    ratio: int = COMPRESS_RATIO
    also: tuple[str, ...] = ()  # the other work points of the same top-k shape (rows and columns)

    @property
    def rows(self) -> int:
        return self.point.requests * self.point.rows_per_request

    @property
    def columns(self) -> int:
        return self.point.longest_context // self.ratio

    @property
    def problem(self) -> registries.TopkProblem:
        """The top-k step of the point as ``qsa_select_paged_tokens`` makes it (on a GPU, the expansion fused)."""
        return registries.TopkProblem("cuda", self.rows, self.columns, self.block_topk, fused=True)

    @property
    def name(self) -> str:
        return f"{self.point.name} ({self.point.phase}) {self.rows} x {self.columns}"

    @property
    def source(self) -> str:
        """The ``source`` of its rows: the command, and the work points of its shape."""
        points = ", ".join([f"{self.point.name} ({self.point.phase})", *self.also])
        return f"python -m qsa_aiter tune --op topk at {points}"


def plan_sweeps(point_filter: str = "", block_topk: int = BLOCK_TOPK) -> list[TopkSweep]:
    """The sweeps of the timed work points whose name contains one of the comma-separated ``point_filter``
    substrings (all where empty), one per top-k shape (the first point of a shape names the others in ``also``);
    points whose rows are no wider than ``block_topk`` are left out (every plan is the trivial one there, and every
    candidate takes the visible groups without reading a score)."""
    wanted = [part for part in point_filter.split(",") if part]
    sweeps: dict[tuple[int, int], TopkSweep] = {}
    for point in work_points():
        if wanted and not any(part in point.name for part in wanted):
            continue
        sweep = TopkSweep(point, block_topk)
        if sweep.columns <= block_topk:
            continue
        shape = (sweep.rows, sweep.columns)
        if shape in sweeps:  # one sweep per shape (16x4 @ 32K and 64x1 @ 32K are both 64 x 8192): the first point's
            first = sweeps[shape]
            sweeps[shape] = dataclasses.replace(first, also=(*first.also, f"{point.name} ({point.phase})"))
        else:
            sweeps[shape] = sweep
    return list(sweeps.values())


@dataclass
class TopkInputs:
    """Rotated input sets of a sweep (``problems`` and ``launches``, as ``timing.time_launcher`` takes them), and the
    torch path's groups and tokens on the first set."""

    problems: list
    launches: list[registries.TopkArgs]
    groups: torch.Tensor
    tokens: torch.Tensor


def topk_inputs(sweep: TopkSweep, device, max_sets: int = 8) -> TopkInputs:
    """Input sets of ``sweep`` on ``device`` (2 to ``max_sets``, enough that cycling through their logits exceeds L2):
    random fp32 logits ``[rows, columns]``, each row's visible count from its position (the last rows of each
    request) and its request's context, and the fused expansion's metadata and outputs."""
    point, ratio = sweep.point, sweep.ratio
    device = torch.device(device)
    # Drawn where they are used: a prefill point's logits are gigabytes.
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(f"topk/{point.name}".encode()))
    contexts = torch.tensor(point.context_lens, dtype=torch.int64)
    per_request = point.rows_per_request
    requests = torch.arange(point.requests).repeat_interleave(per_request)
    positions = contexts[requests] - per_request + torch.arange(per_request).repeat(point.requests)
    visible = torch.minimum((positions + 1) // ratio, contexts[requests] // ratio).clamp(0, sweep.columns)
    metadata = [t.to(torch.int32).to(device) for t in (positions, contexts, requests, visible)]
    positions, contexts, requests, visible = metadata
    token_topk = sweep.block_topk * ratio
    set_bytes = 4 * sweep.rows * sweep.columns
    sets = min(max_sets, max(2, math.ceil(L2_ROTATE_BYTES / max(set_bytes, 1))))
    launches = []
    for _ in range(sets):
        logits = torch.randn(sweep.rows, sweep.columns, generator=gen, device=device)
        groups = torch.empty(sweep.rows, sweep.block_topk, dtype=torch.int32, device=device)
        tokens = torch.empty(sweep.rows, token_topk + ratio - 1, dtype=torch.int32, device=device)
        launches.append(registries.TopkArgs(logits, visible, groups, sweep.block_topk,
                                            (positions, contexts, requests, tokens, ratio, token_topk)))
    first = launches[0]
    groups, tokens = torch.empty_like(first.groups), torch.empty_like(first.expand_into[3])
    torch_block_topk(first.logits, visible, sweep.block_topk, groups)
    torch_expand_block_indices(groups, positions, contexts, requests, ratio, token_topk, tokens)
    return TopkInputs([sweep.problem] * sets, launches, groups, tokens)


@dataclass
class TopkTiming:
    """What one (candidate, plan) of a sweep gave: ``us``, or ``error`` (it did not run, or selected differently)."""

    candidate: str
    plan: str
    us: float | None = None
    error: str = ""


@dataclass
class TopkSweepResult:
    sweep: TopkSweep
    timings: list[TopkTiming]
    skipped: dict[str, list[str]]  # candidate -> why it does not serve here
    heuristic: str  # the native plan choose_plan makes ('' where the native top-k does not serve)

    @property
    def timed(self) -> list[TopkTiming]:
        """The timings that ran, fastest first."""
        return sorted((t for t in self.timings if t.us is not None), key=lambda t: t.us)


def candidate_plans(name: str, problem, platform: Platform) -> dict[str, object]:
    """The plans the top-k mode times for candidate ``name``: its ``plans`` for the shape on ``platform``, or its one
    launch (``{"": None}``)."""
    candidate = registries.TOPK.candidates[name]
    return dict(candidate.plans(problem, platform)) if candidate.plans else {"": None}


def _matches(inputs: TopkInputs, launch: Callable[[object, registries.TopkArgs], None]) -> str:
    """Why ``launch`` on the first input set (outputs poisoned first) differs from the torch path ('' where not)."""
    args = inputs.launches[0]
    args.groups.fill_(-7)
    args.expand_into[3].fill_(-7)
    launch(inputs.problems[0], args)
    if not torch.equal(args.groups, inputs.groups):
        return "groups differ from the torch path's"
    if not torch.equal(args.expand_into[3], inputs.tokens):
        return "tokens differ from the torch path's"
    return ""


def time_sweep(sweep: TopkSweep, candidates: tuple[str, ...], replays: int, device, settings: QsaSettings,
               timer=time_launcher) -> TopkSweepResult:
    """Check and time every plan of every candidate of ``candidates`` that serves ``sweep`` on ``device``
    (``timer(inputs, launch, replays)``: µs per call, ``timing.time_launcher`` on a GPU)."""
    device = torch.device(device)
    platform = Platform.of(device)
    problem = dataclasses.replace(sweep.problem, device_type=device.type)
    skipped = {name: why for name in candidates if (why := registries.TOPK.reasons(name, problem, settings))}
    inputs = topk_inputs(sweep, device)
    inputs.problems = [problem] * len(inputs.launches)
    timings = []
    for name in candidates:
        if name in skipped:
            continue
        candidate = registries.TOPK.candidates[name]
        for plan_name, plan in candidate_plans(name, problem, platform).items():
            timing = TopkTiming(name, plan_name)
            timings.append(timing)
            planned = dataclasses.replace(inputs, launches=[dataclasses.replace(a, plan=plan) for a in inputs.launches])

            def launch(p, args, candidate=candidate):
                candidate.launch(p, args, settings)

            try:
                timing.error = _matches(planned, launch)
                if not timing.error:
                    timing.us = timer(planned, launch, replays)
            except Exception as err:  # a plan that does not compile or launch here
                message = str(err).splitlines()[0][:200] if str(err) else ""
                timing.error = f"{type(err).__name__}: {message}"
    heuristic = ""
    if (native_topk.CANDIDATE in candidates and native_topk.CANDIDATE not in skipped
            and not native_topk.kernels.SPEC.reasons(problem, platform)):
        chosen = native_topk.kernels.choose_plan(sweep.rows, sweep.columns, sweep.block_topk, platform)
        plans = candidate_plans(native_topk.CANDIDATE, problem, platform)
        heuristic = next((n for n, p in plans.items() if p == chosen), chosen.variant.name)
    del inputs
    return TopkSweepResult(sweep, timings, skipped, heuristic)


def topk_rows(result: TopkSweepResult, arch: str) -> list[dict]:
    """The top-k table's rows of a sweep (``tuned.TopkRow`` columns): one per (candidate, plan) that ran, measured
    on ``arch``."""
    sweep = result.sweep
    return [dict(arch=arch, block_topk=sweep.block_topk, rows=sweep.rows, columns=sweep.columns,
                 candidate=t.candidate, plan=t.plan, us=f"{t.us:.2f}", measured=1,
                 source=sweep.source)
            for t in result.timed]


def summary(result: TopkSweepResult) -> str:
    """One line per sweep: every timing, fastest first, what failed or was skipped, and the native heuristic's plan
    against the fastest."""
    timed = result.timed
    parts = [f"{t.candidate}{' ' + t.plan if t.plan else ''} {t.us:.2f}" for t in timed]
    line = f"{result.sweep.name:<44} " + (", ".join(parts) + " us" if parts else "nothing ran")
    if result.heuristic:
        line += f"; choose_plan: {result.heuristic}"
    failed = [f"{t.candidate}{' ' + t.plan if t.plan else ''}: {t.error}" for t in result.timings if t.error]
    skipped = [f"{name}: {'; '.join(why)}" for name, why in result.skipped.items()]
    return "\n".join([line] + [f"    failed {f}" for f in failed] + [f"    skipped {s}" for s in skipped])

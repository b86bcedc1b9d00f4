"""The tuner (``python -m qsa_aiter tune``): measures candidate tile configs of each scoring kernel at the benchmark's
work points (docs/benchmarks.md) on the present GPU and writes the best one per point as a tuned-config row
(``qsa_aiter.runtime.tuned``); with ``--op topk``, the block top-k's candidates and native plans, one row each.

A sweep is one (kernel, work point, cache format, page size): the kernels are those whose spec has a candidate grid
(``KernelSpec.tune_grid``), at the work points their spec names (``tune_points``). Its candidates are the product of
the grid (or ``--grid`` axes) plus the kernel's default config; the default is always timed, so every row records
what tuning gained (``default_us`` beside ``us``). Two stages:

1. **Compile and check**, in ``--jobs`` worker processes: each launches its share of the candidates once on one
   input set of the sweep's shapes, so Triton compiles them into its on-disk cache in parallel, and compares the
   logits of ``[0, visible)`` with the default config's (poisoned output first). A config that does not compile
   (shared memory, registers) or scores differently is reported and dropped.
2. **Time**, in this process, one candidate after another (timings never share the GPU): the benchmark's rotated
   input sets (past L2), CUDA-graph replay, the median of ``--replays`` (``qsa_aiter.tools.timing.time_launcher``).

With ``--csv FILE`` the best config of each sweep replaces the row with the same key and buckets in FILE (other
rows are kept), so re-tuning a point updates it in place. ``--results FILE`` writes every timing.

``--op topk`` tunes the block top-k instead (``tools/topk_tuning.py``): each top-k candidate with tuned rows, and
each plan of the native one, timed at the work points on random logits of the point's shape, one row per
(candidate, plan) into a top-k table (``configs/topk.csv``), from which the dispatcher takes the fastest.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import multiprocessing
import os
import sys
from pathlib import Path

from tqdm import tqdm

from ..kernels.catalog import spec_named, tunable_specs
from ..kernels.quant.formats import CACHE_FORMATS
from ..runtime import tuned
from . import topk_tuning
from .cli_args import RenamedOption, add_page_sizes, cache_formats, comma_subset, positive_int, run_command
from .inputs import point_inputs
from .testing import e4m3_mma_atol
from .timing import time_launcher
from .tuned_rows import check_kind, merge_rows
from .work_points import point_named

#: The kernels tuned, by name: every spec with a candidate grid.
KERNELS = tuple(spec.name for spec in tunable_specs())
#: The index-cache formats tuned by default: one of each kind the tuned tables key rows by (bf16, fp8, fp4).
CACHES = ("bf16", "fp8", "fp4")
#: What ``--op`` tunes: the scoring kernels' tiles, or the block top-k's candidates and plans.
OPS = ("scoring", "topk")
#: The options of one ``--op`` only (their destinations): giving one with the other op is an error.
SCORING_ONLY = ("kernels", "caches", "page_sizes", "grid", "jobs")
TOPK_ONLY = ("candidates", "block_topk")


@dataclasses.dataclass(frozen=True)
class Sweep:
    """One (kernel, work point, phase, cache format, page size) to tune."""

    kernel: str
    point: str
    phase: str
    cache: str
    page_size: int

    @property
    def name(self) -> str:
        return f"{self.kernel} {self.point} ({self.phase}) {self.cache} page {self.page_size}"


@dataclasses.dataclass
class SweepResult:
    sweep: Sweep
    default: object  # the kernel's default config for the point
    default_us: float | None
    timings: list[tuple[float, object]]  # (µs, config), fastest first
    failed: list[tuple[object, str]]
    problem: object = None  # the point's ``Problem`` (the row's key and buckets)

    @property
    def best(self) -> tuple[float, object] | None:
        return self.timings[0] if self.timings else None


def _launch(kernel: str, problem, args, cfg) -> None:
    """One launch of ``kernel``'s plan for ``problem`` with tile config ``cfg`` on ``args`` (``ScoreArgs``)."""
    from ..kernels.platform import Platform

    spec_named(kernel).plan(problem, Platform.of(args.q.device), config=cfg).launch(*args.kernel_args())


def _point(sweep: Sweep):
    """The sweep's work point, in the sweep's phase."""
    return dataclasses.replace(point_named(sweep.point), phase=sweep.phase)


def candidates(kernel: str, default, grid: dict[str, tuple[int, ...]]) -> list:
    """The default config, then every combination of ``grid`` applied over it (duplicates dropped, in order)."""
    fields = {f.name for f in dataclasses.fields(default)}
    unknown = sorted(set(grid) - fields)
    if unknown:
        raise ValueError(f"--grid: {', '.join(unknown)} is not a setting of the {kernel} kernel "
                         f"(settings: {', '.join(sorted(fields))})")
    out = [default]
    for values in itertools.product(*grid.values()):
        cfg = dataclasses.replace(default, **dict(zip(grid, values)))
        if cfg not in out:
            out.append(cfg)
    return out


def plan(kernels, caches, pages, point_filter: str = "") -> list[Sweep]:
    sweeps = []
    for kernel in kernels:
        for point, phase in spec_named(kernel).tune_points:
            if point_filter and not any(s in point for s in point_filter.split(",")):
                continue
            for page in pages:
                for cache in caches:
                    sweeps.append(Sweep(kernel, point, phase, cache, page))
    return sweeps


# --- stage 1: compile in worker processes --------------------------------------------------------------------------

_WORKER_INPUTS: dict = {}


def _compile_share(task: tuple[Sweep, list]) -> tuple[int, list[tuple[Sweep, object, str]]]:
    """Launch each config of ``task`` once on one input set (compiling it); return how many configs it had and
    those that failed, with the error."""
    import torch

    sweep, default, configs = task
    if sweep not in _WORKER_INPUTS:
        _WORKER_INPUTS.clear()
        torch.cuda.empty_cache()
        inputs = point_inputs(_point(sweep), sweep.page_size, torch.device("cuda"), sweep.cache, max_sets=1)
        _WORKER_INPUTS[sweep] = inputs, _scores(sweep.kernel, inputs, default)
    inputs, expected = _WORKER_INPUTS[sweep]
    failed = []
    for cfg in configs:
        try:
            got = _scores(sweep.kernel, inputs, cfg)
        except Exception as err:  # a config that does not compile or launch (shared memory, registers)
            failed.append((sweep, cfg, f"{type(err).__name__}: {str(err)[:200]}"))
            continue
        if not torch.equal(got[1], expected[1]):
            failed.append((sweep, cfg, "visible lengths differ from the default config's"))
        elif not _close(got[0], expected[0], _atol(sweep, inputs, default, cfg)):
            failed.append((sweep, cfg, "logits differ from the default config's"))
    return len(configs), failed


def _uses_e4m3_mma(kernel: str, problem, device, cfg) -> bool:
    from ..kernels.platform import Platform

    return bool(spec_named(kernel).plan(problem, Platform.of(device), config=cfg).constexprs.get("E4M3_MMA"))


def _atol(sweep: Sweep, inputs, default, cfg):
    """The absolute tolerance of ``cfg``'s logits against the default config's: 1e-4, plus ``E4M3_MMA_TOL`` of the
    magnitude bound (``testing.magnitude_bound``, per logit) where either scores with e4m3 tensor cores, which
    round inside their sums (a config may feed them where the default decodes)."""
    import torch

    problem, args = inputs.problems[0], inputs.launches[0]
    if not any(_uses_e4m3_mma(sweep.kernel, problem, args.q.device, c) for c in (default, cfg)):
        return 1e-4
    key = ("e4m3 atol", sweep)
    if key not in _WORKER_INPUTS:
        atol = e4m3_mma_atol(
            (args.q, args.k_cache, args.page_table, args.token_to_request, args.query_positions, args.context_lens,
             args.compress_ratio), 1e-4, score_divisor=1.0 / args.scale, max_columns=args.num_columns,
            k_scale=args.k_scale)
        # The bound is -inf past a row's visible count and at bad pages: there the scores compared are zeros
        # (``_scores``) or -inf, matched exactly, and a -inf tolerance would fail every config.
        _WORKER_INPUTS[key] = torch.where(torch.isfinite(atol), atol, 1e-4)
    return _WORKER_INPUTS[key]


def _close(got, expected, atol) -> bool:
    """``got`` within ``atol`` (a float or a per-logit tensor) plus 1e-3 relative of ``expected``; equal infinities
    match, NaN (unwritten) never does."""
    import torch

    near = (got - expected).abs() <= atol + 1e-3 * expected.abs()
    return bool(torch.where(torch.isfinite(expected), near, got == expected).all())


def _scores(kernel: str, inputs, cfg):
    """One launch of ``cfg`` on the first input set, output poisoned first: (logits with the columns past each row's
    visible length zeroed, visible)."""
    import torch

    problem, args = inputs.problems[0], inputs.launches[0]
    args.logits.fill_(float("nan"))
    args.visible.fill_(-1)
    _launch(kernel, problem, args, cfg)
    columns = torch.arange(args.logits.shape[1], device=args.logits.device)
    inside = columns[None, :] < args.visible[:, None].long()
    return torch.where(inside, args.logits, 0.0), args.visible.clone()


def compile_all(work: dict[Sweep, list], jobs: int, progress: bool) -> dict[tuple[Sweep, object], str]:
    """Compile every (sweep, config) in ``jobs`` processes; returns {(sweep, config): error} of those that failed."""
    tasks = [(sweep, configs[0], configs[i:i + 8]) for sweep, configs in work.items()
             for i in range(1, len(configs), 8)]
    failed: dict = {}
    bar = tqdm(total=sum(len(t[2]) for t in tasks), desc="compile", unit="config", disable=not progress)
    if jobs <= 1:
        results = map(_compile_share, tasks)
        pool = None
    else:
        # spawn: CUDA cannot be used in forked children of a process that has initialised it.
        pool = multiprocessing.get_context("spawn").Pool(jobs)
        results = pool.imap_unordered(_compile_share, tasks)
    try:
        for count, share in results:
            for sweep, cfg, error in share:
                failed[(sweep, cfg)] = error
            bar.update(count)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
            pool.join()
    return failed


# --- stage 2: time in this process ---------------------------------------------------------------------------------

def time_sweep(sweep: Sweep, configs: list, failed: dict, replays: int, device, progress: bool) -> SweepResult:
    import torch

    inputs = point_inputs(_point(sweep), sweep.page_size, device, sweep.cache)
    default = configs[0]
    timings, errors = [], [(cfg, failed[(sweep, cfg)]) for cfg in configs if (sweep, cfg) in failed]
    for cfg in tqdm(configs, desc=sweep.name, leave=False, disable=not progress):
        if (sweep, cfg) in failed:
            continue
        try:
            us = time_launcher(inputs, lambda p, a, cfg=cfg: _launch(sweep.kernel, p, a, cfg), replays)
        except Exception as err:
            errors.append((cfg, f"{type(err).__name__}: {str(err)[:200]}"))
            continue
        timings.append((us, cfg))
    default_us = next((us for us, cfg in timings if cfg == default), None)
    timings.sort(key=lambda t: t[0])
    result = SweepResult(sweep, default, default_us, timings, errors, inputs.problems[0])
    del inputs
    torch.cuda.empty_cache()
    return result


# --- output --------------------------------------------------------------------------------------------------------

def tuned_row(result: SweepResult, arch: str) -> dict:
    """The CSV row of a sweep's best config (the ``qsa_aiter.runtime.tuned`` format)."""
    from ..runtime import tuned

    us, cfg = result.best
    problem, sweep = result.problem, result.sweep
    row = dict(zip(tuned.KEY_FIELDS + tuned.BUCKET_FIELDS,
                   tuned.problem_key(arch, sweep.kernel, problem) + tuned.buckets(problem)), us=f"{us:.2f}",
               default_us=f"{result.default_us:.2f}" if result.default_us else "", measured=1,
               source=f"python -m qsa_aiter tune at {sweep.point} ({sweep.phase})", **dataclasses.asdict(cfg))
    return {k: v for k, v in row.items() if k in tuned.TunedRow.model_fields}


def _parse_grid(items: list[str]) -> dict[str, tuple[int, ...]]:
    """``["block_n=64,128", ...]`` -> ``{"block_n": (64, 128), ...}``; anything else raises ``ValueError``."""
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        try:
            grid[name] = tuple(int(v) for v in values.split(","))
        except ValueError:
            raise ValueError(f"--grid: expected field=v1,v2,... (integers); got {item!r}") from None
    return grid


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m qsa_aiter tune``."""
    parser = argparse.ArgumentParser(prog="python -m qsa_aiter tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=OPS, default="scoring",
                        help="what to tune: the scoring kernels' tile configs (default; rows of configs/scoring.csv) "
                             "or the block top-k's candidates and native plans (rows of configs/topk.csv)")
    parser.add_argument("--kernels", type=comma_subset(KERNELS), default=KERNELS,
                        help=f"kernels to tune, comma-separated among {','.join(KERNELS)} (default: all)")
    parser.add_argument("--caches", type=cache_formats, default=CACHES,
                        help=f"index-cache formats, comma-separated, among {', '.join(CACHE_FORMATS)} "
                             f"(default {','.join(CACHES)})")
    parser.add_argument("--kv", dest="caches", type=cache_formats, action=RenamedOption, renamed_to="--caches")
    add_page_sizes(parser)
    parser.add_argument("--points", default="",
                        help="substrings of work-point names, comma-separated (default: the kernel's plan; with "
                             "--op topk every timed work point)")
    candidates = topk_tuning.tuned_candidates()
    parser.add_argument("--candidates", type=comma_subset(candidates), default=candidates,
                        help=f"--op topk: top-k candidates to time, comma-separated among {','.join(candidates)} "
                             "(default: all; every plan of each)")
    parser.add_argument("--block-topk", type=positive_int, default=topk_tuning.BLOCK_TOPK,
                        help=f"--op topk: groups kept per row (default {topk_tuning.BLOCK_TOPK}, the model's token "
                             "top-k 2048 at R 4)")
    parser.add_argument("--grid", action="append", default=None, metavar="FIELD=V1,V2",
                        help="a candidate axis instead of the kernel's grid (one kernel at a time); repeat the option "
                             "for each axis: --grid block_n=64,128 --grid num_stages=2,3")
    parser.add_argument("--replays", type=positive_int, default=20,
                        help="CUDA-graph replays per timing of a config, the median kept (default 20)")
    parser.add_argument("--jobs", type=positive_int, default=max(1, min(16, (os.cpu_count() or 2) - 1)),
                        help="compile worker processes")
    parser.add_argument("--csv", default="", help="table to write the best row of each sweep into")
    parser.add_argument("--results", default="", help="CSV of every timing")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bars (compiles and sweeps); each sweep's result line is still printed")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, set[str]]:
    """``parser``'s arguments from ``argv``, and the destinations of the options it gave (the others keep their
    defaults): an option of the other ``--op`` is an argparse error naming it."""
    unset = object()
    # Each destination starts unset (an appending option's as None, which it appends to): what is still unset, or
    # None, after parsing was not given, and takes its default.
    args = argparse.Namespace(**{a.dest: None if isinstance(a, argparse._AppendAction) else unset
                                 for a in parser._actions if a.dest != argparse.SUPPRESS})
    parser.parse_args(argv, namespace=args)
    given = {dest for dest, value in vars(args).items() if value is not unset and value is not None}
    for dest in set(vars(args)) - given:
        setattr(args, dest, parser.get_default(dest))
    other, other_op = (TOPK_ONLY, "topk") if args.op == "scoring" else (SCORING_ONLY, "scoring")
    wrong = sorted({a.option_strings[0] for a in parser._actions
                    if a.dest in other and a.dest in given and a.help != argparse.SUPPRESS})
    if wrong:
        parser.error(f"{', '.join(wrong)}: an option of --op {other_op} only (this run is --op {args.op})")
    return args, given


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, _ = parse(parser, argv)
    if args.op == "topk":
        return tune_topk(args)
    kernels = list(args.kernels)
    if args.grid is not None and len(kernels) != 1:
        parser.error("--grid applies to one kernel: give --kernels with one name")

    grid = None
    if args.grid is not None:
        try:
            grid = _parse_grid(args.grid)
            candidates(kernels[0], spec_named(kernels[0]).Config(), grid)  # names a field it lacks
        except ValueError as err:
            parser.error(str(err))
    sweeps = plan(kernels, args.caches, list(args.page_sizes), args.points)
    if not sweeps:  # nothing to tune: say so rather than exit 0 having done nothing
        print(f"error: --points {args.points!r} matches none of the work points {', '.join(kernels)} is tuned at",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: the tuner needs a GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    from ..kernels.platform import Platform

    platform = Platform.of(device)
    arch = platform.arch
    print(f"{torch.cuda.get_device_name()} ({arch}): {len(sweeps)} sweeps")
    results = []
    log = open(args.results, "w", newline="") if args.results else None
    writer = csv.DictWriter(log, fieldnames=["sweep", "us", "config"]) if log else None
    if writer:
        writer.writeheader()
    try:
        # One kernel at a time (candidates, compile, time): an interrupted run keeps the rows of the kernels before.
        for kernel in kernels:
            work = {}
            for sweep in (s for s in sweeps if s.kernel == kernel):
                inputs = point_inputs(_point(sweep), sweep.page_size, device, sweep.cache, max_sets=1)
                default = spec_named(kernel).default_config(inputs.problems[0], platform)
                del inputs
                work[sweep] = candidates(kernel, default, grid or spec_named(kernel).tune_grid)
            torch.cuda.empty_cache()
            failed = compile_all(work, args.jobs, not args.no_progress)
            for sweep, configs in tqdm(work.items(), desc=f"time {kernel}", unit="sweep", disable=args.no_progress):
                result = time_sweep(sweep, configs, failed, args.replays, device, not args.no_progress)
                results.append(result)
                if writer:
                    writer.writerows(dict(sweep=sweep.name, us=f"{us:.2f}", config=repr(cfg))
                                     for us, cfg in result.timings)
                    writer.writerows(dict(sweep=sweep.name, us="", config=f"{cfg!r} failed: {error}")
                                     for cfg, error in result.failed)
                    log.flush()
                if not result.best:
                    tqdm.write(f"{sweep.name:<52} no config ran")
                    continue
                us, cfg = result.best
                gain = f"{result.default_us / us:5.2f}x" if result.default_us else "  n/a"
                tqdm.write(f"{sweep.name:<52} default {result.default_us or float('nan'):9.2f} us  "
                           f"best {us:9.2f} us {gain}  {cfg}")
                if args.csv:  # row by row, so an interrupted run keeps what it measured
                    merge_rows(Path(args.csv), [tuned_row(result, arch)])
    finally:
        if log:
            log.close()
    return 0 if all(r.best for r in results) else 1


def tune_topk(args: argparse.Namespace, timer=time_launcher) -> int:
    """``--op topk``: time the top-k candidates and plans at the work points (``topk_tuning``) and write their rows
    into ``--csv`` (a top-k table) sweep by sweep; 0 where every sweep timed something, 1 where one did not, 2 for
    bad arguments (no point matches, ``--csv`` a scoring table) or no GPU."""
    sweeps = topk_tuning.plan_sweeps(args.points, args.block_topk)
    if not sweeps:
        print(f"error: --points {args.points!r} matches none of the work points whose rows are wider than "
              f"--block-topk {args.block_topk}", file=sys.stderr)
        return 2
    if args.csv:
        try:
            check_kind(Path(args.csv), tuned.TOPK_TABLE)
        except ValueError as err:
            print(f"error: --csv: {err}", file=sys.stderr)
            return 2
    import torch

    if not torch.cuda.is_available():
        print("error: the tuner needs a GPU (--op topk times the top-k kernels on it)", file=sys.stderr)
        return 2
    from ..kernels.platform import Platform
    from ..runtime.settings import get_settings

    device = torch.device("cuda")
    arch = Platform.of(device).arch
    settings = get_settings()
    print(f"{torch.cuda.get_device_name()} ({arch}): {len(sweeps)} top-k sweeps of {', '.join(args.candidates)}")
    results = []
    log = open(args.results, "w", newline="") if args.results else None
    writer = csv.DictWriter(log, fieldnames=["sweep", "candidate", "plan", "us", "error"]) if log else None
    if writer:
        writer.writeheader()
    try:
        for sweep in tqdm(sweeps, desc="time top-k", unit="sweep", disable=args.no_progress):
            result = topk_tuning.time_sweep(sweep, tuple(args.candidates), args.replays, device, settings, timer)
            results.append(result)
            torch.cuda.empty_cache()
            tqdm.write(topk_tuning.summary(result))
            if writer:
                writer.writerows(dict(sweep=sweep.name, candidate=t.candidate, plan=t.plan,
                                      us="" if t.us is None else f"{t.us:.2f}", error=t.error)
                                 for t in result.timings)
                log.flush()
            rows = topk_tuning.topk_rows(result, arch)
            if args.csv and rows:  # sweep by sweep, so an interrupted run keeps what it measured
                merge_rows(Path(args.csv), rows, tuned.TOPK_TABLE)
    finally:
        if log:
            log.close()
    return 0 if all(r.timed for r in results) else 1


if __name__ == "__main__":  # as ``python -m qsa_aiter tune`` runs it (environment check, closed pipes)
    raise SystemExit(run_command(main, sys.argv[1:]))

"""Tile configs for GPUs this project cannot time on, chosen by a static model from what the compiler builds
(``python -m qsa_aiter model-configs --arch gfx942,gfx950``).

For every MFMA scorer x index-cache format x page size, each candidate config is compiled for the target
(``aot.compile_plan``), in every variant the row serves in the warm-up matrix (``row_problems``: each phase's work
points, and both cache formats of a kv dtype), and read from its assembly (``assembly``): registers, LDS, scratch and
waves per SIMD, the worst of its variants. The model:

1. **No spills**: a candidate with scratch (``.private_segment_fixed_size > 0``) is out.
2. **Waves per SIMD** (the smaller of the register and the LDS limit, ``assembly.amd_waves``) of at least
   ``MIN_WAVES[phase]``: 2 for decode/verify/draft (their loops wait on paged key gathers; a second wave hides one
   gather behind the other's MFMAs), 1 for prefill (its tiles reuse each key tile across 128 query columns).
3. Among the rest, the order of ``_rank``: decode/verify prefer more waves (up to ``WAVES_ENOUGH``), then wider key
   tiles (fewer loop trips, longer loads), then deeper staging, then fewer VGPRs; prefill prefers the larger output
   tile (MFMA work per key byte), then waves, then staging.
4. ``programs_per_sm`` (where the kernel has it) = workgroups that fit one CU at those waves
   (``waves x 4 SIMDs / num_warps``): one wave of programs fills the GPU.

Each row is written with ``measured=0`` and a ``source`` that starts ``model, not measured:``, so ``explain`` says
what it is; the tuner's rows replace them the day it runs on the hardware (same key and bucket), and a row already in
the table that is not the model's (measured, or reported from the hardware) is never replaced by one. The e4m3 cache
of a target is its MFMAs' flavour (gfx942: e4m3fnuz; gfx950: e4m3fn), since the fp8 rows serve both.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

from ..kernels import catalog
from ..kernels.platform import Platform
from ..kernels.quant.formats import CACHE_FORMATS
from ..kernels.scoring import keys_major, stacked, tiled
from ..kernels.scoring.base import example_problem, work_problem
from ..runtime import tuned
from ..runtime.settings import get_settings
from .aot import compile_plan
from .assembly import amd_resources, amd_waves, mma_mix
from .cli_args import PAGE_SIZE_MEANING, cache_formats, comma_subset, run_command
from .tuned_rows import merge_rows, row_key
from .warmup import Matrix, WarmContext
from .work_points import point_named

#: The targets modelled and their e4m3 cache flavour (the one their MFMAs multiply).
TARGETS = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}
#: The kernels modelled (the MFMA scorers; the row-wise CUDA-core fallback keeps its defaults).
KERNELS = (stacked.SPEC.name, keys_major.SPEC.name, tiled.SPEC.name)
#: How a model row's ``source`` starts (``explain`` prints it with the row).
MODEL_SOURCE = "model, not measured:"
#: One row per cache kind (``CacheFormat.kind``: bf16 serves fp16 too, fp8 serves fp8_fnuz): q dtype and kv name.
FORMATS = {"bf16": (torch.bfloat16, "bf16"), "fp8": (None, "fp8"), "fp4": (torch.float4_e2m1fn_x2, "fp4")}
PAGE_SIZES = (16, 64)
MIN_WAVES = {"prefill": 1, "verify": 2, "draft": 2, "decode": 2}
#: Waves per SIMD beyond which more do not hide more latency in the model (a wider tile wins instead).
WAVES_ENOUGH = 4
SIMDS_PER_CU = 4
#: The candidate axes per kernel: the fields that change what is compiled (``programs_per_sm`` only sizes the grid:
#: the model sets it). ``num_warps`` is an axis here: an AMD wave is 64 lanes, so the NVIDIA defaults' 4 warps are
#: twice the lanes.
GRIDS = {
    stacked.SPEC.name: dict(block_n=(32, 64, 128), num_warps=(2, 4), num_stages=(2, 3)),
    keys_major.SPEC.name: dict(block_n=(64, 128), num_warps=(2, 4), num_stages=(2, 3)),
    # Prefill: keys-major tiles with every head stacked as N only. Rows as M, or one N operand per head, keep four
    # accumulators live and spilled on gfx950 at every tile of 32 rows or more (docs/kernels.md).
    tiled.SPEC.name: dict(block_m=(32, 64), block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3), keys_major=(1,),
                  stack_heads=(1,)),
}


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled candidate config and what its assembly says."""

    config: object
    mma: dict
    vgprs: int
    agprs: int
    lds: int
    scratch: int
    waves: int
    limit: str

    @property
    def work(self) -> int:
        """Output elements per tile of the config (rows x keys; the decode kernels' rows are fixed)."""
        return getattr(self.config, "block_m", 1) * self.config.block_n


def model_problem(kernel: str, arch: str, fmt: str, page_size: int):
    """The ``ScoreProblem`` a row is modelled at: the kernel's first tuning work point (its main one), the model's
    shape, ``fmt`` (fp8: the target's flavour) and ``page_size``."""
    spec = catalog.spec_named(kernel)
    point_name, phase = spec.tune_points[0]
    point = dataclasses.replace(point_named(point_name), phase=phase)
    dtype, kv = FORMATS[fmt]
    base = example_problem(cache_dtype=dtype or TARGETS[arch], kv_dtype=kv, block_size=page_size)
    return work_problem(base, point.requests, point.rows_per_request, point.longest_context, phase)


def candidates(kernel: str, problem, platform: Platform) -> list:
    """The default config on ``platform``, then every combination of the kernel's ``GRIDS`` over it that the kernel
    accepts (a stacked-heads tile needs ``stack_heads`` with ``keys_major``, and rows x heads of 128)."""
    spec = catalog.spec_named(kernel)
    default = spec.default_config(problem, platform)
    grid = GRIDS[kernel]
    out = [default]
    for values in itertools.product(*grid.values()):
        cfg = dataclasses.replace(default, **dict(zip(grid, values)))
        if kernel == tiled.SPEC.name and cfg.stack_heads and cfg.block_m * problem.num_heads > 256:
            continue  # a stacked N operand beyond 256 columns: more LDS than a CU has
        if cfg not in out:
            out.append(cfg)
    return out


#: The cache formats a row's kv dtype serves: its candidates must keep their registers on each.
SERVED_CACHES = {"bf16": ("bf16", "fp16"), "fp8": ("fp8", "fp8_fnuz"), "fp4": ("fp4",)}


def row_problems(kernel: str, arch: str, fmt: str, page_size: int) -> list:
    """Every problem a row of ``kernel`` x ``fmt`` x ``page_size`` on ``arch`` serves in the warm-up matrix (each
    phase's warmed work points, with every cache format of the kv dtype: fp8 rows serve both e4m3 flavours, which
    one target multiplies and the other decodes), the modelled point first."""
    matrix = Matrix(kernels=(kernel,), caches=SERVED_CACHES[fmt], page_sizes=(page_size,), index_dtypes=("int32",))
    context = WarmContext(matrix, Platform.named(arch), get_settings())
    return [model_problem(kernel, arch, fmt, page_size)] + [p for _, p in
                                                            context.scorer_problems(catalog.spec_named(kernel))]


def measure(kernel: str, problems: list, arch: str, cfg) -> Candidate | None:
    """Compile ``cfg`` for ``arch`` for every distinct variant it takes over ``problems`` (``row_problems``) and read
    them: the worst of them (most scratch and registers, fewest waves), with the first problem's MFMA instructions.
    None when the compiler refuses one."""
    platform = Platform.named(arch)
    spec = catalog.spec_named(kernel)
    builds, seen = [], set()
    for problem in problems:
        plan = spec.plan(problem, platform, config=cfg)
        key = (tuple(sorted((k, str(v)) for k, v in plan.constexprs.items())), tuple(sorted(plan.options.items())))
        if key in seen:
            continue
        seen.add(key)
        try:
            built = compile_plan(spec, problem, arch, config=cfg)
        except Exception:  # a config the backend cannot build (too much LDS ...) is no candidate
            return None
        text = built.asm["amdgcn"]
        res = amd_resources(text)
        lds = int(built.metadata.shared)
        waves, limit = amd_waves(res["occupancy"], lds, cfg.num_warps, platform.shared_memory_per_multiprocessor)
        builds.append((mma_mix(text, True), res, lds, waves, limit))
    worst = min(builds, key=lambda b: (b[3], -b[1]["scratch"]))
    return Candidate(cfg, builds[0][0], max(b[1]["vgprs"] for b in builds), max(b[1]["agprs"] for b in builds),
                     max(b[2] for b in builds), max(b[1]["scratch"] for b in builds), worst[3], worst[4])


def _rank(candidate: Candidate, phase: str) -> tuple:
    """Sort key of an admissible candidate (smaller first), as the module's docstring says."""
    cfg = candidate.config
    stages = getattr(cfg, "num_stages", 1)
    if phase == "prefill":
        return (-candidate.work, -min(candidate.waves, WAVES_ENOUGH), -stages, candidate.vgprs + candidate.agprs)
    return (-min(candidate.waves, WAVES_ENOUGH), -cfg.block_n, -stages, candidate.vgprs + candidate.agprs)


def choose(measured: list[Candidate], phase: str) -> Candidate | None:
    """The model's choice among ``measured``: no scratch, at least ``MIN_WAVES[phase]`` waves per SIMD, best by
    ``_rank``; None when no candidate is admissible."""
    admissible = [c for c in measured if c is not None and c.scratch == 0 and c.waves >= MIN_WAVES[phase]]
    return min(admissible, key=lambda c: _rank(c, phase)) if admissible else None


def fill_programs(candidate: Candidate) -> object:
    """The chosen config with ``programs_per_sm`` set to the workgroups one CU holds at its waves (kernels that have
    the field)."""
    cfg = candidate.config
    if not any(f.name == "programs_per_sm" for f in dataclasses.fields(cfg)):
        return cfg
    return dataclasses.replace(cfg, programs_per_sm=max(1, candidate.waves * SIMDS_PER_CU // cfg.num_warps))


def model_row(kernel: str, arch: str, fmt: str, page_size: int) -> dict:
    """The CSV row (``tuned.TunedRow`` fields) the model chooses for one kernel x format x page size on ``arch``.
    Raises ``RuntimeError`` when no candidate is admissible."""
    problems = row_problems(kernel, arch, fmt, page_size)
    problem = problems[0]
    platform = Platform.named(arch)
    measured = [measure(kernel, problems, arch, cfg) for cfg in candidates(kernel, problem, platform)]
    chosen = choose(measured, problem.phase)
    if chosen is None:
        raise RuntimeError(f"{kernel} {fmt} page {page_size} on {arch}: no candidate without scratch reaches "
                           f"{MIN_WAVES[problem.phase]} waves per SIMD")
    cfg = fill_programs(chosen)
    mix = ", ".join(f"{name} x{count}" for name, count in chosen.mma.items()) or "no MFMA"
    source = (f"{MODEL_SOURCE} {chosen.waves} waves/SIMD ({chosen.limit}), {chosen.vgprs} VGPR + "
              f"{chosen.agprs} AGPR, {chosen.lds} B LDS, no scratch; {mix}; "
              f"{sum(c is not None for c in measured)} candidates compiled (python -m qsa_aiter model-configs)")
    row = dict(zip(tuned.KEY_FIELDS + tuned.BUCKET_FIELDS,
                   tuned.problem_key(arch, kernel, problem) + tuned.buckets(problem)),
               measured=0, source=source, **dataclasses.asdict(cfg))
    return {k: v for k, v in row.items() if k in tuned.TunedRow.model_fields}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m qsa_aiter model-configs",
        description="Choose tile configs for AMD targets by the static model of qsa_aiter/tools/static_model.py "
                    "(compiled for the target, read from the assembly; no GPU) and write them as model rows "
                    "(measured=0) into a tuned table.")
    parser.add_argument("--arch", type=comma_subset(tuple(TARGETS)), default=tuple(TARGETS),
                        help=f"comma-separated subset of {','.join(TARGETS)} (default: both)")
    parser.add_argument("--kernels", type=comma_subset(KERNELS), default=KERNELS,
                        help=f"comma-separated subset of {','.join(KERNELS)} (default: all)")
    parser.add_argument("--caches", type=cache_formats, default=tuple(FORMATS),
                        help=f"index-cache formats, comma-separated, among {','.join(CACHE_FORMATS)} (default: "
                             f"{','.join(FORMATS)}); one row serves each kind (bf16 and fp16 alike, fp8 and fp8_fnuz "
                             "alike: the target's e4m3 flavour is modelled)")
    parser.add_argument("--page-sizes", type=comma_subset(tuple(map(str, PAGE_SIZES))),
                        default=tuple(map(str, PAGE_SIZES)),
                        help=f"comma-separated page sizes among {','.join(map(str, PAGE_SIZES))} "
                             f"({PAGE_SIZE_MEANING}; default: all)")
    parser.add_argument("--csv", type=Path, required=True, help="tuned table to write the rows into (merged)")
    return parser


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm

    args = build_parser().parse_args(argv)
    caches = list(dict.fromkeys(CACHE_FORMATS[name].kind for name in args.caches))  # a row per kind (FORMATS)
    pages = [int(p) for p in dict.fromkeys(args.page_sizes)]
    work = list(itertools.product(dict.fromkeys(args.arch), dict.fromkeys(args.kernels), caches, pages))
    kept = other_rows(args.csv)
    rows = []
    for arch, kernel, fmt, page in tqdm(work, desc="model-configs", unit="row"):
        row = model_row(kernel, arch, fmt, page)
        if row_key(row) not in kept:
            rows.append(row)
    merge_rows(args.csv, rows)
    print(f"model-configs: {len(rows)} rows written to {args.csv}; {len(work) - len(rows)} left to the rows already "
          "there that are not the model's (measured, or reported from the hardware)")
    return 0


def other_rows(path: Path) -> set[tuple]:
    """Keys and buckets of the rows of the table at ``path`` that are not model rows (a measured row, or one reported
    from the hardware, outranks the model: the model never replaces it)."""
    if not path.exists():
        return set()
    with open(path, newline="") as handle:
        return {row_key(r) for r in csv.DictReader(handle) if not str(r.get("source", "")).startswith(MODEL_SOURCE)}


if __name__ == "__main__":  # as ``python -m qsa_aiter model-configs`` runs it (environment check, closed pipes)
    raise SystemExit(run_command(main, sys.argv[1:]))

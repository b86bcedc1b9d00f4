"""Where the fused selection's time goes, phase by phase, on a GPU.

    python benchmarks/fused_phases.py [--points 16x4@32K,1x1@262K,9x4@64K-128K] [--splits auto,64,c16]
                                      [--page-size 64] [--cache bf16] [--replays 30]

For each work point and each split that fits (``auto``: the plan ``fused_select.choose_plan`` makes; a number: CTAs
a row group in the last arriver's design, ``cN``: a cluster of N CTAs a group, through ``fused_select.split_plan``,
which names why another does not fit), the fused selection
(``runtime.fused_select.fused_select``) is timed with the CUDA-graph replay (``qsa_aiter.tools.timing.time_graph``:
median over ``--replays``); then one eager launch with a debug stamps buffer (``stamp_buffer``: thread 0 of each CTA
records the GPU's global timer at each phase boundary) gives the median over CTAs of each phase
(``fused_select.PHASES``: query, score, merge, offer, arrive, and over the CTAs that select, each group's last
arriver and its selectors or a cluster's selecting CTAs, the finish's gather, select and output, and their sum
"finish"), the median CTA
span (start to arrival) and the launch's span (first start to last finish), in us, and the candidates the rows wider
than the budget offered (mean, and its ratio to their visible columns); its picks are checked equal to the timed
launches'. One row per point and split, ``#`` lines for what does not fit.
"""

from __future__ import annotations

import argparse

import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import fused_select as fs
from qsa_aiter.runtime import fused_select as runtime
from qsa_aiter.runtime.grid_topk import workspace_for
from qsa_aiter.tools.cli_args import add_selection_point_options, positive_int, work_point_list
from qsa_aiter.tools.inputs import selection_call, selection_inputs
from qsa_aiter.tools.timing import time_graph
from qsa_aiter.tools.work_points import TOKEN_TOPK

DEFAULT_POINTS = "16x4@32K,1x1@262K,9x4@64K-128K"


def split_list(text: str) -> tuple[tuple[int, bool] | None, ...]:
    """argparse type: comma-separated splits, ``auto`` for the plan's own (None), ``N`` for N CTAs a group in the
    last arriver's design, ``cN`` for a cluster of N CTAs a group: ``(N, cluster)`` pairs."""
    def one(v: str):
        return (None if v == "auto" else (positive_int(v[1:]), True) if v.startswith("c") else
                (positive_int(v), False))
    return tuple(one(v.strip()) for v in text.split(",") if v.strip())


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/fused_phases.py``."""
    ap = argparse.ArgumentParser(description="the fused selection's phases, per split")
    add_selection_point_options(ap)
    ap.set_defaults(points=work_point_list(DEFAULT_POINTS))
    ap.add_argument("--splits", type=split_list, default=(None,),
                    help="CTAs a row group, comma-separated: 'auto' for the plan's own (default), N in the last "
                         "arriver's design, cN a cluster of N")
    return ap


def header() -> str:
    return ",".join(["point", "cache", "page", "split", "cluster", "grid", "fused_us",
                     *(f"{name}_us" for name in fs.PHASES), "finish_us", "span_us", "last_us", "candidates",
                     "candidates_share"])


def offered(problem, plan: fs.Plan, visible: torch.Tensor) -> tuple[float, float]:
    """The mean candidates of the rows wider than the budget at the last launch, and their mean share of the rows'
    visible columns (``visible``: int32 ``[rows]``), from the count words in the stream's candidates buffer (NaN for
    a cluster plan, whose counts stay in shared memory)."""
    if plan.cluster:
        return float("nan"), float("nan")
    buffer = workspace_for(visible.device, plan.candidate_words, runtime.CANDIDATES)
    counts = runtime.candidates_offered(buffer, plan)[: problem.score.num_tokens].double()
    wide = visible > problem.block_topk
    if not wide.any():
        return 0.0, 0.0
    return float(counts[wide].mean()), float((counts[wide] / visible[wide].double()).mean())


def measure_point(point, cache: str, page: int, splits, replays: int) -> None:
    """One work point: a row per split that fits."""
    inputs = selection_inputs(point, page, cache)
    hints = dict(phase=point.phase, max_query_len=inputs.batch.max_query_len)
    problem, args = selection_call(inputs.batch, TOKEN_TOPK, hints)
    platform = Platform.of(torch.device("cuda", torch.cuda.current_device()))
    for split in splits:
        try:
            plan = (fs.choose_plan(problem, platform) if split is None else
                    fs.problem_split_plan(problem, split[0], platform, cluster=split[1]))
        except ValueError as err:
            print(f"# {point.name} split {split}: {err}")
            continue
        fused_us = time_graph(lambda plan=plan: runtime.fused_select(problem, args, plan=plan), 1, replays)
        picked = args.out.clone()
        stamps = runtime.stamp_buffer(plan, args.q.device)
        runtime.fused_select(problem, args, plan=plan, stamps=stamps)
        torch.cuda.synchronize()
        if not torch.equal(args.out, picked):
            raise SystemExit(f"{point.name} split {plan.split}: the stamped launch picked other tokens")
        times = runtime.phase_times(stamps, plan)
        mean, share = offered(problem, plan, inputs.visible)
        print(",".join([point.name, cache, str(page), str(plan.split), str(plan.cluster), str(plan.grid),
                        f"{fused_us:.2f}",
                        *(f"{times[name]:.2f}" for name in (*fs.PHASES, "finish", "span", "last")), f"{mean:.0f}",
                        f"{share:.4f}"]), flush=True)


def main() -> None:
    a = build_parser().parse_args()
    if not torch.cuda.is_available() or torch.version.cuda is None:
        raise SystemExit("benchmarks/fused_phases.py needs an NVIDIA GPU and a CUDA build of torch (the fused "
                         "selection and its stamps run only there)")
    print(header())
    for point in a.points:
        measure_point(point, a.cache, a.page, a.splits, a.replays)


if __name__ == "__main__":
    main()

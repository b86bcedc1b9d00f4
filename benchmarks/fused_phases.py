"""Where the fused selection's time goes, phase by phase, beside the grid top-k alone, on a GPU.

    python benchmarks/fused_phases.py [--points 16x4@32K,1x1@262K,9x4@64K-128K] [--splits 1,2,4,8,16,32]
                                      [--page-size 64] [--cache bf16] [--replays 30]

For each work point and each split that fits (``fused_select.split_plan`` names why another does not), the fused
selection (``runtime.fused_select.fused_select``, the plan's split forced) is timed with the CUDA-graph replay
(``qsa_aiter.tools.timing.time_graph``: median over ``--replays``); then one eager launch with a debug stamps buffer
(``stamp_buffer``: thread 0 of each CTA records the GPU's global timer at each phase boundary of each row group it
takes) gives the median over CTAs and groups of each phase (``fused_select.PHASES``: query, score, keys, rounds,
counts, output, end) and the median CTA span, in us; its picks are checked equal to the timed launches'. The grid
top-k alone (``grid_topk.grid_block_topk`` on the point's logits, the same split through ``grid_topk.split_plan``) is
timed beside it. One row per point and split, ``#`` lines for what does not fit.
"""

from __future__ import annotations

import argparse

import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import fused_select as fs
from qsa_aiter.kernels.selection import grid_topk as gt
from qsa_aiter.runtime.fused_select import fused_select, phase_times, resident_fused_plan, stamp_buffer
from qsa_aiter.runtime.grid_topk import grid_block_topk
from qsa_aiter.tools.cli_args import add_selection_point_options, positive_ints, work_point_list
from qsa_aiter.tools.inputs import selection_call, selection_inputs
from qsa_aiter.tools.timing import time_graph
from qsa_aiter.tools.work_points import TOKEN_TOPK

DEFAULT_POINTS = "16x4@32K,1x1@262K,9x4@64K-128K"
DEFAULT_SPLITS = (1, 2, 4, 8, 16, 32)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/fused_phases.py``."""
    ap = argparse.ArgumentParser(description="the fused selection's phases and the grid top-k alone, per split")
    add_selection_point_options(ap)
    ap.set_defaults(points=work_point_list(DEFAULT_POINTS))
    ap.add_argument("--splits", type=positive_ints, default=DEFAULT_SPLITS,
                    help="CTAs a row group (fused) and a row (grid top-k), comma-separated (default 1,2,4,8,16,32)")
    return ap


def header() -> str:
    return ",".join(["point", "cache", "page", "split", "slots", "grid", "fused_us",
                     *(f"{name}_us" for name in fs.PHASES), "span_us", "grid_topk_us"])


def time_grid_topk(inputs, split: int, platform: Platform, replays: int) -> str:
    """The grid top-k alone on the point's logits with ``split`` CTAs a row ('' where that split does not fit)."""
    logits, visible, groups = inputs.logits, inputs.visible, inputs.groups
    try:
        plan = gt.split_plan(split, logits.shape[0], logits.shape[1], platform)
    except ValueError as err:
        print(f"# grid top-k split {split}: {err}")
        return ""
    block_topk = groups.shape[1]
    return f"{time_graph(lambda: grid_block_topk(logits, visible, groups, block_topk, plan=plan), 1, replays):.2f}"


def measure_point(point, cache: str, page: int, splits, replays: int) -> None:
    """One work point: a row per split that fits."""
    inputs = selection_inputs(point, page, cache)
    hints = dict(phase=point.phase, max_query_len=inputs.batch.max_query_len)
    problem, args = selection_call(inputs.batch, TOKEN_TOPK, hints)
    platform = Platform.of(torch.device("cuda", torch.cuda.current_device()))
    for split in splits:
        try:
            wanted = fs.problem_split_plan(problem, split, platform)
        except ValueError as err:
            print(f"# {point.name} split {split}: {err}")
            continue
        _, plan = resident_fused_plan(problem, args.q.device, wanted)
        fused_us = time_graph(lambda plan=plan: fused_select(problem, args, plan=plan), 1, replays)
        picked = args.out.clone()
        stamps = stamp_buffer(plan, args.q.device)
        fused_select(problem, args, plan=plan, stamps=stamps)
        torch.cuda.synchronize()
        if not torch.equal(args.out, picked):
            raise SystemExit(f"{point.name} split {split}: the stamped launch picked other tokens")
        times = phase_times(stamps, plan)
        grid_us = time_grid_topk(inputs, split, platform, replays)
        print(",".join([point.name, cache, str(page), str(split), str(plan.slots), str(plan.grid), f"{fused_us:.2f}",
                        *(f"{times[name]:.2f}" for name in (*fs.PHASES, "span")), grid_us]), flush=True)


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

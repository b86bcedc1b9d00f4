"""The scorers' per-row histogram and the native top-k that starts from it, on a GPU.

    python benchmarks/score_histogram.py [--points 9x4@64K-128K,...] [--page-size 64] [--cache bf16] [--replays 30]

Per work point (the selection targets' points by default), CUDA-graph medians (``tools.timing.time_graph``) of:

- ``score``: the registry's scorer as the op launches it; ``score_hist``: the same kernel built with
  ``ScoreProblem.histogram``, the histogram zeroed first (``zero``: the zeroing alone; ``score_hist_only``: the
  launch without it);
- ``topk``: the native top-k's automatic plan; ``topk_hist``: the same plan starting from the scorer's histogram;
- ``select``: the op's selection as shipped, timed in the same run; ``select_hist``: the arithmetic of a selection
  built on the histogram (score_hist + topk_hist; the expansion, fused in ``select``, left out).

Every top-k result is checked equal to ``torch_block_topk`` and the scorer's histogram to ``torch_score_histogram``
of the logits it stored.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring.base import ScoreArgs
from qsa_aiter.kernels.scoring.histogram import torch_score_histogram
from qsa_aiter.kernels.selection import native_topk
from qsa_aiter.kernels.selection.reference import torch_block_topk
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.runtime import native_topk as native_topk_runtime, registries
from qsa_aiter.runtime.dispatch import plan_for
from qsa_aiter.tools.cli_args import add_selection_point_options
from qsa_aiter.tools.inputs import selection_inputs
from qsa_aiter.tools.timing import time_graph

COLUMNS = ("point", "scorer", "score", "score_hist", "score_hist_only", "zero", "topk_plan", "topk", "topk_hist",
           "select", "select_hist")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/score_histogram.py``."""
    ap = argparse.ArgumentParser()
    add_selection_point_options(ap)
    return ap


def main() -> None:
    a = build_parser().parse_args()
    print(",".join(COLUMNS))
    tested = 0
    for point in a.points:
        inputs = selection_inputs(point, a.page, a.cache)
        b, logits, visible, groups = inputs.batch, inputs.logits, inputs.visible, inputs.groups
        rows, columns = logits.shape
        k = groups.shape[1]
        platform = Platform.of(logits.device)
        problem = describe_call(*inputs.args, **inputs.hints)
        chosen = registries.SCORING.select(problem).chosen
        spec = registries.SCORING.candidates[chosen].spec
        if spec is None:
            print(f"# {point.name}: the scorer {chosen} has no histogram build")
            continue
        histogram = torch.zeros((rows, native_topk.HISTOGRAM_BINS), dtype=torch.int32, device=logits.device)
        args = ScoreArgs(b.q, b.compressed_k_cache, b.page_table, b.token_to_request, b.query_positions,
                         b.context_lens, logits, visible, problem.num_columns, b.compress_ratio,
                         1.0 / math.sqrt(b.q.shape[2]), b.k_scale)
        counting = replace(args, histogram=histogram)
        plain_plan = plan_for(spec, problem, platform)
        counting_plan = plan_for(spec, replace(problem, histogram=True), platform)

        def score_hist():
            histogram.zero_()
            counting_plan.launch(*counting.kernel_args())

        times = {"score": time_graph(lambda: plain_plan.launch(*args.kernel_args()), 1, a.replays),
                 "score_hist": time_graph(score_hist, 1, a.replays),
                 "score_hist_only": time_graph(lambda: counting_plan.launch(*counting.kernel_args()), 1, a.replays),
                 "zero": time_graph(histogram.zero_, 1, a.replays)}
        score_hist()
        expected_hist = torch_score_histogram(logits, visible)
        if not torch.equal(histogram, expected_hist):
            raise SystemExit(f"{point.name}: the {chosen} scorer's histogram differs from torch_score_histogram")
        expected = torch.empty_like(groups)
        torch_block_topk(logits, visible, k, expected)
        auto = native_topk.choose_plan(rows, columns, k, platform)
        for name, (plan, hist) in {"topk": (auto, None), "topk_hist": (auto, histogram)}.items():
            def launch(plan=plan, hist=hist):
                native_topk_runtime.native_block_topk(logits, visible, groups, k, plan=plan, histogram=hist)
            groups.fill_(-7)
            launch()
            if not torch.equal(groups, expected):
                raise SystemExit(f"{point.name}: {name} ({plan.describe()}) differs from torch_block_topk")
            times[name] = time_graph(launch, 1, a.replays)
            tested += 1
        times["select"] = time_graph(inputs.select, 1, a.replays)
        times["select_hist"] = times["score_hist"] + times["topk_hist"]
        cells = {**{key: f"{value:.2f}" for key, value in times.items()}, "point": point.name, "scorer": chosen,
                 "topk_plan": auto.variant.name}
        print(",".join(cells.get(column, "") for column in COLUMNS), flush=True)
    if not tested:
        raise SystemExit("no work point was measured (check --points)")


if __name__ == "__main__":
    main()

"""Selection beside scoring alone, and the Triton block top-k beside ``torch.topk`` plus a sort, on a GPU.

    python benchmarks/selection.py [--points 9x4@64K-128K,4x4@262K,...] [--page 64] [--cache bf16] [--replays 30]

The default points are those of the selection targets (docs/selection.md).

Each call is timed with the benchmark's CUDA-graph replay (``qsa_aiter.tools.timing.time_graph``: compilation before the
capture, median over ``--replays``). Scoring reads the keys from HBM (the caches are larger than L2); the top-k
steps read logits that scoring has just written, as they do inside ``qsa_select_paged_tokens``. Ratios: selection /
scoring, and (torch.topk + sort) / Triton top-k.
"""

from __future__ import annotations

import argparse

import torch

import qsa_aiter
from qsa_aiter.kernels.selection.reference import torch_block_topk
from qsa_aiter.tools.cli_args import RenamedOption, cache_format
from qsa_aiter.tools.inputs import selection_inputs
from qsa_aiter.tools.timing import time_graph
from qsa_aiter.tools.work_points import work_points


def torch_topk_then_sort(logits: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The baseline: ``torch.topk`` over the visible columns, then the indices sorted ascending."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    masked = torch.where(cols[None, :] < visible[:, None], logits, float("-inf"))
    return torch.sort(torch.topk(masked, k, dim=1).indices, dim=1).values


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="9x4@64K-128K,4x4@262K,1x1@262K,64x4@98K,128x1@98K,prefill 4096@32K,"
                                        "prefill 16K@96K")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--cache", type=cache_format, default="bf16", help="index-cache format (docs/cache_formats.md)")
    ap.add_argument("--kv", dest="cache", type=cache_format, action=RenamedOption, renamed_to="--cache")
    ap.add_argument("--replays", type=int, default=30)
    a = ap.parse_args()
    wanted = a.points.split(",")
    print("point,cache,page,scoring_us,selection_us,selection_over_scoring,triton_topk_us,torch_topk_sort_us,"
          "topk_speedup")
    for point in work_points():
        if point.name not in wanted:
            continue
        inputs = selection_inputs(point, a.page, a.cache)
        logits, visible, groups = inputs.logits, inputs.visible, inputs.groups
        block_topk = groups.shape[1]
        scoring = time_graph(inputs.score, 1, a.replays)
        selection = time_graph(inputs.select, 1, a.replays)
        triton_topk = time_graph(lambda: qsa_aiter.qsa_block_topk(logits, visible, block_topk, out=groups),
                                 1, a.replays)
        torch_topk = time_graph(lambda: torch_topk_then_sort(logits, visible, block_topk), 1, a.replays)
        # The timed kernels' results on these inputs: the Triton top-k equals the torch path exactly.
        expected = torch.empty_like(groups)
        torch_block_topk(logits, visible, block_topk, expected)
        if not torch.equal(groups, expected):
            raise SystemExit(f"{point.name}: the Triton top-k differs from torch_block_topk")
        print(f"{point.name},{a.cache},{a.page},{scoring:.2f},{selection:.2f},{selection / scoring:.2f},"
              f"{triton_topk:.2f},{torch_topk:.2f},{torch_topk / triton_topk:.2f}")


if __name__ == "__main__":
    main()

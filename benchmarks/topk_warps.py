"""The one-program-per-row block top-k with 8, 4 and 2 warps per program, by row count, on a GPU.

    python benchmarks/topk_warps.py [--page-size 64] [--cache bf16] [--replays 30]

Times ``topk.launch`` (no expansion) on the logits scoring has just written: the verify and decode work points, and
the first 256 to 16384 rows of the 16K-row prefill point (96K tokens, 24K columns), each result checked equal to
``torch_block_topk``. What ``topk.warps_for`` is set from (docs/selection.md). CUDA-graph replay medians, µs.
"""

from __future__ import annotations

import argparse

import torch

from qsa_aiter.kernels.selection import topk
from qsa_aiter.kernels.selection.reference import torch_block_topk
from qsa_aiter.tools.cli_args import RenamedOption, add_page_size, cache_format
from qsa_aiter.tools.inputs import selection_inputs
from qsa_aiter.tools.timing import time_graph
from qsa_aiter.tools.work_points import points_named

POINTS = "9x4@64K-128K,4x4@262K,1x1@262K,64x4@98K,128x1@98K,prefill 16K@96K"
PREFILL_ROWS = (256, 512, 1024, 2048, 4096, 16384)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/topk_warps.py``."""
    ap = argparse.ArgumentParser()
    add_page_size(ap)
    ap.add_argument("--cache", type=cache_format, default="bf16", help="index-cache format (docs/cache_formats.md)")
    ap.add_argument("--kv", dest="cache", type=cache_format, action=RenamedOption, renamed_to="--cache")
    ap.add_argument("--replays", type=int, default=30)
    return ap


def main() -> None:
    a = build_parser().parse_args()
    print("point,rows,columns,w8_us,w4_us,w2_us,w4_over_w8")
    for point in points_named(POINTS):
        inputs = selection_inputs(point, a.page, a.cache)
        logits, visible, groups = inputs.logits, inputs.visible, inputs.groups
        block_topk = groups.shape[1]
        for rows in (PREFILL_ROWS if point.phase == "prefill" else (logits.shape[0],)):
            lg, vis, out = logits[:rows], visible[:rows], groups[:rows]
            expected = torch.empty_like(out)
            torch_block_topk(lg, vis, block_topk, expected)
            times = []
            for warps in (8, 4, 2):
                cfg = topk.TopkConfig(num_warps=warps)
                out.fill_(-7)
                topk.launch(lg, vis, out, block_topk, cfg)
                if not torch.equal(out, expected):
                    raise SystemExit(f"{point.name}, {rows} rows, {warps} warps: differs from torch_block_topk")
                times.append(time_graph(lambda cfg=cfg: topk.launch(lg, vis, out, block_topk, cfg), 1, a.replays))
            print(f"{point.name},{rows},{lg.shape[1]},{times[0]:.2f},{times[1]:.2f},{times[2]:.2f},"
                  f"{times[1] / times[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()

"""Where the block top-k's time goes, stage by stage, beside scoring alone and the whole selection.

``qsa_select_paged_tokens`` is scoring, then one launch that ranks each row and expands it
(``qsa_aiter/kernels/selection/topk.py``, one program per row). This script builds kernels from that launch's own building
blocks that stop after each stage and times them in CUDA graphs on the logits scoring has just written, as the selection
op reads them:

- ``launch``: read the row's length and write one word (the kernel boundary after scoring, and nothing else);
- ``+ lane maxima``: one pass over the row keeping each lane's maximum;
- ``+ floor``: the radix select of the floor over the lane maxima;
- ``+ candidates``: the second pass, writing the columns at or above the floor to the candidate buffer;
- ``+ exact``: the whole top-k (``qsa_block_topk``'s launch), then ``+ expansion``: the launch the selection op makes.

Each stage's time is cumulative (a kernel that stops there): the difference between neighbouring columns is what a
stage adds. The last column is the room that "selection <= 1.3x scoring" leaves after scoring (0.3 x scoring).

    python benchmarks/topk_stages.py [--points 9x4@64K-128K,64x4@98K,128x1@98K] [--page-size 64] [--replays 30]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from qsa_aiter.kernels.selection import topk
from qsa_aiter.tools.cli_args import add_page_size, work_point_list
from qsa_aiter.tools.inputs import selection_inputs
from qsa_aiter.tools.timing import time_graph
from qsa_aiter.tools.work_points import TOKEN_TOPK

#: Stages a staged kernel can stop after (its ``STAGE``), in order.
STAGES = ("launch", "lane maxima", "floor", "candidates")


@triton.jit
def _stage_kernel(logits_ptr, vis_ptr, out_ptr, buf_ptr, logits_stride, out_stride, buf_stride,
                  STAGE: tl.constexpr, K: tl.constexpr, CAPACITY: tl.constexpr, TILE: tl.constexpr,
                  SCAN: tl.constexpr, PAST_END_OK: tl.constexpr):
    """The top-k kernel's path for rows longer than the capacity, stopped after stage ``STAGE`` (index into
    ``STAGES``). Writes to fp32 ``out[row]``: the row length (0), the lane maxima (1), the floor (2) or the number of
    candidates (3); rows of at most ``CAPACITY`` columns write their length whatever the stage."""
    row = tl.program_id(0)
    n = tl.load(vis_ptr + row)
    out_row = out_ptr + row.to(tl.int64) * out_stride
    if (STAGE == 0) or (n <= CAPACITY):
        tl.store(out_row, n.to(tl.float32))
    else:
        src = logits_ptr + row.to(tl.int64) * logits_stride
        n_vec = topk.vector_end(n, PAST_END_OK)
        lane_max = topk.lane_maxima(src, n, n_vec, CAPACITY, TILE)
        if STAGE == 1:
            tl.store(out_row + tl.arange(0, CAPACITY), lane_max)
        else:
            floor = topk.lane_floor(lane_max, n, K, CAPACITY)
            if STAGE == 2:
                tl.store(out_row, floor)
            else:
                kept = topk.collect_candidates(src, n, n_vec, floor, buf_ptr + row.to(tl.int64) * buf_stride,
                                               CAPACITY, SCAN)
                tl.store(out_row, kept.to(tl.float32))


def launch_stage(stage: int, logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int,
                 cfg: topk.TopkConfig | None = None) -> None:
    """Run the staged kernel over fp32 ``logits`` ``[tokens, columns]`` with int32 ``visible`` ``[tokens]`` into
    fp32 ``out`` ``[tokens, >= capacity]``, with the top-k's specialisation for ``block_topk`` under ``cfg``."""
    cfg = cfg or topk.TopkConfig()
    spec = topk.constexprs(block_topk, cfg, None, logits.shape[1])
    buf = torch.empty((logits.shape[0], spec["CAPACITY"]), dtype=torch.int32, device=logits.device)
    _stage_kernel[(logits.shape[0],)](
        logits, visible, out, buf, logits.stride(0), out.stride(0), buf.stride(0), STAGE=stage, K=spec["K"],
        CAPACITY=spec["CAPACITY"], TILE=spec["TILE"], SCAN=spec["SCAN"], PAST_END_OK=spec["PAST_END_OK"],
        num_warps=cfg.num_warps)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/topk_stages.py``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", type=work_point_list, default="9x4@64K-128K,64x4@98K,128x1@98K",
                    help="work-point names, comma-separated")
    add_page_size(ap)
    ap.add_argument("--replays", type=int, default=30)
    return ap


def main() -> None:
    a = build_parser().parse_args()
    points = a.points
    print("point,scoring_us,selection_us," + ",".join(f"{s.replace(' ', '_')}_us" for s in STAGES)
          + ",topk_us,topk_expansion_us,after_scoring_us,budget_1.3x_us")
    for point in points:
        inputs = selection_inputs(point, a.page)
        batch, logits, visible, groups = inputs.batch, inputs.logits, inputs.visible, inputs.groups
        block_topk = groups.shape[1]
        staged = torch.empty((logits.shape[0], topk.capacity(block_topk, topk.TopkConfig())), dtype=torch.float32,
                             device=logits.device)
        expansion = (batch.query_positions, batch.context_lens, batch.token_to_request, inputs.picked,
                     batch.compress_ratio, TOKEN_TOPK)

        def timed(fn):
            return time_graph(fn, 1, a.replays)

        scoring, selection = timed(inputs.score), timed(inputs.select)
        stages = [timed(lambda s=s: launch_stage(s, logits, visible, staged, block_topk)) for s in range(len(STAGES))]
        ranked = timed(lambda: topk.launch(logits, visible, groups, block_topk))
        expanded = timed(lambda: topk.launch(logits, visible, groups, block_topk, expand_into=expansion))
        print(f"{point.name},{scoring:.2f},{selection:.2f}," + ",".join(f"{t:.2f}" for t in stages)
              + f",{ranked:.2f},{expanded:.2f},{selection - scoring:.2f},{0.3 * scoring:.2f}", flush=True)


if __name__ == "__main__":
    main()

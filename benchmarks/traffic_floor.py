"""How fast the stacked scorer's memory traffic alone can go, per cache format: a traffic-only kernel beside it.

The "% of copy" figures of ``python -m qsa_aiter bench`` compare each kernel with a device-to-device copy, which
streams long contiguous runs. The scorer's traffic is not that: each key tile is one page of the cache (64 groups x
256 B = 16 KB for bf16, 8 KB for fp8, 4 KB for MXFP4, a quarter of that at page 16), fp8 and MXFP4 add a separate 256 B
(page 64) run of scales or exponents per page, and every tile writes ``rows`` runs of ``4 x BLOCK_N`` bytes of logits.
This script times a kernel that moves exactly those bytes in the scorer's order (same grid, same page-table walk,
same tiles, same stores; loads pipelined through shared memory) and does no arithmetic beyond an integer sum that
keeps the loads alive. Its best time over a few tile shapes is the floor for that format's traffic on this GPU;
the scorer's time over it says how much of the remaining gap to the copy figure is the kernel's and how much the
access pattern's.

    python benchmarks/traffic_floor.py                 # 64x4 @ 98K and 128x1 @ 98K, pages 64 and 16, all formats
    python benchmarks/traffic_floor.py --page-sizes 64 --caches fp8,fp4
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from qsa_aiter.runtime import dispatch
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring import stacked
from qsa_aiter.kernels.scoring.tiles import block_request, key_tile_slots, row_visibility
from qsa_aiter.tools.cli_args import RenamedOption, add_page_sizes, cache_formats, positive_ints, work_point_list
from qsa_aiter.tools.inputs import point_inputs
from qsa_aiter.tools.timing import copy_bandwidth, time_launcher


@triton.jit
def _traffic_kernel(
    q_ptr, k_ptr, ks_ptr, pt_ptr, t2r_ptr, pos_ptr, ctx_ptr, out_ptr, vis_ptr, hist_ptr,
    num_tokens, num_requests, num_pages, num_columns, pt_stride, out_stride, scale,
    RATIO: tl.constexpr, KEY_WORDS: tl.constexpr, SCALE_WORDS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SCALAR_PAGES: tl.constexpr, STAGES: tl.constexpr,
):
    """The stacked scorer's walk (``stacked._stacked_scorer_kernel``) with the scoring replaced by a row sum of the
    key tile's 32-bit words (``KEY_WORDS`` per group) plus its scale word (``SCALE_WORDS`` 0 or 1 per group)."""
    block = tl.program_id(0)
    col_prog = tl.program_id(1)
    col_progs = tl.num_programs(1)
    rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    req, vis = row_visibility(t2r_ptr, pos_ptr, ctx_ptr, rows, num_tokens, num_requests, num_columns, RATIO)
    if col_prog == 0:
        tl.store(vis_ptr + rows, vis, mask=rows < num_tokens)
    out_rows = out_ptr + rows.to(tl.int64) * out_stride
    keys_ptr = k_ptr.to(tl.pointer_type(tl.int32))
    scales_ptr = ks_ptr.to(tl.pointer_type(tl.int32))
    for i in tl.static_range(BLOCK_ROWS):
        r_i, starts, mine, req_vis = block_request(req, vis, i, BLOCK_ROWS)
        if starts:
            pt_row = pt_ptr + r_i.to(tl.int64) * pt_stride
            for tile in tl.range(col_prog, tl.cdiv(req_vis, BLOCK_N), col_progs, num_stages=STAGES):
                cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                slot, page_ok = key_tile_slots(pt_row, tile, req_vis, num_pages, BLOCK_N, PAGE_SIZE, SCALAR_PAGES)
                words = tl.load(keys_ptr + slot[:, None] * KEY_WORDS + tl.arange(0, KEY_WORDS)[None, :],
                                mask=page_ok[:, None], other=0)
                total = tl.sum(words, axis=1)
                if SCALE_WORDS:
                    total += tl.load(scales_ptr + slot, mask=page_ok, other=0)
                value = total.to(tl.float32)
                keep = mine[:, None] & (cols[None, :] < vis[:, None])
                tl.store(out_rows[:, None] + cols[None, :], tl.broadcast_to(value[None, :], (BLOCK_ROWS, BLOCK_N)),
                         mask=keep)


@dataclasses.dataclass(frozen=True)
class Tile:
    block_n: int
    stages: int
    programs_per_sm: int
    scalar_pages: int
    num_warps: int = 4


def launch_traffic(problem, args, tile: Tile) -> None:
    """The traffic kernel on one input set, on the stacked scorer's grid for ``tile``."""
    key_bytes = args.k_cache.shape[-1] * args.k_cache.element_size()
    scale_words = 0 if args.k_scale is None else 1  # fp8: one fp32; MXFP4 (D = 128): four e8m0 bytes
    if scale_words and args.k_scale[0, 0].numel() * args.k_scale.element_size() != 4:
        raise ValueError(f"k_scale: one 4-byte word per group expected (head_dim {args.q.shape[2]})")
    platform = Platform.of(args.q.device)
    cfg = stacked.StackedConfig(block_rows=stacked.SPEC.default_config(problem, platform).block_rows,
                                block_n=tile.block_n, num_stages=tile.stages, programs_per_sm=tile.programs_per_sm,
                                scalar_pages=tile.scalar_pages)
    grid = stacked.SPEC.grid(problem, platform, cfg)
    _traffic_kernel[grid](
        *args.kernel_args(), RATIO=problem.compress_ratio, KEY_WORDS=key_bytes // 4, SCALE_WORDS=scale_words,
        PAGE_SIZE=problem.block_size, BLOCK_ROWS=cfg.block_rows, BLOCK_N=cfg.block_n,
        SCALAR_PAGES=bool(cfg.scalar_pages), STAGES=cfg.num_stages, num_warps=tile.num_warps,
    )


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/traffic_floor.py``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=work_point_list, default="64x4@98K,128x1@98K",
                    help="work-point names, comma-separated")
    add_page_sizes(ap)
    ap.add_argument("--caches", type=cache_formats, default=("bf16", "fp8", "fp4"),
                    help="index-cache formats, comma-separated (docs/cache_formats.md)")
    ap.add_argument("--kv", dest="caches", type=cache_formats, action=RenamedOption, renamed_to="--caches")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--block-n", type=positive_ints, default=(64, 128), help="tile widths to try, comma-separated")
    ap.add_argument("--stages", type=positive_ints, default=(3, 5), help="pipeline depths to try, comma-separated")
    ap.add_argument("--per-sm", type=positive_ints, default=(4, 8),
                    help="programs per multiprocessor to try, comma-separated")
    ap.add_argument("--warps", type=positive_ints, default=(4,), help="warps per program to try, comma-separated")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    grid_axes = [getattr(a, f) for f in ("block_n", "stages", "per_sm", "warps")]
    points = a.points
    device = torch.device("cuda")
    copy_bps = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name(device)}: device-to-device copy {copy_bps / 1e9:.0f} GB/s")
    print(f"{'point':12s} {'cache':8s} {'page':>4s} {'floor us':>9s} {'%copy':>6s} {'stacked us':>10s} {'%copy':>6s} "
          f"{'stacked/floor':>13s}  floor tile")
    for point, page, cache in itertools.product(points, a.page_sizes, a.caches):
        inputs = point_inputs(point, page, device, cache)
        best = None
        for block_n, stages, per_sm, warps in itertools.product(*grid_axes):
            tile = Tile(block_n, stages, per_sm, int(block_n <= page), warps)
            try:
                us = time_launcher(inputs, lambda p, args, t=tile: launch_traffic(p, args, t), a.replays)
            except OutOfResources:  # the tile's stages do not fit in shared memory
                continue
            best = min(best or (us, tile), (us, tile), key=lambda x: x[0])
        if best is None:
            print(f"{point.name:12s} {cache:8s} {page:4d} no tile of the grid fits in shared memory")
            continue
        scorer = time_launcher(inputs, lambda p, args: dispatch.plan_for(
            stacked.SPEC, p, Platform.of(args.q.device)).launch(*args.kernel_args()), a.replays)
        nbytes = inputs.nbytes
        pct = lambda us: 100 * nbytes / (us * 1e-6) / copy_bps  # noqa: E731
        print(f"{point.name:12s} {cache:8s} {page:4d} {best[0]:9.2f} {pct(best[0]):6.1f} {scorer:10.2f} "
              f"{pct(scorer):6.1f} {scorer / best[0]:13.3f}  {best[1]}")
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

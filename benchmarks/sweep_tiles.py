"""Sweep tile configurations of one kernel at chosen work points: the tuner. Uses the benchmark's rotated inputs and
CUDA-graph timing (median of ``--replays``), prints the best configs, and with ``--csv`` appends the best one per work
point as a tuned-config row (``qsa_aiter.tuned``: arch of this GPU, the point's key and buckets, measured time).

    python benchmarks/sweep_tiles.py --kernel stacked --points 9x4,64x4@98K --page 64 --kv bf16,fp8 \
        --grid block_n=32,64,128 num_warps=2,4 num_stages=2,3,4 --csv configs/scoring.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools

import csv
from pathlib import Path

import torch
from tqdm import tqdm

from qsa_aiter import tuned
from qsa_aiter.bench import copy_bandwidth, point_inputs, time_launcher, work_points


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--points", required=True, help="comma-separated substrings of work-point names")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--kv", default="bf16", help="index-cache formats, comma-separated: bf16, fp8, fp4")
    ap.add_argument("--phase", default="", help="override the work points' phase (e.g. draft)")
    ap.add_argument("--grid", nargs="*", default=[], help="field=v1,v2 ...")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--top", type=int, default=6)
    ap.add_argument("--csv", default="", help="append the best config of each point to this tuned-config CSV")
    a = ap.parse_args()
    module = importlib.import_module(f"qsa_aiter.kernels.{a.kernel}")
    device = torch.device("cuda")
    copy_bps = copy_bandwidth(device)
    axes = {k: [int(x) for x in v.split(",")] for k, v in (g.split("=") for g in a.grid)}
    for point in work_points():
        if not any(s in point.name for s in a.points.split(",")):
            continue
        if a.phase:
            point = dataclasses.replace(point, phase=a.phase)
        for kv in a.kv.split(","):
            sweep(module, point, a, kv, axes, device, copy_bps)


def sweep(module, point, a, kv, axes, device, copy_bps) -> None:
    if True:
        inputs = point_inputs(point, a.page, device, kv)
        base = module.default_config(inputs.problems[0])
        results = []
        combos = list(itertools.product(*axes.values()))
        for values in tqdm(combos, desc=f"{point.name} {kv}", leave=False):
            cfg = dataclasses.replace(base, **dict(zip(axes, values)))
            try:
                us = time_launcher(inputs, lambda p, args, cfg=cfg: module.launch(p, args, cfg), a.replays)
            except Exception as err:  # a config that does not compile (shared memory, registers)
                print(f"  {cfg}: failed {type(err).__name__}: {str(err)[:300]}")
                continue
            results.append((us, cfg))
        results.sort(key=lambda x: x[0])
        print(f"{point.name} {kv} page {a.page}: floor {inputs.nbytes / 1e6:.1f} MB, copy {copy_bps / 1e9:.0f} GB/s, "
              f"default {base}")
        for us, cfg in results[: a.top]:
            print(f"  {us:8.2f} us {100 * inputs.nbytes / (us * 1e-6) / copy_bps:6.1f}%  {cfg}")
        if a.csv and results:
            append_row(Path(a.csv), a.kernel, inputs.problems[0], results[0], device, point.name)
        del inputs
        torch.cuda.empty_cache()


def append_row(path: Path, kernel: str, problem, best, device, point_name: str) -> None:
    """Append the best config as a tuned row (a header first if the file is new); the row is validated on load."""
    us, cfg = best
    fields = list(tuned.TunedRow.model_fields)
    row = dict(arch=tuned.device_arch(device), kernel=kernel, kv_dtype=problem.kv_dtype, page_size=problem.block_size,
               heads=problem.num_heads, head_dim=problem.head_dim, rows=problem.num_tokens,
               context=problem.num_columns * problem.compress_ratio, us=f"{us:.2f}", measured=1,
               source=f"benchmarks/sweep_tiles.py at {point_name}", **dataclasses.asdict(cfg))
    row = {k: v for k, v in row.items() if k in fields}
    new = not path.exists()
    with open(path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerow(row)


if __name__ == "__main__":
    main()

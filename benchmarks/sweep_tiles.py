"""Sweep tile configurations of one kernel at chosen work points (a development aid; the tuner of record comes
with the tuned-config tables). Uses the benchmark's rotated inputs and CUDA-graph timing; prints the best configs.

    python benchmarks/sweep_tiles.py --kernel stacked --points 9x4,64x4@98K --page 64 --kv bf16,fp8 \
        --grid block_n=32,64,128 num_warps=2,4 num_stages=2,3,4
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools

import torch

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
        for values in itertools.product(*axes.values()):
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
        del inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Sweep tile configurations of one kernel at chosen work points (a development aid; the tuner of record comes
with the tuned-config tables). Prints median µs per config, best first.

    python benchmarks/sweep_tiles.py --kernel stacked --points 9x4,64x4@98K --page 64 \
        --grid block_n=32,64,128 num_warps=2,4 num_stages=2,3,4
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math

import torch

from qsa_aiter.bench import copy_bandwidth, floor_bytes, time_graph, work_points
from qsa_aiter.kernels.common import ScoreLaunch
from qsa_aiter.ops import describe_call
from qsa_aiter.workloads import make_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--points", required=True, help="comma-separated substrings of work-point names")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--grid", nargs="*", default=[], help="field=v1,v2 ...")
    ap.add_argument("--replays", type=int, default=30)
    a = ap.parse_args()
    module = importlib.import_module(f"qsa_aiter.kernels.{a.kernel}")
    copy_bps = copy_bandwidth(torch.device("cuda"))
    axes = {k: [int(x) for x in v.split(",")] for k, v in (g.split("=") for g in a.grid)}
    for point in work_points():
        if not any(s in point.name for s in a.points.split(",")):
            continue
        gen = torch.Generator().manual_seed(1)
        sets = [make_batch(list(point.context_lens), point.rows_per_request, page_size=a.page, device="cuda",
                           generator=gen) for _ in range(2)]
        nbytes, _ = floor_bytes(sets[0])
        probs = [describe_call(*b.args(), phase=point.phase, max_query_len=b.max_query_len) for b in sets]
        launches = [ScoreLaunch(b.q, b.compressed_k_cache, b.page_table, b.token_to_request, b.query_positions,
                                b.context_lens, torch.empty(b.q.shape[0], p.num_columns, device="cuda"),
                                torch.empty(b.q.shape[0], dtype=torch.int32, device="cuda"), p.num_columns, 4,
                                1 / math.sqrt(128)) for b, p in zip(sets, probs)]
        base = module.default_config(probs[0])
        results = []
        for values in itertools.product(*axes.values()):
            cfg = base.__class__(**{**base.__dict__, **dict(zip(axes, values))})
            try:
                us = time_graph(lambda: [module.launch(p, l, cfg) for p, l in zip(probs, launches)], 2, a.replays)
            except Exception as err:  # a config that does not compile (shared memory, registers)
                print(f"  {cfg}: failed {type(err).__name__}: {str(err)[:300]}")
                continue
            results.append((us, cfg))
        results.sort(key=lambda x: x[0])
        print(f"{point.name} page {a.page}: floor {nbytes / 1e6:.1f} MB, copy {copy_bps / 1e9:.0f} GB/s")
        for us, cfg in results[:8]:
            pct = 100 * nbytes / (us * 1e-6) / copy_bps
            print(f"  {us:8.2f} us {pct:6.1f}%  {cfg}")
        del sets, launches
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

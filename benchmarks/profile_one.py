"""Run one forced kernel at one work point a few times (for a profiler such as ncu to capture).

    ncu --clock-control none -k regex:tiled --launch-skip 2 --launch-count 1 python benchmarks/profile_one.py \
        --kernel tiled --point 4096 --page 64
"""

import argparse
import os

import torch

import qsa_aiter
from qsa_aiter.tools.bench import KV_CACHES, work_points
from qsa_aiter.tools.workloads import make_batch

ap = argparse.ArgumentParser()
ap.add_argument("--kernel", required=True)
ap.add_argument("--point", required=True, help="substring of a work-point name")
ap.add_argument("--page", type=int, default=64)
ap.add_argument("--runs", type=int, default=4)
ap.add_argument("--kv", default="bf16", choices=sorted(KV_CACHES), help="index-cache format")
a = ap.parse_args()
point = next(p for p in work_points() if a.point in p.name)
os.environ["QSA_AITER_BACKEND"] = a.kernel
b = make_batch(list(point.context_lens), point.rows_per_request, page_size=a.page, device="cuda",
               cache=KV_CACHES[a.kv], generator=torch.Generator().manual_seed(0))
for _ in range(a.runs):
    qsa_aiter.qsa_paged_mqa_logits(*b.args(), **b.kwargs(), phase=point.phase, max_query_len=b.max_query_len)
torch.cuda.synchronize()
print("ran", a.kernel, point.name, a.kv, "page", a.page)

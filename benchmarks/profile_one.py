"""Run one forced kernel at one work point a few times (for a profiler such as ncu to capture).

    ncu --clock-control none -k regex:tiled --launch-skip 2 --launch-count 1 python benchmarks/profile_one.py \
        --kernel tiled --point 4096 --page-size 64
"""

import argparse
import os

import torch

import qsa_aiter
from qsa_aiter.tools.cli_args import RenamedOption, add_page_size, cache_format
from qsa_aiter.tools.work_points import work_points
from qsa_aiter.tools.workloads import make_batch


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/profile_one.py``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--point", required=True, help="substring of a work-point name")
    add_page_size(ap)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--cache", type=cache_format, default="bf16", help="index-cache format (docs/cache_formats.md)")
    ap.add_argument("--kv", dest="cache", type=cache_format, action=RenamedOption, renamed_to="--cache")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    point = next(p for p in work_points() if a.point in p.name)
    os.environ["QSA_AITER_BACKEND"] = a.kernel
    b = make_batch(list(point.context_lens), point.rows_per_request, page_size=a.page, device="cuda",
                   cache=a.cache, generator=torch.Generator().manual_seed(0))
    for _ in range(a.runs):
        qsa_aiter.qsa_paged_mqa_logits(*b.args(), **b.kwargs(), phase=point.phase, max_query_len=b.max_query_len)
    torch.cuda.synchronize()
    print("ran", a.kernel, point.name, a.cache or "bf16", "page", a.page)


if __name__ == "__main__":
    main()

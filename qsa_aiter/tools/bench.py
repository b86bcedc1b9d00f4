"""Benchmark of every scoring kernel at the work points of docs/benchmarks.md (``python -m qsa_aiter bench``).

Method: every scoring kernel that serves a work point (``scoring.SPECS``, and the native tensor-core scorer,
``native``, where it serves: a CUDA GPU with NVRTC) runs its registry plan; the call is
captured in a CUDA graph over several input sets (rotated so that the working set exceeds L2: ``inputs.point_inputs``),
the graph is replayed many times between CUDA events and the median per call is kept (``timing.time_launcher``).
Bytes moved are the physical floor (visible keys read once per request plus logits written); they are compared to a
device-to-device copy measured in the same run. The row-wise scorer is timed beside every kernel. Writes a CSV and a
PNG plot. The command line only: what the benchmarks share lives in ``work_points``, ``inputs`` and ``timing``.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from dataclasses import dataclass, field

import torch

from ..runtime import dispatch, registries
from .cli_args import RenamedOption, add_page_sizes, cache_formats, comma_subset, positive_int, run_command
from ..kernels.platform import Platform
from ..kernels.quant.formats import CACHE_FORMATS
from ..kernels.scoring import SPECS
from ..kernels.scoring.base import example_problem
from ..runtime.settings import get_settings
from .host_bench import eager_report
from .inputs import point_inputs
from .timing import copy_bandwidth, time_launcher
from .work_points import WorkPoint, work_points


@dataclass
class Row:
    point: str
    cache: str  # the index cache's format
    page_size: int
    kernel: str
    rows: int
    requests: int
    us: float
    bytes: int
    flops: int
    copy_gbps: float
    rowwise_us: float | None = None
    bf16_us: float | None = None  # the same kernel on the 16-bit cache, same run
    target: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / (self.us * 1e-6) / 1e9

    @property
    def pct_copy(self) -> float:
        return 100.0 * self.gbps / self.copy_gbps

    @property
    def tflops(self) -> float:
        return self.flops / (self.us * 1e-6) / 1e12


#: Quantised-cache targets (page 64, the point's preferred kernel): speed-up over bf16 and % of copy bandwidth by
#: the format's own bytes, at these points.
QUANTISED_TARGETS = {"fp8": 1.8, "fp4": 3.0}
QUANTISED_TARGET_POINTS = ("64x4@98K", "128x1@98K")
QUANTISED_TARGET_PCT = 85


def preferred_kernel(point: WorkPoint, page_size: int, cache: str = "bf16") -> str:
    """The scoring kernel the registry's order puts first for ``point``'s phase (the targets apply to it)."""
    order, _ = registries.SCORING.order(
        describe_point(point, page_size, cache))
    return next(name for name in order if registries.SCORING.candidates[name].spec is not None)


def describe_point(point: WorkPoint, page_size: int, cache: str):
    """A ``ScoreProblem`` with ``point``'s phase, page size and cache format (for the registry's order)."""
    fmt = CACHE_FORMATS[cache]
    return example_problem(q_dtype=fmt.query_dtype, kv_dtype=fmt.kind, cache_dtype=fmt.dtype, block_size=page_size,
                           phase=point.phase)


def _target_text(point: WorkPoint, page_size: int, row: Row) -> str:
    if page_size != 64 or row.kernel != preferred_kernel(point, page_size, row.cache):
        return ""
    if row.cache != "bf16":
        if point.name not in QUANTISED_TARGET_POINTS or row.bf16_us is None or row.cache not in QUANTISED_TARGETS:
            return ""
        want = QUANTISED_TARGETS[row.cache]
        speedup = row.bf16_us / row.us
        return (f">= {want}x bf16: {'met' if speedup >= want else 'missed'}; >= {QUANTISED_TARGET_PCT}%: "
                f"{'met' if row.pct_copy >= QUANTISED_TARGET_PCT else 'missed'}")
    parts = []
    if point.target_us is not None:
        parts.append(f"<= {point.target_us} us: {'met' if row.us <= point.target_us else 'missed'}")
    if point.target_pct is not None:
        parts.append(f">= {point.target_pct}%: {'met' if row.pct_copy >= point.target_pct else 'missed'}")
    return "; ".join(parts)


#: The native tensor-core scorer's registry candidate (CUDA C++ compiled by NVRTC), timed beside the Triton kernels.
NATIVE = "native"
#: Every kernel the benchmark can time, in its columns' order.
BENCH_KERNELS = tuple(spec.name for spec in SPECS) + (NATIVE,)


def bench_point(point: WorkPoint, page_size: int, copy_bps: float, device, replays: int, kernels=None,
                cache: str = "bf16") -> list[Row]:
    inputs = point_inputs(point, page_size, device, cache)
    settings, platform = get_settings(), Platform.of(device)
    rows = []
    for spec in SPECS:
        if kernels and spec.name not in kernels:
            continue
        if registries.SCORING.candidates[spec.name].reasons(inputs.problems[0], platform, settings):
            continue
        us = time_launcher(inputs, lambda p, a, spec=spec: dispatch.plan_for(spec, p, platform, settings).launch(
            *a.kernel_args()), replays)
        name = spec.name
        rows.append(Row(point.name, cache, page_size, name, inputs.rows, len(point.context_lens), us, inputs.nbytes,
                        inputs.flops, copy_bps / 1e9))
    candidate = registries.SCORING.candidates[NATIVE]
    if (not kernels or NATIVE in kernels) and not candidate.reasons(inputs.problems[0], platform, settings):
        us = time_launcher(inputs, lambda p, a: candidate.launch(p, a, settings), replays)
        rows.append(Row(point.name, cache, page_size, NATIVE, inputs.rows, len(point.context_lens), us, inputs.nbytes,
                        inputs.flops, copy_bps / 1e9))
    universal = next(spec.name for spec in SPECS if spec.universal)  # the baseline column: the universal fallback
    rowwise = next((r.us for r in rows if r.kernel == universal), None)
    for r in rows:
        r.rowwise_us = rowwise
    del inputs
    torch.cuda.empty_cache()
    return rows


def write_csv(rows: list[Row], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["point", "cache", "page_size", "kernel", "rows", "requests", "us", "bytes", "gbps", "copy_gbps",
                    "pct_copy", "tflops", "rowwise_us", "speedup_vs_rowwise",
                    "speedup_vs_bf16", "target"])
        for r in rows:
            w.writerow([r.point, r.cache, r.page_size, r.kernel, r.rows, r.requests, f"{r.us:.2f}", r.bytes,
                        f"{r.gbps:.1f}",
                        f"{r.copy_gbps:.1f}", f"{r.pct_copy:.1f}", f"{r.tflops:.1f}",
                        f"{r.rowwise_us:.2f}" if r.rowwise_us else "",
                        f"{r.rowwise_us / r.us:.2f}" if r.rowwise_us else "",
                        f"{r.bf16_us / r.us:.2f}" if r.bf16_us else "", r.target])


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.cache, r.page_size) for r in rows))
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 4.2 * len(panels)), squeeze=False)
    kernels = [name for name in BENCH_KERNELS if any(r.kernel == name for r in rows)]
    for ax, (cache, ps) in zip(axes[:, 0], panels):
        mine = [r for r in rows if r.cache == cache and r.page_size == ps]
        points = list(dict.fromkeys(r.point for r in mine))
        width = 0.8 / len(kernels)
        for k, name in enumerate(kernels):
            xs, ys = [], []
            for i, p in enumerate(points):
                hit = [r for r in mine if r.point == p and r.kernel == name]
                if hit:
                    xs.append(i + (k - (len(kernels) - 1) / 2) * width)
                    ys.append(hit[0].pct_copy)
            ax.bar(xs, ys, width, label=name)
        ax.axhline(100, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(points)), points, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("% of D2D copy bandwidth")
        ax.set_title(f"QSA scoring, {cache} cache, page {ps} (bytes = visible keys once per request in the cache's "
                     "format + logits)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m qsa_aiter bench``."""
    parser = argparse.ArgumentParser(prog="python -m qsa_aiter bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", help="output folder (CSV, PNG)")
    add_page_sizes(parser)
    parser.add_argument("--points", default="", help="substring filter on work-point names")
    parser.add_argument("--replays", type=positive_int, default=50,
                        help="CUDA-graph replays per timing, the median kept (default 50); with --eager, the replays "
                             "of each op's GPU timing")
    parser.add_argument("--quick", action="store_true", help="skip the 16K-row prefill")
    parser.add_argument("--caches", type=cache_formats, default=("bf16",),
                        help=f"index-cache formats, comma-separated: {', '.join(CACHE_FORMATS)} (default bf16)")
    parser.add_argument("--kv", dest="caches", type=cache_formats, action=RenamedOption, renamed_to="--caches")
    parser.add_argument("--kernels", type=comma_subset(BENCH_KERNELS), default=None,
                        help=f"kernels to time, comma-separated among {','.join(BENCH_KERNELS)} (default: every "
                             "scoring kernel that serves the point; native: the native tensor-core scorer)")
    parser.add_argument("--eager", action="store_true",
                        help="host time of eager calls of each public op, with and without out=, beside its GPU "
                             "time (page 64, bf16; --points filters, default: the verify and prefill points)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.points and not any(args.points in p.name for p in work_points(args.quick and not args.eager)):
        # a filter that keeps nothing would time nothing and write an empty table
        print(f"error: --points {args.points!r} is in no work point's name"
              + (" (--quick leaves out the 16K-row prefill)" if args.quick else ""), file=sys.stderr)
        return 2
    if args.eager:
        return eager_report(args.points, args.replays)
    if not torch.cuda.is_available():
        print("error: the benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    copy_bps = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_bps / 1e9:.0f} GB/s (read + write)")
    rows: list[Row] = []
    print(f"{'point':<18}{'cache':>9}{'page':>5} {'kernel':<8}{'us':>9}{'GB/s':>8}{'%copy':>7}{'TF/s':>7}"
          f"{'rowwise':>9}{'x bf16':>8}  target")
    kernels = args.kernels
    for ps in args.page_sizes:
        for point in work_points(args.quick):
            if args.points and args.points not in point.name:
                continue
            bf16_us = {}
            for cache in args.caches:
                for r in bench_point(point, ps, copy_bps, device, args.replays, kernels, cache):
                    if cache == "bf16":
                        bf16_us[r.kernel] = r.us
                    r.bf16_us = bf16_us.get(r.kernel)
                    r.target = _target_text(point, ps, r)
                    rows.append(r)
                    speedup = f"{r.bf16_us / r.us:8.2f}" if r.bf16_us and cache != "bf16" else " " * 8
                    print(f"{r.point:<18}{r.cache:>9}{r.page_size:>5} {r.kernel:<8}{r.us:>9.2f}{r.gbps:>8.0f}"
                          f"{r.pct_copy:>7.1f}{r.tflops:>7.1f}{(r.rowwise_us or 0):>9.2f}{speedup}  {r.target}",
                          flush=True)
    write_csv(rows, os.path.join(args.out, "bench_scoring.csv"))
    plot(rows, os.path.join(args.out, "bench_scoring.png"))
    print(f"wrote {args.out}/bench_scoring.csv and bench_scoring.png")
    return 0


if __name__ == "__main__":  # as ``python -m qsa_aiter bench`` runs it (environment check, closed pipes)
    raise SystemExit(run_command(main, sys.argv[1:]))

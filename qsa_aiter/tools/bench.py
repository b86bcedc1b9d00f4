"""Benchmark of every scoring kernel at the work points of docs/benchmarks.md (``python -m qsa_aiter bench``).

Method: every scoring kernel that serves a work point (``scoring.SPECS``) runs its registry plan; the call is captured in a CUDA graph over several input sets
(rotated so that the working set exceeds L2), the graph is replayed many times between CUDA events and the median
per call is kept. Bytes moved are the physical floor (visible keys read once per request plus logits written); they
are compared to a device-to-device copy measured in the same run. The row-wise scorer is timed beside every kernel.
Writes a CSV and a PNG plot.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import zlib
from dataclasses import dataclass, field

import torch

from ..runtime import dispatch
from .cli_args import positive_int
from ..kernels.platform import Platform
from ..kernels.scoring import SPECS
from ..kernels.scoring.base import ScoreArgs
from ..ops.scoring import describe_call, qsa_paged_mqa_logits
from ..ops.selection import qsa_select_paged_tokens
from ..runtime.settings import get_settings
from .workloads import ScoringBatch, make_batch

K, L2_ROTATE_BYTES = 1024, 256 << 20


@dataclass(frozen=True)
class WorkPoint:
    name: str
    context_lens: tuple[int, ...]
    rows_per_request: int
    phase: str
    # Targets (page 64, bf16) from the project's issue: a time ceiling in µs and/or a floor in % of copy bandwidth.
    target_us: float | None = None
    target_pct: float | None = None


def _mixed(lo: int, hi: int, n: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(int(x) for x in torch.randint(lo, hi + 1, (n,), generator=gen))


def work_points(quick: bool = False) -> list[WorkPoint]:
    points = [
        WorkPoint("9x4@64K-128K", tuple(64 * K + i * 8 * K for i in range(9)), 4, "verify", target_pct=80),
        WorkPoint("16x4@32K", (32 * K,) * 16, 4, "verify", target_us=9.5),
        WorkPoint("64x4@32K", (32 * K,) * 64, 4, "verify"),
        WorkPoint("64x4@98K", (98 * K,) * 64, 4, "verify", target_pct=95),
        WorkPoint("4x4@262K", (262 * K,) * 4, 4, "verify", target_us=15),
        WorkPoint("64x1@32K", (32 * K,) * 64, 1, "decode", target_pct=90),
        WorkPoint("16x1@98K", (98 * K,) * 16, 1, "decode"),
        WorkPoint("1x1@262K", (262 * K,), 1, "decode", target_us=6.5),
        WorkPoint("128x1@98K", (98 * K,) * 128, 1, "decode", target_pct=90),
        WorkPoint("128x1@8K-200K", _mixed(8 * K, 200 * K, 128, 0), 1, "decode"),
        WorkPoint("prefill 4096@32K", (32 * K,), 4096, "prefill", target_us=90),
    ]
    if not quick:
        points.append(WorkPoint("prefill 16K@96K", (96 * K,), 16 * K, "prefill"))
    return points


def points_named(names: str) -> list[WorkPoint]:
    """The work points named in ``names`` (comma-separated), in work-point order; ``ValueError`` names any that do
    not exist."""
    wanted = names.split(",")
    points = work_points()
    unknown = set(wanted) - {p.name for p in points}
    if unknown:
        raise ValueError(f"no work point named {', '.join(sorted(unknown))}")
    return [p for p in points if p.name in wanted]


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of ``reps``)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def key_bytes_per_group(batch: ScoringBatch) -> int:
    """Bytes one compressed key group occupies in the cache, scales included: 2 D for 16-bit caches, D + 4 for fp8
    (one fp32 scale per token), D / 2 + D / 32 for MXFP4 (one e8m0 exponent per 32 elements)."""
    cache, scale = batch.compressed_k_cache, batch.k_scale
    key_bytes = cache.shape[-1] * cache.element_size()
    return key_bytes if scale is None else key_bytes + scale[0, 0].numel() * scale.element_size()


def floor_bytes(batch: ScoringBatch) -> tuple[int, int]:
    """(bytes, flops): visible keys read once per request (in the cache's own format) + fp32 logits written; dot
    FLOPs of the visible region."""
    t2r = batch.token_to_request.cpu().tolist()
    pos = batch.query_positions.cpu().tolist()
    ctx = batch.context_lens.cpu().tolist()
    r_ = batch.compress_ratio
    heads, head_dim = batch.q.shape[1:]
    per_req: dict[int, int] = {}
    logits = flops = 0
    for r, p in zip(t2r, pos):
        if r < 0:
            continue
        vis = max(0, min((p + 1) // r_, ctx[r] // r_))
        per_req[r] = max(per_req.get(r, 0), vis)
        logits += 4 * vis
        flops += 2 * heads * head_dim * vis
    return sum(per_req.values()) * key_bytes_per_group(batch) + logits, flops


def capture_graph(call, warmups: int = 1, repeats: int = 1):
    """``call()`` run ``warmups`` times on a side stream (compiling outside the capture), then captured ``repeats``
    times in one CUDA graph: ``(graph, what the last captured call returned)``."""
    if warmups:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            result = call()
    return graph, result


def time_graph(calls, n_calls: int, replays: int, min_graph_us: float = 300.0) -> float:
    """Median µs per call of a CUDA graph that repeats ``calls()`` (which issues ``n_calls`` calls).

    The graph repeats ``calls()`` until one replay lasts about ``min_graph_us``, so launch gaps between back-to-back
    kernels are counted (as in a decode step's graph) but the per-replay overhead is amortised.
    """

    def replay_us(graph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    probe, _ = capture_graph(calls)
    probe.replay()
    once = min(replay_us(probe) for _ in range(3))
    del probe
    repeats = max(1, min(64, math.ceil(min_graph_us / max(once, 1e-3))))
    graph, _ = capture_graph(calls, warmups=0, repeats=repeats)
    graph.replay()
    torch.cuda.synchronize()
    times = [replay_us(graph) / (repeats * n_calls) for _ in range(replays)]
    del graph
    return statistics.median(times)


@dataclass
class Row:
    point: str
    kv: str
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


def preferred_kernel(point: WorkPoint, page_size: int, kv: str = "bf16") -> str:
    """The scoring kernel the registry's order puts first for ``point``'s phase (the targets apply to it)."""
    order, _ = dispatch.candidate_order(
        describe_point(point, page_size, kv))
    return next(name for name in order if dispatch.CANDIDATES[name].spec is not None)


def describe_point(point: WorkPoint, page_size: int, kv: str):
    """A ``ScoreProblem`` with ``point``'s phase, page size and cache format (for the registry's order)."""
    from ..kernels.scoring.base import example_problem

    return example_problem(kv_dtype=kv, block_size=page_size, phase=point.phase)


def _target_text(point: WorkPoint, page_size: int, row: Row) -> str:
    if page_size != 64 or row.kernel != preferred_kernel(point, page_size, row.kv):
        return ""
    if row.kv != "bf16":
        if point.name not in QUANTISED_TARGET_POINTS or row.bf16_us is None:
            return ""
        want = QUANTISED_TARGETS[row.kv]
        speedup = row.bf16_us / row.us
        return (f">= {want}x bf16: {'met' if speedup >= want else 'missed'}; >= {QUANTISED_TARGET_PCT}%: "
                f"{'met' if row.pct_copy >= QUANTISED_TARGET_PCT else 'missed'}")
    parts = []
    if point.target_us is not None:
        parts.append(f"<= {point.target_us} us: {'met' if row.us <= point.target_us else 'missed'}")
    if point.target_pct is not None:
        parts.append(f">= {point.target_pct}%: {'met' if row.pct_copy >= point.target_pct else 'missed'}")
    return "; ".join(parts)


@dataclass
class PointInputs:
    """Rotated input sets of one work point: one validated problem and one launch-argument bundle per set."""

    problems: list
    launches: list[ScoreArgs]
    rows: int
    nbytes: int
    flops: int


#: Benchmark name of each cache format (``make_batch``'s ``cache`` argument).
KV_CACHES = {"bf16": "16bit", "fp8": "fp8", "fp4": "fp4"}


def point_inputs(point: WorkPoint, page_size: int, device, kv: str = "bf16", max_sets: int = 8) -> PointInputs:
    """Enough input sets of ``point`` that cycling through them exceeds L2 (2 to ``max_sets`` sets), with a ``kv``
    cache. Every set has the same shapes, so one Triton variant serves them all."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{point.name}/{page_size}".encode()))

    def batch():
        return make_batch(list(point.context_lens), point.rows_per_request, page_size=page_size, device=device,
                          cache=KV_CACHES[kv], generator=gen)

    probe = batch()
    nbytes, flops = floor_bytes(probe)
    pages = probe.compressed_k_cache.shape[0] * page_size
    set_bytes = pages * key_bytes_per_group(probe) + probe.q.shape[0] * 4 * (probe.page_table.shape[1] * page_size)
    n_sets = min(max_sets, max(2, min(8, math.ceil(L2_ROTATE_BYTES / max(set_bytes, 1)))))
    sets = [probe] + [batch() for _ in range(n_sets - 1)]
    problems, launches = [], []
    for b in sets:
        problem = describe_call(*b.args(), **b.kwargs(), phase=point.phase, max_query_len=b.max_query_len)
        logits = torch.empty(b.q.shape[0], problem.num_columns, dtype=torch.float32, device=device)
        visible = torch.empty(b.q.shape[0], dtype=torch.int32, device=device)
        problems.append(problem)
        launches.append(ScoreArgs(b.q, b.compressed_k_cache, b.page_table, b.token_to_request, b.query_positions,
                                  b.context_lens, logits, visible, problem.num_columns, b.compress_ratio,
                                  1.0 / math.sqrt(b.q.shape[2]), b.k_scale))
    return PointInputs(problems, launches, probe.q.shape[0], nbytes, flops)


#: The selection benchmarks' token budget (the model's: 2048 tokens, 512 groups of R = 4).
TOKEN_TOPK = 2048


@dataclass
class SelectionInputs:
    """One batch of a work point with the selection op's output buffers, for the selection benchmarks; ``logits``
    and ``visible`` hold the batch's scores (``selection_inputs`` scores it once)."""

    args: tuple  # qsa_paged_mqa_logits' positional arguments up to context_lens
    hints: dict  # k_scale, phase, max_query_len
    batch: ScoringBatch
    logits: torch.Tensor  # fp32 [tokens, columns]
    visible: torch.Tensor  # int32 [tokens]
    groups: torch.Tensor  # int32 [tokens, TOKEN_TOPK // R]
    picked: torch.Tensor  # int32 [tokens, TOKEN_TOPK + R - 1]

    def score(self):
        """Scoring alone into ``logits`` (``qsa_paged_mqa_logits``)."""
        return qsa_paged_mqa_logits(*self.args, out=self.logits, **self.hints)

    def select(self):
        """The whole selection into ``picked`` (``qsa_select_paged_tokens``)."""
        return qsa_select_paged_tokens(*self.args, TOKEN_TOPK, self.batch.compress_ratio, out=self.picked,
                                       **self.hints)


def selection_inputs(point: WorkPoint, page_size: int, kv: str = "bf16", device="cuda") -> SelectionInputs:
    """A ``kv``-cache batch of ``point`` (seed 0) at ``page_size``, scored once, with the selection buffers."""
    batch = make_batch(list(point.context_lens), point.rows_per_request, page_size=page_size, cache=KV_CACHES[kv],
                       device=device, generator=torch.Generator().manual_seed(0))
    tokens, ratio = batch.q.shape[0], batch.compress_ratio
    args, hints = batch.args()[:6], dict(batch.kwargs(), phase=point.phase, max_query_len=batch.max_query_len)
    logits = torch.empty((tokens, batch.page_table.shape[1] * page_size), dtype=torch.float32, device=device)
    _, visible = qsa_paged_mqa_logits(*args, out=logits, **hints)
    return SelectionInputs(args, hints, batch, logits, visible,
                           torch.empty((tokens, TOKEN_TOPK // ratio), dtype=torch.int32, device=device),
                           torch.empty((tokens, TOKEN_TOPK + ratio - 1), dtype=torch.int32, device=device))


def time_launcher(inputs: PointInputs, launch, replays: int) -> float:
    """Median µs per call of ``launch(problem, args)`` over the rotated input sets (CUDA-graph replay)."""

    def calls():
        for problem, args in zip(inputs.problems, inputs.launches):
            launch(problem, args)

    return time_graph(calls, len(inputs.launches), replays)


def bench_point(point: WorkPoint, page_size: int, copy_bps: float, device, replays: int, kernels=None,
                kv: str = "bf16") -> list[Row]:
    inputs = point_inputs(point, page_size, device, kv)
    settings, platform = get_settings(), Platform.of(device)
    rows = []
    for spec in SPECS:
        if kernels and spec.name not in kernels:
            continue
        if dispatch.CANDIDATES[spec.name].reasons(inputs.problems[0], platform, settings):
            continue
        us = time_launcher(inputs, lambda p, a, spec=spec: dispatch.plan_for(spec, p, platform, settings).launch(
            *a.kernel_args()), replays)
        name = spec.name
        rows.append(Row(point.name, kv, page_size, name, inputs.rows, len(point.context_lens), us, inputs.nbytes,
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
        w.writerow(["point", "kv", "page_size", "kernel", "rows", "requests", "us", "bytes", "gbps", "copy_gbps",
                    "pct_copy", "tflops", "rowwise_us", "speedup_vs_rowwise",
                    "speedup_vs_bf16", "target"])
        for r in rows:
            w.writerow([r.point, r.kv, r.page_size, r.kernel, r.rows, r.requests, f"{r.us:.2f}", r.bytes,
                        f"{r.gbps:.1f}",
                        f"{r.copy_gbps:.1f}", f"{r.pct_copy:.1f}", f"{r.tflops:.1f}",
                        f"{r.rowwise_us:.2f}" if r.rowwise_us else "",
                        f"{r.rowwise_us / r.us:.2f}" if r.rowwise_us else "",
                        f"{r.bf16_us / r.us:.2f}" if r.bf16_us else "", r.target])


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys((r.kv, r.page_size) for r in rows))
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 4.2 * len(panels)), squeeze=False)
    kernels = [spec.name for spec in SPECS]
    for ax, (kv, ps) in zip(axes[:, 0], panels):
        mine = [r for r in rows if r.kv == kv and r.page_size == ps]
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
        ax.set_title(f"QSA scoring, {kv} cache, page {ps} (bytes = visible keys once per request in the cache's "
                     "format + logits)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qsa_aiter bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out", help="output folder (CSV, PNG)")
    parser.add_argument("--pages", default="64,16", help="page sizes, comma-separated")
    parser.add_argument("--points", default="", help="substring filter on work-point names")
    parser.add_argument("--replays", type=positive_int, default=50)
    parser.add_argument("--quick", action="store_true", help="skip the 16K-row prefill")
    parser.add_argument("--kv", default="bf16", help="index-cache formats, comma-separated: bf16, fp8, fp4")
    parser.add_argument("--kernels", default="", help="kernels to time, comma-separated (default: every scoring kernel that serves the point)")
    parser.add_argument("--eager", action="store_true",
                        help="host time of eager calls of each public op beside its GPU time (page 64, bf16; "
                             "--points filters, default: the verify and prefill points)")
    args = parser.parse_args(argv)
    if args.eager:
        from .host_bench import main as eager_main  # host_bench imports this module

        return eager_main(args.points, args.replays)
    kvs = args.kv.split(",")
    for kv in kvs:
        if kv not in KV_CACHES:
            parser.error(f"--kv: {kv!r} is not one of {', '.join(KV_CACHES)}")
    if not torch.cuda.is_available():
        print("the benchmark needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    copy_bps = copy_bandwidth(device)
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {copy_bps / 1e9:.0f} GB/s (read + write)")
    rows: list[Row] = []
    print(f"{'point':<18}{'kv':>5}{'page':>5} {'kernel':<8}{'us':>9}{'GB/s':>8}{'%copy':>7}{'TF/s':>7}"
          f"{'rowwise':>9}{'x bf16':>8}  target")
    kernels = tuple(args.kernels.split(",")) if args.kernels else None
    for ps in [int(p) for p in args.pages.split(",")]:
        for point in work_points(args.quick):
            if args.points and args.points not in point.name:
                continue
            bf16_us = {}
            for kv in kvs:
                for r in bench_point(point, ps, copy_bps, device, args.replays, kernels, kv):
                    if kv == "bf16":
                        bf16_us[r.kernel] = r.us
                    r.bf16_us = bf16_us.get(r.kernel)
                    r.target = _target_text(point, ps, r)
                    rows.append(r)
                    speedup = f"{r.bf16_us / r.us:8.2f}" if r.bf16_us and kv != "bf16" else " " * 8
                    print(f"{r.point:<18}{r.kv:>5}{r.page_size:>5} {r.kernel:<8}{r.us:>9.2f}{r.gbps:>8.0f}"
                          f"{r.pct_copy:>7.1f}{r.tflops:>7.1f}{(r.rowwise_us or 0):>9.2f}{speedup}  {r.target}",
                          flush=True)
    write_csv(rows, os.path.join(args.out, "bench_scoring.csv"))
    plot(rows, os.path.join(args.out, "bench_scoring.png"))
    print(f"wrote {args.out}/bench_scoring.csv and bench_scoring.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

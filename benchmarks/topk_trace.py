"""Where the native top-k's time goes inside one launch, stage by stage, on a GPU.

    python benchmarks/topk_trace.py [--points 9x4@64K-128K,...] [--page-size 64] [--cache bf16] [--plan cluster4|...]
                                    [--defines TOPK_GATHER=1,...] [--expand]

Each point's logits are scored once (``tools.inputs.selection_inputs``); the kernel the op would launch
(``native_topk.choose_plan``) is built once more with ``-DTOPK_TRACE=<CTAs>``, which makes thread 0 of every CTA
store the multiprocessor's clock at the numbered stage boundaries of ``native_topk.cu`` (``TRACE(i)``) and the
global timer at entry and exit. The traced launch is the last of ``--launches`` back-to-back launches on the same
logits (as the benchmarks time it) and its output is checked against ``torch_block_topk``; ``--expand`` adds the
fused expansion into the op's token indices (as selection runs it). Printed per stage: the
median and the largest time across CTAs since the stage before it; then the spread of the CTAs' start times and
the launch's span (first entry to last exit, global timer). The trace adds a store per stage to thread 0, so the
traced launch is slightly slower than the untraced kernel.
"""

from __future__ import annotations

import argparse

import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import native_topk as nt
from qsa_aiter.kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from qsa_aiter.runtime.jit import cuda_driver, native, nvrtc
from qsa_aiter.runtime.native_topk import native_topk_call
from qsa_aiter.tools.cli_args import add_selection_point_options
from qsa_aiter.tools.inputs import selection_inputs

#: The stage boundaries the source marks (``TRACE(i)``), by number.
STAGES = {
    1: "visible read", 2: "zeroing", 18: "first bulk piece arrived", 19: "last bulk piece arrived",
    3: "pass 1 (load, keys, histogram)", 4: "cluster barrier (0) wait",
    5: "histogram push + cluster barrier (1)", 6: "threshold bin 1", 7: "classify", 8: "candidate histogram 2",
    9: "second exchange + cluster barrier (2)", 10: "threshold bin 2", 11: "digit 3 (when needed)",
    12: "candidate marks",
    13: "chunk counts + push", 14: "cluster barrier (4)", 15: "bitmap output", 16: "expansion barrier",
    17: "expansion", 29: "exit",
}
SLOTS, START_NS, END_NS = 32, 30, 31


def read_trace(kernel: native.LoadedKernel, ctas: int) -> torch.Tensor:
    """The ``topk_trace`` array of ``kernel``'s module: int64 ``[ctas, SLOTS]``."""
    raw = cuda_driver.read_global(kernel, "topk_trace")
    return torch.frombuffer(bytearray(raw), dtype=torch.int64).view(-1, SLOTS)[:ctas].clone()


def stage_times(trace: torch.Tensor) -> tuple[float, list[tuple[str, float, float, int]]]:
    """From a trace (int64 ``[ctas, SLOTS]``: clocks in the stage slots, global-timer ns in ``START_NS`` and
    ``END_NS``, zero where a CTA did not pass a boundary or was not traced): the ns per clock cycle (median over the
    CTAs of their ns over their cycles from entry to exit), and per stage passed (name, median ns, largest ns,
    CTAs), each stage timed from the last boundary the same CTA passed before it."""
    trace = trace[trace[:, START_NS] > 0]
    if trace.shape[0] == 0:
        raise ValueError("no CTA was traced")
    cycles = (trace[:, 29] - trace[:, 0]).clamp(min=1).double()
    ns_per_cycle = ((trace[:, END_NS] - trace[:, START_NS]).double() / cycles).median().item()
    stages = []
    previous = trace[:, 0]
    for slot, stage in STAGES.items():
        seen = trace[:, slot] > 0
        if not bool(seen.any()):
            continue
        delta = ((trace[:, slot] - previous).double() * ns_per_cycle)[seen]
        stages.append((stage, delta.median().item(), delta.max().item(), int(seen.sum())))
        previous = torch.where(seen, trace[:, slot], previous)
    return ns_per_cycle, stages


def plan_named(name: str, columns: int, platform: Platform) -> nt.Plan:
    if name.startswith("cluster"):
        return nt.cluster_plan(int(name[len("cluster"):]), columns, platform)
    return nt.rows_plan(int(name.split("_")[1]), columns, platform)


def trace_point(point, page: int, cache: str, plan_name: str | None, launches: int,
                defines: tuple[str, ...] = (), expand: bool = False) -> None:
    inputs = selection_inputs(point, page, cache)
    logits, visible, groups = inputs.logits, inputs.visible, inputs.groups
    rows, columns = logits.shape
    k = groups.shape[1]
    batch, tokens = inputs.batch, inputs.picked
    ratio = batch.compress_ratio
    token_topk = tokens.shape[1] - ratio + 1
    # the op's fused expansion into its token indices, as selection launches it
    expand_into = (batch.query_positions, batch.context_lens, batch.token_to_request, tokens, ratio,
                   token_topk) if expand else None
    platform = Platform.of(logits.device)
    plan = plan_named(plan_name, columns, platform) if plan_name else nt.choose_plan(rows, columns, k, platform)
    variant = plan.variant
    ctas = rows * variant.cluster
    built = nvrtc.compile_cubin(nt.source(), platform.arch,
                                (*[f"-D{d}" for d in (*nt.SPEC.defines(variant, platform.arch), *defines)], f"-DTOPK_TRACE={ctas}"),
                                name="native_topk.cu")
    kernel = cuda_driver.load_cubin(built.cubin, variant.name, variant.name + "-trace", logits.device.index or 0,
                                    variant.non_portable_cluster)
    call, addresses, _target, _direct, _keep = native_topk_call(logits, visible, groups, k, plan, expand_into, None)
    launch = native.PreparedLaunch("trace", kernel, call.grid, call.block, call.shared_bytes,
                                   tuple(n for n, _ in call.pointers), call.scalars)
    for _ in range(launches):
        launch(*addresses)
    torch.cuda.synchronize()
    expected = torch.empty_like(groups)
    torch_block_topk(logits, visible, k, expected)
    if not torch.equal(groups, expected):
        raise SystemExit(f"{point.name}: the traced kernel differs from torch_block_topk")
    if expand:
        expected_tokens = torch.empty_like(tokens)
        torch_expand_block_indices(expected, *expand_into[:3], ratio, token_topk, expected_tokens)
        if not torch.equal(tokens, expected_tokens):
            raise SystemExit(f"{point.name}: the traced kernel's tokens differ from torch_expand_block_indices")
    trace = read_trace(kernel, ctas)
    ns_per_cycle, stages = stage_times(trace)
    traced = trace[trace[:, START_NS] > 0]
    print(f"# {point.name}: {rows} x {columns}, {plan.describe()}{' with ' + ' '.join(defines) if defines else ''}"
          f"{', with the expansion' if expand else ''}, "
          f"{traced.shape[0]} CTAs traced, {ns_per_cycle:.3f} ns per cycle")
    print("point,stage,median_ns,max_ns,ctas")
    for stage, median, largest, ctas_seen in stages:
        print(f"{point.name},{stage},{median:.0f},{largest:.0f},{ctas_seen}")
    start = traced[:, START_NS] - traced[:, START_NS].min()
    print(f"{point.name},CTA start spread (global timer),{start.double().median().item():.0f},"
          f"{start.max().item():.0f},{traced.shape[0]}")
    print(f"{point.name},launch span (first entry to last exit),"
          f"{(traced[:, END_NS].max() - traced[:, START_NS].min()).item():.0f},,")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/topk_trace.py``."""
    ap = argparse.ArgumentParser()
    add_selection_point_options(ap, replays=False)
    ap.add_argument("--plan", default=None, help="a variant (rows_256, rows_512, cluster2/4/8/16); default the op's")
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--defines", default="", help="the source's switches to build with (NAME=VALUE,...)")
    ap.add_argument("--expand", action="store_true", help="with the fused expansion into the op's token indices")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    for point in a.points:
        trace_point(point, a.page, a.cache, a.plan, a.launches, tuple(d for d in a.defines.split(",") if d),
                    a.expand)


if __name__ == "__main__":
    main()

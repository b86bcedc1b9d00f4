"""GPU timing shared by the benchmarks, the tuner, the demo and the graph tests: CUDA-graph capture and replay
medians, and the device-to-device copy bandwidth the benchmarks compare with (docs/benchmarks.md, "Method")."""

from __future__ import annotations

import math
import statistics

import torch


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


def time_launcher(inputs, launch, replays: int) -> float:
    """Median µs per call of ``launch(problem, args)`` over the rotated input sets of ``inputs`` (a
    ``point_inputs.PointInputs``), in one CUDA graph."""

    def calls():
        for problem, args in zip(inputs.problems, inputs.launches):
            launch(problem, args)

    return time_graph(calls, len(inputs.launches), replays)

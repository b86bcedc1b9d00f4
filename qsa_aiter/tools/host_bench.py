"""Host time of eager calls (``python -m qsa_aiter bench --eager``): each public op's host microseconds per call beside
its GPU time.

Method: per work point (page 64, the bench's batches, seed 0) and op, each variant of the call (``VARIANTS``: every
output given with ``out=``, and, for the ops that take ``out``, none given, so the op allocates its outputs as a
plain ``logits, visible = qsa_paged_mqa_logits(...)`` does) is made a few times (its launch plan is recorded by the
first); then ``ROUNDS`` rounds, each timing every (point, op, variant) once as ``CALLS`` back-to-back calls with no
synchronisation between them, from the first call's entry to the last one's return (the kernels queue behind each
other; fewer than the launch queue holds, so no call waits for the GPU), the GPU drained after each. Each keeps its
median over the rounds: interleaved, a stretch of slow host (its clocks, other tenants) lands on every call alike
instead of on whichever was measured then. "first-call path" is the ``out=`` call with the plan cache emptied before
every call: what a call with a new signature costs (validation, dispatch, Triton's launcher). The GPU time is the
CUDA-graph replay median of the ``out=`` call (``timing.time_graph``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..runtime import replay
from ..ops.cache import qsa_write_index_cache
from ..ops.scoring import qsa_paged_mqa_logits
from ..ops.selection import qsa_block_topk, qsa_expand_block_indices, qsa_select_paged_tokens
from .inputs import SelectionInputs, selection_inputs
from .timing import time_graph
from .work_points import TOKEN_TOPK, points_named, work_points

#: The host-time targets (µs per call) at the verify and prefill work points.
TARGET_US = {"qsa_paged_mqa_logits": 25.0, "qsa_select_paged_tokens": 40.0}
DEFAULT_POINTS = "9x4@64K-128K,64x4@98K,128x1@98K,prefill 4096@32K"


def batch_us(call, calls: int, fresh_plans: bool = False) -> float:
    """Host µs per call of ``calls`` back-to-back calls of ``call()``, from the first one's entry to the last one's
    return; ``fresh_plans``: the plan cache is emptied before every call (the call's first-call path), outside the
    time."""
    if not fresh_plans:
        start = time.perf_counter()
        for _ in range(calls):
            call()
        return (time.perf_counter() - start) / calls * 1e6
    spent = 0.0
    for _ in range(calls):
        replay.clear()
        start = time.perf_counter()
        call()
        spent += time.perf_counter() - start
    return spent / calls * 1e6


def interleaved_us(calls: dict, rounds: int, per_batch: int, fresh_plans: bool = False) -> dict:
    """Median over ``rounds`` of ``batch_us`` for each of ``calls`` (name -> call), every call timed once per round,
    the GPU drained after each batch."""
    for call in calls.values():
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(batch_us(call, per_batch, fresh_plans))
            torch.cuda.synchronize()
    return {name: statistics.median(t) for name, t in times.items()}


#: The variants of an op's call that are timed: every output given (``out=``), and none given (the op allocates
#: them; only for the ops that take ``out``: the writer writes in place).
GIVEN, ALLOCATED = "out=", "no out="
VARIANTS = (GIVEN, ALLOCATED)


def op_calls(s: SelectionInputs) -> dict[str, dict[str, Callable]]:
    """The public ops' calls on ``s`` (one batch of a work point with its buffers): op name -> variant (``GIVEN``:
    every output given; ``ALLOCATED``: the same arguments without ``out``, for the ops that take it) -> the call. The
    top-k and expansion calls read the batch's groups, which the top-k is run once here to fill."""
    ratio = s.batch.compress_ratio
    block_topk = TOKEN_TOPK // ratio
    qsa_block_topk(s.logits, s.visible, block_topk, out=s.groups)
    # One new key per query row written into the cache (the decode step's write).
    cache = s.batch.compressed_k_cache
    tokens, device = s.batch.q.shape[0], s.logits.device
    keys = torch.randn((tokens, 1, s.batch.q.shape[2]), dtype=torch.bfloat16, device=device)
    slots = torch.randperm(cache.shape[0] * cache.shape[1], device=device)[:tokens]
    positions, lengths, requests = s.batch.query_positions, s.batch.context_lens, s.batch.token_to_request
    return {
        "qsa_paged_mqa_logits": {
            GIVEN: s.score,
            ALLOCATED: lambda: qsa_paged_mqa_logits(*s.args, **s.hints),
        },
        "qsa_select_paged_tokens": {
            GIVEN: s.select,
            ALLOCATED: lambda: qsa_select_paged_tokens(*s.args, TOKEN_TOPK, ratio, **s.hints),
        },
        "qsa_block_topk": {
            GIVEN: lambda: qsa_block_topk(s.logits, s.visible, block_topk, out=s.groups),
            ALLOCATED: lambda: qsa_block_topk(s.logits, s.visible, block_topk),
        },
        "qsa_expand_block_indices": {
            GIVEN: lambda: qsa_expand_block_indices(s.groups, positions, lengths, requests, ratio, TOKEN_TOPK,
                                                    out=s.picked),
            ALLOCATED: lambda: qsa_expand_block_indices(s.groups, positions, lengths, requests, ratio, TOKEN_TOPK),
        },
        "qsa_write_index_cache": {GIVEN: lambda: qsa_write_index_cache(keys, slots, cache, s.batch.k_scale)},
    }


def report_line(point: str, op: str, host: dict[str, float], first: float, gpu: float) -> str:
    """One row of the eager report: ``host`` µs per call by variant (a variant the op lacks shows ``-``), the
    first-call path's µs, the GPU µs, and whether the op's host target (``TARGET_US``, for the ``out=`` call) was
    met."""
    target = TARGET_US.get(op)
    verdict = "" if target is None else f"<= {target:.0f} us: {'met' if host[GIVEN] <= target else 'missed'}"
    cells = "".join(f"{host[v]:>14.1f}" if v in host else f"{'-':>14}" for v in VARIANTS)
    return f"{point:<18} {op:<26}{cells}{first:>17.1f}{gpu:>9.2f}  {verdict}"


REPORT_HEADER = (f"{'point':<18} {'op':<26}" + "".join(f"{'host ' + v:>14}" for v in VARIANTS)
                 + f"{'first-call path':>17}{'GPU':>9}  target")


#: Rounds and calls per batch of the cached calls, then of the first-call path.
ROUNDS, CALLS = 15, 50
FIRST_ROUNDS, FIRST_CALLS = 5, 20


def eager_report(points: str = "", replays: int = 30) -> int:
    """Print the host times of every public op at the work points whose names contain ``points`` (default:
    ``DEFAULT_POINTS``), with and without ``out=`` (``VARIANTS``), beside the first-call path and the GPU time; what
    ``bench --eager`` runs. Returns the exit code."""
    if not torch.cuda.is_available():
        print("the eager benchmark needs a CUDA GPU")
        return 2
    chosen = [p for p in work_points() if points in p.name] if points else points_named(DEFAULT_POINTS)
    calls = {(point.name, name, variant): call for point in chosen
             for name, variants in op_calls(selection_inputs(point, 64)).items()
             for variant, call in variants.items()}
    print(f"{torch.cuda.get_device_name()}: host µs per eager call (median of {ROUNDS} interleaved rounds of "
          f"{CALLS} calls) with every output given ({GIVEN}) and allocated by the op ({ALLOCATED}), GPU µs (graph)")
    host = interleaved_us(calls, ROUNDS, CALLS)
    given = {key: call for key, call in calls.items() if key[2] == GIVEN}
    first = interleaved_us(given, FIRST_ROUNDS, FIRST_CALLS, fresh_plans=True)
    print(REPORT_HEADER)
    for (point, name, _), call in given.items():
        by_variant = {v: host[point, name, v] for v in VARIANTS if (point, name, v) in host}
        print(report_line(point, name, by_variant, first[point, name, GIVEN], time_graph(call, 1, replays)),
              flush=True)
    return 0

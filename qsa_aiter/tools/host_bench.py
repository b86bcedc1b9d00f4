"""Host time of eager calls (``python -m qsa_aiter bench --eager``): each public op's host microseconds per call beside
its GPU time.

Method: per work point (page 64, the bench's batches, seed 0) and op, the call is made a few times (its launch plan
is recorded by the first, ``call_plans``); then ``ROUNDS`` rounds, each timing every (point, op) once as ``CALLS``
back-to-back calls with no synchronisation between them, from the first call's entry to the last one's return (the
kernels queue behind each other; fewer than the launch queue holds, so no call waits for the GPU), the GPU drained
after each. Each (point, op) keeps its median over the rounds: interleaved, a stretch of slow host (its clocks, other
tenants) lands on every op alike instead of on whichever was measured then. "first-call path" is the same with the
plan cache emptied before every call: what a call with a new signature costs (validation, dispatch, Triton's
launcher). The GPU time is the CUDA-graph replay median of the same call (``timing.time_graph``).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..runtime import replay
from ..ops.cache import qsa_write_index_cache
from ..ops.selection import qsa_block_topk, qsa_expand_block_indices
from .inputs import selection_inputs
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


def op_calls(point) -> dict:
    """The public ops' calls at ``point``: name -> a call with every output given."""
    s = selection_inputs(point, 64)
    ratio = s.batch.compress_ratio
    tokens = s.batch.q.shape[0]
    groups = torch.empty((tokens, TOKEN_TOPK // ratio), dtype=torch.int32, device=s.logits.device)
    qsa_block_topk(s.logits, s.visible, TOKEN_TOPK // ratio, out=groups)
    # One new key per query row written into the cache (the decode step's write).
    cache = s.batch.compressed_k_cache
    keys = torch.randn((tokens, 1, s.batch.q.shape[2]), dtype=torch.bfloat16, device=s.logits.device)
    slots = torch.randperm(cache.shape[0] * cache.shape[1], device=s.logits.device)[:tokens]
    return {
        "qsa_paged_mqa_logits": s.score,
        "qsa_select_paged_tokens": s.select,
        "qsa_block_topk": lambda: qsa_block_topk(s.logits, s.visible, TOKEN_TOPK // ratio, out=groups),
        "qsa_expand_block_indices": lambda: qsa_expand_block_indices(
            groups, s.batch.query_positions, s.batch.context_lens, s.batch.token_to_request, ratio, TOKEN_TOPK,
            out=s.picked),
        "qsa_write_index_cache": lambda: qsa_write_index_cache(keys, slots, cache, s.batch.k_scale),
    }


#: Rounds and calls per batch of the cached calls, then of the first-call path.
ROUNDS, CALLS = 15, 50
FIRST_ROUNDS, FIRST_CALLS = 5, 20


def eager_report(points: str = "", replays: int = 30) -> int:
    """Print the host and GPU times of every public op at the work points whose names contain ``points`` (default:
    ``DEFAULT_POINTS``); what ``bench --eager`` runs. Returns the exit code."""
    if not torch.cuda.is_available():
        print("the eager benchmark needs a CUDA GPU")
        return 2
    chosen = [p for p in work_points() if points in p.name] if points else points_named(DEFAULT_POINTS)
    calls = {(point.name, name): call for point in chosen for name, call in op_calls(point).items()}
    print(f"{torch.cuda.get_device_name()}: host µs per eager call (median of {ROUNDS} interleaved rounds of "
          f"{CALLS} calls), GPU µs (graph)")
    host = interleaved_us(calls, ROUNDS, CALLS)
    first = interleaved_us(calls, FIRST_ROUNDS, FIRST_CALLS, fresh_plans=True)
    print(f"{'point':<18} {'op':<26}{'host':>8}{'first-call path':>17}{'GPU':>9}  target")
    for (point, name), call in calls.items():
        gpu = time_graph(call, 1, replays)
        target = TARGET_US.get(name)
        verdict = "" if target is None else f"<= {target:.0f} us: {'met' if host[point, name] <= target else 'missed'}"
        print(f"{point:<18} {name:<26}{host[point, name]:>8.1f}{first[point, name]:>17.1f}{gpu:>9.2f}  {verdict}",
              flush=True)
    return 0

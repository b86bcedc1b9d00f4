"""The host path of eager calls without a GPU: what the library's own Python costs per call.

CPU tensors (the 9x4 @ 64K-128K verify batch of the benchmark, page 64, bf16), every kernel launch replaced by a
no-op: a launch through ``LaunchPlan.launch`` is recorded with a stand-in for its compiled kernel, and a cached
call's direct launches do nothing. So neither Triton's launcher nor the kernels are in the numbers: only
validation, dispatch, the plan cache, argument building and the allocations (CPU ones). "cached" is a repeated
call (its plan recorded), "first-call path" the same call with the plan cache emptied before it. Per op the minimum
over ``--batches`` batches of ``--calls`` calls (the minimum: the machine may be shared). On a GPU,
``python -m qsa_aiter bench --eager`` measures the real thing.

    python benchmarks/host_path_cpu.py
    python benchmarks/host_path_cpu.py --calls 200 --batches 9
"""

from __future__ import annotations

import argparse
import os

# The Triton paths run on CPU tensors only under the interpreter; the stand-ins replace every launch, so nothing
# is actually interpreted.
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import qsa_aiter  # noqa: E402
from qsa_aiter.kernels import spec  # noqa: E402
from qsa_aiter.runtime.jit import triton_compat  # noqa: E402
from qsa_aiter.tools.work_points import TOKEN_TOPK, point_named  # noqa: E402
from qsa_aiter.tools.host_bench import batch_us  # noqa: E402
from qsa_aiter.tools.workloads import make_batch  # noqa: E402


def stub_launches() -> None:
    """Record launches with a stand-in kernel and make direct launches no-ops."""

    def launch(self, *args):
        launches = spec._recording.get()
        if launches is not None:
            launches.append((self, object(), args))

    spec.LaunchPlan.launch = launch
    triton_compat.compiled_launcher = lambda kernel, grid, device: lambda params: None
    torch.cuda.current_device = lambda: 0  # read only when recording a plan (as for a GPU call)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--batches", type=int, default=7)
    args = parser.parse_args()
    stub_launches()
    point = point_named("9x4@64K-128K")
    batch = make_batch(list(point.context_lens), point.rows_per_request, page_size=64,
                       generator=torch.Generator().manual_seed(0))
    scoring = batch.args()[:6]
    hints = {"phase": point.phase, "max_query_len": batch.max_query_len}
    tokens, ratio = batch.q.shape[0], batch.compress_ratio
    logits = torch.zeros((tokens, batch.page_table.shape[1] * 64))
    visible = torch.full((tokens,), logits.shape[1], dtype=torch.int32)
    groups = torch.zeros((tokens, TOKEN_TOPK // ratio), dtype=torch.int32)
    picked = torch.empty((tokens, TOKEN_TOPK + ratio - 1), dtype=torch.int32)
    new_keys = torch.randn((tokens, batch.q.shape[2])).to(batch.compressed_k_cache.dtype)
    new_slots = torch.arange(tokens, dtype=torch.int64)
    calls = {
        "qsa_paged_mqa_logits": lambda: qsa_aiter.qsa_paged_mqa_logits(*scoring, out=logits, **hints),
        "qsa_select_paged_tokens": lambda: qsa_aiter.qsa_select_paged_tokens(*scoring, TOKEN_TOPK, ratio,
                                                                             out=picked, **hints),
        "qsa_block_topk": lambda: qsa_aiter.qsa_block_topk(logits, visible, TOKEN_TOPK // ratio, out=groups),
        "qsa_expand_block_indices": lambda: qsa_aiter.qsa_expand_block_indices(
            groups, batch.query_positions, batch.context_lens, batch.token_to_request, ratio, TOKEN_TOPK,
            out=picked),
        # One new key per query row into the batch's bf16 cache.
        "qsa_write_index_cache": lambda: qsa_aiter.qsa_write_index_cache(
            new_keys, new_slots, batch.compressed_k_cache),
    }
    print(f"host µs per call, launches stubbed (CPU, {point.name}, min of {args.batches} x {args.calls} calls)")
    print(f"{'op':<26}{'cached':>9}{'first-call path':>17}")
    for name, call in calls.items():
        call()
        cached = min(batch_us(call, args.calls) for _ in range(args.batches))
        first = min(batch_us(call, args.calls, fresh_plans=True) for _ in range(args.batches))
        print(f"{name:<26}{cached:>9.1f}{first:>17.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The host path of eager calls without a GPU: what the library's own Python costs per call.

CPU tensors (the 9x4 @ 64K-128K verify batch of the benchmark, page 64, bf16), every kernel launch replaced by a
no-op: a launch through ``LaunchPlan.launch`` is recorded with a stand-in for its compiled kernel, and a cached
call's direct launches do nothing. So neither Triton's launcher nor the kernels are in the numbers: only
validation, dispatch, the plan cache, argument building and the allocations (CPU ones). The calls are those
``bench --eager`` times (``host_bench.op_calls``): with every output given (``out=``) and, for the ops that take
``out``, without it (the op allocates). "cached" is a repeated call (its plan recorded), "first-call path" the
``out=`` call with the plan cache emptied before it. Per op the minimum over ``--batches`` batches of ``--calls``
calls (the minimum: the machine may be shared). On a GPU, ``python -m qsa_aiter bench --eager`` measures the real
thing.

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

from qsa_aiter.kernels import spec  # noqa: E402
from qsa_aiter.runtime.jit import triton_compat  # noqa: E402
from qsa_aiter.tools.host_bench import GIVEN, VARIANTS, batch_us, op_calls  # noqa: E402
from qsa_aiter.tools.inputs import selection_inputs  # noqa: E402
from qsa_aiter.tools.work_points import point_named  # noqa: E402


def stub_launches() -> None:
    """Record launches with a stand-in kernel and make direct launches no-ops."""

    def launch(self, *args):
        launches = spec._recording.get()
        if launches is not None:
            launches.append(spec.RecordedLaunch(self, object(), args))

    spec.LaunchPlan.launch = launch
    triton_compat.compiled_launcher = lambda kernel, grid, device: lambda params: None
    torch.cuda.current_device = lambda: 0  # read only when recording a plan (as for a GPU call)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/host_path_cpu.py``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per timed batch (default 100)")
    parser.add_argument("--batches", type=int, default=7, help="timed batches per call; the minimum is kept "
                                                                "(default 7)")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    stub_launches()
    point = point_named("9x4@64K-128K")
    # The calls `bench --eager` times, with and without `out=`, on the point's batch on the CPU.
    calls = op_calls(selection_inputs(point, 64, device="cpu"))
    print(f"host µs per call, launches stubbed (CPU, {point.name}, min of {args.batches} x {args.calls} calls)")
    print(f"{'op':<26}" + "".join(f"{'cached ' + v:>16}" for v in VARIANTS) + f"{'first-call path':>17}")
    for name, variants in calls.items():
        cells = ""
        for variant in VARIANTS:
            call = variants.get(variant)
            if call is None:
                cells += f"{'-':>16}"
                continue
            call()
            cells += f"{min(batch_us(call, args.calls) for _ in range(args.batches)):>16.1f}"
        given = variants[GIVEN]
        first = min(batch_us(given, args.calls, fresh_plans=True) for _ in range(args.batches))
        print(f"{name:<26}{cells}{first:>17.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

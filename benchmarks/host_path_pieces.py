"""Where a cached eager call's host time goes, piece by piece, on a GPU.

A work point's batch (``--point``, default the 9x4 @ 64K-128K verify batch; page 64, bf16, seed 0), the scoring
call with its logits given (as ``bench --eager``). Each piece is timed alone, as ``--calls`` back-to-back
repetitions with no synchronisation between them (the GPU drained between batches), and reported as the median over
``--batches`` batches, in µs per repetition: the whole cached call, then what its host path does in order (the
settings, the signature, the plan lookup, the plan's replay: the visible-count allocation and the direct launch),
and the launch's own parts (the stream query, Triton's C launch entry given the pointer arguments as tensors, which
makes it call ``data_ptr`` and ask the driver about each one, or as integer addresses, as a replay does).

    python benchmarks/host_path_pieces.py
    python benchmarks/host_path_pieces.py --calls 200 --batches 21
    python benchmarks/host_path_pieces.py --point "prefill 4096@32K"
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qsa_aiter.runtime import replay
from qsa_aiter import qsa_paged_mqa_logits
from qsa_aiter.runtime.jit.triton_compat import driver
from qsa_aiter.ops import scoring as scoring_op
from qsa_aiter.kernels.scoring.base import ScoreArgs
from qsa_aiter.runtime.settings import get_settings
from qsa_aiter.tools.inputs import selection_inputs
from qsa_aiter.tools.work_points import point_named


def per_call_us(piece, calls: int, batches: int) -> float:
    """Median over ``batches`` of the µs per repetition of ``calls`` back-to-back ``piece()`` calls."""
    for _ in range(3):
        piece()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(calls):
            piece()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/host_path_pieces.py``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--batches", type=int, default=15)
    parser.add_argument("--point", default="9x4@64K-128K", help="a work point's name (qsa_aiter.tools.work_points)")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    s = selection_inputs(point_named(args.point), 64)
    kwargs = dict(s.hints, out=s.logits)
    qsa_paged_mqa_logits(*s.args, **kwargs)  # records the plan
    settings = get_settings()
    b = s.batch

    def signature():
        return scoring_op._signature(settings, *s.args, 4, None, None, None, b.k_scale, s.logits, s.hints["phase"],
                                     s.hints["max_query_len"])

    key, addresses = signature()
    plan = replay.lookup(key)
    if plan is None:
        print("the call recorded no plan")
        return 1
    visible = b.q.new_empty((b.q.shape[0],), dtype=torch.int32)
    kernel_args = ScoreArgs(b.q, b.compressed_k_cache, b.page_table, b.token_to_request, b.query_positions,
                            b.context_lens, s.logits, visible, plan.problem.num_columns, b.compress_ratio,
                            b.q.shape[-1] ** -0.5, b.k_scale).kernel_args()
    launch = plan.launch
    params = kernel_args[:launch.pointers] + launch.tail
    pointers = tuple(a.data_ptr() for a in params[:launch.pointers])
    entry = launch._launch
    device = torch.cuda.current_device()
    stream = driver.active.get_current_stream

    pieces = {
        "cached call": lambda: qsa_paged_mqa_logits(*s.args, **kwargs),
        "get_settings": get_settings,
        "signature": signature,
        "lookup": lambda: replay.lookup(key),
        "visible allocation": lambda: b.q.new_empty((b.q.shape[0],), dtype=torch.int32),
        "plan replay": lambda: plan.run(addresses, b.q, s.logits, None, b.k_scale is not None),
        "direct launch": lambda: launch(*pointers),
        "launch entry (tensors)": lambda: entry(params),
        "launch entry (addresses)": lambda: entry(pointers + launch.tail),
        "current stream": lambda: stream(device),
        "torch.cuda.current_device": torch.cuda.current_device,
        "is_compiling": torch.compiler.is_compiling,
    }
    print(f"{torch.cuda.get_device_name()}, {args.point}: host µs per repetition, median of {args.batches} x "
          f"{args.calls}")
    for name, piece in pieces.items():
        print(f"{name:<28}{per_call_us(piece, args.calls, args.batches):>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

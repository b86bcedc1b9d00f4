"""``python -m qsa_aiter demo``: score an MTP-verify batch and a prefill chunk, check and time them.

On a CUDA GPU the batches are model-sized (9 requests x 4 verify rows at 64K-128K tokens; a 2048-row prefill chunk at
the end of a 32K context) and each call is timed as the median of CUDA events over many calls. Without a GPU the
batches shrink (Triton's interpreter is slow) and each call runs once, through the Triton kernels under
``TRITON_INTERPRET=1``, else through the torch reference path. Every phase prints ``qsa_aiter.explain`` (which kernel
serves and why the others do not) and checks the logits on ``[0, visible)`` against
``qsa_aiter.reference_paged_mqa_logits``. The exit code is non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from .. import explain, qsa_paged_mqa_logits, qsa_select_paged_tokens, reference_paged_mqa_logits, selected_kernel
from .cli_args import cache_format, positive_int, run_command
from ..kernels.platform import interpreting
from ..kernels.quant.formats import CACHE_FORMATS
from ..kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from .inputs import floor_bytes
from .timing import time_graph
from .work_points import COMPRESS_RATIO as RATIO, HEAD_DIM, HEADS, TOKEN_TOPK
from .workloads import make_batch

#: Relative tolerance of the check: max abs error <= RTOL * max(1, max |reference|) over the visible region.
RTOL = 1e-3
PAGE_SIZE = 64


@dataclass(frozen=True)
class Phase:
    name: str
    context_lens: list[int]
    rows_per_request: int

    def label(self) -> str:
        lo, hi = min(self.context_lens), max(self.context_lens)
        span = _tokens(lo) if lo == hi else f"{_tokens(lo)}-{_tokens(hi)}"
        return f"{self.name}: {len(self.context_lens)} request(s) x {self.rows_per_request} rows at {span} tokens"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _spread(lo: int, hi: int, n: int) -> list[int]:
    """``n`` context lengths from ``lo`` to ``hi`` tokens, evenly spaced, multiples of 64."""
    if n == 1:
        return [hi]
    return [(lo + (hi - lo) * i // (n - 1)) // 64 * 64 for i in range(n)]


def gpu_phases() -> list[Phase]:
    return [
        Phase("MTP verify", _spread(64 * 1024, 128 * 1024, 9), 4),
        Phase("prefill chunk", [32 * 1024], 2048),
    ]


def cpu_phases() -> list[Phase]:
    # Small enough for Triton's interpreter; the prefill chunk keeps > 256 rows so the dispatcher infers prefill.
    return [
        Phase("MTP verify", _spread(2 * 1024, 4 * 1024, 9), 4),
        Phase("prefill chunk", [4 * 1024], 384),
    ]


@dataclass
class Check:
    ok: bool
    max_abs_err: float
    tolerance: float
    detail: str


def check_logits(logits, visible, ref_logits, ref_visible) -> Check:
    """Compare the region ``[0, visible)`` of each row; the rest of the output is never read by a consumer."""
    if not torch.equal(visible.cpu(), ref_visible.cpu()):
        bad = int((visible.cpu() != ref_visible.cpu()).sum())
        return Check(False, float("nan"), 0.0, f"visible_groups differ from the reference in {bad} rows")
    cols = torch.arange(ref_logits.shape[1], device=ref_logits.device)
    region = cols[None, :] < ref_visible.long()[:, None]
    got, want = logits[region], ref_logits[region]
    if got.numel() == 0:
        return Check(True, 0.0, 0.0, "no visible columns")
    if torch.isnan(got).any():
        return Check(False, float("nan"), 0.0, f"{int(torch.isnan(got).sum())} visible columns were not written")
    inf_got, inf_want = torch.isinf(got), torch.isinf(want)
    if not torch.equal(inf_got, inf_want) or not torch.equal(got[inf_got], want[inf_want]):
        return Check(False, float("inf"), 0.0, "-inf (bad page) columns differ from the reference")
    finite = ~inf_want
    err = float((got[finite] - want[finite]).abs().max()) if finite.any() else 0.0
    scale = float(want[finite].abs().max()) if finite.any() else 0.0
    tol = RTOL * max(1.0, scale)
    return Check(err <= tol, err, tol, f"{got.numel():,} visible logits")


def _cuda_median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_phase(phase: Phase, device: torch.device, iters: int, seed: int, cache: str = "bf16") -> bool:
    """Score, check and time ``phase`` on a ``cache`` index cache (a format name; q has the format's query
    dtype)."""
    print(f"\n=== {phase.label()} ===")
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(phase.context_lens, phase.rows_per_request, heads=HEADS, head_dim=HEAD_DIM,
                       page_size=PAGE_SIZE, compress_ratio=RATIO, cache=cache, device=device, generator=gen)
    args, hints = batch.args(), {"max_query_len": batch.max_query_len, **batch.kwargs()}
    print(explain(*args, **hints))

    chosen = selected_kernel(*args, **hints)
    num_columns = batch.page_table.shape[1] * PAGE_SIZE
    out = torch.full((batch.q.shape[0], num_columns), float("nan"), dtype=torch.float32, device=device)
    start = time.perf_counter()
    logits, visible = qsa_paged_mqa_logits(*args, out=out, **hints)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    ran = selected_kernel(*args, **hints)  # after the call: reflects a kernel marked broken by a fallback

    ref_logits, ref_visible = reference_paged_mqa_logits(*args, **batch.kwargs())
    check = check_logits(logits, visible, ref_logits, ref_visible)
    fell_back = ran != chosen
    verdict = "PASS" if check.ok else "FAIL"
    print(f"  kernel: {ran}")
    if fell_back:
        print(f"  FAIL: {chosen} was selected but failed on this machine (see the warning above); the call fell back "
              f"to {ran}")
    print(f"  check vs reference_paged_mqa_logits on [0, visible): {verdict}  max abs err {check.max_abs_err:.3g} "
          f"(tolerance {check.tolerance:.3g}; {check.detail})")
    if ran == "torch":
        print("  (the torch path is the reference itself: this check exercises dispatch and validation only)")

    floor = floor_bytes(batch)[0]
    if device.type == "cuda":
        call = lambda: qsa_paged_mqa_logits(*args, out=out, **hints)  # noqa: E731
        eager_ms = _cuda_median_ms(call, iters)
        graph_us = time_graph(call, 1, iters)  # the op captured in a CUDA graph: the kernel alone
        print(f"  time in a CUDA graph: {graph_us:.1f} us per call ({floor / 1e6:.1f} MB floor traffic -> "
              f"{floor / (graph_us * 1e-6) / 1e9:.0f} GB/s; same inputs, L2 partly warm)")
        print(f"  time eager: {eager_ms * 1e3:.1f} us per call (host-side validation, dispatch and launch included)")
        print("  (python -m qsa_aiter bench times every kernel with inputs rotated past L2)")
    else:
        print(f"  time: {wall_ms:.0f} ms (one wall-clock call on the CPU; not a kernel timing)")
    return check.ok and not fell_back and run_selection(batch, hints, logits, visible, device, iters)


def run_selection(batch, hints: dict, logits, visible, device: torch.device, iters: int) -> bool:
    """``qsa_select_paged_tokens`` on the same batch, checked against the torch top-k and expansion of the scores."""
    select_args = batch.args()[:6] + (TOKEN_TOPK, RATIO)
    picked = qsa_select_paged_tokens(*select_args, **hints)
    groups = torch.empty((logits.shape[0], TOKEN_TOPK // RATIO), dtype=torch.int32, device=device)
    torch_block_topk(logits, visible, TOKEN_TOPK // RATIO, groups)
    expected = torch.empty_like(picked)
    torch_expand_block_indices(groups, batch.query_positions, batch.context_lens, batch.token_to_request, RATIO,
                               TOKEN_TOPK, expected)
    ok = torch.equal(picked, expected)
    chosen = (picked >= 0).sum(dim=1)
    print(f"  selection (top {TOKEN_TOPK} tokens per row): {'PASS' if ok else 'FAIL'} against torch top-k and "
          f"expansion of the same scores; {int(chosen.min())}-{int(chosen.max())} tokens per row")
    if device.type == "cuda":
        out = torch.empty_like(picked)
        graph_us = time_graph(lambda: qsa_select_paged_tokens(*select_args, out=out, **hints), 1, iters)
        print(f"  selection time in a CUDA graph: {graph_us:.1f} us per call (scoring, top-k and expansion)")
    return ok


def describe_mode(device: torch.device) -> str:
    if device.type == "cuda":
        return f"CUDA GPU ({torch.cuda.get_device_name(device)}): Triton kernels, model-sized batches"
    if interpreting():
        return "CPU: Triton kernels under TRITON_INTERPRET=1 (Triton's interpreter), reduced batch sizes"
    return ("CPU: torch reference path (no GPU; set TRITON_INTERPRET=1 to run the Triton kernels in Triton's "
            "interpreter), reduced batch sizes")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m qsa_aiter demo``."""
    parser = argparse.ArgumentParser(
        prog="python -m qsa_aiter demo",
        description="Score an MTP-verify batch and a prefill chunk on this machine, check them against the reference "
                    "and time them.",
    )
    parser.add_argument("--iters", type=positive_int, default=50, help="timed calls per phase on a GPU (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic batches (default 0)")
    parser.add_argument("--cache", type=cache_format, default="bf16", metavar="FORMAT",
                        help=f"index-cache format: {', '.join(CACHE_FORMATS)} (default bf16; fp4 is MXFP4); "
                             "quantised caches are written from the same keys with qsa_write_index_cache")
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)

    use_gpu = torch.cuda.is_available() and not interpreting()
    device = torch.device("cuda") if use_gpu else torch.device("cpu")
    print(f"qsa_aiter demo on {describe_mode(device)}")
    cache = opts.cache or "bf16"  # the former 16bit (None): a cache of the queries' dtype, bf16
    queries = str(CACHE_FORMATS[cache].query_dtype).removeprefix("torch.")
    print(f"{queries} queries, {cache} index cache, {HEADS} index heads, head_dim {HEAD_DIM}, compress ratio "
          f"{RATIO}, page size {PAGE_SIZE} compressed key groups ({PAGE_SIZE * RATIO} tokens per page)")
    if torch.cuda.is_available() and interpreting():
        print("note: TRITON_INTERPRET=1 is set, so the demo runs on the CPU although a GPU is present")
    if interpreting():
        import numpy
        import triton

        if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
            print(f"note: Triton 3.6's interpreter fails under NumPy >= 2.4 (installed: NumPy {numpy.__version__}, "
                  f"Triton {triton.__version__}); if the kernels fail below, pip install 'numpy<2.4'")

    phases = gpu_phases() if use_gpu else cpu_phases()
    results = [run_phase(phase, device, opts.iters, opts.seed + i, cache)
               for i, phase in enumerate(phases)]
    failed = [p.name for p, ok in zip(phases, results) if not ok]
    print("\n" + (f"FAILED: {', '.join(failed)}" if failed else f"all {len(phases)} checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":  # as ``python -m qsa_aiter demo`` runs it (environment check, closed pipes)
    raise SystemExit(run_command(main, sys.argv[1:]))

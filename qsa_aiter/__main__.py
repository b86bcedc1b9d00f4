"""Command line: ``python -m qsa_aiter {demo,bench,explain}`` (also installed as ``qsa-aiter``)."""

from __future__ import annotations

import argparse
import re
import sys

from .problem import PHASES


def _tokens(text: str) -> int:
    """``65536``, ``64K`` or ``64k`` -> tokens."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a token count such as 65536 or 64K; got {text!r}")
    value, unit = int(match.group(1)), match.group(2).lower()
    return value * {"": 1, "k": 1024, "m": 1024 * 1024}[unit]


def _context(text: str) -> tuple[int, int]:
    """``64K`` -> (64K, 64K); ``64K-128K`` -> a range spread over the requests."""
    parts = text.split("-")
    if len(parts) == 1:
        n = _tokens(parts[0])
        return n, n
    if len(parts) == 2:
        lo, hi = _tokens(parts[0]), _tokens(parts[1])
        if lo <= hi:
            return lo, hi
    raise argparse.ArgumentTypeError(f"expected a context such as 64K or a range such as 64K-128K; got {text!r}")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="python -m qsa_aiter",
        description="qsa_aiter: Triton kernels for QSA index scoring.",
    )
    parser.add_argument("--version", action="version", version=f"qsa_aiter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,explain}")

    sub.add_parser("demo", add_help=False,
                   help="score an MTP-verify batch and a prefill chunk on this machine, check and time them")
    sub.add_parser("bench", add_help=False,
                   help="run the benchmark (arguments go to qsa_aiter.bench; `bench --help` lists them)")

    ex = sub.add_parser("explain", help="print which kernel would serve a workload, and why the others do not",
                        description="Build a synthetic batch with qsa_aiter.workloads.make_batch and print "
                                    "qsa_aiter.explain() for it.")
    ex.add_argument("--requests", type=_positive, default=9, help="number of requests (default 9)")
    ex.add_argument("--rows-per-request", type=_positive, default=4,
                    help="query rows per request: 4 for MTP verify, 1 for decode (default 4)")
    ex.add_argument("--context", type=_context, default=(64 * 1024, 128 * 1024),
                    help="context length in tokens, or a range spread over the requests (default 64K-128K)")
    ex.add_argument("--page-size", type=_positive, default=64,
                    help="compressed groups per page of the index cache (default 64)")
    ex.add_argument("--phase", choices=PHASES, default=None,
                    help="phase hint passed to the op (default: none, the dispatcher infers it)")
    ex.add_argument("--heads", type=_positive, default=4, help="index heads (default 4)")
    ex.add_argument("--head-dim", type=_positive, default=128, help="index head dim (default 128)")
    ex.add_argument("--compress-ratio", type=_positive, default=4, help="tokens per compressed group (default 4)")
    ex.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="q and cache dtype (default bf16)")
    ex.add_argument("--cache", choices=("16bit", "fp8", "fp8_fnuz", "fp4"), default="16bit",
                    help="index-cache format (default 16bit: like --dtype)")
    ex.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="where the batch lives (default: cuda if available, else cpu)")
    return parser


def _explain(opts: argparse.Namespace) -> int:
    import torch

    from . import explain
    from .workloads import make_batch

    lo, hi = opts.context
    n = opts.requests
    contexts = [hi] if n == 1 else [lo + (hi - lo) * i // (n - 1) for i in range(n)]
    if min(contexts) < opts.rows_per_request:
        print(f"error: a context of {min(contexts)} tokens is shorter than {opts.rows_per_request} rows per request",
              file=sys.stderr)
        return 2
    device = opts.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[opts.dtype]
    batch = make_batch(contexts, opts.rows_per_request, heads=opts.heads, head_dim=opts.head_dim,
                       page_size=opts.page_size, compress_ratio=opts.compress_ratio, dtype=dtype, cache=opts.cache,
                       device=device, spare_pages=0)
    try:
        print(explain(*batch.args(), **batch.kwargs(), phase=opts.phase, max_query_len=batch.max_query_len))
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    # demo and bench take their own arguments: everything after the subcommand goes to them unparsed here.
    if argv and argv[0] in ("demo", "bench"):
        command, rest = argv[0], argv[1:]
    else:
        opts = parser.parse_args(argv)
        command, rest = opts.command, []
    from .settings import get_settings

    try:  # a bad environment switch is reported once, plainly, before any work
        get_settings()
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if command == "bench":
        from .bench import main as bench_main

        return bench_main(rest)
    return _explain(opts)


if __name__ == "__main__":
    raise SystemExit(main())

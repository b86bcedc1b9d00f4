"""Command line: ``python -m qsa_aiter {demo,bench,tune,fuzz,quality,explain,warmup,jit,isa,native-resources,
model-configs}`` (also installed as ``qsa-aiter``).

Exit status, every command: 0 done; 1 the command ran and found a problem, or did nothing (a warm-up that built
nothing, a ``jit clear`` with nothing to remove); 2 bad arguments or configuration (an environment variable, named).
Multi-value options are comma lists (``cli_args``)."""

from __future__ import annotations

import argparse
import os
import re
import sys

from .cli_args import (PAGE_SIZE_MEANING, cache_format, cache_formats, comma_subset, positive_int, positive_ints,
                       run_command)
from ..kernels.quant.formats import CACHE_FORMATS
from ..kernels.scoring.problem import PHASES

_TOKENS = r"\s*(\d+)\s*([kKmM]?)\s*"


def _tokens(text: str) -> int:
    """``65536``, ``64K`` or ``64k`` -> tokens."""
    match = re.fullmatch(_TOKENS, text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a token count such as 65536 or 64K; got {text!r}")
    value, unit = int(match.group(1)), match.group(2).lower()
    return value * {"": 1, "k": 1024, "m": 1024 * 1024}[unit]


def _context(text: str) -> tuple[int, int]:
    """``64K`` -> (64K, 64K); ``64K-128K`` -> a range spread over the requests. Anything else (a negative count
    included) is rejected with the whole value in the message."""
    match = re.fullmatch(f"{_TOKENS}(?:-{_TOKENS})?", text)
    if match:
        lo = _tokens(text.split("-")[0])
        hi = _tokens(text.split("-")[1]) if "-" in text else lo
        if lo <= hi:
            return lo, hi
    raise argparse.ArgumentTypeError(f"expected a context such as 64K or a range such as 64K-128K; got {text!r}")


def _cache_dir(text: str):
    """``--jit-dir``: a directory, or a path where one can be made (as ``QSA_AITER_JIT_DIR`` is checked)."""
    from pathlib import Path

    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is not a directory")
    return path


def _arch_name(text: str) -> str:
    """``jit clear --arch``: an arch as the cache's directories name them (``sm_90``, ``sm_90a``, ``gfx942``)."""
    if not re.fullmatch(r"sm_\d+a?|gfx[0-9a-f]+", text):
        raise argparse.ArgumentTypeError(f"expected an arch such as sm_90 or gfx942; got {text!r}")
    return text


def _build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="python -m qsa_aiter",
        description="qsa_aiter: Triton kernels for QSA index scoring.",
    )
    parser.add_argument("--version", action="version", version=f"qsa_aiter {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{demo,bench,tune,fuzz,quality,explain,warmup,jit,isa,"
                                        "native-resources,model-configs}")

    sub.add_parser("demo", add_help=False,
                   help="score an MTP-verify batch and a prefill chunk on this machine, check and time them")
    sub.add_parser("bench", add_help=False,
                   help="run the benchmark (arguments go to qsa_aiter.tools.bench; `bench --help` lists them)")
    sub.add_parser("tune", add_help=False,
                   help="measure tile configs (or, with --op topk, the top-k's candidates and plans) at the work "
                        "points and write tuned rows (`tune --help` lists options)")
    sub.add_parser("fuzz", add_help=False,
                   help="fuzz the ops against the torch oracles over random metadata (`fuzz --help` lists options)")
    sub.add_parser("quality", add_help=False,
                   help="measure on the CPU how much of the bf16 selection each quantised cache keeps "
                        "(`quality --help` lists options)")
    sub.add_parser("isa", add_help=False,
                   help="compile for a target without its GPU and print each kernel's matrix instructions, registers, "
                        "LDS, scratch and waves per SIMD (`isa --help` lists options)")
    sub.add_parser("model-configs", add_help=False,
                   help="choose AMD tile configs by the static model (compiled, read from the assembly) and write "
                        "them as model rows (`model-configs --help`)")

    ex = sub.add_parser("explain", help="print which kernel would serve a workload, and why the others do not",
                        description="Build a synthetic batch with qsa_aiter.workloads.make_batch and print "
                                    "qsa_aiter.explain() for it.")
    ex.add_argument("--requests", type=positive_int, default=9, help="number of requests (default 9)")
    ex.add_argument("--rows-per-request", type=positive_int, default=4,
                    help="query rows per request: 4 for MTP verify, 1 for decode (default 4)")
    ex.add_argument("--context", type=_context, default=(64 * 1024, 128 * 1024),
                    help="context length in tokens, or a range spread over the requests (default 64K-128K)")
    ex.add_argument("--page-size", type=positive_int, default=64,
                    help=f"{PAGE_SIZE_MEANING} (default 64: 256 tokens at R 4)")
    ex.add_argument("--phase", choices=PHASES, default=None,
                    help="phase hint passed to the op (default: none, the dispatcher infers it)")
    ex.add_argument("--heads", type=positive_int, default=4, help="index heads (default 4)")
    ex.add_argument("--head-dim", type=positive_int, default=128, help="index head dim (default 128)")
    ex.add_argument("--compress-ratio", type=positive_int, default=4, help="tokens per compressed group (default 4)")
    ex.add_argument("--dtype", choices=("bf16", "fp16"), default=None,
                    help="q dtype (default: a 16-bit --cache's, else bf16)")
    ex.add_argument("--cache", type=cache_format, default=None, metavar="FORMAT",
                    help=f"index-cache format: {', '.join(CACHE_FORMATS)} (default: a 16-bit cache of --dtype)")
    ex.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="where the batch lives (default: cuda if available, else cpu)")

    from .aot import TARGETS
    from .warmup import CACHES, INDEX_DTYPES, KERNELS, NATIVE_KERNELS

    wu = sub.add_parser("warmup", help="compile every kernel variant into the JIT cache (with a progress bar)",
                        description="Compile the variant matrix (the model's shapes x kernels x index-cache dtypes x "
                                    "page sizes x tile configs) into the JIT cache: for the present GPU by launching "
                                    "each variant once, or for a named arch without a GPU. The native kernels "
                                    "(native_topk) are compiled by NVRTC for NVIDIA targets and by clang (with the HIP headers) "
                                    "for gfx942 / gfx950. See "
                                    "docs/jit_and_configs.md.")
    wu.add_argument("--arch", choices=tuple(TARGETS), default=None,
                    help="compile for this arch without a GPU (default: the present GPU's)")
    wu.add_argument("--kernels", type=comma_subset(KERNELS + NATIVE_KERNELS), default=None,
                    help=f"comma-separated subset of {','.join(KERNELS + NATIVE_KERNELS)} (default: all those that "
                         "can be built for the arch; a kernel named here that cannot is an error, exit 1)")
    wu.add_argument("--caches", type=cache_formats, default=CACHES,
                    help=f"index-cache formats, comma-separated subset of {','.join(CACHES)} (default: all)")
    wu.add_argument("--page-sizes", type=positive_ints, default=None,
                    help=f"comma-separated page sizes; {PAGE_SIZE_MEANING} (default: 16,64)")
    wu.add_argument("--index-dtypes", type=comma_subset(tuple(INDEX_DTYPES)), default=tuple(INDEX_DTYPES),
                    help="dtypes of the index tensors (page table, positions, slot mapping ...), one per call, "
                         "comma-separated (default: int32,int64)")
    wu.add_argument("--jit-dir", type=_cache_dir, default=None,
                    help="cache directory (default: QSA_AITER_JIT_DIR, else jit/ of a source checkout, else "
                         "~/.cache/qsa_aiter/jit)")
    wu.add_argument("--no-progress", action="store_true", help="no progress bar")

    from ..kernels.native_spec import AMD_ARCHS

    nr = sub.add_parser("native-resources",
                        help="compile every native kernel variant for gfx942 / gfx950 with clang (no GPU) and print "
                             "its VGPRs, AGPRs, SGPRs, scratch, spills, LDS and waves per SIMD",
                        description="Compile every variant of every native kernel family that exists for each arch "
                                    "(offline, with clang and the HIP headers: .ci/amd-toolchain.sh installs them), "
                                    "read its resources from clang's kernel-resource-usage remarks, check them "
                                    "against the code object's AMDGPU metadata note and print the table. Exit 1 "
                                    "where a variant does not compile, the two disagree, --fail-on-spills and a "
                                    "variant uses scratch or spills VGPRs, or the toolchain is missing (nothing "
                                    "checked). See docs/selection.md.")
    nr.add_argument("--arch", type=comma_subset(AMD_ARCHS), default=AMD_ARCHS,
                    help=f"comma-separated subset of {','.join(AMD_ARCHS)} (default: both)")
    nr.add_argument("--kernels", type=comma_subset(NATIVE_KERNELS), default=None,
                    help=f"native kernel families, comma-separated subset of {','.join(NATIVE_KERNELS)} "
                         "(default: all)")
    nr.add_argument("--jobs", type=positive_int, default=os.cpu_count() or 1,
                    help="compiles at a time (default: the CPU count)")
    nr.add_argument("--fail-on-spills", action="store_true",
                    help="exit 1 when a variant uses scratch, a dynamic stack or spills VGPRs, naming it")
    nr.add_argument("--write-docs", action="store_true",
                    help="rewrite the generated table in docs/selection.md (a source checkout's) with this one")

    jit = sub.add_parser("jit", help="list or clear the JIT cache")
    jit_sub = jit.add_subparsers(dest="jit_command", required=True, metavar="{list,clear}")
    ls = jit_sub.add_parser("list", help="every cached variant: kernel, specialisation, compile time, date, status; "
                                         "native entries with their registers and spills")
    ls.add_argument("--jit-dir", type=_cache_dir, default=None, help="cache directory (default as for warmup)")
    ls.add_argument("--no-verify", action="store_true", help="do not check the files' hashes")
    cl = jit_sub.add_parser("clear", help="remove the cached kernels (all, or one arch's)")
    cl.add_argument("--jit-dir", type=_cache_dir, default=None, help="cache directory (default as for warmup)")
    cl.add_argument("--arch", type=_arch_name, default=None,
                    help="only this arch's directory (e.g. sm_90, gfx942); nothing to remove is an error, exit 1")
    return parser


def _jit_root(opts: argparse.Namespace):
    from ..runtime.jit import jit_root

    return opts.jit_dir or jit_root()


def _unwritable_root(opts: argparse.Namespace, root) -> str:
    """Why ``warmup`` cannot write into ``root`` ('' where it can), naming where the directory came from: the
    ``--jit-dir`` flag, ``QSA_AITER_JIT_DIR`` or the default."""
    from ..runtime.jit import writable
    from ..runtime.settings import get_settings

    if writable(root):
        return ""
    jit_dir = get_settings().jit_dir
    source = ("--jit-dir" if opts.jit_dir else f"environment variable QSA_AITER_JIT_DIR={jit_dir!r}" if jit_dir
              else "the default cache directory")
    return (f"the JIT cache directory {root} ({source}) is not writable: warmup compiles into it (a read-only "
            "cache still serves the kernels cached in it); give a writable --jit-dir or QSA_AITER_JIT_DIR")


def _warmup(opts: argparse.Namespace) -> int:
    from .warmup import Matrix, warmup
    from ..runtime.registries import BLOCK_SIZES

    matrix = Matrix(kernels=opts.kernels or Matrix().kernels, caches=opts.caches,
                    page_sizes=opts.page_sizes or BLOCK_SIZES, index_dtypes=opts.index_dtypes)
    root = _jit_root(opts)
    unwritable = _unwritable_root(opts, root)
    if unwritable:
        print(f"error: {unwritable}", file=sys.stderr)
        return 2
    try:
        report = warmup(opts.arch, root=root, matrix=matrix, progress=not opts.no_progress)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report.summary())
    # A warm-up that built nothing, or skipped a kernel the user named (the native tier without NVRTC, or for an
    # AMD target), did not do what was asked: say so and fail.
    named_skipped = report.skipped if opts.kernels else []
    if not (report.compiled or report.found or report.failed):
        print(f"error: nothing was built for {report.arch}" + (f": {'; '.join(report.notes)}" if report.notes else ""),
              file=sys.stderr)
        return 1
    if named_skipped:
        print(f"error: --kernels {','.join(named_skipped)}: not built for {report.arch} (see the notes above)",
              file=sys.stderr)
        return 1
    return 1 if report.failed else 0


def _native_resources(opts: argparse.Namespace) -> int:
    from .native_resources import measure, table, write_docs

    report = measure(tuple(dict.fromkeys(opts.arch)), opts.kernels, opts.jobs)
    if isinstance(report, str):
        print(f"error: nothing was compiled or checked: {report}", file=sys.stderr)
        return 1
    if report.builds:
        print(table(report.builds))
    print(f"{len(report.builds)} variants compiled in {report.seconds:.1f} s ({opts.jobs} at a time) by "
          f"{report.compiler}; {len(report.failures)} failed")
    for failure in report.failures:
        print(f"error: {failure}", file=sys.stderr)
    spilling = report.spilling
    if spilling:
        print(f"{len(spilling)} of {len(report.builds)} variants use scratch or spill VGPRs: "
              + "; ".join(map(str, spilling)), file=sys.stderr)
    if opts.write_docs:
        if report.failures or not report.builds:
            print("error: --write-docs: not written, a variant failed", file=sys.stderr)
            return 1
        try:
            changed = write_docs(report)
        except ValueError as err:
            print(f"error: --write-docs: {err}", file=sys.stderr)
            return 2
        print("docs/selection.md: table " + ("rewritten" if changed else "unchanged"))
    return 1 if report.failures or (opts.fail_on_spills and spilling) else 0


def _jit(opts: argparse.Namespace) -> int:
    from .inventory import cached_archs, clear, describe, removal_report

    try:
        root = _jit_root(opts)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if opts.jit_command == "list":
        print(describe(root, verify=not opts.no_verify))
        return 0
    try:
        removed = clear(root, opts.arch)
    except OSError as err:
        print(f"error: could not clear the JIT cache under {root}: {err}", file=sys.stderr)
        return 1
    if not removed:  # nothing cleared: an arch the cache has no directory for, or an empty cache
        held = cached_archs(root)
        print(f"error: {removal_report(root, opts.arch, removed)}"
              + (f" (the cache holds {', '.join(held)})" if held else " (the cache is empty)"), file=sys.stderr)
        return 1
    print(removal_report(root, opts.arch, removed))
    return 0


def _explain(opts: argparse.Namespace) -> int:
    import torch

    from .. import explain
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
    elif device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but this machine has no CUDA device (use --device cpu or auto)", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[opts.dtype]
    try:
        batch = make_batch(contexts, opts.rows_per_request, heads=opts.heads, head_dim=opts.head_dim,
                           page_size=opts.page_size, compress_ratio=opts.compress_ratio, dtype=dtype,
                           cache=opts.cache, device=device, spare_pages=0)
        print(explain(*batch.args(), **batch.kwargs(), phase=opts.phase, max_query_len=batch.max_query_len))
    except (ValueError, TypeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command (``cli_args.run_command``: the environment checked first, a closed pipe ended quietly); its
    exit status: 0 done, 1 it ran and found a problem (or did nothing), 2 bad arguments or configuration."""
    return run_command(_run, list(sys.argv[1:] if argv is None else argv))


def _run(argv: list[str]) -> int:
    parser = _build_parser()
    # demo, bench, tune, fuzz, quality, isa and model-configs take their own arguments: the rest goes to them unparsed.
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    opts = parser.parse_args(argv)
    if opts.command == "warmup":
        return _warmup(opts)
    if opts.command == "jit":
        return _jit(opts)
    if opts.command == "native-resources":
        return _native_resources(opts)
    return _explain(opts)


#: The subcommands whose own parsers take the rest of the command line, and the module that runs each.
DELEGATED = {"demo": "demo", "bench": "bench", "tune": "tuner", "fuzz": "fuzz", "quality": "quality", "isa": "isa",
             "model-configs": "static_model"}


def _delegate(command: str, rest: list[str]) -> int:
    """Run a subcommand with its own parser; each module is imported only when its command runs."""
    if command == "demo":
        from .demo import main as run
    elif command == "bench":
        from .bench import main as run
    elif command == "tune":
        from .tuner import main as run
    elif command == "fuzz":
        from .fuzz import main as run
    elif command == "quality":
        from .quality import main as run
    elif command == "isa":
        from .isa import main as run
    else:
        from .static_model import main as run
    return run(rest)

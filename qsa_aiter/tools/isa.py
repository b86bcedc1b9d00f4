"""``python -m qsa_aiter isa --arch gfx950``: compile the warm-up matrix for a target without its GPU and print what
the compiler made of each variant (``tools/assembly.py``): matrix instructions, registers, LDS / shared memory,
scratch and spills, waves per SIMD."""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

from ..kernels import catalog
from ..kernels.platform import Platform
from .aot import TARGETS
from .assembly import VariantIsa, analyse, table
from .cli_args import PAGE_SIZE_MEANING, cache_formats, comma_subset, positive_ints, run_command
from .warmup import CACHES, INDEX_DTYPES, KERNELS, Matrix

#: The scoring kernels (the default of ``isa --kernels``: the ones whose registers matter most).
SCORING_KERNELS = catalog.family_names("scoring")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m qsa_aiter isa",
        description="Compile the warm-up matrix for a target (into the JIT cache; entries there are reused) and "
                    "print each variant's matrix instructions, registers, LDS, scratch and waves per SIMD (AMD), or "
                    "its registers, shared memory, spills and stack (NVIDIA, from ptxas -v). No GPU needed.")
    parser.add_argument("--arch", required=True, choices=tuple(TARGETS), help="the target to compile for")
    parser.add_argument("--kernels", default=",".join(k for k in KERNELS if k in SCORING_KERNELS),
                        help=f"comma-separated subset of {','.join(KERNELS)} (default: the scorers)")
    parser.add_argument("--caches", type=cache_formats, default=CACHES,
                        help=f"index-cache formats, comma-separated subset of {','.join(CACHES)} (default: all)")
    parser.add_argument("--page-sizes", type=positive_ints, default=(16, 64),
                        help=f"comma-separated page sizes ({PAGE_SIZE_MEANING}; default: 16,64)")
    parser.add_argument("--index-dtypes", type=comma_subset(tuple(INDEX_DTYPES)), default=("int32",),
                        help=f"comma-separated subset of {','.join(INDEX_DTYPES)} (default: int32)")
    parser.add_argument("--jit-dir", default=None, help="JIT cache directory (default: as for warmup)")
    parser.add_argument("--csv", action="store_true", help="print CSV rows instead of a Markdown table")
    parser.add_argument("--fail-on-spills", action="store_true",
                        help="exit 1 when a variant spills (scratch or spill stores), naming it")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while compiling")
    return parser


def _csv(rows: list[VariantIsa]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["kernel", "cache", "page_size", "variant", "matrix_instructions", "vgprs", "agprs", "sgprs",
                     "lds", "scratch", "spill_bytes", "waves", "limit", "entry"])
    for r in rows:
        writer.writerow([r.kernel, r.cache, r.page_size or "", r.variant,
                         " ".join(f"{k}x{v}" for k, v in r.mma.items()), r.vgprs, r.agprs, r.sgprs, r.lds, r.scratch,
                         r.spill_bytes, r.waves, r.limit, r.entry])
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    index_dtypes = tuple(args.index_dtypes)
    try:
        matrix = Matrix(kernels=kernels, caches=tuple(args.caches), page_sizes=args.page_sizes,
                        index_dtypes=index_dtypes)
        if any(k not in KERNELS for k in kernels):
            raise ValueError(f"--kernels: the native kernels are not Triton builds; choose among {', '.join(KERNELS)}")
        rows = analyse(args.arch, root=Path(args.jit_dir) if args.jit_dir else None, matrix=matrix,
                       progress=not args.no_progress)
    except (ValueError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not rows:
        print("error: no variant was built: nothing to report", file=sys.stderr)
        return 1
    platform = Platform.named(args.arch)
    print(_csv(rows) if args.csv else table(rows, platform.backend), end="" if args.csv else "\n")
    spilling = [r for r in rows if r.spills]
    if spilling:
        print(f"{len(spilling)} of {len(rows)} variants spill: "
              + "; ".join(f"{r.kernel} {r.cache} page {r.page_size} {r.variant} ("
                          + (f"scratch {r.scratch} B per lane" if r.backend == "hip"
                             else f"spill stores {r.spill_bytes} B, stack {r.scratch} B") + ")"
                          for r in spilling), file=sys.stderr)
        if args.fail_on_spills:
            return 1
    return 0


if __name__ == "__main__":  # as ``python -m qsa_aiter isa`` runs it (environment check, closed pipes)
    raise SystemExit(run_command(main, sys.argv[1:]))

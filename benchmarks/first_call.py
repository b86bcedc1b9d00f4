"""First-call latency of an MTP-verify scoring call: a cold process (nothing compiled) against a warm one (after
``python -m qsa_aiter warmup``).

Every measurement is a fresh Python process on the GPU. It builds the target-verify batch (9 requests x 4 rows,
64K-128K context, page 64), synchronises, then times its first ``qsa_paged_mqa_logits`` call and a second one, and
counts Triton compilations (``triton.knobs.compilation.listener``: one per call of Triton's compiler, cache hits
included). The cold process starts from an empty JIT directory and an empty Triton cache; the warm ones from the same
directories after a warm-up: one calls at once, the other first does what an engine does at start-up,
``qsa_aiter.runtime.jit.load()`` (``integrations.atom.install`` calls it), timed apart. The target: a warm process that
did that start-up compiles nothing and its first call takes <= 10 ms.

    python benchmarks/first_call.py                    # warm-up of the verify kernels only (quick)
    python benchmarks/first_call.py --full-warmup      # warm-up of the whole variant matrix first
    python benchmarks/first_call.py --cache fp8 --keep /tmp/first_call
    python benchmarks/first_call.py --profile 40       # where the warm processes' first calls spend their time
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from qsa_aiter.tools.cli_args import cache_format

ROOT = Path(__file__).resolve().parents[1]
TARGET_MS = 10.0

_MEASURE = r"""
import json, sys, time
start = time.perf_counter()
import torch
from triton import knobs
compiles = []
knobs.compilation.listener = lambda **kw: compiles.append(getattr(kw["src"], "name", "?"))
import qsa_aiter
from qsa_aiter.tools.workloads import make_batch
imported = time.perf_counter()
torch.cuda.init()
contexts = [64 * 1024 + (64 * 1024) * i // 8 for i in range(9)]
batch = make_batch(contexts, 4, page_size=64, cache=sys.argv[1], device="cuda")
torch.cuda.synchronize()
startup_ms = None
if sys.argv[3] == "1":  # an engine's start-up: open the JIT cache and do Triton's set-up before the first call
    t0 = time.perf_counter()
    from qsa_aiter import jit
    jit.load()
    startup_ms = (time.perf_counter() - t0) * 1e3
times = []
profile_rows = int(sys.argv[2])
for i in range(2):
    if i == 0 and profile_rows:
        import cProfile, io, pstats
        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **batch.kwargs(), phase="verify", max_query_len=4)
    torch.cuda.synchronize()
    times.append((time.perf_counter() - t0) * 1e3)
    if i == 0 and profile_rows:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(profile_rows)
        print(text.getvalue())
print("FIRST-CALL " + json.dumps({"first_ms": times[0], "second_ms": times[1], "compiles": len(compiles),
                                  "startup_ms": startup_ms,
                                  "import_s": imported - start, "kernel": qsa_aiter.selected_kernel(
                                      *batch.args(), **batch.kwargs(), phase="verify", max_query_len=4)}))
"""


def _env(jit_dir: Path, triton_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("QSA_AITER_")}
    env.update(QSA_AITER_JIT_DIR=str(jit_dir), TRITON_CACHE_DIR=str(triton_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def _measure(cache: str, env: dict, profile_rows: int = 0, startup: bool = False) -> dict:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, cache, str(profile_rows), str(int(startup))], cwd=ROOT,
                          env=env,
                          capture_output=True, text=True, timeout=900)
    if profile_rows:  # the first call's profile (the lines before the result)
        print("\n".join(line for line in proc.stdout.splitlines() if not line.startswith("FIRST-CALL ")))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FIRST-CALL ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"measurement failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("FIRST-CALL "))


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/first_call.py``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=cache_format, default="bf16",
                        help="index-cache format (docs/cache_formats.md; default bf16)")
    parser.add_argument("--full-warmup", action="store_true", help="warm the whole variant matrix, not just the "
                                                                   "verify kernels")
    parser.add_argument("--keep", default=None, help="directory for the JIT and Triton caches (default: temporary)")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="print the warm process's first call under cProfile (this many rows, by cumulative time)")
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(opts.keep or tmp)
        jit_dir, triton_dir = base / "jit", base / "triton"
        env = _env(jit_dir, triton_dir)
        cache = opts.cache or "bf16"  # the former 16bit: a cache of the queries' dtype, bf16
        cold = _measure(cache, env)
        subset = [] if opts.full_warmup else ["--kernels", "stacked,rowwise,cache_writer", "--caches", cache,
                                              "--page-sizes", "64", "--index-dtypes", "int32,int64"]
        proc = subprocess.run([sys.executable, "-m", "qsa_aiter", "warmup", "--no-progress", *subset], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"warm-up failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
        print(proc.stdout.strip())
        warm = _measure(cache, env, opts.profile)
        started = _measure(cache, env, opts.profile, startup=True)
    for name, result in (("cold", cold), ("warm", warm), ("warm, qsa_aiter.runtime.jit.load() at start-up", started)):
        startup = f", start-up {result['startup_ms']:.1f} ms" if result["startup_ms"] is not None else ""
        print(f"{name} process: first call {result['first_ms']:8.1f} ms ({result['compiles']} Triton compilations), "
              f"second call {result['second_ms']:.2f} ms, import {result['import_s']:.2f} s{startup}, "
              f"kernel {result['kernel']}")
    ok = started["compiles"] == 0 and started["first_ms"] <= TARGET_MS
    print(f"target: a warm process with jit.load() at start-up compiles nothing and its first call takes "
          f"<= {TARGET_MS:.0f} ms: "
          f"{'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

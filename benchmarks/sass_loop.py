"""Instruction counts of a scoring kernel's key-tile loop in sm_90 SASS, without a GPU.

Compiles ``stacked`` or ``tiled`` ahead of time (``qsa_aiter.tools.aot``; run without ``TRITON_INTERPRET``) for a
model-shaped problem, disassembles the cubin with the ``nvdisasm`` that ships with Triton, finds the innermost loops
(backward branches) and prints, for the first one (the key-tile loop of the first request walk), its instruction count,
an opcode histogram, the registers per thread and the shared memory, plus warp instructions per 128 keys (instructions
per tile x warps x 128 / BLOCK_N), the figure to compare tile shapes and cache formats by.

    python benchmarks/sass_loop.py --cache fp4                                # the default config
    python benchmarks/sass_loop.py --cache fp4 --no-e4m3                      # QSA_AITER_E4M3_MMA=0
    python benchmarks/sass_loop.py --cache fp4 --set block_n=64,num_stages=5  # another tile
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton

from qsa_aiter.kernels.quant.formats import CACHE_FORMATS
from qsa_aiter.tools.aot import compile_kernel, kernel_config
from qsa_aiter.tools.cli_args import RenamedOption, add_page_size, cache_format
from qsa_aiter.kernels.scoring.base import example_problem

def compile_variant(kernel: str, cache: str, page: int, rows: int, e4m3: bool, overrides: dict):
    """The sm_90 build of ``kernel`` for a ``cache`` index cache (a format name) at ``page`` with its default config,
    fields replaced by ``overrides``; returns ``(compiled, config)``."""
    fmt = CACHE_FORMATS[cache]
    formats = dict(q_dtype=fmt.query_dtype, cache_dtype=fmt.dtype, kv_dtype=fmt.kind)
    if kernel == "tiled":
        problem = example_problem(block_size=page, num_tokens=4096, num_requests=1, max_query_len=4096,
                                  phase="prefill", **formats)
    else:
        problem = example_problem(block_size=page, max_query_len=rows, num_tokens=9 * rows, **formats)
    e4m3_mma = None if e4m3 else False
    cfg = kernel_config(kernel, "sm_90", problem, e4m3_mma, overrides)
    return compile_kernel(kernel, "sm_90", problem, e4m3_mma=e4m3_mma, overrides=overrides), cfg


def innermost_loops(sass: str) -> list[list[str]]:
    """Opcodes of each innermost loop (a backward branch's body containing no other loop), in program order."""
    labels, ops = {}, []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        insn = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*?);?\s*$", line)
        if insn:
            text = re.sub(r"^@!?U?P\w+\s+", "", insn.group(1).strip())
            ops.append((text.split()[0] if text else "", text))
    loops = []
    for i, (op, text) in enumerate(ops):
        target = re.search(r"\((\.L_x_\d+)\)", text) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), i + 1) <= i:
            loops.append((labels[target.group(1)], i))
    inner = [(s, e) for s, e in loops if not any((s2, e2) != (s, e) and s <= s2 and e2 <= e for s2, e2 in loops)]
    return [[op for op, _ in ops[s:e + 1]] for s, e in inner if e > s]


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/sass_loop.py``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="stacked", choices=("stacked", "keys_major", "tiled"))
    ap.add_argument("--cache", type=cache_format, default="fp4", help="index-cache format (docs/cache_formats.md)")
    ap.add_argument("--kv", dest="cache", type=cache_format, action=RenamedOption, renamed_to="--cache")
    add_page_size(ap)
    ap.add_argument("--rows", type=int, default=4, help="verify rows per request (stacked)")
    ap.add_argument("--no-e4m3", action="store_true", help="build the decoding path (QSA_AITER_E4M3_MMA=0)")
    ap.add_argument("--set", default="", help="config fields to replace, comma-separated: name=value,name=value")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")
    overrides = {k: int(v) for k, v in (item.split("=") for item in a.set.split(",") if item)}
    compiled, cfg = compile_variant(a.kernel, a.cache or "bf16", a.page, a.rows, not a.no_e4m3, overrides)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    spill = re.search(r"STACK:(\d+)", usage)
    loops = innermost_loops(sass)
    body = loops[0]
    histogram = collections.Counter(op.split(".")[0] for op in body)
    print(f"{a.kernel} {a.cache or 'bf16'} page {a.page}: {cfg}")
    print(f"registers {regs.group(1) if regs else '?'}, stack {spill.group(1) if spill else '?'} B, shared "
          f"{compiled.metadata.shared} B; innermost loops {[len(loop) for loop in loops]}")
    print(f"key-tile loop: {len(body)} instructions per {cfg.block_n}-key tile, "
          f"{len(body) * cfg.num_warps * 128 // cfg.block_n} warp instructions per 128 keys")
    print("  " + ", ".join(f"{op} {n}" for op, n in histogram.most_common()))


if __name__ == "__main__":
    main()

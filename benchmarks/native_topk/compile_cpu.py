"""Compile benchmarks/native_topk/topk.cu with NVRTC on a machine without a GPU (ctypes on libnvrtc).

Usage:
    python benchmarks/native_topk/compile_cpu.py [--arch sm_90] [--lib /path/to/libnvrtc.so.12] [--out DIR]

libnvrtc is looked up in this order: --lib, $NVRTC_LIB, the pip wheel
(nvidia-cuda-nvrtc-cu12 / -cu13: site-packages/nvidia/cuda_nvrtc/lib or nvidia/cu13/lib),
then the system loader.  No CUDA driver and no GPU are needed: NVRTC only needs
libnvrtc + libnvrtc-builtins (both in the wheel).  The source includes no headers.

Prints the NVRTC log (which, with --ptxas-options=-v, holds ptxas' register / shared
memory / spill report per kernel), and writes topk.ptx and topk.cubin to --out.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import site
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))


def find_nvrtc(explicit: str | None = None) -> str:
    cands = []
    if explicit:
        cands.append(explicit)
    if os.environ.get("NVRTC_LIB"):
        cands.append(os.environ["NVRTC_LIB"])
    roots = set(site.getsitepackages() + [site.getusersitepackages(), sysconfig.get_paths()["purelib"]])
    for r in sorted(roots):
        cands += sorted(glob.glob(os.path.join(r, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
        cands += sorted(glob.glob(os.path.join(r, "nvidia", "cu13", "lib", "libnvrtc.so*")))
    cands += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for c in cands:
        if "builtins" in c or "alt" in os.path.basename(c):
            continue
        try:
            ctypes.CDLL(c)
            return c
        except OSError:
            continue
    raise OSError("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12, or pass --lib)")


def compile_source(src: str, arch: str = "sm_90", lib: str | None = None, extra=None, want_cubin=True):
    """Returns (ptx_bytes, cubin_bytes_or_None, log_str, nvrtc_version)."""
    path = find_nvrtc(lib)
    nv = ctypes.CDLL(path)
    maj, mnr = ctypes.c_int(), ctypes.c_int()
    nv.nvrtcVersion(ctypes.byref(maj), ctypes.byref(mnr))
    nv.nvrtcGetErrorString.restype = ctypes.c_char_p

    def chk(r):
        if r != 0:
            raise RuntimeError("NVRTC error: " + nv.nvrtcGetErrorString(r).decode())

    prog = ctypes.c_void_p()
    chk(nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"topk.cu", 0, None, None))
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", "--ptxas-options=-v"]
    opts += list(extra or [])
    copts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    res = nv.nvrtcCompileProgram(prog, len(opts), copts)
    lsz = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(lsz))
    logb = ctypes.create_string_buffer(lsz.value)
    nv.nvrtcGetProgramLog(prog, logb)
    log = logb.value.decode(errors="replace")
    if res != 0:
        raise RuntimeError(f"compile failed ({nv.nvrtcGetErrorString(res).decode()}):\n{log}")
    sz = ctypes.c_size_t()
    chk(nv.nvrtcGetPTXSize(prog, ctypes.byref(sz)))
    ptx = ctypes.create_string_buffer(sz.value)
    chk(nv.nvrtcGetPTX(prog, ptx))
    cubin = None
    if want_cubin and arch.startswith("sm_"):
        chk(nv.nvrtcGetCUBINSize(prog, ctypes.byref(sz)))
        cb = ctypes.create_string_buffer(sz.value)
        chk(nv.nvrtcGetCUBIN(prog, cb))
        cubin = cb.raw
    nv.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value, cubin, log, (maj.value, mnr.value, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--out", default=os.path.join(HERE, "build"))
    ap.add_argument("-D", action="append", default=[], help="extra defines, e.g. -D TOPK_NO_CLUSTER16")
    a = ap.parse_args()
    src = open(os.path.join(HERE, "topk.cu")).read()
    ptx, cubin, log, ver = compile_source(src, a.arch, a.lib, [f"-D{d}" for d in a.D])
    print(f"NVRTC {ver[0]}.{ver[1]} from {ver[2]}, arch {a.arch}")
    print(log.strip() or "(empty log)")
    os.makedirs(a.out, exist_ok=True)
    open(os.path.join(a.out, "topk.ptx"), "wb").write(ptx)
    if cubin:
        open(os.path.join(a.out, "topk.cubin"), "wb").write(cubin)
    entries = [l.split()[-1] for l in ptx.decode().splitlines() if l.startswith(".visible .entry")]
    print("entries:", ", ".join(e.rstrip("(") for e in entries))
    print(f"ptx {len(ptx)} B, cubin {len(cubin) if cubin else 0} B -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

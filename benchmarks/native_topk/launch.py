"""Compile (NVRTC, at run time) and launch the native block top-k kernels of topk.cu.

    block_topk(logits, visible, K, out=None, plan=None) -> out

logits  fp32 [rows, columns], last dim contiguous, any row stride ld >= columns
visible int32 [rows] (read on the device: rewriting it in place before a CUDA-graph replay works)
out     int32 [rows, K] contiguous (allocated if None)

Per row: the K best columns of [0, clamp(visible, 0, columns)) by (-score, column), in ascending
column order, -1 padded.  Exact and deterministic (see topk.cu).

Kernel choice (choose_plan):
  * cluster path ("cluster", CL): sm_90+, rows <= #SMs / 2 (one CTA per row would leave most
    SMs idle) and columns >= 8192.  Take the largest CL in (16 if enabled, 8, 4, 2) with
    rows * CL <= CTA slots (2 per SM when the CTA's shared memory <= 112 KB, else 1), so the
    whole grid is one wave.  E.g. 1 row -> 8, 16 rows -> 8, 36 rows -> 4.  Measured on H200
    (NOTES.md, run 3): 36 x 32768 cluster4 13.7 us vs rows512 15.6 us, but 128 x 25088
    rows512 16.0 us vs cluster2 18.5 us, hence the #SMs / 2 cut-off.
  * row path ("rows", BLOCK): one CTA per row; BLOCK = 256 for columns <= 12288 (4 CTAs/SM,
    short rows are latency-bound) else 512 (2 CTAs/SM when the CTA fits in <= 112 KB).
    "cached" (row keys kept in shared memory) when the layout (8864 B fixed + column bitmap +
    candidate list + 4*round4(columns)) fits the per-block opt-in limit (227 KB on H100/H200,
    i.e. columns <= ~53K); otherwise "uncached" with a 16384-key candidate buffer.
    The fast-path candidate list holds 4096 columns unless that would push a CTA that fits
    twice per SM over 112 KB (then as many as fit, >= 1024): e.g. 25088 columns -> 1168.
  * columns <= K: every row is the trivial 0..n-1 case; a row launch without buffer.

Compilation backends (env TOPK_BACKEND):
  "torch"  (default) torch.cuda._compile_kernel (torch >= 2.8): NVRTC -> PTX -> driver JIT.
           Python ints are passed as C int (int32): all scalar kernel params are `int`.
           Dynamic shared memory >= 48 KB needs kernel.set_shared_memory_config(bytes) first.
  "ctypes" NVRTC (compile_cpu.compile_source) -> CUBIN -> cuModuleLoadData / cuLaunchKernel
           on torch's current stream, via ctypes on libcuda.  Used automatically when
           _compile_kernel is missing.
Both launch on torch.cuda.current_stream(), so the launch is captured by torch.cuda.graph.
One NVRTC program per kernel (-DTOPK_SINGLE -DTOPK_KERNEL_<name>) keeps driver JIT short.
The cluster-16 kernel uses a non-portable cluster size; it is off unless TOPK_CLUSTER16=1.
"""

from __future__ import annotations

import ctypes
import os
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SRC_PATH = os.path.join(HERE, "topk.cu")

ROW_FIXED_BYTES = 2216 * 4  # must match ROW_FIXED_WORDS in topk.cu
CL_FIXED_BYTES = 7344 * 4  # must match CL_FIXED_WORDS
CAND_CAP = 16384  # candidate-buffer keys in uncached row mode (multiple of 4)
MAX_CAND, MIN_CAND = 4096, 1024  # fast-path candidate list (u16 columns), see _cand_cap
TWO_PER_SM_SMEM = 112 * 1024  # a CTA at or under this fits twice in a 228 KB SM (1 KB reserved each)
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14

COMPILE_LOG: list[str] = []  # (name, backend, seconds) records for the check script


def _round4(x: int) -> int:
    return (x + 3) // 4 * 4


# ----------------------------------------------------------------------------- backends
class _CtypesKernel:
    """cuModuleLoadData + cuLaunchKernel through ctypes (no torch private API)."""

    _libcuda = None

    def __init__(self, cubin: bytes, name: str):
        if _CtypesKernel._libcuda is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuLaunchKernel.argtypes = [
                ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ]
            lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            lib.cuModuleLoadData.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.cuModuleGetFunction.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.c_void_p]
            _CtypesKernel._libcuda = lib
        self.lib = _CtypesKernel._libcuda
        torch.empty(1, device="cuda")  # make sure the primary context exists and is current
        self.module = ctypes.c_void_p()
        self._chk(self.lib.cuModuleLoadData(ctypes.byref(self.module), cubin))
        self.func = ctypes.c_void_p()
        self._chk(self.lib.cuModuleGetFunction(ctypes.byref(self.func), self.module, name.encode()))

    def _chk(self, r):
        if r != 0:
            s = ctypes.c_char_p()
            self.lib.cuGetErrorString(r, ctypes.byref(s))
            raise RuntimeError(f"CUDA driver error {r}: {s.value.decode() if s.value else '?'}")

    def set_attribute(self, attr: int, value: int):
        self._chk(self.lib.cuFuncSetAttribute(self.func, attr, value))

    def set_shared_memory_config(self, nbytes: int):
        self.set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)

    def __call__(self, grid, block, args, shared_mem=0):
        keep, ptrs = [], []
        for a in args:
            if isinstance(a, torch.Tensor):
                c = ctypes.c_void_p(a.data_ptr())
            elif isinstance(a, int):
                c = ctypes.c_int(a)
            else:
                raise TypeError(type(a))
            keep.append(c)
            ptrs.append(ctypes.cast(ctypes.byref(c), ctypes.c_void_p))
        arr = (ctypes.c_void_p * len(ptrs))(*ptrs)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._chk(self.lib.cuLaunchKernel(self.func, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                          shared_mem, stream, arr, None))


def _load_compile_cpu():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_topk_compile_cpu", os.path.join(HERE, "compile_cpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Kernel:
    """Uniform wrapper: launch(grid, block, args, smem) with the >48 KB opt-in handled."""

    def __init__(self, name: str, backend: str | None = None, defines: tuple = ()):
        self.name = name
        src = open(SRC_PATH).read()
        opts = ["-DTOPK_SINGLE", f"-DTOPK_KERNEL_{name}"] + [f"-D{d}" for d in defines]
        backend = backend or os.environ.get("TOPK_BACKEND", "torch")
        if backend == "torch" and not hasattr(torch.cuda, "_compile_kernel"):
            backend = "ctypes"
        t0 = time.perf_counter()
        if backend == "torch":
            try:
                self.k = torch.cuda._compile_kernel(src, name, nvcc_options=opts)
                self.func = self.k.func
                self.k.set_shared_memory_config  # noqa: B018  (required API)
            except Exception as ex:  # noqa: BLE001
                COMPILE_LOG.append(f"{name}: torch._compile_kernel failed ({ex!r}); falling back to ctypes")
                backend = "ctypes"
        if backend != "torch":
            compile_source = _load_compile_cpu().compile_source

            major, minor = torch.cuda.get_device_capability()
            _, cubin, _, _ = compile_source(src, f"sm_{major}{minor}", None, opts)
            self.k = _CtypesKernel(cubin, name)
            self.func = self.k.func
        torch.cuda.synchronize()
        self.backend = backend
        COMPILE_LOG.append(f"{name}{list(defines) if defines else ''}: backend={backend} compile+load {time.perf_counter() - t0:.2f}s")
        self.smem_configured = 0

    def set_attribute(self, attr: int, value: int):
        if isinstance(self.k, _CtypesKernel):
            self.k.set_attribute(attr, value)
        else:
            from torch.cuda._utils import _check_cuda, _get_gpu_runtime_library

            _check_cuda(_get_gpu_runtime_library().cuFuncSetAttribute(self.func, attr, value))

    def launch(self, grid, block, args, smem):
        if smem > self.smem_configured:
            self.k.set_shared_memory_config(smem)
            self.smem_configured = smem
        self.k(grid=grid, block=block, args=args, shared_mem=smem)


_KERNELS: dict[tuple, _Kernel] = {}


def get_kernel(name: str, backend: str | None = None, defines: tuple = ()) -> _Kernel:
    """defines: extra -D macros (experiments only, e.g. ("TOPK_HIST=1",))."""
    key = (name, backend or os.environ.get("TOPK_BACKEND", "torch"), tuple(defines))
    k = _KERNELS.get(key)
    if k is None:
        k = _Kernel(name, backend, tuple(defines))
        if name == "topk_cluster16_512":
            k.set_attribute(CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        _KERNELS[key] = k
    return k


# ----------------------------------------------------------------------------- planning
_PROPS: dict[int, tuple[int, int, int]] = {}


def _device_info(dev: int):
    if dev not in _PROPS:
        p = torch.cuda.get_device_properties(dev)
        optin = getattr(p, "shared_memory_per_block_optin", 48 * 1024)
        _PROPS[dev] = (p.multi_processor_count, optin, p.major)
    return _PROPS[dev]


def choose_plan(rows: int, columns: int, K: int, dev: int = 0, allow_cluster: bool | None = None,
                allow_cl16: bool | None = None) -> dict:
    sms, optin, major = _device_info(dev)
    if allow_cluster is None:
        allow_cluster = os.environ.get("TOPK_DISABLE_CLUSTER", "0") != "1"
    if allow_cl16 is None:
        allow_cl16 = os.environ.get("TOPK_CLUSTER16", "0") == "1"
    if columns <= K:
        return {"kind": "rows", "block": 256, "cached": 0, "buf_cap": 0, "cand_cap": 0}
    if allow_cluster and major >= 9 and 2 * rows <= sms and columns >= 8192:
        for cl in ((16,) if allow_cl16 else ()) + (8, 4, 2):
            pl = cluster_plan(cl, columns)
            smem = plan_smem(pl)
            if smem > optin:
                continue
            slots = sms * (2 if smem <= TWO_PER_SM_SMEM else 1)
            if rows * cl <= slots:
                return pl
    block = 256 if columns <= 12288 else 512
    pl = rows_plan(block, columns, cached=1)
    if plan_smem(pl) <= optin:
        return pl
    return rows_plan(512, columns, cached=0)


def _nwcap(cap: int) -> int:
    return _round4(-(-cap // 32))


def _cand_cap(fixed_bytes: int, cap: int) -> int:
    """Candidate-list entries (u16, multiple of 8): MAX_CAND unless that pushes a CTA that
    would otherwise fit twice per SM over TWO_PER_SM_SMEM; never below MIN_CAND."""
    base = fixed_bytes + 4 * (_nwcap(cap) + cap)
    if base + 2 * MAX_CAND <= TWO_PER_SM_SMEM or base + 2 * MIN_CAND > TWO_PER_SM_SMEM:
        return MAX_CAND
    return max(MIN_CAND, (TWO_PER_SM_SMEM - base) // 2 // 8 * 8)


def rows_plan(block: int, columns: int, cached: int = 1, buf_cap: int | None = None) -> dict:
    if cached:
        cap = _round4(columns) if buf_cap is None else buf_cap
        return {"kind": "rows", "block": block, "cached": 1, "buf_cap": cap,
                "cand_cap": _cand_cap(ROW_FIXED_BYTES, cap)}
    return {"kind": "rows", "block": block, "cached": 0, "buf_cap": CAND_CAP if buf_cap is None else buf_cap,
            "cand_cap": 0}


def cluster_plan(cl: int, columns: int) -> dict:
    cap = _round4(-(-columns // cl))
    return {"kind": "cluster", "cl": cl, "cap": cap, "cand_cap": _cand_cap(CL_FIXED_BYTES, cap)}


def plan_smem(plan: dict) -> int:
    """Dynamic shared memory; must mirror the layouts in topk.cu."""
    if plan["kind"] == "cluster":
        return CL_FIXED_BYTES + 4 * (_nwcap(plan["cap"]) + plan["cand_cap"] // 2 + plan["cap"])
    nw = _nwcap(plan["buf_cap"]) if plan["cached"] else 0
    return ROW_FIXED_BYTES + 4 * (nw + plan["cand_cap"] // 2 + plan["buf_cap"])


def plan_name(plan: dict) -> str:
    if plan["kind"] == "cluster":
        return f"cluster{plan['cl']}"
    return f"rows{plan['block']}" + ("" if plan["cached"] else f"-uncached{plan['buf_cap']}")


# ----------------------------------------------------------------------------- entry point
def block_topk(logits: torch.Tensor, visible: torch.Tensor, K: int, out: torch.Tensor | None = None,
               plan: dict | None = None, backend: str | None = None, defines: tuple = ()) -> torch.Tensor:
    assert logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2
    assert logits.stride(1) == 1 or logits.shape[1] <= 1, "last dim must be contiguous"
    assert K >= 1
    rows, columns = logits.shape
    assert visible.dtype == torch.int32 and visible.is_contiguous() and visible.numel() == rows
    if out is None:
        out = torch.empty(rows, K, dtype=torch.int32, device=logits.device)
    assert out.dtype == torch.int32 and out.is_contiguous() and tuple(out.shape) == (rows, K)
    if rows == 0:
        return out
    ld = logits.stride(0) if rows > 1 else max(columns, 1)
    assert ld < 2**31 and columns < 2**31
    vec_ok = int(logits.data_ptr() % 16 == 0 and (ld % 4 == 0 or rows == 1))
    dev = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    p = plan or choose_plan(rows, columns, K, dev)
    smem = plan_smem(p)
    if p["kind"] == "cluster":
        cl = p["cl"]
        k = get_kernel(f"topk_cluster{cl}_512", backend, defines)
        k.launch((rows * cl, 1, 1), (512, 1, 1),
                 [logits, visible, out, rows, columns, ld, K, vec_ok, p["cap"], p["cand_cap"]], smem)
    else:
        b = p["block"]
        k = get_kernel(f"topk_rows_{b}", backend, defines)
        k.launch((rows, 1, 1), (b, 1, 1),
                 [logits, visible, out, rows, columns, ld, K, p["buf_cap"], p["cached"], vec_ok, p["cand_cap"]], smem)
    return out

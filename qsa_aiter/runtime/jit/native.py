"""Launching the native kernels: ``kernel_for`` gets a kernel built for an arch (from this process's memo, else the
JIT cache's ``native_store``, compiled there first by the arch's run-time compiler where it is missing: NVRTC on
NVIDIA, hipRTC on AMD, where an offline clang entry of the same source and macros also serves) and loaded on a device
by the vendor's driver (``cuda_driver``: ``libcuda.so.1``; ``hip_driver``: ``libamdhip64.so``); a ``PreparedLaunch``
holds a launch's converted scalars and launches it with each call's addresses on torch's current stream, so a launch
inside ``torch.cuda.graph`` is captured and a replayed call reuses it. Load before capturing: module loading is not a
stream operation (warm-up, or one call outside the capture, does it).

Modules: ``native_store`` (records, keys, locks, the build lifecycle), ``nvrtc`` / ``hiprtc`` / ``hip_clang`` (one
compiler per vendor and route), ``cuda_driver`` / ``hip_driver`` (one device driver per vendor), this one
(launching).
"""

from __future__ import annotations

import ctypes
import threading

import torch

from ...kernels.native_spec import target_of
from ..settings import QsaSettings, get_settings
from . import cuda_driver, hip_driver, hiprtc, nvrtc
from . import native_store as store_module
from .cuda_driver import (
    C_TYPES, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, LoadedKernel, _in_context, _primary_context, check,
    cluster_config, cooperative_config, current_stream, driver, load_cubin, programmatic_config,
)
from .native_store import Compiler, native_store, source_hash
from .paths import jit_root

#: This process's loaded kernels: (QSA_AITER_JIT_DIR, QSA_AITER_REBUILD, arch, source hash, kernel, defines, device)
#: -> the kernel. Keyed by the settings rather than the root they name, so a launch does not probe the directory.
_loaded: dict[tuple, LoadedKernel] = {}


def runtime_compiler(arch: str) -> Compiler:
    """The compiler a launch for ``arch`` uses: NVRTC for ``sm_XY``, hipRTC for gfx942 / gfx950 (their
    ``...Unavailable`` where it is missing)."""
    return nvrtc.compiler() if target_of(arch).vendor == "cuda" else hiprtc.find()


def unavailable_reasons(vendor: str) -> list[str]:
    """Why native kernels cannot be compiled and launched here for ``vendor`` (``cuda`` or ``hip``; empty: they
    can): its run-time compiler and its driver library."""
    if vendor == "cuda":
        found = (nvrtc.unavailable_reason(), cuda_driver.driver_reason())
    else:
        found = (hiprtc.unavailable_reason(), hip_driver.driver_reason())
    return [reason for reason in found if reason]


def cuda_only_reasons(device_type: str, on_rocm: str) -> list[str]:
    """The host facts a native kernel with no AMD version needs before its own limits: tensors on a CUDA GPU
    (``device_type``) and a CUDA build of torch (``on_rocm``: why a ROCm build does not serve). NVRTC and the driver
    come after the kernel's limits (``unavailable_reasons("cuda")``)."""
    found = []
    if device_type != "cuda":
        found.append(f"needs CUDA GPU tensors (tensors are on {device_type})")
    if torch.version.hip is not None:
        found.append(on_rocm)
    elif torch.version.cuda is None:
        found.append(f"needs a CUDA build of torch (torch {torch.__version__} has none)")
    return found


def kernel_for(source: str, kernel: str, defines: tuple[str, ...], device: int, arch: str,
               settings: QsaSettings | None = None, *, non_portable_cluster: bool = False) -> LoadedKernel:
    """``kernel`` built from ``source`` with ``defines`` for ``arch``, loaded on GPU ``device`` (an index): from this
    process's memo, else from the JIT cache (``QSA_AITER_JIT_DIR``, ``QSA_AITER_REBUILD``), compiled into it first
    where it is not there."""
    settings = settings or get_settings()
    memo_key = (settings.jit_dir, settings.rebuild, arch, source_hash(source), kernel, defines, device)
    loaded = _loaded.get(memo_key)
    if loaded is None:
        store = native_store(jit_root(settings), arch, settings.rebuild)
        if target_of(arch).vendor == "cuda":
            built = store.build(source, kernel, defines, runtime_compiler(arch))
            loaded = load_cubin(built.binary, kernel, built.entry_id, device, non_portable_cluster)
        else:
            built = store.build(source, kernel, defines, runtime_compiler(arch), prebuilt=True)
            loaded = hip_driver.load_code_object(built.binary, kernel, built.entry_id, device)
        _loaded[memo_key] = loaded
    return loaded


class PreparedLaunch:
    """One launch of a loaded native kernel with everything fixed but its pointer arguments: ``__call__(*addresses,
    stream=None)`` launches it with the integer ``addresses`` of its pointer parameters ``pointer_names`` (in the
    kernel's order; ``taking`` reorders them), on ``stream`` or the device's current one. ``name`` says what it
    launches (a replayed call's recorded launches are matched by it). The scalar arguments are converted once, here,
    so a replayed call only fills in its addresses. ``programmatic``: a programmatic dependent launch
    (``cuda_driver.programmatic_config``; NVIDIA only: the kernel must wait with ``griddepcontrol.wait`` before it
    reads what the kernel before it writes). ``cooperative``: a cooperative launch (``cuda_driver.cooperative_config``;
    NVIDIA only: the whole grid co-resident or the launch fails). ``cluster``: CTAs a thread-block cluster given at
    launch (``cuda_driver.cluster_config``; NVIDIA sm_90+; 1: none). A kernel loaded through HIP launches with
    ``hipModuleLaunchKernel``."""

    __slots__ = ("_arguments", "_config", "_cooperative", "_lock", "_pointers", "_scalars", "block", "cluster",
                 "grid", "kernel", "name", "pointer_names", "shared_bytes")

    def __init__(self, name: str, kernel: LoadedKernel, grid: tuple[int, int, int], block: tuple[int, int, int],
                 shared_bytes: int, pointer_names: tuple[str, ...], scalars: tuple[tuple[str, str, int], ...],
                 programmatic: bool = False, cooperative: bool = False, cluster: int = 1):
        if programmatic + cooperative + (cluster > 1) > 1:
            raise ValueError(f"{name}: a launch is programmatic, cooperative or clustered, one at most")
        if (cooperative or cluster > 1) and kernel.vendor != "cuda":
            raise ValueError(f"{name}: cooperative and clustered launches are wired for CUDA only (the kernel is "
                             f"{kernel.vendor}'s)")
        self.name, self.kernel, self.grid, self.block, self.shared_bytes = name, kernel, grid, block, shared_bytes
        self.cluster = cluster
        self._config = (programmatic_config(grid, block, shared_bytes) if programmatic else
                        cooperative_config(grid, block, shared_bytes) if cooperative else
                        cluster_config(grid, block, shared_bytes, cluster) if cluster > 1 else None)
        self._cooperative = cooperative
        self.pointer_names = pointer_names
        self._pointers = [ctypes.c_void_p() for _ in pointer_names]
        self._scalars = [C_TYPES[ctype](value) for _, ctype, value in scalars]
        values = self._pointers + self._scalars
        self._arguments = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self._lock = threading.Lock()  # the address slots are filled in per call: one call at a time
        if shared_bytes > kernel.shared_limit and kernel.vendor == "cuda":  # HIP has no 48 KB opt-in
            with _in_context(kernel.device):
                check(driver().cuFuncSetAttribute(kernel.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                  shared_bytes),
                      f"cuFuncSetAttribute({kernel.kernel}, MAX_DYNAMIC_SHARED_SIZE_BYTES={shared_bytes})")
            kernel.shared_limit = shared_bytes

    def __call__(self, *addresses: int, stream: int | None = None) -> None:
        kernel = self.kernel
        if stream is None:
            stream = current_stream(kernel.device)
        if kernel.vendor == "hip":
            with self._lock:
                for slot, address in zip(self._pointers, addresses, strict=True):
                    slot.value = address
                hip_driver.launch(kernel, self.grid, self.block, self.shared_bytes, stream, self._arguments)
            return
        lib = driver()
        with self._lock:
            for slot, address in zip(self._pointers, addresses, strict=True):
                slot.value = address
            current = ctypes.c_void_p()
            check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
            if current.value == _primary_context(kernel.device).value:  # torch's context: the usual case
                self._launch(lib, stream)
            else:
                with _in_context(kernel.device):
                    self._launch(lib, stream)

    @property
    def programmatic(self) -> bool:
        """Whether it is a programmatic dependent launch."""
        return self._config is not None and not self._cooperative and self.cluster == 1

    @property
    def cooperative(self) -> bool:
        """Whether it is a cooperative launch."""
        return self._cooperative

    def _launch(self, lib, stream: int) -> None:
        grid, block = self.grid, self.block
        if self._config is not None:
            config = self._config[0]
            config.stream = stream
            check(lib.cuLaunchKernelEx(ctypes.byref(config), self.kernel.function, self._arguments, None),
                  f"cuLaunchKernelEx({self.kernel.kernel}, grid {grid}, block {block}, {self.shared_bytes} B shared, "
                  f"{'cooperative' if self._cooperative else 'programmatic' if self.cluster == 1 else ''}"
                  f"{f'clusters of {self.cluster}' if self.cluster > 1 else ''})")
            return
        check(lib.cuLaunchKernel(self.kernel.function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                 self.shared_bytes, ctypes.c_void_p(stream), self._arguments, None),
              f"cuLaunchKernel({self.kernel.kernel}, grid {grid}, block {block}, {self.shared_bytes} B shared)")

    def taking(self, *names: str):
        """This launch as a function of the addresses of its pointer parameters ``names``, in that order (each named
        once; None otherwise), like the replay's ``DirectLaunch.taking``."""
        if sorted(names) != sorted(self.pointer_names):
            return None
        if names == self.pointer_names:
            return self
        order = [names.index(n) for n in self.pointer_names]
        return lambda *addresses: self(*(addresses[i] for i in order))


def forget_loaded() -> None:
    """Forget this process's loaded kernels and stores (tests; the modules stay loaded in the driver)."""
    _loaded.clear()
    store_module._stores.clear()

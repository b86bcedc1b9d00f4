"""The CUDA driver API through ctypes (``libcuda.so.1``): load a CUBIN into a device's primary context (the one torch
uses) with ``cuModuleLoadData`` and get its function (``cuModuleGetFunction``); raise a function's dynamic
shared-memory limit above 48 KB and allow a non-portable cluster size (``cuFuncSetAttribute``); launch
(``cuLaunchKernel``, or ``cuLaunchKernelEx`` for a programmatic dependent launch, ``programmatic_config``, or a
cooperative one, ``cooperative_config``). Every
call's result is checked (``check``) and a failure raises ``DriverError`` with the driver's name and text for it.
``native.PreparedLaunch`` launches through it; ``hip_driver.py`` is the AMD counterpart.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass
from functools import lru_cache

import torch

# CUDA driver API constants (cuda.h).
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
#: The carveout that gives shared memory all it can take of the unified L1 / shared memory (percent).
CARVEOUT_MAX_SHARED = 100
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_LAUNCH_ATTRIBUTE_COOPERATIVE = 2
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: Dynamic shared memory a kernel may use without raising its limit.
DEFAULT_DYNAMIC_SHARED_BYTES = 48 * 1024
#: ctypes types of the C types a ``NativeLaunch`` names for its scalar arguments.
C_TYPES = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "long long": ctypes.c_longlong,
           "unsigned long long": ctypes.c_ulonglong, "float": ctypes.c_float}


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): an attribute id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h): what ``cuLaunchKernelEx`` launches with."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(LaunchAttribute)),
                ("attribute_count", ctypes.c_uint)]


class DriverUnavailable(RuntimeError):
    """The CUDA driver library does not load here."""


class DriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


#: The driver functions used, with their ctypes argument types (the ``_v2`` names are what cuda.h maps the plain
#: names to).
_DRIVER_FUNCTIONS = {
    "cuInit": [ctypes.c_uint],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
    "cuCtxGetCurrent": [ctypes.POINTER(ctypes.c_void_p)],
    "cuCtxPushCurrent_v2": [ctypes.c_void_p],
    "cuCtxPopCurrent_v2": [ctypes.POINTER(ctypes.c_void_p)],
    "cuModuleLoadData": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p],
    "cuModuleGetFunction": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p],
    "cuFuncSetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int],
    "cuLaunchKernel": [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                       ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                       ctypes.c_void_p],
    "cuModuleGetGlobal_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p,
                             ctypes.c_char_p],
    "cuMemcpyDtoH_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t],
    "cuLaunchKernelEx": [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                         ctypes.c_void_p],
    "cuOccupancyMaxActiveBlocksPerMultiprocessor": [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int,
                                                    ctypes.c_size_t],
}
DRIVER_LIBRARY = "libcuda.so.1"


@lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL | str:
    try:
        lib = ctypes.CDLL(DRIVER_LIBRARY)
        for name, argtypes in _DRIVER_FUNCTIONS.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
    except (OSError, AttributeError) as err:
        return f"the CUDA driver library {DRIVER_LIBRARY} does not load ({str(err).splitlines()[0][:160]})"
    return lib


def driver_reason() -> str | None:
    """Why the CUDA driver API cannot be used here (None: it can)."""
    found = _driver()
    return found if isinstance(found, str) else None


def driver() -> ctypes.CDLL:
    """The CUDA driver library (``DriverUnavailable`` where it does not load)."""
    found = _driver()
    if isinstance(found, str):
        raise DriverUnavailable(found)
    return found


def check(result: int, call: str) -> None:
    """Raise ``DriverError`` naming ``call`` and the driver's error unless ``result`` is CUDA_SUCCESS."""
    if result == 0:
        return
    lib = driver()
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(result, ctypes.byref(name))
    lib.cuGetErrorString(result, ctypes.byref(text))
    raise DriverError(f"{call} failed: {name.value.decode() if name.value else result}: "
                      f"{text.value.decode() if text.value else 'unknown error'}")


_primary: dict[int, ctypes.c_void_p] = {}
_driver_lock = threading.Lock()


def _primary_context(device: int) -> ctypes.c_void_p:
    """The primary context of ``device`` (torch's), retained once per process."""
    if device not in _primary:
        with _driver_lock:
            if device not in _primary:
                lib = driver()
                check(lib.cuInit(0), "cuInit")
                handle = ctypes.c_int()
                check(lib.cuDeviceGet(ctypes.byref(handle), device), f"cuDeviceGet({device})")
                context = ctypes.c_void_p()
                check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle.value),
                      f"cuDevicePrimaryCtxRetain({device})")
                _primary[device] = context
    return _primary[device]


@contextlib.contextmanager
def _in_context(device: int):
    """Make ``device``'s primary context current for the block (pushed only where another one is current)."""
    lib = driver()
    context = _primary_context(device)
    current = ctypes.c_void_p()
    check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
    if current.value == context.value:
        yield
        return
    check(lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    try:
        yield
    finally:
        popped = ctypes.c_void_p()
        check(lib.cuCtxPopCurrent_v2(ctypes.byref(popped)), "cuCtxPopCurrent")


@dataclass
class LoadedKernel:
    """A native kernel loaded on one device: its entry, the module and function handles, the dynamic shared-memory
    limit set for it so far and its vendor (``cuda``, or ``hip``: ``hip_driver.py``)."""

    kernel: str
    entry_id: str
    device: int
    module: ctypes.c_void_p
    function: ctypes.c_void_p
    shared_limit: int = DEFAULT_DYNAMIC_SHARED_BYTES
    vendor: str = "cuda"


def load_cubin(cubin: bytes, kernel: str, entry_id: str, device: int,
               non_portable_cluster: bool = False) -> LoadedKernel:
    """Load ``cubin`` into ``device``'s primary context and get function ``kernel`` (with a cluster size above 8
    allowed where ``non_portable_cluster``)."""
    lib = driver()
    with _in_context(device):
        module = ctypes.c_void_p()
        check(lib.cuModuleLoadData(ctypes.byref(module), cubin), f"cuModuleLoadData({entry_id})")
        function = ctypes.c_void_p()
        check(lib.cuModuleGetFunction(ctypes.byref(function), module, kernel.encode()),
              f"cuModuleGetFunction({kernel})")
        if non_portable_cluster:
            check(lib.cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                  f"cuFuncSetAttribute({kernel}, NON_PORTABLE_CLUSTER_SIZE_ALLOWED)")
    return LoadedKernel(kernel, entry_id, device, module, function)


def read_global(kernel: LoadedKernel, name: str) -> bytes:
    """The bytes of the ``__device__`` variable ``name`` of ``kernel``'s module (a diagnostic build's trace buffer),
    copied to the host after the device's pending work."""
    lib = driver()
    with _in_context(kernel.device):
        address, size = ctypes.c_uint64(), ctypes.c_size_t()
        check(lib.cuModuleGetGlobal_v2(ctypes.byref(address), ctypes.byref(size), kernel.module, name.encode()),
              f"cuModuleGetGlobal({name})")
        host = ctypes.create_string_buffer(size.value)
        check(lib.cuMemcpyDtoH_v2(host, address.value, size.value), f"cuMemcpyDtoH({name})")
    return host.raw


def programmatic_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int
                        ) -> tuple[LaunchConfig, LaunchAttribute]:
    """The ``cuLaunchKernelEx`` configuration of a programmatic dependent launch (its stream filled in per launch),
    and the attribute it points to (keep both alive together): the kernel may start while the kernel before it on
    the stream finishes, and waits for it where it executes ``griddepcontrol.wait``."""
    attribute = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1  # programmaticStreamSerializationAllowed
    config = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_bytes, None,
                          ctypes.pointer(attribute), 1)
    return config, attribute


def cooperative_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int
                       ) -> tuple[LaunchConfig, LaunchAttribute]:
    """The ``cuLaunchKernelEx`` configuration of a cooperative launch (its stream filled in per launch), and the
    attribute it points to (keep both alive together): the driver launches the grid only if every CTA of it can be
    resident at once (``CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE`` otherwise), so CTAs may wait on each other."""
    attribute = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_COOPERATIVE)
    attribute.value[0] = 1  # cooperative
    config = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_bytes, None,
                          ctypes.pointer(attribute), 1)
    return config, attribute


def cluster_config(grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int, cluster: int
                   ) -> tuple[LaunchConfig, LaunchAttribute]:
    """The ``cuLaunchKernelEx`` configuration of a launch whose CTAs form thread-block clusters of ``cluster`` CTAs
    along x (its stream filled in per launch), and the attribute it points to (keep both alive together): for a
    kernel without ``__cluster_dims__``, the size given at launch (sm_90+; above 8 the kernel must be loaded with
    non-portable cluster sizes allowed)."""
    attribute = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
    attribute.value[0], attribute.value[1], attribute.value[2] = cluster, 1, 1
    config = LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_bytes, None,
                          ctypes.pointer(attribute), 1)
    return config, attribute


def resident_blocks(kernel: LoadedKernel, threads: int, shared_bytes: int) -> int:
    """CTAs of ``kernel`` (``threads`` each, ``shared_bytes`` of dynamic shared memory) that one multiprocessor holds
    at once, as the driver counts them for a cooperative launch (``cuOccupancyMaxActiveBlocksPerMultiprocessor``),
    with the kernel's shared-memory carveout set to the most shared memory first and its dynamic shared-memory limit
    raised to ``shared_bytes`` where needed (a launch then needs no other set-up)."""
    lib = driver()
    with _in_context(kernel.device):
        check(lib.cuFuncSetAttribute(kernel.function, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                     CARVEOUT_MAX_SHARED),
              f"cuFuncSetAttribute({kernel.kernel}, PREFERRED_SHARED_MEMORY_CARVEOUT={CARVEOUT_MAX_SHARED})")
        if shared_bytes > kernel.shared_limit:
            check(lib.cuFuncSetAttribute(kernel.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         shared_bytes),
                  f"cuFuncSetAttribute({kernel.kernel}, MAX_DYNAMIC_SHARED_SIZE_BYTES={shared_bytes})")
            kernel.shared_limit = shared_bytes
        blocks = ctypes.c_int()
        check(lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(blocks), kernel.function, threads,
                                                              shared_bytes),
              f"cuOccupancyMaxActiveBlocksPerMultiprocessor({kernel.kernel}, {threads} threads, {shared_bytes} B)")
    return blocks.value


#: torch's C entry for the current stream's handle (what Triton's launcher reads too); the public API where it is gone.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: int) -> int:
    """The ``cudaStream_t`` handle of ``device``'s current torch stream."""
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream

"""The HIP module API through ctypes (``libamdhip64.so``): the AMD counterpart of ``cuda_driver.py``. Load an AMDGPU
code object on a device (``hipModuleLoadData``, with that device current), get its function
(``hipModuleGetFunction``) and launch it (``hipModuleLaunchKernel``, the same argument layout as ``cuLaunchKernel``)
on torch's current stream. Every call's result is checked and a failure raises ``cuda_driver.DriverError`` with
HIP's name and text for it.

On AMD a kernel's dynamic LDS is not capped below the device's limit (no 48 KB opt-in as on NVIDIA) and there are no
clusters nor programmatic dependent launches: ``native.PreparedLaunch`` sets no attribute and launches plainly.
"""

from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

from .cuda_driver import DriverError, DriverUnavailable, LoadedKernel

#: The HIP functions used, with their ctypes argument types (hip_runtime_api.h).
_HIP_FUNCTIONS = {
    "hipGetErrorName": [ctypes.c_int],
    "hipGetErrorString": [ctypes.c_int],
    "hipGetDevice": [ctypes.POINTER(ctypes.c_int)],
    "hipSetDevice": [ctypes.c_int],
    "hipModuleLoadData": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p],
    "hipModuleGetFunction": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p],
    "hipModuleLaunchKernel": [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                              ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                              ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p],
}
#: Loader names tried, the unversioned one (ROCm's and torch's ROCm wheels') first.
LIBRARIES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")
_lock = threading.Lock()


@lru_cache(maxsize=1)
def _hip() -> ctypes.CDLL | str:
    failures = []
    for name in LIBRARIES:
        try:
            lib = ctypes.CDLL(name)
            for function, argtypes in _HIP_FUNCTIONS.items():
                getattr(lib, function).argtypes = argtypes
                getattr(lib, function).restype = ctypes.c_int
            lib.hipGetErrorName.restype = lib.hipGetErrorString.restype = ctypes.c_char_p
            return lib
        except (OSError, AttributeError) as err:
            failures.append(f"{name}: {str(err).splitlines()[0][:120]}")
    return f"the HIP runtime library does not load ({'; '.join(failures)})"


def driver_reason() -> str | None:
    """Why the HIP module API cannot be used here (None: it can)."""
    found = _hip()
    return found if isinstance(found, str) else None


def driver() -> ctypes.CDLL:
    """The HIP runtime library (``cuda_driver.DriverUnavailable`` where it does not load)."""
    found = _hip()
    if isinstance(found, str):
        raise DriverUnavailable(found)
    return found


def check(result: int, call: str) -> None:
    """Raise ``DriverError`` naming ``call`` and HIP's error unless ``result`` is hipSuccess."""
    if result == 0:
        return
    lib = driver()
    name, text = lib.hipGetErrorName(result), lib.hipGetErrorString(result)
    raise DriverError(f"{call} failed: {name.decode() if name else result}: "
                      f"{text.decode() if text else 'unknown error'}")


def load_code_object(code: bytes, kernel: str, entry_id: str, device: int) -> LoadedKernel:
    """Load the code object ``code`` on ``device`` (made current for the load, then restored) and get function
    ``kernel``."""
    lib = driver()
    with _lock:
        current = ctypes.c_int()
        check(lib.hipGetDevice(ctypes.byref(current)), "hipGetDevice")
        if current.value != device:
            check(lib.hipSetDevice(device), f"hipSetDevice({device})")
        try:
            module = ctypes.c_void_p()
            check(lib.hipModuleLoadData(ctypes.byref(module), code), f"hipModuleLoadData({entry_id})")
            function = ctypes.c_void_p()
            check(lib.hipModuleGetFunction(ctypes.byref(function), module, kernel.encode()),
                  f"hipModuleGetFunction({kernel})")
        finally:
            if current.value != device:
                check(lib.hipSetDevice(current.value), f"hipSetDevice({current.value})")
    return LoadedKernel(kernel, entry_id, device, module, function, vendor="hip")


def launch(kernel: LoadedKernel, grid: tuple[int, int, int], block: tuple[int, int, int], shared_bytes: int,
           stream: int, arguments) -> None:
    """``hipModuleLaunchKernel`` of ``kernel`` with ``arguments`` (an array of argument addresses) on ``stream``."""
    check(driver().hipModuleLaunchKernel(kernel.function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                         shared_bytes, ctypes.c_void_p(stream), arguments, None),
          f"hipModuleLaunchKernel({kernel.kernel}, grid {grid}, block {block}, {shared_bytes} B shared)")

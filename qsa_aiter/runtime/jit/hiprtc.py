"""hipRTC (AMD's run-time compiler, ROCm's ``libhiprtc.so``) through ctypes: compile a native source to an AMDGPU
code object for ``gfx942`` / ``gfx950`` on a ROCm machine, what a launch there does at a kernel's first use
(``native.kernel_for``). hipRTC pre-includes the HIP runtime header, so the source needs no ``#include``.

The library is looked for beside torch (a ROCm build of torch ships ``torch/lib/libhiprtc.so``), under
``$ROCM_PATH/lib`` and ``/opt/rocm/lib``, then by the loader's name. ``unavailable_reason()`` says why none loads
(on a CUDA or CPU build of torch: none is looked for). ``HiprtcCompiler.compile`` raises ``HiprtcError`` with the
log when the source does not compile.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from .native_store import Compiled, Resources

#: Options of every compile (after ``--offload-arch=<arch>``): C++17, optimised as the offline clang build is.
BASE_OPTIONS = ("-std=c++17", "-O3")
#: Loader names tried after the files found.
SYSTEM_NAMES = ("libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6")


class HiprtcUnavailable(RuntimeError):
    """No hipRTC library loads here; the message says why."""


class HiprtcError(RuntimeError):
    """hipRTC rejected a source: the message holds the options and the compile log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


#: hipRTC's functions used, with their ctypes argument types (hiprtc.h).
_FUNCTIONS = {
    "hiprtcVersion": [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
    "hiprtcGetErrorString": [ctypes.c_int],
    "hiprtcCreateProgram": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                            ctypes.c_void_p, ctypes.c_void_p],
    "hiprtcCompileProgram": [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "hiprtcGetProgramLogSize": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)],
    "hiprtcGetProgramLog": [ctypes.c_void_p, ctypes.c_char_p],
    "hiprtcGetCodeSize": [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)],
    "hiprtcGetCode": [ctypes.c_void_p, ctypes.c_char_p],
    "hiprtcDestroyProgram": [ctypes.POINTER(ctypes.c_void_p)],
}


def library_candidates() -> list[str]:
    """Every hipRTC library to try, in order: torch's, ``$ROCM_PATH/lib``'s, ``/opt/rocm/lib``'s, the loader's."""
    directories = []
    try:
        import torch

        directories.append(Path(torch.__file__).resolve().parent / "lib")
    except ImportError:
        pass
    if os.environ.get("ROCM_PATH"):
        directories.append(Path(os.environ["ROCM_PATH"]) / "lib")
    directories.append(Path("/opt/rocm/lib"))
    found = [str(p) for d in directories for p in sorted(d.glob("libhiprtc.so*")) if p.is_file()]
    return list(dict.fromkeys(found)) + list(SYSTEM_NAMES)


def _check(lib, result: int, what: str) -> None:
    if result != 0:
        text = lib.hiprtcGetErrorString(result)
        raise HiprtcError(f"hipRTC {what} failed: {text.decode() if text else f'error {result}'}")


def open_library(lib, path: str) -> "HiprtcCompiler":
    """A compiler on the loaded library ``lib`` (a ``ctypes.CDLL``, or a stand-in with the same functions)."""
    for name, argtypes in _FUNCTIONS.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_char_p if name == "hiprtcGetErrorString" else ctypes.c_int
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor)), "hiprtcVersion")
    return HiprtcCompiler(path, f"{major.value}.{minor.value}", lib)


@lru_cache(maxsize=1)
def _find() -> "HiprtcCompiler | str":
    import torch

    if torch.version.hip is None:
        return "hipRTC is looked for on a ROCm build of torch only"
    failures = []
    for candidate in library_candidates():
        try:
            return open_library(ctypes.CDLL(candidate), candidate)
        except (OSError, HiprtcError, AttributeError) as err:
            if "/" in candidate:
                failures.append(f"{candidate}: {str(err).splitlines()[0][:120]}")
    tried = "; ".join(failures) or "no libhiprtc.so beside torch, in $ROCM_PATH/lib, /opt/rocm/lib or the loader's path"
    return f"hipRTC not found ({tried})"


def find() -> "HiprtcCompiler":
    """The hipRTC compiler this process uses (searched once); ``HiprtcUnavailable`` says why there is none."""
    found = _find()
    if isinstance(found, str):
        raise HiprtcUnavailable(found)
    return found


def unavailable_reason() -> str | None:
    """Why hipRTC cannot be used here (None: it can)."""
    found = _find()
    return found if isinstance(found, str) else None


@dataclass(frozen=True)
class HiprtcCompiler:
    """``native_store.Compiler`` for AMD archs at run time: the hipRTC library at ``path`` of ``version``."""

    path: str
    version: str
    lib: object = field(repr=False, compare=False)
    kind = "hiprtc"

    def options(self, arch: str, defines: tuple[str, ...]) -> tuple[str, ...]:
        return (f"--offload-arch={arch}", *BASE_OPTIONS, *(f"-D{d}" for d in defines))

    def compile(self, source: str, kernel: str, arch: str, defines: tuple[str, ...]) -> Compiled:
        """Compile ``source`` for ``arch``; ``HiprtcError`` with the log where it does not compile."""
        lib, options = self.lib, self.options(arch, defines)
        encoded = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        program = ctypes.c_void_p()
        start = time.perf_counter()
        _check(lib, lib.hiprtcCreateProgram(ctypes.byref(program), source.encode(), f"{kernel}.cu".encode(), 0, None,
                                            None), "hiprtcCreateProgram")
        try:
            result = lib.hiprtcCompileProgram(program, len(options), encoded)
            size = ctypes.c_size_t()
            _check(lib, lib.hiprtcGetProgramLogSize(program, ctypes.byref(size)), "hiprtcGetProgramLogSize")
            buffer = ctypes.create_string_buffer(size.value)
            _check(lib, lib.hiprtcGetProgramLog(program, buffer), "hiprtcGetProgramLog")
            log = buffer.value.decode(errors="replace")
            if result != 0:
                status = lib.hiprtcGetErrorString(result)
                raise HiprtcError(f"hipRTC {self.version} could not compile {kernel} for {arch} "
                                  f"({status.decode() if status else result}; options {' '.join(options)}):\n"
                                  f"{log.strip()}", log)
            _check(lib, lib.hiprtcGetCodeSize(program, ctypes.byref(size)), "hiprtcGetCodeSize")
            code = ctypes.create_string_buffer(size.value)
            _check(lib, lib.hiprtcGetCode(program, code), "hiprtcGetCode")
        finally:
            lib.hiprtcDestroyProgram(ctypes.byref(program))
        return Compiled(code.raw, log, time.perf_counter() - start, Resources(), "")


def forget() -> None:
    """Search again at the next ``find`` (tests)."""
    _find.cache_clear()

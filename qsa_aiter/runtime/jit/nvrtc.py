"""NVRTC (NVIDIA's run-time CUDA compiler) through ctypes: find the library, compile a CUDA source to a CUBIN for a
named arch (``sm_XY``), no GPU and no driver needed.

The library is looked for (``library_candidates``) in the ``nvidia-cuda-nvrtc*`` wheels and the copies torch's CUDA
wheels bring (``nvidia/<package>/lib/libnvrtc.so*`` under each site-packages directory and beside torch), preferring
the CUDA major version torch was built with, then newer ones; then in the system's (the dynamic loader's
``libnvrtc.so.<major>``, ``/usr/local/cuda/lib64``). ``unavailable_reason()`` says why none loads.

``compile_cubin(source, arch, options)`` returns the CUBIN bytes and NVRTC's log, which holds ptxas' ``-v`` report
(registers, spill stores and loads, stack frame per kernel: ``ptxas_report``); a compile error raises
``NvrtcError`` with the log.
"""

from __future__ import annotations

import ctypes
import re
import site
import sysconfig
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from .native_store import Compiled as Built, Resources

#: Options of every compile (``compile_cubin`` adds the arch): C++17, device code by default, and ptxas' report of
#: registers, spills and stack in the log.
BASE_OPTIONS = ("--std=c++17", "-default-device", "--ptxas-options=-v")
#: Loader names tried after the wheels' libraries, newest CUDA first.
SYSTEM_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so")
#: Where a CUDA toolkit installs the library when the loader does not know it.
TOOLKIT_LIBS = (Path("/usr/local/cuda/lib64"),)
#: How to get one: the wheel CI installs.
INSTALL_HINT = "pip install nvidia-cuda-nvrtc-cu12 (or a CUDA build of torch, which brings NVRTC)"


class NvrtcUnavailable(RuntimeError):
    """No NVRTC library loads here, or it cannot compile for the arch asked; the message says why."""


class NvrtcError(RuntimeError):
    """NVRTC rejected a source: the message holds the options and the compile log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class Nvrtc:
    """A loaded NVRTC library: its ``path`` (or loader name), ``version`` (major, minor), the archs it can compile
    for (``sm_XY``) and the ctypes handle."""

    path: str
    version: tuple[int, int]
    archs: tuple[str, ...]
    lib: ctypes.CDLL = field(repr=False, compare=False)

    @property
    def version_text(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


@dataclass(frozen=True)
class Compiled:
    """A CUBIN NVRTC built: ``cubin`` bytes, the compile ``log`` (ptxas' report included), ``seconds`` of compile,
    and the ``Nvrtc`` that built it."""

    cubin: bytes
    log: str
    seconds: float
    nvrtc: Nvrtc


@dataclass(frozen=True)
class PtxasReport:
    """ptxas' ``-v`` report of one kernel: registers per thread, spill stores and loads and stack frame (bytes)."""

    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int


def _torch_cuda_major() -> int | None:
    """The CUDA major version torch was built with (None: a CPU or ROCm build)."""
    import torch

    version = torch.version.cuda
    return int(version.split(".")[0]) if version else None


def _search_roots() -> list[Path]:
    """The site-packages directories (and the one torch is installed in), in a stable order, each once."""
    # (site.getsitepackages is missing in some virtualenv layouts)
    roots = list(getattr(site, "getsitepackages", list)()) + [site.getusersitepackages(),
                                                              sysconfig.get_paths()["purelib"]]
    try:
        import torch

        roots.append(str(Path(torch.__file__).resolve().parents[1]))
    except ImportError:
        pass
    seen, result = set(), []
    for root in roots:
        path = Path(root)
        if path not in seen and path.is_dir():
            seen.add(path)
            result.append(path)
    return result


def _major_of(path: Path) -> int:
    """The CUDA major version in a library file name (``libnvrtc.so.12`` -> 12; 0 where it has none)."""
    match = re.search(r"\.so\.(\d+)", path.name)
    return int(match.group(1)) if match else 0


def library_candidates() -> list[str]:
    """Every NVRTC library to try, in order: the wheels' (torch's CUDA major first, then newer majors first), then
    the system's."""
    found = []
    for root in _search_roots():
        for pattern in ("nvidia/*/lib/libnvrtc.so*", "torch/lib/libnvrtc*.so*"):
            found += [p for p in root.glob(pattern)
                      if "builtins" not in p.name and ".alt." not in p.name and p.is_file()]
    for directory in TOOLKIT_LIBS:
        found += [p for p in directory.glob("libnvrtc.so*") if "builtins" not in p.name and p.is_file()]
    major = _torch_cuda_major()
    ordered = sorted(dict.fromkeys(found), key=lambda p: (_major_of(p) != major, -_major_of(p), str(p)))
    return [str(p) for p in ordered] + list(SYSTEM_NAMES)


def _check(lib, result: int, what: str) -> None:
    if result != 0:
        text = lib.nvrtcGetErrorString(result)
        raise NvrtcError(f"NVRTC {what} failed: {text.decode() if text else f'error {result}'}")


def _open(path: str) -> Nvrtc:
    lib = ctypes.CDLL(path)
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    archs: tuple[str, ...] = ()
    if hasattr(lib, "nvrtcGetNumSupportedArchs"):
        count = ctypes.c_int()
        _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
        values = (ctypes.c_int * count.value)()
        _check(lib, lib.nvrtcGetSupportedArchs(values), "nvrtcGetSupportedArchs")
        archs = tuple(f"sm_{v}" for v in values)
    for name, args in (("nvrtcCreateProgram", [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                                ctypes.c_void_p, ctypes.c_void_p]),
                       ("nvrtcCompileProgram", [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]),
                       ("nvrtcGetProgramLogSize", [ctypes.c_void_p, ctypes.c_void_p]),
                       ("nvrtcGetProgramLog", [ctypes.c_void_p, ctypes.c_char_p]),
                       ("nvrtcGetCUBINSize", [ctypes.c_void_p, ctypes.c_void_p]),
                       ("nvrtcGetCUBIN", [ctypes.c_void_p, ctypes.c_char_p]),
                       ("nvrtcDestroyProgram", [ctypes.c_void_p])):
        getattr(lib, name).argtypes = args
    return Nvrtc(path, (major.value, minor.value), archs, lib)


@lru_cache(maxsize=1)
def _find() -> Nvrtc | str:
    """The first NVRTC that loads and has ``nvrtcGetCUBIN`` (CUDA 11.1+), or the reason none does."""
    failures = []
    for candidate in library_candidates():
        try:
            nvrtc = _open(candidate)
        except (OSError, NvrtcError, AttributeError) as err:
            if "/" in candidate:  # a file that exists but does not load is worth naming; a loader miss is not
                failures.append(f"{candidate}: {str(err).splitlines()[0][:120]}")
            continue
        if not hasattr(nvrtc.lib, "nvrtcGetCUBIN"):
            failures.append(f"{candidate}: NVRTC {nvrtc.version_text} cannot emit CUBINs (needs 11.1+)")
            continue
        return nvrtc
    tried = "; ".join(failures) if failures else "no libnvrtc.so in site-packages (nvidia/*/lib), torch/lib, " \
        f"{', '.join(map(str, TOOLKIT_LIBS))} or the loader's path"
    return f"NVRTC not found ({tried}): {INSTALL_HINT}"


def find() -> Nvrtc:
    """The NVRTC library this process compiles with (searched once); ``NvrtcUnavailable`` says why there is none."""
    found = _find()
    if isinstance(found, str):
        raise NvrtcUnavailable(found)
    return found


def unavailable_reason() -> str | None:
    """Why NVRTC cannot be used here (None: it can)."""
    found = _find()
    return found if isinstance(found, str) else None


def forget() -> None:
    """Search again at the next ``find`` (tests)."""
    _find.cache_clear()


def arch_reason(nvrtc: Nvrtc, arch: str) -> str | None:
    """Why ``nvrtc`` cannot compile for ``arch`` (``sm_XY``; None: it can)."""
    if not re.fullmatch(r"sm_\d+a?", arch):
        return f"arch must be an NVIDIA arch such as sm_90; got {arch!r}"
    if nvrtc.archs and arch.rstrip("a") not in nvrtc.archs:
        return (f"NVRTC {nvrtc.version_text} ({nvrtc.path}) cannot compile for {arch} "
                f"(it knows {', '.join(nvrtc.archs)})")
    return None


def compile_cubin(source: str, arch: str, options: tuple[str, ...] = (), *, name: str = "kernel.cu",
                  nvrtc: Nvrtc | None = None) -> Compiled:
    """Compile CUDA ``source`` to a CUBIN for ``arch`` (``sm_XY``) with ``BASE_OPTIONS`` and ``options`` (e.g.
    ``-DNAME=1``). ``name`` is the source's name in the log. ``NvrtcUnavailable`` without NVRTC (or one too old for
    ``arch``); ``NvrtcError`` with the log when the source does not compile."""
    nvrtc = nvrtc or find()
    reason = arch_reason(nvrtc, arch)
    if reason:
        raise NvrtcUnavailable(reason)
    lib = nvrtc.lib
    all_options = [f"--gpu-architecture={arch}", *BASE_OPTIONS, *options]
    encoded = (ctypes.c_char_p * len(all_options))(*[o.encode() for o in all_options])
    program = ctypes.c_void_p()
    start = time.perf_counter()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        result = lib.nvrtcCompileProgram(program, len(all_options), encoded)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)), "nvrtcGetProgramLogSize")
        buffer = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetProgramLog(program, buffer), "nvrtcGetProgramLog")
        log = buffer.value.decode(errors="replace")
        if result != 0:
            status = lib.nvrtcGetErrorString(result)
            raise NvrtcError(f"NVRTC {nvrtc.version_text} could not compile {name} for {arch} "
                             f"({status.decode() if status else result}; options {' '.join(all_options)}):\n"
                             f"{log.strip()}", log)
        _check(lib, lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))
    return Compiled(cubin.raw, log, time.perf_counter() - start, nvrtc)


_FUNCTION = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def ptxas_report(log: str) -> dict[str, PtxasReport]:
    """ptxas' ``-v`` report in an NVRTC log, per kernel name (``Function properties for <name>``, then its stack
    frame and spill line, then ``Used N registers``)."""
    reports: dict[str, PtxasReport] = {}
    current, frame = None, None
    for line in log.splitlines():
        if match := _FUNCTION.search(line):
            current, frame = match.group(1), None
        elif current and (match := _FRAME.search(line)):
            frame = tuple(int(g) for g in match.groups())
        elif current and frame and (match := _REGISTERS.search(line)):
            reports[current] = PtxasReport(int(match.group(1)), frame[1], frame[2], frame[0])
            current, frame = None, None
    return reports


@dataclass(frozen=True)
class NvrtcCompiler:
    """``native_store.Compiler`` for NVIDIA archs: ``nvrtc`` (default: ``find()``) compiling to a CUBIN."""

    nvrtc: Nvrtc
    kind = "nvrtc"

    @property
    def version(self) -> str:
        return self.nvrtc.version_text

    @property
    def path(self) -> str:
        return self.nvrtc.path

    def options(self, arch: str, defines: tuple[str, ...]) -> tuple[str, ...]:
        return (f"--gpu-architecture={arch}", *BASE_OPTIONS, *(f"-D{d}" for d in defines))

    def compile(self, source: str, kernel: str, arch: str, defines: tuple[str, ...]) -> Built:
        done = compile_cubin(source, arch, tuple(f"-D{d}" for d in defines), name=f"{kernel}.cu", nvrtc=self.nvrtc)
        report = ptxas_report(done.log).get(kernel)
        resources = (Resources(report.registers, report.spill_store_bytes, report.spill_load_bytes, report.stack_bytes)
                     if report else Resources())
        lines = "\n".join(line for line in done.log.splitlines() if line.startswith("ptxas"))
        return Built(done.cubin, done.log, done.seconds, resources, lines)


def compiler(nvrtc: Nvrtc | None = None) -> NvrtcCompiler:
    """The NVRTC compiler of native sources (``NvrtcUnavailable`` without NVRTC)."""
    return NvrtcCompiler(nvrtc or find())

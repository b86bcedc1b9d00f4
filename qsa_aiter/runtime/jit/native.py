"""The native entries of the JIT cache: CUDA C++ kernels compiled by NVRTC (``nvrtc``) to CUBINs, kept under the JIT
root, loaded and launched through the CUDA driver API (ctypes on ``libcuda.so.1``).

Layout::

    <root>/native/<arch>/                e.g. jit/native/sm_90/
        <kernel>-<hash>.cubin            the binary
        <kernel>-<hash>.json             its record (``NativeRecord``): what, when, compile seconds, registers and
                                         spills from ptxas' report, the cubin's size and sha256; written last
        locks/<kernel>-<hash>.lock       held by the process that checks, compiles and records that entry

An entry is keyed (``native_key``) by the sha256 of the source, the kernel, the arch, the NVRTC options (the
kernel's ``-D`` macros included) and the NVRTC version. Its lifecycle (``NativeStore.build``) is the Triton entries'
(``store.py``): look for a usable entry; else take its file lock, look again (another process may have built it
meanwhile), compile, write the cubin then the record (each replaced atomically), release. An entry whose record does
not parse or whose cubin is missing or altered is rebuilt with a warning, never fatal; with ``QSA_AITER_REBUILD=1``
an entry written before the store was opened is rebuilt (once, however many processes ask).

Launching (``kernel_for``, ``PreparedLaunch``): each process loads an entry's cubin once per device into the
device's primary context (the one torch uses) with ``cuModuleLoadData`` and keeps the function
(``cuModuleGetFunction``); ``cuFuncSetAttribute`` raises its dynamic shared-memory limit above 48 KB when a launch
needs it and allows a non-portable cluster size where the kernel has one; a ``PreparedLaunch`` holds a launch's
converted scalars and ``cuLaunchKernel``s it with each call's addresses on torch's current stream, so a launch inside
``torch.cuda.graph`` is captured and a replayed call reuses it (``cuLaunchKernelEx`` for a programmatic dependent
launch). Every driver call's result is checked and a failure raises ``DriverError`` with the driver's name and text
for it. Load before capturing: module loading is not a stream operation (warm-up, or one call outside the capture,
does it).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Literal

import filelock
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..log import log_once
from ..settings import QsaSettings, get_settings
from . import nvrtc as nvrtc_module
from .manifest import file_sha256
from .paths import jit_root, writable
from .store import LOCK_TIMEOUT_S, Event, acquire_compile_lock

FORMAT = 1
#: The directory under the JIT root that holds the native entries (``<root>/native/<arch>/``).
NATIVE_DIR = "native"

# CUDA driver API constants (cuda.h).
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
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


class NativeRecord(BaseModel):
    """The record of one native entry (``<entry>.json``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1] = FORMAT
    kernel: str = Field(description="the kernel's extern \"C\" name")
    arch: str = Field(description="the NVIDIA arch it was compiled for (sm_90 ...)")
    options: list[str] = Field(description="the NVRTC options, arch and -D macros included")
    source_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the CUDA source compiled")
    nvrtc_version: str = Field(description="major.minor of the NVRTC that compiled it")
    nvrtc_library: str = Field(description="the NVRTC library file")
    cubin: str = Field(description="file name of the cubin beside the record")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    registers: int | None = Field(description="registers per thread (ptxas -v)")
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    stack_bytes: int | None
    ptxas: str = Field(description="ptxas' report lines of the compile log")
    built_by: Literal["launch", "target"] = Field(description="compiled at a launch on the GPU, or for a named arch")
    compile_seconds: float = Field(ge=0)
    date: datetime

    def summary(self) -> str:
        """Its kernel, NVRTC and ptxas' report on one line."""
        def size(value):
            return "?" if value is None else f"{value} B"

        return (f"{self.kernel} NVRTC {self.nvrtc_version}: {self.registers if self.registers is not None else '?'} "
                f"registers, {size(self.spill_store_bytes)} spill stores, {size(self.spill_load_bytes)} spill loads, "
                f"{size(self.stack_bytes)} stack")


@lru_cache(maxsize=16)
def source_hash(source: str) -> str:
    """sha256 of a CUDA source's text (memoised: a launch asks for it each time, with the same string)."""
    return hashlib.sha256(source.encode()).hexdigest()


def nvrtc_options(defines: tuple[str, ...]) -> tuple[str, ...]:
    """The NVRTC options of a kernel built with ``defines`` (``NAME`` or ``NAME=VALUE``), after the arch."""
    return nvrtc_module.BASE_OPTIONS + tuple(f"-D{d}" for d in defines)


def native_key(source_sha256: str, kernel: str, arch: str, options: tuple[str, ...], nvrtc_version: str) -> str:
    """What identifies a native build: sha256 over the source's hash, the kernel, the arch, the options and the NVRTC
    version."""
    text = json.dumps([source_sha256, kernel, arch, list(options), nvrtc_version])
    return hashlib.sha256(text.encode()).hexdigest()


def native_entry_id(kernel: str, key: str) -> str:
    """An entry's file stem: the kernel's name and the first 20 hex digits of its key."""
    return f"{kernel}-{key[:20]}"


def _write_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: a reader sees the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@dataclass(frozen=True)
class Built:
    """A usable entry: its id, record and cubin bytes, and the ``Event`` of getting it (compiled here or found)."""

    entry_id: str
    record: NativeRecord
    cubin: bytes
    event: Event


class NativeStore:
    """The native entries of one JIT root and arch (``<root>/native/<arch>/``).

    ``rebuild``: entries recorded before this store was opened are rebuilt rather than used (``QSA_AITER_REBUILD``).
    ``events``: what this process compiled or found here, in order."""

    def __init__(self, root: Path, arch: str, rebuild: bool = False):
        self.root = Path(root)
        self.arch = arch
        self.rebuild = rebuild
        self.dir = self.root / NATIVE_DIR / arch
        self.opened = datetime.now(timezone.utc)
        self.events: list[Event] = []

    def writable(self) -> bool:
        return writable(self.dir)

    def record_path(self, eid: str) -> Path:
        return self.dir / f"{eid}.json"

    def cubin_path(self, eid: str) -> Path:
        return self.dir / f"{eid}.cubin"

    def lock(self, eid: str) -> filelock.BaseFileLock:
        """The file lock a process holds while it checks, compiles and records entry ``eid``."""
        (self.dir / "locks").mkdir(parents=True, exist_ok=True)
        return filelock.FileLock(str(self.dir / "locks" / f"{eid}.lock"), timeout=LOCK_TIMEOUT_S)

    def entry_ids(self) -> list[str]:
        """The ids of the records here (sorted)."""
        return sorted(p.stem for p in self.dir.glob("*.json")) if self.dir.is_dir() else []

    def read(self, eid: str) -> NativeRecord | None:
        """Entry ``eid``'s record; None if there is none. ``ValueError`` naming the file where it does not parse."""
        path = self.record_path(eid)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return NativeRecord.model_validate_json(data)
        except ValidationError as err:
            raise ValueError(f"{path.name} does not parse ({str(err).splitlines()[0][:160]})") from None

    def problem(self, eid: str, record: NativeRecord, cubin: bytes | None = None) -> str | None:
        """Why entry ``eid`` (``record``) cannot be used (None: it can): a record of another arch or entry, its cubin
        (``cubin``: its bytes, already read) missing, or of another size or sha256 than recorded."""
        path = self.cubin_path(eid)
        if record.arch != self.arch or record.cubin != path.name:
            return f"corrupt: the record describes {record.cubin} for {record.arch}"
        try:
            size = path.stat().st_size if cubin is None else len(cubin)
        except FileNotFoundError:
            return f"corrupt: {path.name} is missing"
        if size != record.size:
            return f"corrupt: {path.name} has {size} bytes, {record.size} recorded"
        digest = file_sha256(path) if cubin is None else hashlib.sha256(cubin).hexdigest()
        if digest != record.sha256:
            return f"corrupt: {path.name} does not match its recorded sha256"
        return None

    def needs_rebuild(self, record: NativeRecord) -> bool:
        """Under ``rebuild``, an entry recorded before this store was opened (one rebuilt since by another process
        is used)."""
        return self.rebuild and record.date < self.opened

    def _usable(self, eid: str) -> tuple[NativeRecord, bytes] | None:
        """Entry ``eid``'s record and cubin if it can be used as it is (the bytes checked are the bytes returned); a
        corrupt one is logged once and None."""
        cubin = None
        try:
            record = self.read(eid)
            if record is None:
                return None
            cubin = self.cubin_path(eid).read_bytes()
        except FileNotFoundError:
            problem = f"corrupt: {self.cubin_path(eid).name} is missing"
        except ValueError as err:
            problem = f"corrupt: {err}"
        else:
            problem = self.problem(eid, record, cubin)
        if problem:
            log_once(logging.WARNING, ("native-rebuild", str(self.dir), eid, problem),
                     f"native JIT cache entry {self.dir / eid} is {problem}; rebuilding it")
            return None
        if self.needs_rebuild(record):
            return None
        return record, cubin

    def identify(self, source: str, kernel: str, defines: tuple[str, ...],
                 nvrtc: nvrtc_module.Nvrtc) -> tuple[str, tuple[str, ...]]:
        """``(entry id, NVRTC options)`` of ``kernel`` built from ``source`` with ``defines`` by ``nvrtc``."""
        options = nvrtc_options(defines)
        key = native_key(source_hash(source), kernel, self.arch, (f"--gpu-architecture={self.arch}", *options),
                         nvrtc.version_text)
        return native_entry_id(kernel, key), options

    def build(self, source: str, kernel: str, defines: tuple[str, ...] = (), *,
              built_by: Literal["launch", "target"] = "launch", wait: bool = True,
              nvrtc: nvrtc_module.Nvrtc | None = None) -> Built:
        """The entry of ``kernel`` (its ``extern "C"`` name) built from ``source`` with ``-D`` ``defines`` for this
        store's arch: found here, or compiled once (under its lock) and recorded. ``wait=False`` raises
        ``VariantBusy`` instead of waiting for another process's compile. ``NvrtcUnavailable`` without NVRTC;
        ``NvrtcError`` (with the log) when the source does not compile. A directory that is not writable still
        serves its entries; a missing entry is then compiled into memory only (logged once)."""
        nvrtc = nvrtc or nvrtc_module.find()
        eid, options = self.identify(source, kernel, defines, nvrtc)
        found = self._usable(eid)
        if found is not None:
            return self._found(eid, *found)
        persist = self.writable()
        lock = None
        if persist:
            lock = acquire_compile_lock(self.lock(eid), eid, wait, self.dir)
        else:
            log_once(logging.WARNING, ("native-readonly", str(self.dir)),
                     f"native JIT cache {self.dir} is not writable: new native kernels are compiled in memory only")
        try:
            found = self._usable(eid) if persist else None  # another process may have built it meanwhile
            if found is not None:
                return self._found(eid, *found)
            compiled = nvrtc_module.compile_cubin(source, self.arch, options, name=f"{kernel}.cu", nvrtc=nvrtc)
            record = self._record(eid, kernel, source, options, compiled, built_by)
            if persist:
                _write_atomically(self.cubin_path(eid), compiled.cubin)
                _write_atomically(self.record_path(eid), record.model_dump_json(indent=1).encode())
        finally:
            if lock is not None:
                lock.release()
        event = Event(eid, kernel, True, compiled.seconds)
        self.events.append(event)
        return Built(eid, record, compiled.cubin, event)

    def _found(self, eid: str, record: NativeRecord, cubin: bytes) -> Built:
        event = Event(eid, record.kernel, False, 0.0)
        self.events.append(event)
        return Built(eid, record, cubin, event)

    def _record(self, eid: str, kernel: str, source: str, options: tuple[str, ...],
                compiled: nvrtc_module.Compiled, built_by: str) -> NativeRecord:
        report = nvrtc_module.ptxas_report(compiled.log).get(kernel)
        ptxas = "\n".join(line for line in compiled.log.splitlines() if line.startswith("ptxas"))
        return NativeRecord(
            kernel=kernel, arch=self.arch, options=[f"--gpu-architecture={self.arch}", *options],
            source_sha256=source_hash(source), nvrtc_version=compiled.nvrtc.version_text,
            nvrtc_library=compiled.nvrtc.path, cubin=self.cubin_path(eid).name, size=len(compiled.cubin),
            sha256=hashlib.sha256(compiled.cubin).hexdigest(),
            registers=report.registers if report else None,
            spill_store_bytes=report.spill_store_bytes if report else None,
            spill_load_bytes=report.spill_load_bytes if report else None,
            stack_bytes=report.stack_bytes if report else None,
            ptxas=ptxas, built_by=built_by, compile_seconds=round(compiled.seconds, 4),
            date=datetime.now(timezone.utc))


_stores: dict[tuple, NativeStore] = {}


def native_store(root: Path, arch: str, rebuild: bool = False) -> NativeStore:
    """The process's ``NativeStore`` of ``root`` and ``arch`` (one object per directory and rebuild switch, so a
    rebuild happens once per process)."""
    key = (Path(root).resolve(), arch, rebuild)
    if key not in _stores:
        _stores[key] = NativeStore(Path(root), arch, rebuild)
    return _stores[key]


# ---------------------------------------------------------------------------------------------------------------
# The CUDA driver API
# ---------------------------------------------------------------------------------------------------------------


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
    """A native kernel loaded on one device: its entry, the module and function handles, and the dynamic
    shared-memory limit set for it so far."""

    kernel: str
    entry_id: str
    device: int
    module: ctypes.c_void_p
    function: ctypes.c_void_p
    shared_limit: int = DEFAULT_DYNAMIC_SHARED_BYTES


#: This process's loaded kernels: (QSA_AITER_JIT_DIR, QSA_AITER_REBUILD, arch, source hash, kernel, defines, device)
#: -> the kernel. Keyed by the settings rather than the root they name, so a launch does not probe the directory.
_loaded: dict[tuple, LoadedKernel] = {}


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


def kernel_for(source: str, kernel: str, defines: tuple[str, ...], device: int, arch: str,
               settings: QsaSettings | None = None, *, non_portable_cluster: bool = False) -> LoadedKernel:
    """``kernel`` built from ``source`` with ``defines`` for ``arch``, loaded on CUDA ``device`` (an index): from
    this process's memo, else from the JIT cache (``QSA_AITER_JIT_DIR``, ``QSA_AITER_REBUILD``), compiled into it
    first where it is not there."""
    settings = settings or get_settings()
    memo_key = (settings.jit_dir, settings.rebuild, arch, source_hash(source), kernel, defines, device)
    loaded = _loaded.get(memo_key)
    if loaded is None:
        built = native_store(jit_root(settings), arch, settings.rebuild).build(source, kernel, defines)
        loaded = load_cubin(built.cubin, kernel, built.entry_id, device, non_portable_cluster)
        _loaded[memo_key] = loaded
    return loaded


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


class PreparedLaunch:
    """One launch of a loaded native kernel with everything fixed but its pointer arguments: ``__call__(*addresses,
    stream=None)`` launches it with the integer ``addresses`` of its pointer parameters ``pointer_names`` (in the
    kernel's order; ``taking`` reorders them), on ``stream`` or the device's current one. ``name`` says what it
    launches (a replayed call's recorded launches are matched by it). The scalar arguments are converted once, here,
    so a replayed call only fills in its addresses. ``programmatic``: a programmatic dependent launch
    (``programmatic_config``; the kernel must wait with ``griddepcontrol.wait`` before it reads what the kernel
    before it writes)."""

    __slots__ = ("_arguments", "_config", "_lock", "_pointers", "_scalars", "block", "grid", "kernel", "name",
                 "pointer_names", "shared_bytes")

    def __init__(self, name: str, kernel: LoadedKernel, grid: tuple[int, int, int], block: tuple[int, int, int],
                 shared_bytes: int, pointer_names: tuple[str, ...], scalars: tuple[tuple[str, str, int], ...],
                 programmatic: bool = False):
        self.name, self.kernel, self.grid, self.block, self.shared_bytes = name, kernel, grid, block, shared_bytes
        self._config = programmatic_config(grid, block, shared_bytes) if programmatic else None
        self.pointer_names = pointer_names
        self._pointers = [ctypes.c_void_p() for _ in pointer_names]
        self._scalars = [C_TYPES[ctype](value) for _, ctype, value in scalars]
        values = self._pointers + self._scalars
        self._arguments = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self._lock = threading.Lock()  # the address slots are filled in per call: one call at a time
        if shared_bytes > kernel.shared_limit:
            with _in_context(kernel.device):
                check(driver().cuFuncSetAttribute(kernel.function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                  shared_bytes),
                      f"cuFuncSetAttribute({kernel.kernel}, MAX_DYNAMIC_SHARED_SIZE_BYTES={shared_bytes})")
            kernel.shared_limit = shared_bytes

    def __call__(self, *addresses: int, stream: int | None = None) -> None:
        kernel = self.kernel
        if stream is None:
            stream = current_stream(kernel.device)
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
        return self._config is not None

    def _launch(self, lib, stream: int) -> None:
        grid, block = self.grid, self.block
        if self._config is not None:
            config = self._config[0]
            config.stream = stream
            check(lib.cuLaunchKernelEx(ctypes.byref(config), self.kernel.function, self._arguments, None),
                  f"cuLaunchKernelEx({self.kernel.kernel}, grid {grid}, block {block}, {self.shared_bytes} B shared, "
                  "programmatic)")
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


#: torch's C entry for the current stream's handle (what Triton's launcher reads too); the public API where it is gone.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device: int) -> int:
    """The ``cudaStream_t`` handle of ``device``'s current torch stream."""
    if _raw_stream is not None:
        return _raw_stream(device)
    return torch.cuda.current_stream(device).cuda_stream


def forget_loaded() -> None:
    """Forget this process's loaded kernels and stores (tests; the modules stay loaded in the driver)."""
    _loaded.clear()
    _stores.clear()

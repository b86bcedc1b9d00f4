"""The native entries of the JIT cache: kernels compiled from a native source (``kernels/native_spec.py``) for one
arch, by NVRTC (``nvrtc.py``) or hipRTC (``hiprtc.py``) at a launch, or offline (NVRTC for ``sm_XY``, clang for
gfx942 / gfx950: ``hip_clang.py``), kept under the JIT root. Loading and launching them is the vendor drivers'
(``cuda_driver.py``, ``hip_driver.py``) and ``native.py``'s.

Layout::

    <root>/native/<arch>/                e.g. jit/native/sm_90/, jit/native/gfx942/
        <kernel>-<hash>.cubin | .hsaco   the binary (a CUBIN on NVIDIA, an AMDGPU code object on AMD)
        <kernel>-<hash>.json             its record (``NativeRecord``): what, which compiler, when, compile seconds,
                                         registers and spills from the compiler's report, the binary's size and
                                         sha256; written last
        locks/<kernel>-<hash>.lock       held by the process that checks, compiles and records that entry

An entry is keyed (``native_key``) by the sha256 of the source, the kernel, the arch, the compiler's options (the
kernel's ``-D`` macros included) and the compiler's identity (``nvrtc 12.8``, ``hiprtc 7.2``, ``clang 22.1.8``).
So a hipRTC build and a clang build of one kernel are two entries. A launch on a ROCm GPU looks for its hipRTC entry
first; where there is none it loads the newest clang entry of the same source, kernel, arch and ``-D`` macros
(``NativeStore.prebuilt``: what ``warmup --arch gfx942`` made on a machine without the GPU) and compiles nothing;
only without either does it compile with hipRTC.

The lifecycle (``NativeStore.build``) is the Triton entries' (``store.py``): look for a usable entry; else take its
file lock, look again (another process may have built it meanwhile), compile, write the binary then the record (each
replaced atomically), release. An entry whose record does not parse or whose binary is missing or altered is rebuilt
with a warning, never fatal; with ``QSA_AITER_REBUILD=1`` an entry written before the store was opened is rebuilt
(once, however many processes ask).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Literal, Protocol

import filelock
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...kernels.native_spec import target_of
from ..log import log_once
from .manifest import file_sha256
from .paths import writable
from .store import LOCK_TIMEOUT_S, Event, acquire_compile_lock

FORMAT = 2
#: The directory under the JIT root that holds the native entries (``<root>/native/<arch>/``).
NATIVE_DIR = "native"
#: How each compiler is named in listings.
COMPILER_LABELS = {"nvrtc": "NVRTC", "hiprtc": "hipRTC", "clang": "clang"}


@dataclass(frozen=True)
class Resources:
    """A kernel's resources from its compiler's report: registers per thread (VGPRs on AMD), spill stores and loads
    and stack frame (scratch per lane on AMD) in bytes; None where the report does not say."""

    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    stack_bytes: int | None = None


@dataclass(frozen=True)
class Compiled:
    """What a compiler made: the ``binary``, its ``log``, ``seconds`` of compile, the kernel's ``resources`` and the
    log's report lines (``report``)."""

    binary: bytes
    log: str
    seconds: float
    resources: Resources
    report: str


class Compiler(Protocol):
    """A compiler of native sources for one vendor (``nvrtc.NvrtcCompiler``, ``hiprtc.HiprtcCompiler``,
    ``hip_clang.ClangCompiler``)."""

    kind: str  # nvrtc, hiprtc or clang
    version: str
    path: str

    def options(self, arch: str, defines: tuple[str, ...]) -> tuple[str, ...]:
        """Every option of a compile for ``arch`` with ``-D`` ``defines`` (what the key and the record hold)."""

    def compile(self, source: str, kernel: str, arch: str, defines: tuple[str, ...]) -> Compiled:
        """Compile ``source`` (``kernel`` is its name in logs and reports)."""


class NativeRecord(BaseModel):
    """The record of one native entry (``<entry>.json``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[2] = FORMAT
    kernel: str = Field(description="the kernel's extern \"C\" name")
    arch: str = Field(description="the arch it was compiled for (sm_90, gfx942 ...)")
    options: list[str] = Field(description="the compiler's options, arch and -D macros included")
    defines: list[str] = Field(description="the -D macros (what a hipRTC launch matches a clang entry by)")
    source_sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the source compiled")
    compiler: Literal["nvrtc", "hiprtc", "clang"]
    compiler_version: str = Field(description="the compiler's version")
    compiler_path: str = Field(description="the compiler's library or executable")
    binary: str = Field(description="file name of the binary beside the record")
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    registers: int | None = Field(description="registers per thread (ptxas -v; VGPRs on AMD)")
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    stack_bytes: int | None = Field(description="stack frame (scratch bytes per lane on AMD)")
    report: str = Field(description="the compiler's resource report lines")
    built_by: Literal["launch", "target"] = Field(description="compiled at a launch on the GPU, or for a named arch")
    compile_seconds: float = Field(ge=0)
    date: datetime

    @property
    def compiler_identity(self) -> str:
        return f"{self.compiler} {self.compiler_version}"

    def summary(self) -> str:
        """Its kernel, compiler and resources on one line."""
        def size(value):
            return "?" if value is None else f"{value} B"

        registers = self.registers if self.registers is not None else "?"
        return (f"{self.kernel} {COMPILER_LABELS[self.compiler]} {self.compiler_version}: {registers} registers, "
                f"{size(self.spill_store_bytes)} spill stores, {size(self.spill_load_bytes)} spill loads, "
                f"{size(self.stack_bytes)} stack")


@lru_cache(maxsize=16)
def source_hash(source: str) -> str:
    """sha256 of a native source's text (memoised: a launch asks for it each time, with the same string)."""
    return hashlib.sha256(source.encode()).hexdigest()


def native_key(source_sha256: str, kernel: str, arch: str, options: tuple[str, ...], compiler: str) -> str:
    """What identifies a native build: sha256 over the source's hash, the kernel, the arch, the options and the
    compiler's identity (``nvrtc 12.8``)."""
    text = json.dumps([source_sha256, kernel, arch, list(options), compiler])
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
    """A usable entry: its id, record and binary bytes, and the ``Event`` of getting it (compiled here or found)."""

    entry_id: str
    record: NativeRecord
    binary: bytes
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
        try:
            self.suffix = target_of(arch).binary_suffix
        except ValueError:  # a directory of no known arch (listed, never built into)
            self.suffix = ".bin"
        self.opened = datetime.now(timezone.utc)
        self.events: list[Event] = []

    def writable(self) -> bool:
        return writable(self.dir)

    def record_path(self, eid: str) -> Path:
        return self.dir / f"{eid}.json"

    def binary_path(self, eid: str) -> Path:
        return self.dir / f"{eid}{self.suffix}"

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

    def problem(self, eid: str, record: NativeRecord, binary: bytes | None = None) -> str | None:
        """Why entry ``eid`` (``record``) cannot be used (None: it can): a record of another arch or entry, its binary
        (``binary``: its bytes, already read) missing, or of another size or sha256 than recorded."""
        path = self.binary_path(eid)
        if record.arch != self.arch or record.binary != path.name:
            return f"corrupt: the record describes {record.binary} for {record.arch}"
        try:
            size = path.stat().st_size if binary is None else len(binary)
        except FileNotFoundError:
            return f"corrupt: {path.name} is missing"
        if size != record.size:
            return f"corrupt: {path.name} has {size} bytes, {record.size} recorded"
        digest = file_sha256(path) if binary is None else hashlib.sha256(binary).hexdigest()
        if digest != record.sha256:
            return f"corrupt: {path.name} does not match its recorded sha256"
        return None

    def needs_rebuild(self, record: NativeRecord) -> bool:
        """Under ``rebuild``, an entry recorded before this store was opened (one rebuilt since by another process
        is used)."""
        return self.rebuild and record.date < self.opened

    def _usable(self, eid: str, warn: bool = True) -> tuple[NativeRecord, bytes] | None:
        """Entry ``eid``'s record and binary if it can be used as it is (the bytes checked are the bytes returned); a
        corrupt one is logged once (``warn``) and None."""
        binary = None
        try:
            record = self.read(eid)
            if record is None:
                return None
            binary = self.binary_path(eid).read_bytes()
        except FileNotFoundError:
            problem = f"corrupt: {self.binary_path(eid).name} is missing"
        except ValueError as err:
            problem = f"corrupt: {err}"
        else:
            problem = self.problem(eid, record, binary)
        if problem:
            if warn:
                log_once(logging.WARNING, ("native-rebuild", str(self.dir), eid, problem),
                         f"native JIT cache entry {self.dir / eid} is {problem}; rebuilding it")
            return None
        if self.needs_rebuild(record):
            return None
        return record, binary

    def identify(self, source: str, kernel: str, defines: tuple[str, ...],
                 compiler: Compiler) -> tuple[str, tuple[str, ...]]:
        """``(entry id, options)`` of ``kernel`` built from ``source`` with ``defines`` by ``compiler``."""
        options = compiler.options(self.arch, defines)
        key = native_key(source_hash(source), kernel, self.arch, options, f"{compiler.kind} {compiler.version}")
        return native_entry_id(kernel, key), options

    def prebuilt(self, source: str, kernel: str, defines: tuple[str, ...]) -> Built | None:
        """The newest usable clang entry of ``kernel`` built from ``source`` with ``defines`` (an offline build for an
        AMD arch, ``warmup --arch gfx942``), or None: what a ROCm launch loads where it has no hipRTC entry."""
        digest, best = source_hash(source), None
        for eid in self.entry_ids():
            if not eid.startswith(f"{kernel}-"):
                continue
            found = self._usable(eid, warn=False)
            if found is None:
                continue
            record = found[0]
            if (record.compiler == "clang" and record.kernel == kernel and record.source_sha256 == digest
                    and tuple(record.defines) == tuple(defines) and (best is None or record.date > best[1][0].date)):
                best = (eid, found)
        return None if best is None else self._found(best[0], *best[1])

    def build(self, source: str, kernel: str, defines: tuple[str, ...], compiler: Compiler | None = None, *,
              built_by: Literal["launch", "target"] = "launch", wait: bool = True,
              prebuilt: bool = False) -> Built:
        """The entry of ``kernel`` (its ``extern "C"`` name) built from ``source`` with ``-D`` ``defines`` by
        ``compiler`` for this store's arch: found here, or compiled once (under its lock) and recorded.
        ``prebuilt``: a clang entry of the same source, kernel and defines serves where the compiler's own is not
        here (``prebuilt``; ROCm launches). ``wait=False`` raises ``VariantBusy`` instead of waiting for another
        process's compile. The compiler's errors (with its log) propagate. A directory that is not writable still
        serves its entries; a missing entry is then compiled into memory only (logged once). ``compiler``: default
        the arch's run-time compiler (``native.runtime_compiler``)."""
        if compiler is None:
            from .native import runtime_compiler  # the launching layer picks compilers; imported where needed

            compiler = runtime_compiler(self.arch)
        eid, options = self.identify(source, kernel, defines, compiler)
        found = self._usable(eid)
        if found is not None:
            return self._found(eid, *found)
        if prebuilt and (offline := self.prebuilt(source, kernel, defines)) is not None:
            return offline
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
            compiled = compiler.compile(source, kernel, self.arch, defines)
            record = self._record(eid, kernel, source, options, defines, compiler, compiled, built_by)
            if persist:
                _write_atomically(self.binary_path(eid), compiled.binary)
                _write_atomically(self.record_path(eid), record.model_dump_json(indent=1).encode())
        finally:
            if lock is not None:
                lock.release()
        event = Event(eid, kernel, True, compiled.seconds)
        self.events.append(event)
        return Built(eid, record, compiled.binary, event)

    def _found(self, eid: str, record: NativeRecord, binary: bytes) -> Built:
        event = Event(eid, record.kernel, False, 0.0)
        self.events.append(event)
        return Built(eid, record, binary, event)

    def _record(self, eid: str, kernel: str, source: str, options: tuple[str, ...], defines: tuple[str, ...],
                compiler: Compiler, compiled: Compiled, built_by: str) -> NativeRecord:
        resources = compiled.resources
        return NativeRecord(
            kernel=kernel, arch=self.arch, options=list(options), defines=list(defines),
            source_sha256=source_hash(source), compiler=compiler.kind, compiler_version=compiler.version,
            compiler_path=compiler.path, binary=self.binary_path(eid).name, size=len(compiled.binary),
            sha256=hashlib.sha256(compiled.binary).hexdigest(), registers=resources.registers,
            spill_store_bytes=resources.spill_store_bytes, spill_load_bytes=resources.spill_load_bytes,
            stack_bytes=resources.stack_bytes, report=compiled.report, built_by=built_by,
            compile_seconds=round(compiled.seconds, 4), date=datetime.now(timezone.utc))


_stores: dict[tuple, NativeStore] = {}


def native_store(root: Path, arch: str, rebuild: bool = False) -> NativeStore:
    """The process's ``NativeStore`` of ``root`` and ``arch`` (one object per directory and rebuild switch, so a
    rebuild happens once per process)."""
    key = (Path(root).resolve(), arch, rebuild)
    if key not in _stores:
        _stores[key] = NativeStore(Path(root), arch, rebuild)
    return _stores[key]

"""Compiled-kernel cache (``jit/``): each kernel variant compiled once per GPU arch and Triton version, with a manifest.

A variant is one Triton specialisation of one of this library's kernels: the kernel, its constexprs, what Triton
derives from the other arguments (pointer dtypes and 16-byte alignment; integers equal to 1, divisible by 16 or
neither), the launch options (warps, stages), the GPU arch and the Triton version. Layout::

    <root>/triton-<version>/<arch>/
        manifest.json        one entry per variant: kernel, constexprs, Triton's keys, files with size and sha256,
                             compile seconds, date (replaced atomically, under manifest.lock)
        locks/<entry>.lock   held by the process that checks, compiles and records one variant
        triton/<group>/      Triton's cache groups (IR stages, binary, metadata) and the launcher stubs it builds

``<root>`` is ``QSA_AITER_JIT_DIR``; else ``jit/`` of a source checkout where it is writable; else
``~/.cache/qsa_aiter/jit`` (an installed package directory is never written).

Launches on a GPU run inside ``scope(device)`` (the registry and the writer enter it):

- Once per process, device and directory, every usable manifest entry is put in its kernel's in-memory Triton cache,
  under the key Triton computes at launch, as a placeholder. Triton's launch path resolves a cached object that has
  a ``result()`` method before using it (its asynchronous-compile protocol); the placeholder then checks the entry's
  files, loads the binary and takes its own place. A warm process never calls Triton's compiler, nor hashes
  Triton's libraries for a cache key.
- A variant not in the manifest is compiled by Triton as usual, but into this directory (Triton's cache manager is
  routed here while a scope is active; kernels launched outside one are untouched), while its file lock is held, and
  is recorded. A process that waited on the lock finds the other's build and only loads it.
- An entry whose files are missing, truncated or altered, or that was built from other kernel sources or another
  Triton environment, is not used: a warning is logged and the variant is rebuilt when next launched.

``QSA_AITER_REBUILD=1`` installs no placeholders and rebuilds every variant it meets whose entry is older than the
process (so several processes rebuilding at once rebuild each variant once).
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import filelock
import torch
import triton
from pydantic import BaseModel, ConfigDict, Field

from .kernels.common import interpreting
from .log import log_once
from .settings import ConfigurationError, QsaSettings, get_settings
from .triton_compat import (
    ASTSource, CompiledKernel, FileCacheManager, JITFunction, compile_into_cache, convert_to_tuple_if_list, driver,
    get_cache_invalidating_env_vars, install_compile_hooks, kernel_backend, kernel_cache, make_backend,
    resolves_placeholders, serialize_specialization, specialize_launch,
)

FORMAT = 1
#: ``jit/`` of a source checkout (it holds the README that marks it); a wheel has none.
CHECKOUT_JIT_DIR = Path(__file__).resolve().parent.parent / "jit"
#: The kernel sources whose hash every entry records: a change to any of them makes every entry stale.
KERNEL_SOURCES = Path(__file__).resolve().parent / "kernels"
#: How long a process waits for another's compile of the same variant before compiling it itself.
LOCK_TIMEOUT_S = 1800.0


# ---------------------------------------------------------------------------------------------------------------
# Where the cache lives
# ---------------------------------------------------------------------------------------------------------------


def user_cache_dir() -> Path:
    """The per-user cache: ``~/.cache/qsa_aiter/jit``."""
    return Path.home() / ".cache" / "qsa_aiter" / "jit"


def writable(path: Path) -> bool:
    """Whether files can be created in ``path`` (or, where it does not exist yet, in its nearest existing parent).
    A real probe: permission bits say nothing for root or on a read-only mount."""
    probe = Path(path)
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    if not probe.is_dir():
        return False
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".qsa_aiter_probe"):
            return True
    except OSError:
        return False


def jit_root(settings: QsaSettings | None = None) -> Path:
    """The cache root: ``QSA_AITER_JIT_DIR``; else a source checkout's ``jit/`` if writable; else the user cache."""
    settings = settings or get_settings()
    if settings.jit_dir:
        path = Path(settings.jit_dir).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigurationError(f"environment variable QSA_AITER_JIT_DIR={settings.jit_dir!r} is invalid: {path} "
                                     "is not a directory")
        return path
    if (CHECKOUT_JIT_DIR / "README.md").is_file() and writable(CHECKOUT_JIT_DIR):
        return CHECKOUT_JIT_DIR
    return user_cache_dir()


@lru_cache(maxsize=1)
def kernel_sources_hash() -> str:
    """sha256 over the kernel package's Python files (name and bytes): what an entry was built from."""
    digest = hashlib.sha256()
    for path in sorted(KERNEL_SOURCES.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _triton_env() -> dict[str, str]:
    """Triton's cache-invalidating environment variables (its own file cache keys builds by them too)."""
    return {str(k): str(v) for k, v in get_cache_invalidating_env_vars().items()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _full_name(fn) -> str:
    """Module-qualified name of a ``@triton.jit`` function (Triton's own name for it)."""
    return f"{fn.fn.__module__}.{fn.fn.__qualname__}"


def entry_id(function: str, runtime_key: str) -> str:
    """The manifest key of a variant: the kernel's module name and a hash of its function and Triton launch key."""
    kernel = function.rsplit(".", 2)[-2]
    return f"{kernel}-{hashlib.sha256(f'{function}|{runtime_key}'.encode()).hexdigest()[:20]}"


def _plain(value: Any) -> Any:
    """A constexpr value as JSON: numbers and booleans as they are, Triton dtypes and anything else as text."""
    value = getattr(value, "value", value)  # tl.constexpr
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


# ---------------------------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------------------------


class FileRecord(BaseModel):
    """One file of an entry's Triton cache group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Entry(BaseModel):
    """One compiled variant."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kernel: str = Field(description="kernel module: rowwise, stacked, tiled, cache_writer, topk, expand")
    function: str = Field(description="module-qualified name of the @triton.jit function")
    constexprs: dict[str, Any] = Field(description="constexpr (and value-specialised) arguments by name")
    options: dict[str, Any] = Field(description="launch options: num_warps, num_stages")
    arguments: dict[str, str] = Field(description="the other arguments as Triton specialised them: type, `%16` for an "
                                                  "integer divisible by 16, `unaligned` for a pointer that is not "
                                                  "16-byte aligned")
    runtime_key: str = Field(description="Triton's in-memory key of the specialisation (argument kinds, options)")
    specialization: str = Field(description="Triton's specialisation data (JSON): signature, constants, attributes, "
                                            "options; enough to rebuild the variant")
    group: str = Field(description="Triton's cache group: the directory under triton/ holding the files")
    metadata: str = Field(description="file name of Triton's metadata of the build")
    binary: str = Field(description="file name of the binary (cubin, hsaco)")
    files: dict[str, FileRecord]
    sources: str = Field(description="kernel_sources_hash() of the sources it was built from")
    triton_env: dict[str, str] = Field(description="Triton's cache-invalidating environment variables at build")
    built_by: Literal["launch", "target"] = Field(description="compiled at a launch on the GPU, or for a named arch")
    compile_seconds: float = Field(ge=0)
    date: datetime

    def summary(self) -> str:
        """``K=V`` of its constexprs and options, and its integer arguments specialised as multiples of 16."""
        parts = [f"{k}={v}" for k, v in self.constexprs.items()]
        parts += [f"{k}={v}" for k, v in self.options.items()]
        parts += [f"{k}%16" for k, v in self.arguments.items() if v.endswith("%16") and not v.startswith("*")]
        return " ".join(parts)


class Manifest(BaseModel):
    """What one ``triton-<version>/<arch>/`` directory holds."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = FORMAT
    arch: str
    triton_version: str
    entries: dict[str, Entry] = Field(default_factory=dict)


class EntryUnusable(Exception):
    """An entry that cannot be used as it is (corrupt or stale); the message says why."""


class VariantBusy(Exception):
    """Another process holds the variant's compile lock (raised only when not waiting for it)."""


@dataclass(frozen=True)
class Event:
    """A variant met by this process: ``compiled`` here, or found already built (by another process)."""

    entry_id: str
    kernel: str
    compiled: bool
    seconds: float


# ---------------------------------------------------------------------------------------------------------------
# One directory: <root>/triton-<version>/<arch>/
# ---------------------------------------------------------------------------------------------------------------


class Store:
    """The cache of one root, Triton version and GPU arch: its manifest, locks and Triton's files.

    ``rebuild``: entries recorded before this store was opened are rebuilt rather than used (``QSA_AITER_REBUILD``).
    ``events``: what this process compiled or found here, in order.
    """

    def __init__(self, root: Path, arch: str, rebuild: bool = False, triton_version: str | None = None):
        self.root = Path(root)
        self.arch = arch
        self.rebuild = rebuild
        self.triton_version = triton_version or triton.__version__
        self.dir = self.root / f"triton-{self.triton_version}" / arch
        self.triton_dir = self.dir / "triton"
        self.manifest_path = self.dir / "manifest.json"
        self.opened = datetime.now(timezone.utc)
        kernel_sources_hash()  # now, before this process compiles anything here: the sources it runs
        self.events: list[Event] = []
        # (thread, function, key) -> (lock, usable build found, start) of a compile between Triton's two hooks
        self._pending: dict[tuple, tuple[filelock.BaseFileLock | None, Entry | None, float]] = {}
        self._writable: bool | None = None
        self._parsed: tuple[tuple, Manifest] | None = None
        self._placed: set[int] = set()

    def writable(self) -> bool:
        if self._writable is None:
            self._writable = writable(self.dir)
        return self._writable

    def _ensure(self) -> None:
        (self.dir / "locks").mkdir(parents=True, exist_ok=True)
        self.triton_dir.mkdir(exist_ok=True)

    def _manifest_lock(self) -> filelock.BaseFileLock:
        self._ensure()
        return filelock.FileLock(str(self.dir / "manifest.lock"), timeout=LOCK_TIMEOUT_S)

    def variant_lock(self, eid: str) -> filelock.BaseFileLock:
        """The file lock a process holds while it checks, compiles and records variant ``eid``."""
        self._ensure()
        return filelock.FileLock(str(self.dir / "locks" / f"{eid}.lock"))

    def busy(self, eid: str) -> bool:
        """Whether another process holds variant ``eid``'s lock now."""
        lock = self.variant_lock(eid)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            return True
        lock.release()
        return False

    # -- manifest ----------------------------------------------------------------------------------------------

    def read(self) -> Manifest:
        """The manifest; an empty one if there is none. An unreadable one is logged once and read as empty (its
        entries are rebuilt as they are met, and the next record replaces the file)."""
        empty = Manifest(arch=self.arch, triton_version=self.triton_version)
        try:
            stat = self.manifest_path.stat()
        except FileNotFoundError:
            return empty
        signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if self._parsed is not None and self._parsed[0] == signature:
            return self._parsed[1]
        try:
            manifest = Manifest.model_validate_json(self.manifest_path.read_bytes())
            if (manifest.arch, manifest.triton_version) != (self.arch, self.triton_version):
                raise ValueError(f"it describes {manifest.arch} / Triton {manifest.triton_version}")
        except (OSError, ValueError) as err:  # pydantic's ValidationError is a ValueError
            reason = str(err).splitlines()[0][:200]
            log_once(logging.WARNING, ("jit-manifest", str(self.manifest_path), signature),
                     f"JIT cache manifest {self.manifest_path} is unreadable ({reason}); its kernels are rebuilt as "
                     "they are used")
            return empty
        self._parsed = (signature, manifest)
        return manifest

    def _write(self, manifest: Manifest) -> None:
        """Replace the manifest atomically (a reader sees the old file or the new one, never a partial one)."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".manifest.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(manifest.model_dump_json(indent=1))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.manifest_path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def record(self, eid: str, entry: Entry) -> None:
        """Add or replace entry ``eid``; the files of a replaced build are removed."""
        with self._manifest_lock():
            manifest = self.read()
            old = manifest.entries.get(eid)
            entries = dict(manifest.entries)
            entries[eid] = entry
            self._write(manifest.model_copy(update={"entries": entries}))
        if old is not None and old.group != entry.group and all(e.group != old.group for e in entries.values()):
            shutil.rmtree(self.triton_dir / old.group, ignore_errors=True)

    def discard(self, entry: Entry) -> None:
        """Remove an entry's files (it is being rebuilt), so that Triton cannot load them."""
        shutil.rmtree(self.triton_dir / entry.group, ignore_errors=True)

    # -- entries -----------------------------------------------------------------------------------------------

    def problem(self, entry: Entry, full: bool = False) -> str | None:
        """Why ``entry`` cannot be used, or None. Checks the sources and Triton environment it was built with and
        its files: sizes and sha256 of the metadata and binary (every file with ``full``)."""
        if entry.sources != kernel_sources_hash():
            return "stale: built from other kernel sources"
        if entry.triton_env != _triton_env():
            return "stale: built under other Triton cache-invalidating environment variables"
        group = self.triton_dir / entry.group
        for name in (entry.files if full else (entry.metadata, entry.binary)):
            record = entry.files.get(name)
            if record is None:
                return f"corrupt: {name} has no record"
            try:
                size = (group / name).stat().st_size
                if size != record.size:
                    return f"corrupt: {name} has {size} bytes, {record.size} recorded"
                if _sha256(group / name) != record.sha256:
                    return f"corrupt: {name} does not match its recorded sha256"
            except FileNotFoundError:
                return f"corrupt: {name} is missing"
            except OSError as err:
                return f"corrupt: {name}: {err.strerror or err}"
        return None

    def needs_rebuild(self, entry: Entry) -> bool:
        """Under ``rebuild``: recorded before this store was opened (not yet rebuilt by any process since)."""
        return self.rebuild and entry.date < self.opened

    def load_entry(self, entry: Entry, fn) -> CompiledKernel:
        """The compiled kernel of ``entry`` (of ``@triton.jit`` function ``fn``), its files checked first; raises
        ``EntryUnusable`` saying why it cannot be used."""
        problem = self.problem(entry)
        if problem:
            raise EntryUnusable(problem)
        group = self.triton_dir / entry.group
        try:
            return _CachedKernel(_source(fn, entry.specialization), {entry.metadata: str(group / entry.metadata),
                                 entry.binary: str(group / entry.binary)}, self)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise EntryUnusable(f"corrupt: {type(err).__name__}: {err}") from None

    # -- compiling ---------------------------------------------------------------------------------------------

    def _claim(self, eid: str, wait: bool) -> tuple[filelock.BaseFileLock | None, Entry | None]:
        """Take the variant's lock, then look again: ``(lock, entry)`` where ``entry`` is a usable build (nothing to
        compile), or None (compile; a corrupt or stale build is removed first, with a warning). ``lock`` is None
        when it was not had after ``LOCK_TIMEOUT_S``; ``VariantBusy`` when it is held and not ``wait``."""
        lock = self.variant_lock(eid)
        try:
            lock.acquire(timeout=LOCK_TIMEOUT_S if wait else 0)
        except filelock.Timeout:
            if not wait:
                raise VariantBusy(eid) from None
            log_once(logging.WARNING, ("jit-lock", str(self.dir), eid),
                     f"waited {LOCK_TIMEOUT_S:.0f} s for {eid}'s compile lock; compiling it without the lock")
            lock = None
        entry = self.read().entries.get(eid)
        if entry is None:
            return lock, None
        problem = self.problem(entry, full=True)
        if problem is None and not self.needs_rebuild(entry):
            return lock, entry
        if problem:
            log_once(logging.WARNING, ("jit-rebuild", str(self.dir), eid, problem),
                     f"JIT cache entry {eid} ({entry.kernel} {entry.summary()}) is {problem}; rebuilding it")
        self.discard(entry)
        return lock, None

    def _record_build(self, fn, key: str, kernel: CompiledKernel, specialization: str, constants: dict,
                      options: dict, seconds: float, built_by: str, found: Entry | None) -> Event:
        """Record ``kernel`` (just compiled, or found by Triton in this directory) as the variant ``(fn, key)``."""
        function = _full_name(fn)
        eid = entry_id(function, key)
        kernel_name = eid.split("-")[0]
        # The group's files in this directory. (Triton's group index holds absolute paths: in a cache directory that
        # was copied or moved, Triton's own cache hits name the files where they were first written.)
        group_dir = self.triton_dir / Path(next(iter(kernel.metadata_group.values()))).parent.name
        paths = [group_dir / name for name in kernel.metadata_group]
        if not all(p.is_file() for p in paths):
            log_once(logging.WARNING, ("jit-outside", str(self.dir)),
                     f"Triton wrote {function} outside {self.triton_dir} (its cache manager was replaced?): not "
                     "recorded in the JIT cache")
            return Event(eid, kernel_name, True, seconds)
        if found is not None and found.group == group_dir.name:
            return Event(eid, kernel_name, False, seconds)
        metadata = next(p.name for p in paths if p.suffix == ".json")
        binary_ext = make_backend(kernel.metadata.target).binary_ext
        binary = next(p.name for p in paths if p.suffix == f".{binary_ext}")
        names = [p.name for p in paths]
        spec = json.loads(specialization)
        attrs = {k[0]: v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"]) if len(k) == 1}  # top-level args
        arguments = {}
        for index, (name, kind) in enumerate(spec["signature"].items()):
            if kind == "constexpr":
                continue
            divisible = ["tt.divisibility", 16] in attrs.get(index, [])
            if str(kind).startswith("*"):
                arguments[name] = kind if divisible else f"{kind} unaligned"
            else:
                arguments[name] = f"{kind}%16" if divisible else str(kind)
        entry = Entry(
            kernel=kernel_name, function=function,
            constexprs={fn.arg_names[path[0]]: _plain(v) for path, v in sorted(constants.items())},
            options={k: options[k] for k in ("num_warps", "num_stages") if k in options}, arguments=arguments,
            runtime_key=key, specialization=specialization, group=group_dir.name, metadata=metadata, binary=binary,
            files={n: FileRecord(size=p.stat().st_size, sha256=_sha256(p)) for n, p in zip(names, paths)},
            sources=kernel_sources_hash(), triton_env=_triton_env(), built_by=built_by,
            compile_seconds=round(seconds, 4), date=datetime.now(timezone.utc),
        )
        self.record(eid, entry)
        return Event(eid, kernel_name, True, seconds)

    # The two halves of a compile at a launch, called from Triton's pre- and post-compile hooks.

    def before_launch_compile(self, fn, key: str) -> None:
        eid = entry_id(_full_name(fn), key)
        lock, found = self._claim(eid, wait=True)
        self._pending[(threading.get_ident(), _full_name(fn), key)] = (lock, found, time.perf_counter())

    def after_launch_compile(self, fn, key: str, info: dict) -> None:
        lock, found, start = self._pending.pop((threading.get_ident(), _full_name(fn), key), (None, None, None))
        try:
            kernel = kernel_cache(fn, info["device"]).get(key)
            if isinstance(kernel, CompiledKernel) and start is not None:
                options = {"num_warps": info.get("num_warps"), "num_stages": info.get("num_stages")}
                self.events.append(self._record_build(fn, key, kernel, info["specialization_data"], info["constants"],
                                                      options, time.perf_counter() - start, "launch", found))
        finally:
            if lock is not None:
                lock.release()

    def release_pending(self) -> None:
        """Release the locks of this thread's compiles that raised before Triton's post-compile hook ran."""
        me = threading.get_ident()
        for pending_key in [k for k in self._pending if k[0] == me]:
            lock = self._pending.pop(pending_key)[0]
            if lock is not None:
                lock.release()

    # -- placing entries in Triton's in-memory caches ---------------------------------------------------------

    def place(self, device: int) -> int:
        """Put every usable-looking entry in its kernel's in-memory cache for ``device`` as a placeholder (files
        are checked when it is first launched). Once per device; none under ``rebuild``. Returns how many."""
        if device in self._placed:
            return 0
        self._placed.add(device)
        if self.rebuild or not resolves_placeholders():
            return 0
        placed = 0
        sources, env = kernel_sources_hash(), _triton_env()
        for eid, entry in self.read().entries.items():
            if entry.sources != sources or entry.triton_env != env:
                continue  # stale: Triton compiles it at its launch, and the pre-compile hook rebuilds the entry
            fn = _jit_function(entry.function)
            if fn is None:
                continue
            cache = kernel_cache(fn, device)
            if entry.runtime_key not in cache:
                cache[entry.runtime_key] = _Placeholder(self, eid, entry, fn, device)
                placed += 1
        return placed

    def activate(self, device: int | None = None) -> _Activation:
        """A context manager routing compiles of this library's kernels here; with ``device``, the entries are
        first placed for it. Needs a writable directory."""
        if not self.writable():
            raise ValueError(f"the JIT cache directory {self.dir} is not writable")
        _install_triton_hooks()
        activation = _Activation(self)
        if device is not None and device not in self._placed:
            driver.active.get_current_target()  # Triton's driver stubs: built or found where Triton keeps them
            with activation:
                self.place(device)
        return activation


def _source(fn, specialization: str) -> ASTSource:
    """The ``ASTSource`` of a recorded variant (as ``JITFunction.preload`` rebuilds it from the same data)."""
    import triton.language as tl

    data = json.loads(specialization)
    if data["name"] != _full_name(fn):
        raise ValueError(f"specialisation of {data['name']}, not of {_full_name(fn)}")

    def value(v):
        if isinstance(v, str) and tl.dtype.is_dtype(v):
            return tl.dtype(v)
        if isinstance(v, dict) and "constexpr" in v:
            return tl.constexpr(v["constexpr"])
        return v

    constants = {tuple(k): value(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: convert_to_tuple_if_list(v) for k, v in data["signature"].items()}
    return ASTSource(fn, signature, constants, attrs)


def _jit_function(name: str):
    """The ``@triton.jit`` function of this library named ``name``, or None (another package's, renamed, or
    interpreted: only compiled kernels have in-memory caches)."""
    module, _, attr = name.rpartition(".")
    if not module.startswith("qsa_aiter."):
        return None
    try:
        fn = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None
    return fn if isinstance(fn, JITFunction) else None


class _CachedKernel(CompiledKernel):
    """A kernel loaded from the cache: the launcher stub Triton builds (or finds) for it on first launch lives in
    the cache directory too."""

    def __init__(self, src, metadata_group, store: Store):
        super().__init__(src, metadata_group, None)
        self.hash = getattr(self.metadata, "hash", None)  # Triton's key of the build, as its own loads set it
        self._store = store

    def _init_handles(self):
        if self.module is not None or not self._store.writable():
            return super()._init_handles()
        with _Activation(self._store):
            return super()._init_handles()


class _Placeholder:
    """Stands in a kernel's in-memory Triton cache for a recorded variant until its first launch, when Triton calls
    ``result()``: the entry is loaded (or rebuilt, with a warning, if unusable) and replaces the placeholder."""

    __slots__ = ("device", "eid", "entry", "fn", "store")

    def __init__(self, store: Store, eid: str, entry: Entry, fn, device: int):
        self.store, self.eid, self.entry, self.fn, self.device = store, eid, entry, fn, device

    def result(self) -> CompiledKernel:
        try:
            kernel = self.store.load_entry(self.entry, self.fn)
        except EntryUnusable as err:
            log_once(logging.WARNING, ("jit-rebuild", str(self.store.dir), self.eid, str(err)),
                     f"JIT cache entry {self.eid} ({self.entry.kernel} {self.entry.summary()}) is {err}; "
                     "rebuilding it")
            kernel = self._rebuild()
        kernel_cache(self.fn, self.device)[self.entry.runtime_key] = kernel
        return kernel

    def _rebuild(self) -> CompiledKernel:
        """Compile the variant again through Triton's own compile path for this device's cache (as a launch that
        missed would), with the cache's hooks: its lock is taken, the bad build removed, the new one recorded."""
        backend = kernel_backend(self.fn, self.device)
        src = _source(self.fn, self.entry.specialization)
        options = json.loads(self.entry.specialization)["options"]
        options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in options.items()})
        with self.store.activate() if self.store.writable() else _NULL:
            built = compile_into_cache(self.fn, self.entry.runtime_key, src, self.device, options)
        entry = self.store.read().entries.get(self.eid)  # the new record (the old one, if recording failed)
        if entry is not None:
            with contextlib.suppress(EntryUnusable):
                return self.store.load_entry(entry, self.fn)  # loaded from the cache: its launcher stub lives there too
        return built


# ---------------------------------------------------------------------------------------------------------------
# Routing Triton's compiles here, and its hooks
# ---------------------------------------------------------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[Store | None] = contextvars.ContextVar("qsa_aiter_jit_store", default=None)


class _Activation:
    """While entered (per thread), compiles of this library's kernels go to ``store`` and are recorded there."""

    __slots__ = ("store", "token")

    def __init__(self, store: Store):
        self.store = store

    def __enter__(self) -> Store:
        self.token = _ACTIVE.set(self.store)
        return self.store

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self.token)
        if self.store._pending:
            self.store.release_pending()


class _RoutedCacheManager(FileCacheManager):
    """Triton's file cache manager placed in the active store's ``triton/`` directory while an activation is
    entered; elsewhere (and for Triton's dump and override directories) the manager Triton would have used."""

    previous: type = FileCacheManager

    def __new__(cls, key, override=False, dump=False):
        if _ACTIVE.get() is None or override or dump:
            return cls.previous(key, override=override, dump=dump)
        return super().__new__(cls)

    def __init__(self, key, override=False, dump=False):
        self.key = key
        self.cache_dir = str(_ACTIVE.get().triton_dir / key)
        self.lock_path = os.path.join(self.cache_dir, "lock")
        os.makedirs(self.cache_dir, exist_ok=True)


_install_lock = threading.Lock()
_installed = False


def _ours(info) -> bool:
    return _full_name(info.jit_function).startswith("qsa_aiter.")


def _before_compile(*, key, fn, **_) -> None:
    store = _ACTIVE.get()
    if store is not None and _ours(fn):
        try:
            store.before_launch_compile(fn.jit_function, key)
        except Exception as err:  # the cache's bookkeeping never stops a launch
            log_once(logging.WARNING, ("jit-hook", str(store.dir), type(err).__name__),
                     f"JIT cache {store.dir}: {type(err).__name__}: {err}")


def _after_compile(*, key, fn, compile, **_) -> None:
    store = _ACTIVE.get()
    if store is not None and _ours(fn):
        try:
            store.after_launch_compile(fn.jit_function, key, compile)
        except Exception as err:
            log_once(logging.WARNING, ("jit-hook", str(store.dir), type(err).__name__),
                     f"JIT cache {store.dir}: {type(err).__name__}: {err}; the kernel was compiled but not recorded")


def _chain(ours, previous):
    """Our hook, then the one that was installed before (whose answer Triton gets)."""
    if previous is None:
        return ours

    def hook(**kwargs):
        ours(**kwargs)
        return previous(**kwargs)

    return hook


def _install_triton_hooks() -> None:
    """Once per process: Triton's cache manager class becomes the routed one (it behaves as before outside an
    activation), and the pre- and post-compile hooks record this library's compiles (chained with any others)."""
    global _installed
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        _RoutedCacheManager.previous = install_compile_hooks(_RoutedCacheManager, _before_compile, _after_compile,
                                                             _chain)
        _installed = True


# ---------------------------------------------------------------------------------------------------------------
# Launch scopes (registry, writer)
# ---------------------------------------------------------------------------------------------------------------

_NULL = contextlib.nullcontext()
_UNOPENED = object()
_stores: dict[tuple, Store] = {}
_device_stores: dict[tuple, Store | None] = {}


def store_for(root: Path, arch: str, rebuild: bool = False) -> Store:
    """The process's ``Store`` of ``root`` and ``arch`` (one object per directory, so placements happen once)."""
    key = (Path(root).resolve(), arch, rebuild)
    if key not in _stores:
        _stores[key] = Store(Path(root), arch, rebuild)
    return _stores[key]


#: Modules Triton's launch-time argument specialiser imports at its first call in a process (Triton 3.6: the Gluon
#: layout and descriptor types it checks arguments against; about 0.1 s of imports on the H200 machine).
_TRITON_LAUNCH_IMPORTS = ("triton.experimental.gluon",)


def _import_triton_launch_modules() -> None:
    """Import the modules Triton's specialiser would import at the first launch (modules a Triton version does not
    have are skipped). Pure Python, no GPU: done when this module is imported, so a first call never pays it."""
    for name in _TRITON_LAUNCH_IMPORTS:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


_import_triton_launch_modules()


def _triton_driver_ready() -> None:
    """Create Triton's GPU driver object now (it probes the platform; the rest of Triton's first-launch set-up,
    the specialiser's imports, was done at import)."""
    driver.active.get_current_device()


def load(device: torch.device | int | None = None, settings: QsaSettings | None = None) -> Store | None:
    """Open the cache for ``device`` (default: the current CUDA device) and place its entries, and do Triton's
    once-per-process launch set-up, now rather than at the first launch: an engine calls it at start-up so that
    its first scoring call pays neither (``benchmarks/first_call.py``). None where there is no cache: off the GPU,
    under the interpreter. A cache that cannot be opened is logged once and None is returned; a bad
    ``QSA_AITER_JIT_DIR`` raises ``ValueError``."""
    if interpreting() or not torch.cuda.is_available():
        return None
    if device is None or isinstance(device, int):
        device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    if device.type != "cuda":
        return None
    settings = settings or get_settings()
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, settings.jit_dir, settings.rebuild)
    if key in _device_stores:
        return _device_stores[key]
    _triton_driver_ready()
    root = jit_root(settings)  # a bad QSA_AITER_JIT_DIR is the caller's error, raised
    store = None
    try:
        from .tuned import device_arch

        store = store_for(root, device_arch(torch.device("cuda", index)), settings.rebuild)
        if store.writable():
            store.activate(index)
        else:  # a read-only cache: its entries serve; new variants go to Triton's own cache
            log_once(logging.WARNING, ("jit-readonly", str(store.dir)),
                     f"JIT cache {store.dir} is not writable: its kernels are used, new variants are compiled into "
                     "Triton's own cache")
            store.place(index)
    except Exception as err:  # an unusable cache never stops a launch
        log_once(logging.WARNING, ("jit-unusable", str(root)),
                 f"JIT cache {root} is unusable ({type(err).__name__}: {err}); kernels compile into Triton's cache")
        store = None
    _device_stores[key] = store
    return store


def scope(device: torch.device, settings: QsaSettings | None = None):
    """Context manager around a launch of this library's kernels on ``device``: warmed variants load from the JIT
    cache, new ones are compiled into it and recorded. A no-op off the GPU, under the interpreter, inside another
    scope (the outer one's directory serves) and where the cache is read-only or unusable."""
    if device.type != "cuda" or _ACTIVE.get() is not None or interpreting():
        return _NULL
    settings = settings or get_settings()
    index = device.index if device.index is not None else torch.cuda.current_device()
    store = _device_stores.get((index, settings.jit_dir, settings.rebuild), _UNOPENED)
    if store is _UNOPENED:  # first launch on this device with these settings
        store = load(torch.device("cuda", index), settings)
    return _NULL if store is None or not store.writable() else _Activation(store)


# ---------------------------------------------------------------------------------------------------------------
# Compiling a launch for a named target (no GPU needed)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Specialisation:
    """A launch as Triton's launch path specialises it for ``target``: the in-memory key and the compile inputs."""

    fn: Any
    target: Any
    key: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: Any

    @property
    def entry_id(self) -> str:
        return entry_id(_full_name(self.fn), self.key)


def specialise(fn, target, args: tuple, kwargs: dict) -> Specialisation:
    """Specialise ``fn(*args, **kwargs)`` (a launch's arguments) for ``target`` (a ``GPUTarget``) with Triton's own
    binder and argument packing, as ``JITFunction.run`` does on that GPU, so the key is the one a launch computes."""
    key, options, signature, constexprs, attrs = specialize_launch(fn, make_backend(target), args, kwargs)
    return Specialisation(fn, target, key, signature, constexprs, attrs, options)


def build_for_target(store: Store, spec: Specialisation, wait: bool = True) -> Event:
    """Compile ``spec`` into ``store`` unless a usable build is recorded (under the variant's lock). Raises
    ``VariantBusy`` when another process holds the lock and not ``wait``."""
    eid = spec.entry_id
    lock, found = store._claim(eid, wait)
    try:
        if found is not None:
            event = Event(eid, found.kernel, False, 0.0)
        else:
            _install_triton_hooks()
            start = time.perf_counter()
            with _Activation(store):
                kernel = triton.compile(ASTSource(spec.fn, spec.signature, spec.constexprs, spec.attrs),
                                        target=spec.target, options=spec.options.__dict__)
            data = serialize_specialization(_full_name(spec.fn), spec.signature, spec.constexprs, spec.attrs,
                                            spec.options, spec.key, spec.target)
            options = {"num_warps": spec.options.num_warps, "num_stages": spec.options.num_stages}
            event = store._record_build(spec.fn, spec.key, kernel, data, spec.constexprs, options,
                                        time.perf_counter() - start, "target", None)
        store.events.append(event)
        return event
    finally:
        if lock is not None:
            lock.release()


# ---------------------------------------------------------------------------------------------------------------
# Listing and clearing
# ---------------------------------------------------------------------------------------------------------------


def stores_in(root: Path) -> list[Store]:
    """Every ``triton-<version>/<arch>/`` directory under ``root``, as stores (sorted)."""
    found = []
    for version_dir in sorted(Path(root).glob("triton-*")):
        for arch_dir in sorted(p for p in version_dir.iterdir() if p.is_dir()):
            found.append(Store(Path(root), arch_dir.name, triton_version=version_dir.name.removeprefix("triton-")))
    return found


def describe(root: Path, verify: bool = True) -> str:
    """A listing of the cache under ``root``: per Triton version and arch, every entry with its kernel,
    specialisation, compile time, date and status (``ok``, or why it would be rebuilt)."""
    lines = [f"JIT cache: {root}"]
    stores = stores_in(root)
    if not stores:
        lines.append("  (empty)")
    for store in stores:
        manifest = store.read()
        size = sum(p.stat().st_size for p in store.dir.rglob("*") if p.is_file())
        lines.append(f"triton {store.triton_version} / {store.arch}: {len(manifest.entries)} entries, "
                     f"{size / 2**20:.1f} MiB")
        current = store.triton_version == triton.__version__
        for eid, entry in sorted(manifest.entries.items(), key=lambda item: (item[1].kernel, item[1].date)):
            status = "(other Triton)" if not current else ("ok" if not verify else store.problem(entry, True) or "ok")
            lines.append(f"  {eid}  {entry.compile_seconds:7.2f} s  {entry.date:%Y-%m-%d %H:%M:%S}  "
                         f"{entry.built_by:6}  {status}")
            lines.append(f"      {entry.summary()}")
    return "\n".join(lines)


def clear(root: Path, arch: str | None = None) -> list[Path]:
    """Remove the cached kernels under ``root`` (only ``arch``'s if given; every Triton version). Keeps the root
    and its README. Returns the directories removed."""
    removed = []
    for store in stores_in(root):
        if arch is not None and store.arch != arch:
            continue
        shutil.rmtree(store.dir)
        removed.append(store.dir)
        parent = store.dir.parent
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
    return removed

"""One directory of the JIT cache, ``<root>/triton-<version>/<arch>/``: its manifest, its locks and Triton's files,
how a variant is claimed, compiled and recorded there, and how its entries are placed in Triton's in-memory caches.

Layout::

    <root>/triton-<version>/<arch>/
        manifest.json        one entry per variant (``manifest.Entry``; replaced atomically, under manifest.lock)
        locks/<entry>.lock   held by the process that checks, compiles and records one variant
        triton/<group>/      Triton's cache groups (IR stages, binary, metadata) and the launcher stubs it builds

Placing: every usable manifest entry is put in its kernel's in-memory Triton cache, under the key Triton computes at
launch, as a placeholder. Triton's launch path resolves a cached object that has a ``result()`` method before using
it (its asynchronous-compile protocol); the placeholder then checks the entry's files, loads the binary and takes its
own place. An entry whose files are missing, truncated or altered, or that was built from other kernel sources or
another Triton environment, is not used: a warning is logged and the variant is rebuilt when next launched.

``rebuild`` (``QSA_AITER_REBUILD=1``) places nothing and rebuilds every variant met whose entry is older than the
store (so several processes rebuilding at once rebuild each variant once).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import filelock
import triton

from ..log import log_once
from . import paths
from .manifest import Entry, EntryUnusable, FileRecord, Manifest, file_sha256
from .paths import entry_id, full_name, kernel_sources_hash, triton_env
from .routing import Activation, install_triton_hooks
from .triton_compat import (
    ASTSource, CompiledKernel, JITFunction, compile_into_cache, convert_to_tuple_if_list, driver, kernel_backend,
    kernel_cache, make_backend, resolves_placeholders,
)

#: How long a process waits for another's compile of the same variant before compiling it itself.
LOCK_TIMEOUT_S = 1800.0


class VariantBusy(Exception):
    """Another process holds the variant's compile lock (raised only when not waiting for it)."""


@dataclass(frozen=True)
class Event:
    """A variant met by this process: ``compiled`` here, or found already built (by another process)."""

    entry_id: str
    kernel: str
    compiled: bool
    seconds: float


def _plain(value: Any) -> Any:
    """A constexpr value as JSON: numbers and booleans as they are, Triton dtypes and anything else as text."""
    value = getattr(value, "value", value)  # tl.constexpr
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)



def acquire_compile_lock(lock: filelock.BaseFileLock, eid: str, wait: bool, directory: Path):
    """``lock`` (entry ``eid``'s compile lock in ``directory``) once taken, or None when it was not had after
    ``LOCK_TIMEOUT_S`` (logged once: the caller compiles without it, as a stale lock must not stop a launch);
    ``VariantBusy`` when another process holds it and not ``wait``. Triton and native entries take it alike."""
    try:
        lock.acquire(timeout=LOCK_TIMEOUT_S if wait else 0)
    except filelock.Timeout:
        if not wait:
            raise VariantBusy(eid) from None
        log_once(logging.WARNING, ("jit-lock", str(directory), eid),
                 f"waited {LOCK_TIMEOUT_S:.0f} s for {eid}'s compile lock; compiling it without the lock")
        return None
    return lock

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
            self._writable = paths.writable(self.dir)
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
        if entry.triton_env != triton_env():
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
                if file_sha256(group / name) != record.sha256:
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

    def claim(self, eid: str, wait: bool) -> tuple[filelock.BaseFileLock | None, Entry | None]:
        """Take the variant's lock, then look again: ``(lock, entry)`` where ``entry`` is a usable build (nothing to
        compile), or None (compile; a corrupt or stale build is removed first, with a warning). ``lock`` is None
        when it was not had after ``LOCK_TIMEOUT_S``; ``VariantBusy`` when it is held and not ``wait``."""
        lock = acquire_compile_lock(self.variant_lock(eid), eid, wait, self.dir)
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

    def record_build(self, fn, key: str, kernel: CompiledKernel, specialization: str, constants: dict,
                     options: dict, seconds: float, built_by: str, found: Entry | None) -> Event:
        """Record ``kernel`` (just compiled, or found by Triton in this directory) as the variant ``(fn, key)``."""
        function = full_name(fn)
        eid = entry_id(function, key)
        kernel_name = eid.split("-")[0]
        # The group's files in this directory. (Triton's group index holds absolute paths: in a cache directory that
        # was copied or moved, Triton's own cache hits name the files where they were first written.)
        group_dir = self.triton_dir / Path(next(iter(kernel.metadata_group.values()))).parent.name
        group_files = [group_dir / name for name in kernel.metadata_group]
        if not all(p.is_file() for p in group_files):
            log_once(logging.WARNING, ("jit-outside", str(self.dir)),
                     f"Triton wrote {function} outside {self.triton_dir} (its cache manager was replaced?): not "
                     "recorded in the JIT cache")
            return Event(eid, kernel_name, True, seconds)
        if found is not None and found.group == group_dir.name:
            return Event(eid, kernel_name, False, seconds)
        metadata = next(p.name for p in group_files if p.suffix == ".json")
        binary_ext = make_backend(kernel.metadata.target).binary_ext
        binary = next(p.name for p in group_files if p.suffix == f".{binary_ext}")
        names = [p.name for p in group_files]
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
            options={**{k: options[k] for k in ("num_warps", "num_stages") if k in options},
                     **({"maxnreg": spec["options"]["maxnreg"]} if spec["options"].get("maxnreg") else {})},
            arguments=arguments,
            runtime_key=key, specialization=specialization, group=group_dir.name, metadata=metadata, binary=binary,
            files={n: FileRecord(size=p.stat().st_size, sha256=file_sha256(p)) for n, p in zip(names, group_files)},
            sources=kernel_sources_hash(), triton_env=triton_env(), built_by=built_by,
            compile_seconds=round(seconds, 4), date=datetime.now(timezone.utc),
        )
        self.record(eid, entry)
        return Event(eid, kernel_name, True, seconds)

    # The two halves of a compile at a launch, called from Triton's pre- and post-compile hooks.

    def before_launch_compile(self, fn, key: str) -> None:
        eid = entry_id(full_name(fn), key)
        lock, found = self.claim(eid, wait=True)
        self._pending[(threading.get_ident(), full_name(fn), key)] = (lock, found, time.perf_counter())

    def after_launch_compile(self, fn, key: str, info: dict) -> None:
        lock, found, start = self._pending.pop((threading.get_ident(), full_name(fn), key), (None, None, None))
        try:
            kernel = kernel_cache(fn, info["device"]).get(key)
            if isinstance(kernel, CompiledKernel) and start is not None:
                options = {"num_warps": info.get("num_warps"), "num_stages": info.get("num_stages")}
                self.events.append(self.record_build(fn, key, kernel, info["specialization_data"], info["constants"],
                                                     options, time.perf_counter() - start, "launch", found))
        finally:
            if lock is not None:
                lock.release()

    def release_pending(self) -> None:
        """Release the locks of this thread's compiles that raised before Triton's post-compile hook ran."""
        if not self._pending:
            return
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
        sources, env = kernel_sources_hash(), triton_env()
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

    def activate(self, device: int | None = None) -> Activation:
        """A context manager routing compiles of this library's kernels here; with ``device``, the entries are
        first placed for it. Needs a writable directory."""
        if not self.writable():
            raise ValueError(f"the JIT cache directory {self.dir} is not writable")
        install_triton_hooks()
        activation = Activation(self)
        if device is not None and device not in self._placed:
            driver.active.get_current_target()  # Triton's driver stubs: built or found where Triton keeps them
            with activation:
                self.place(device)
        return activation


def _source(fn, specialization: str) -> ASTSource:
    """The ``ASTSource`` of a recorded variant (as ``JITFunction.preload`` rebuilds it from the same data)."""
    import triton.language as tl

    data = json.loads(specialization)
    if data["name"] != full_name(fn):
        raise ValueError(f"specialisation of {data['name']}, not of {full_name(fn)}")

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
        with Activation(self._store):
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
        with self.store.activate() if self.store.writable() else contextlib.nullcontext():
            built = compile_into_cache(self.fn, self.entry.runtime_key, src, self.device, options)
        entry = self.store.read().entries.get(self.eid)  # the new record (the old one, if recording failed)
        if entry is not None:
            with contextlib.suppress(EntryUnusable):
                return self.store.load_entry(entry, self.fn)  # loaded from the cache: its launcher stub lives there too
        return built

"""Listing and clearing the JIT cache under a root (``python -m qsa_aiter jit list`` / ``jit clear``): the Triton
entries (``triton-<version>/<arch>/``) and the native ones (``native/<arch>/``)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import triton

from ..kernels import catalog
from ..runtime.jit import nvrtc
from ..runtime.jit.native_store import NATIVE_DIR, NativeRecord, NativeStore, source_hash
from ..runtime.jit.store import Store

#: The sources of the native kernels, by kernel name (``catalog.NATIVE_SPECS``): a native entry built from another
#: text is stale.
NATIVE_SOURCES = {name: spec.source for spec in catalog.NATIVE_SPECS for name in spec.kernel_names()}


def stores_in(root: Path) -> list[Store]:
    """Every ``triton-<version>/<arch>/`` directory under ``root``, as stores (sorted)."""
    found = []
    for version_dir in sorted(Path(root).glob("triton-*")):
        for arch_dir in sorted(p for p in version_dir.iterdir() if p.is_dir()):
            found.append(Store(Path(root), arch_dir.name, triton_version=version_dir.name.removeprefix("triton-")))
    return found


def native_stores_in(root: Path) -> list[NativeStore]:
    """Every ``native/<arch>/`` directory under ``root``, as native stores (sorted)."""
    base = Path(root) / NATIVE_DIR
    if not base.is_dir():
        return []
    return [NativeStore(Path(root), arch_dir.name) for arch_dir in sorted(base.iterdir()) if arch_dir.is_dir()]


def cached_archs(root: Path) -> list[str]:
    """The archs with a directory under ``root`` (Triton's of any version, or native), sorted."""
    return sorted({store.arch for store in [*stores_in(root), *native_stores_in(root)]})


def native_status(store: NativeStore, eid: str, record: NativeRecord, verify: bool,
                  nvrtc_version: str | None) -> str:
    """``ok``, or why a launch here would not use the entry: corrupt (its binary checked where ``verify``), built
    from another source of its kernel, or (an NVRTC entry) by another NVRTC than the one this process loads. An AMD
    entry built offline by clang is ``ok``: a ROCm launch loads it where it has no hipRTC entry of its own."""
    problem = store.problem(eid, record) if verify else None
    if problem:
        return problem
    source = NATIVE_SOURCES.get(record.kernel)
    if source is None:
        return "unknown kernel (not one of this version's native kernels)"
    if record.source_sha256 != source_hash(source()):
        return "stale: built from another source"
    if record.compiler == "nvrtc" and nvrtc_version is not None and record.compiler_version != nvrtc_version:
        return f"other NVRTC (this process compiles with {nvrtc_version})"
    return "ok"


def describe_native(root: Path, verify: bool = True) -> list[str]:
    """The native entries under ``root``: per arch, every entry with its compile time, date, who built it, status,
    and its kernel, compiler (NVRTC, hipRTC or clang) and version, registers and spills."""
    lines = []
    present = None if nvrtc.unavailable_reason() else nvrtc.find().version_text
    for store in native_stores_in(root):
        ids = store.entry_ids()
        size = sum(p.stat().st_size for p in store.dir.rglob("*") if p.is_file())
        lines.append(f"native / {store.arch}: {len(ids)} entries, {size / 2**20:.1f} MiB")
        for eid in ids:
            try:
                record = store.read(eid)
            except ValueError as err:
                lines.append(f"  {eid}  corrupt: {err}")
                continue
            if record is None:  # removed while listing
                continue
            status = native_status(store, eid, record, verify, present)
            lines.append(f"  {eid}  {record.compile_seconds:7.2f} s  {record.date:%Y-%m-%d %H:%M:%S}  "
                         f"{record.built_by:6}  {status}")
            lines.append(f"      {record.summary()}")
    return lines


def describe(root: Path, verify: bool = True) -> str:
    """A listing of the cache under ``root``: per Triton version and arch, every entry with its kernel,
    specialisation, compile time, date and status (``ok``, or why it would be rebuilt); then the native entries
    (``describe_native``)."""
    lines = [f"JIT cache: {root}"]
    stores = stores_in(root)
    natives = describe_native(root, verify)
    if not stores and not natives:
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
            lines.append(f"      arguments: {entry.argument_types()}")
    return "\n".join(lines + natives)


@dataclass(frozen=True)
class Removed:
    """One cache directory ``clear`` removed: its ``path``, what it held (``label``: ``triton <version> / <arch>`` or
    ``native / <arch>``), its ``entries`` and its ``bytes`` on disk."""

    path: Path
    label: str
    entries: int
    bytes: int

    def line(self) -> str:
        return f"removed {self.label}: {self.entries} entries, {_size(self.bytes)} ({self.path})"


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


def _bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def clear(root: Path, arch: str | None = None) -> list[Removed]:
    """Remove the cached kernels under ``root`` (only ``arch``'s if given; every Triton version, and the native
    entries). Keeps the root and its README. Returns what was removed, directory by directory."""
    removed = []
    for store in [*stores_in(root), *native_stores_in(root)]:
        if arch is not None and store.arch != arch:
            continue
        if isinstance(store, Store):
            label, entries = f"triton {store.triton_version} / {store.arch}", len(store.read().entries)
        else:
            label, entries = f"native / {store.arch}", len(store.entry_ids())
        size = _bytes_under(store.dir)
        shutil.rmtree(store.dir)
        removed.append(Removed(store.dir, label, entries, size))
        parent = store.dir.parent
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
    return removed


def removal_report(root: Path, arch: str | None, removed: list[Removed]) -> str:
    """What ``jit clear`` prints: a line per directory removed and the total, or that there was nothing to
    remove."""
    if not removed:
        return f"nothing to remove under {root}" + (f" for {arch}" if arch else "")
    total = (f"removed {sum(r.entries for r in removed)} entries, {_size(sum(r.bytes for r in removed))} in "
             f"{len(removed)} director{'y' if len(removed) == 1 else 'ies'} under {root}")
    return "\n".join([r.line() for r in removed] + [total])

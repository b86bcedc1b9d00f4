"""Listing and clearing the JIT cache under a root (``python -m qsa_aiter jit list`` / ``jit clear``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import triton

from ..runtime.jit.store import Store


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

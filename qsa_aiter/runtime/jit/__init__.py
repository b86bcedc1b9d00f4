"""The compiled-kernel cache (``jit/``): each kernel variant compiled once per GPU arch and Triton version, with a
manifest, and loaded from there by later processes without calling Triton's compiler.

Modules, one concern each: ``paths`` (where the cache lives; what identifies a build), ``manifest`` (its records),
``store`` (one ``triton-<version>/<arch>/`` directory: locks, recording, placing entries in Triton's in-memory
caches), ``routing`` (Triton's compiles routed into a store, its compile hooks), ``launching`` (``load`` and ``scope``
around launches). The native kernels: ``native_store`` (their entries under ``<root>/native/<arch>/``), one
compiler per vendor and route (``nvrtc``: CUDA C++ to a CUBIN; ``hiprtc``: HIP at run time on ROCm; ``hip_clang``:
AMD code objects offline), one device driver per vendor (``cuda_driver``, ``hip_driver``) and ``native`` (loading
and launching).
The offline tools on top of it are in ``qsa_aiter/tools``: ``build`` (compiling for a named target without its
GPU), ``aot`` (ahead-of-time builds), ``warmup`` (the variant matrix) and ``inventory`` (``jit list`` / ``jit
clear``). Triton's private names are reached through ``triton_compat`` only. The public names are re-exported here;
a test that replaces a module constant (``KERNEL_SOURCES``, ``CHECKOUT_JIT_DIR``) patches ``paths``, the module that
reads it.
"""

from .manifest import Entry, EntryUnusable, FileRecord, Manifest
from .paths import (
    CHECKOUT_JIT_DIR, KERNEL_PACKAGES, KERNEL_SOURCES, entry_id, jit_root, kernel_sources_hash, user_cache_dir,
    writable,
)
from .launching import load, scope, store_for
from .store import LOCK_TIMEOUT_S, Event, Store, VariantBusy

__all__ = [
    "CHECKOUT_JIT_DIR", "KERNEL_PACKAGES", "KERNEL_SOURCES", "LOCK_TIMEOUT_S", "Entry", "EntryUnusable", "Event",
    "FileRecord", "Manifest", "Store", "VariantBusy", "entry_id", "jit_root", "kernel_sources_hash", "load", "scope",
    "store_for", "user_cache_dir", "writable",
]

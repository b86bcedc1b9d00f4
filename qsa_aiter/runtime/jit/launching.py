"""The JIT cache at launch time: each process's stores, ``load`` at start-up and ``scope`` around launches.

Launches on a GPU run inside ``scope(device)`` (the registry, the selection ops and the writer enter it):

- Once per process, device and directory, every usable manifest entry is placed in its kernel's in-memory Triton
  cache (``Store.place``), so a warm process never calls Triton's compiler, nor hashes Triton's libraries for a
  cache key.
- A variant not in the manifest is compiled by Triton as usual, but into the cache directory (Triton's cache manager
  is routed there while a scope is active, ``routing``; kernels launched outside one are untouched), while its file
  lock is held, and is recorded. A process that waited on the lock finds the other's build and only loads it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from pathlib import Path

import torch

from ..log import log_once
from ...kernels.platform import Platform, interpreting
from ..settings import QsaSettings, get_settings
from .. import tuned
from .paths import jit_root
from .routing import Activation, active_store
from .store import Store
from .triton_compat import driver, install_uniform_interpreter_dots

#: What ``scope`` returns where there is nothing to route (one shared object: a launch allocates nothing for it).
_NO_SCOPE = contextlib.nullcontext()
_UNOPENED = object()
_stores: dict[tuple, Store] = {}
_device_stores: dict[tuple, Store | None] = {}


def store_for(root: Path, arch: str, rebuild: bool = False) -> Store:
    """The process's ``Store`` of ``root`` and ``arch`` (one object per directory, so placements happen once)."""
    key = (Path(root).resolve(), arch, rebuild)
    if key not in _stores:
        _stores[key] = Store(Path(root), arch, rebuild)
    return _stores[key]


#: Modules Triton's launch path imports at its first launch in a process (Triton 3.6: the Gluon layout and
#: descriptor types its argument specialiser checks arguments against, and the tensor-descriptor type).
_TRITON_LAUNCH_IMPORTS = ("triton.experimental.gluon", "triton.tools.tensor_descriptor")


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
    once-per-process launch set-up, and read the tuned tables, now rather than at the first launch: an engine calls it
    at start-up so that its first scoring call pays none of it (``benchmarks/first_call.py``); a bad
    ``QSA_AITER_TUNED_CONFIG`` file raises ``ConfigurationError`` here. None where there is no cache: off the GPU,
    under the interpreter. A cache that cannot be opened is logged once and None is returned; a bad
    ``QSA_AITER_JIT_DIR`` raises ``ValueError``."""
    if interpreting() or not torch.cuda.is_available():
        return None
    if device is None or isinstance(device, int):
        device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    if device.type != "cuda":
        return None
    settings = settings or get_settings()
    tuned.load_tables(tuple(settings.tuned_config))  # memoised: the first call's dispatch reads them
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, settings.jit_dir, settings.rebuild)
    if key in _device_stores:
        return _device_stores[key]
    _triton_driver_ready()
    root = jit_root(settings)  # a bad QSA_AITER_JIT_DIR is the caller's error, raised
    store = None
    try:
        store = store_for(root, Platform.of(torch.device("cuda", index)).arch, settings.rebuild)
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
    scope (the outer one's directory serves) and where the cache is read-only or unusable.

    Under the interpreter it installs the uniform interpreter dots first (once, the interpreter's only; no GPU is
    touched): every launch of this library's kernels passes here (``Registry.dispatch``), so a score does not depend
    on the other rows of the call in a user's process either, not only in the test suite and the fuzzer."""
    if interpreting():
        install_uniform_interpreter_dots()
        return _NO_SCOPE
    if device.type != "cuda" or active_store() is not None:
        return _NO_SCOPE
    settings = settings or get_settings()
    index = device.index if device.index is not None else torch.cuda.current_device()
    store = _device_stores.get((index, settings.jit_dir, settings.rebuild), _UNOPENED)
    if store is _UNOPENED:  # first launch on this device with these settings
        store = load(torch.device("cuda", index), settings)
    return _NO_SCOPE if store is None or not store.writable() else Activation(store)

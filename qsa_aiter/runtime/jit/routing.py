"""Routing Triton's compiles of this library's kernels into a JIT cache store, and Triton's compile hooks.

While an ``Activation`` of a store is entered (per thread: a context variable), Triton's file cache manager writes
into the store's ``triton/`` directory, and the pre- and post-compile hooks hand each compile of this library's
kernels to the store (its variant lock taken before, the build recorded after). Kernels compiled outside an
activation, and other packages' kernels, are untouched. Triton's classes and knobs are reached through
``triton_compat`` only.
"""

from __future__ import annotations

import contextvars
import logging
import os
import threading
from typing import TYPE_CHECKING

from ..log import log_once
from .paths import full_name
from .triton_compat import FileCacheManager, install_compile_hooks

if TYPE_CHECKING:
    from .store import Store

_ACTIVE: contextvars.ContextVar[Store | None] = contextvars.ContextVar("qsa_aiter_jit_store", default=None)


def active_store() -> Store | None:
    """The store this thread's compiles are routed to now, or None outside an activation."""
    return _ACTIVE.get()


class Activation:
    """While entered (per thread), compiles of this library's kernels go to ``store`` and are recorded there."""

    __slots__ = ("store", "token")

    def __init__(self, store: Store):
        self.store = store

    def __enter__(self) -> Store:
        self.token = _ACTIVE.set(self.store)
        return self.store

    def __exit__(self, *exc) -> None:
        _ACTIVE.reset(self.token)
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
    return full_name(info.jit_function).startswith("qsa_aiter.")


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


def install_triton_hooks() -> None:
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


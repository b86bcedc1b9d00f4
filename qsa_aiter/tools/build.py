"""Compiling a launch for a named GPU target, without that GPU, into a JIT cache store.

``specialise`` binds a launch's arguments with Triton's own binder and argument packing for the target, as
``JITFunction.run`` does on that GPU, so the variant's key (and entry id) is the one a launch there computes;
``build_for_target`` compiles it into a store unless a usable build is recorded there. Warm-up for a named arch and
the ahead-of-time builds use them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import triton

from ..runtime.jit.paths import entry_id, full_name
from ..runtime.jit.routing import Activation, install_triton_hooks
from ..runtime.jit.store import Event, Store
from ..runtime.jit.triton_compat import ASTSource, make_backend, serialize_specialization, specialize_launch


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
        return entry_id(full_name(self.fn), self.key)


def specialise(fn, target, args: tuple, kwargs: dict) -> Specialisation:
    """Specialise ``fn(*args, **kwargs)`` (a launch's arguments) for ``target`` (a ``GPUTarget``) with Triton's own
    binder and argument packing, as ``JITFunction.run`` does on that GPU, so the key is the one a launch computes."""
    key, options, signature, constexprs, attrs = specialize_launch(fn, make_backend(target), args, kwargs)
    return Specialisation(fn, target, key, signature, constexprs, attrs, options)


def build_for_target(store: Store, spec: Specialisation, wait: bool = True) -> Event:
    """Compile ``spec`` into ``store`` unless a usable build is recorded (under the variant's lock). Raises
    ``VariantBusy`` when another process holds the lock and not ``wait``."""
    eid = spec.entry_id
    lock, found = store.claim(eid, wait)
    try:
        if found is not None:
            event = Event(eid, found.kernel, False, 0.0)
        else:
            install_triton_hooks()
            start = time.perf_counter()
            with Activation(store):
                kernel = triton.compile(ASTSource(spec.fn, spec.signature, spec.constexprs, spec.attrs),
                                        target=spec.target, options=spec.options.__dict__)
            data = serialize_specialization(full_name(spec.fn), spec.signature, spec.constexprs, spec.attrs,
                                            spec.options, spec.key, spec.target)
            options = {"num_warps": spec.options.num_warps, "num_stages": spec.options.num_stages}
            event = store.record_build(spec.fn, spec.key, kernel, data, spec.constexprs, options,
                                       time.perf_counter() - start, "target", None)
        store.events.append(event)
        return event
    finally:
        if lock is not None:
            lock.release()

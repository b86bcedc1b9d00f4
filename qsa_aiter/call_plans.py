"""Launch plans cached per call signature: the host path of a repeated eager call.

The first call of a public op with a given signature (its tensors' dtypes, shapes, strides, devices and 16-byte
alignment, its host arguments, the settings in force and the current device) is validated and dispatched in full, and
the kernel launches it makes are recorded: each one's compiled kernel and grid. Every check and every dispatch
decision depends only on what the signature holds (nothing reads device memory), so a later call with the same
signature skips them: it allocates its buffers and launches the compiled kernels directly (Triton's launcher, without
its argument binding, specialisation and cache lookup, which depend only on the signature too). A replay passes the
kernels' pointer arguments as integer addresses (the signature reads each tensor's address anyway), so Triton's
launcher neither calls ``data_ptr`` nor asks the driver about each pointer; the scalar arguments are the first call's,
which the signature fixes as well.

Never stale: the settings are part of the signature (a changed variable gives a new settings object), and reloading
the tuned tables, a kernel marked broken or ``clear()`` empties the cache. At most ``MAX_PLANS`` signatures are
kept, the least recently used dropped first.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .spec import recording  # noqa: F401 (re-exported: the ops record their first call's launches with it)

#: Signatures kept (least recently used dropped first): one per distinct call shape an engine makes.
MAX_PLANS = 256

_plans: OrderedDict = OrderedDict()


def signature(head: tuple, tensors: tuple, hosts: tuple) -> tuple[tuple | None, tuple]:
    """``(key, addresses)`` of a call. ``key``, flat (fewer tuples to build and hash): ``head`` (the op, the
    settings' ``id``), the current device, then per tensor argument what validation, dispatch and Triton's
    specialisation read of it (dtype, shape, strides, device (-1 on the CPU), address modulo 16; None for an absent
    one), then per host argument its type and value (``True`` and ``1`` are different calls); None where an argument
    is not a tensor (the validating path names it). ``addresses``: each tensor argument's data address (0 for an
    absent one), what a replay passes to the kernels."""
    key = list(head)
    addresses = []
    try:
        key.append(torch.cuda.current_device() if tensors[0].get_device() >= 0 else -1)
        for t in tensors:
            if t is None:
                key.append(None)
                addresses.append(0)
            else:
                address = t.data_ptr()
                addresses.append(address)
                key += (t.dtype, t.shape, t.stride(), t.get_device(), address & 15)
    except (AttributeError, TypeError, RuntimeError):
        return None, ()
    for value in hosts:
        key += (type(value), value)
    return tuple(key), addresses


def lookup(key: tuple | None):
    """The plan recorded for ``key`` (None: no plan, or an unhashable key)."""
    if key is None:
        return None
    try:
        entry = _plans.get(key)
    except TypeError:  # an unhashable host argument: the validating path names it
        return None
    if entry is None:
        return None
    try:
        _plans.move_to_end(key)
    except KeyError:  # another thread's store just dropped it: the plan is still valid for this call
        pass
    return entry[0]


def store(key: tuple | None, plan, settings) -> None:
    """Keep ``plan`` for ``key`` (nothing for a None plan or key). A signature names its settings by ``id`` (a
    settings object's hash reads every field); the entry holds ``settings``, so no other object can take that id
    while the plan is kept."""
    if key is None or plan is None:
        return
    _plans[key] = (plan, settings)
    _plans.move_to_end(key)
    while len(_plans) > MAX_PLANS:
        _plans.popitem(last=False)


def clear() -> None:
    """Forget every plan (the tuned tables were reloaded, a kernel was marked broken, or a test asks)."""
    _plans.clear()


def size() -> int:
    return len(_plans)


class DirectLaunch:
    """One recorded launch, replayed without Triton's binder: ``__call__(*addresses)`` takes the integer addresses of
    the kernel's leading pointer arguments (those the recorded call gave as tensors, in order) and launches the
    compiled kernel with the recorded scalar arguments, grid and constexprs on the current stream of ``device`` (the
    current device when it was recorded: the signature holds it)."""

    __slots__ = ("_launch", "pointers", "tail")

    def __init__(self, kernel, grid: tuple[int, ...], pointers: int, tail: tuple, device: int):
        from .jit.triton_compat import compiled_launcher  # Triton's private launch entry, adapted per release

        self.pointers = pointers  # how many addresses a call passes
        self.tail = tail  # the recorded scalar arguments, then the constexprs
        self._launch = compiled_launcher(kernel, (tuple(grid) + (1, 1))[:3], device)

    def __call__(self, *addresses: int) -> None:
        self._launch(addresses + self.tail)


def direct_launches(launches: list, expected: tuple[str, ...]) -> tuple[DirectLaunch, ...] | None:
    """The recorded ``launches`` as direct launches, if they are exactly the kernels ``expected`` (by spec name, in
    order; a kernel name ending in ``?`` may be absent), each one's positional arguments are tensors then scalars,
    and its constexprs follow its positional arguments in its signature; else None (the call is not cached: a
    fallback ran, or the interpreter, which compiles nothing)."""
    names = [plan.kernel for plan, _, _ in launches]
    wanted = [name.rstrip("?") for name in expected if not name.endswith("?") or name.rstrip("?") in names]
    if names != wanted:
        return None
    out = []
    for plan, kernel, args in launches:
        pointers = _leading_tensors(args)
        tail = None if kernel is None else _constexpr_tail(plan, len(args))
        if tail is None or pointers is None:
            return None
        out.append(DirectLaunch(kernel, plan.grid, pointers, tuple(args[pointers:]) + tail,
                                torch.cuda.current_device()))
    return tuple(out)


def _leading_tensors(args: tuple) -> int | None:
    """How many of ``args`` lead as tensors, if no tensor follows the first scalar (None otherwise)."""
    count = 0
    while count < len(args) and isinstance(args[count], torch.Tensor):
        count += 1
    return None if any(isinstance(a, torch.Tensor) for a in args[count:]) else count


def _constexpr_tail(plan, positional: int) -> tuple | None:
    """The values of ``plan.fn``'s parameters after its first ``positional`` ones, which must all be constexprs the
    plan gives (the launcher takes every parameter in signature order); None otherwise."""
    names = plan.fn.arg_names
    if any(name in plan.constexprs for name in names[:positional]):
        return None
    try:
        return tuple(plan.constexprs[name] for name in names[positional:])
    except KeyError:
        return None

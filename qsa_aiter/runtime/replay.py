"""Launch plans cached per call signature: the host path of a repeated eager call.

The first call of a public op with a given signature (its tensors' dtypes, shapes, strides, devices and 16-byte
alignment, its host arguments, the settings in force and the current device) is validated and dispatched in full, and
the kernel launches it makes are recorded: each one's compiled kernel and grid. Every check and every dispatch
decision depends only on what the signature holds (nothing reads device memory), so a later call with the same
signature skips them: it allocates its buffers and launches the compiled kernels directly (Triton's launcher, without
its argument binding, specialisation and cache lookup, which depend only on the signature too). A replay passes the
kernels' pointer arguments as integer addresses (read for the lookup anyway), so Triton's launcher neither calls
``data_ptr`` nor asks the driver about each pointer; the scalar arguments are the first call's, which the signature
fixes as well.

A signature is looked up in two steps, so that a call reads each tensor's metadata in compiled code rather than
attribute by attribute in Python: a dict key of what is cheap to read (the op, the settings, the current device, each
argument's type, the addresses' alignment, the host arguments), then, among the plans under that key, the one whose
tensor guard accepts the call's tensors. A guard is PyTorch's ``TensorGuards`` (the C++ check ``torch.compile``
runs on every compiled call: dispatch keys, dtype, device, requires_grad, sizes and strides); where that is missing or
does not behave as expected, an equivalent Python check.

Never stale: the settings are part of the key (a changed variable gives a new settings object), and reloading the
tuned tables, a kernel marked broken or ``clear()`` empties the cache. At most ``MAX_PLANS`` plans are kept, those of
the least recently used key dropped first.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import operator
import threading
from collections import OrderedDict

import torch

from ..kernels.spec import recording  # noqa: F401 (re-exported: the ops record their first call's launches with it)

#: Plans kept (those of the least recently used key dropped first): one per distinct call shape an engine makes.
MAX_PLANS = 256

#: key -> ``_Bucket`` of the plans of calls with that key, most recently used last.
_plans: OrderedDict = OrderedDict()
_count = 0  # plans in all buckets

#: The argument types a plan may be recorded for: a tensor subclass may override what a guard or ``data_ptr`` reads.
_CACHED_TYPES = frozenset({torch.Tensor, type(None)})


class _PythonGuards:
    """What ``TensorGuards`` checks, in Python: per tensor its dispatch keys, dtype, device, requires_grad, sizes and
    strides."""

    __slots__ = ("_expected",)

    def __init__(self, *tensors: torch.Tensor):
        self._expected = [self._read(t) for t in tensors]

    @staticmethod
    def _read(t: torch.Tensor) -> tuple:
        return (torch._C._dispatch_keys(t), t.dtype, t.device, t.requires_grad, t.shape, t.stride())

    def check(self, *tensors: torch.Tensor) -> bool:
        return len(tensors) == len(self._expected) and all(
            self._read(t) == e for t, e in zip(tensors, self._expected))


def _compiled_guards():
    """A builder of PyTorch's C++ ``TensorGuards`` if it is there and tells apart what a plan depends on (a quick check
    of the private API, which a release may change), else None."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None

    def build(*tensors: torch.Tensor):
        return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                            dynamic_dims_strides=[list(t.stride()) for t in tensors])

    a, b = torch.zeros(4, 2), torch.zeros(3, dtype=torch.int32)
    others = ((a.double(), b), (a[:3], b), (a.t().contiguous().t(), b), (torch.zeros(4, 2, requires_grad=True), b),
              (a, b.long()), (a, torch.zeros(3, dtype=torch.int32, device="meta")))
    try:
        guards = build(a, b)
        accepts = guards.check(torch.ones(4, 2), torch.ones(3, dtype=torch.int32))
        rejects = [guards.check(*other) for other in others]
    except Exception:  # noqa: BLE001 (any failure of a private API: the Python check serves)
        return None
    return build if accepts is True and not any(rejects) else None


_build_guards = _compiled_guards() or _PythonGuards
_store_lock = threading.Lock()


class _Bucket:
    """The plans recorded under one key: ``pick(args)`` takes the key's tensors out of a call's tensor arguments (the
    key fixes which are None), ``entries`` are ``[guards, plan, settings]``, the most recently used first."""

    __slots__ = ("pick", "entries")

    def __init__(self, present: list[int]):
        self.pick = operator.itemgetter(*present) if len(present) > 1 else (lambda args, i=present[0]: (args[i],))
        self.entries: list = []


#: The current CUDA device's index, without ``torch.cuda.current_device``'s lazy-initialisation check (a call with
#: a CUDA tensor has initialised CUDA).
_cuda_device = getattr(torch._C, "_cuda_getDevice", None)


def _current_device(first: torch.Tensor) -> int:
    """The device a call whose first tensor argument is ``first`` launches on: the current CUDA device for a CUDA
    tensor (a plan's launches go to that device's stream), -1 otherwise."""
    if not first.is_cuda:
        return -1
    return _cuda_device() if _cuda_device is not None else torch.cuda.current_device()


def signature(head: tuple, tensors: tuple, hosts: tuple) -> tuple[tuple | None, tuple]:
    """``(key, addresses)`` of a call. ``key``: the dict key (``head`` (the op, the settings' ``id``), the current
    device, each tensor argument's type, the addresses' alignment (16-byte aligned or each one's remainder), each host
    argument's type and value (``True`` and ``1`` are different calls)) and the tensors, which a plan's guard checks;
    None where an argument is not a tensor or None (the validating path names it). ``addresses``: each tensor
    argument's data address (0 for an absent one), what a replay passes to the kernels."""
    try:
        addresses = [0 if t is None else t.data_ptr() for t in tensors]
        device = _current_device(tensors[0])
    except (AttributeError, TypeError, RuntimeError):
        return None, ()
    kinds = tuple(map(type, tensors))
    alignment = math.gcd(*addresses) & 15 and tuple(a & 15 for a in addresses)  # 0: every address 16-byte aligned
    return ((head, device, kinds, alignment, hosts, tuple(map(type, hosts))), tensors), addresses


def lookup(key: tuple | None):
    """The plan recorded for ``key`` (None: no plan, or an unhashable key)."""
    if key is None:
        return None
    name, tensors = key
    try:
        bucket = _plans.get(name)
    except TypeError:  # an unhashable host argument: the validating path names it
        return None
    if bucket is None:
        return None
    present = bucket.pick(tensors)
    entries = bucket.entries
    for i, entry in enumerate(entries):
        if entry[0].check(*present):
            if i:  # most recently used first; under the lock, as a store may be dropping entries from this list
                with _store_lock, contextlib.suppress(ValueError):
                    entries.remove(entry)
                    entries.insert(0, entry)
            try:
                _plans.move_to_end(name)
            except KeyError:  # another thread's store just dropped it: the plan is still valid for this call
                pass
            return entry[1]
    return None


def store(key: tuple | None, plan, settings) -> None:
    """Keep ``plan`` for ``key`` (nothing for a None plan or key, or arguments of a type no plan is kept for). A key
    names its settings by ``id`` (a settings object's hash reads every field); the entry holds ``settings``, so no
    other object can take that id while the plan is kept."""
    global _count
    if key is None or plan is None:
        return
    name, tensors = key
    if not _CACHED_TYPES.issuperset(name[2]):
        return
    try:
        hash(name)
    except TypeError:
        return
    with _store_lock:
        bucket = _plans.get(name)
        if bucket is None:
            bucket = _plans[name] = _Bucket([i for i, t in enumerate(tensors) if t is not None])
        bucket.entries.insert(0, [_build_guards(*bucket.pick(tensors)), plan, settings])
        _count += 1
        _plans.move_to_end(name)
        while _count > MAX_PLANS:
            oldest = next(iter(_plans))
            entries = _plans[oldest].entries
            entries.pop()
            _count -= 1
            if not entries:
                del _plans[oldest]


def clear() -> None:
    """Forget every plan (the tuned tables were reloaded, a kernel was marked broken, or a test asks)."""
    global _count
    with _store_lock:
        _plans.clear()
        _count = 0


def size() -> int:
    """Plans kept."""
    return _count


def kept_plans() -> list:
    """The plans kept, the most recently used key first (tests and diagnostics)."""
    with _store_lock:
        return [entry[1] for bucket in reversed(_plans.values()) for entry in bucket.entries]


class DirectLaunch:
    """One recorded launch, replayed without Triton's binder: ``__call__(*addresses)`` takes the integer addresses of
    the kernel's leading pointer arguments (those the recorded call gave as tensors, in order) and launches the
    compiled kernel with the recorded scalar arguments, grid and constexprs on the current stream of ``device`` (the
    current device when it was recorded: the signature holds it)."""

    __slots__ = ("_launch", "pointer_names", "tail")

    def __init__(self, kernel, grid: tuple[int, ...], pointer_names: tuple[str, ...], tail: tuple, device: int):
        from .jit.triton_compat import compiled_launcher  # Triton's private launch entry, adapted per release

        self.pointer_names = pointer_names  # the kernel's leading pointer parameters: a call passes their addresses
        self.tail = tail  # the recorded scalar arguments, then the constexprs
        self._launch = compiled_launcher(kernel, (tuple(grid) + (1, 1))[:3], device)

    def __call__(self, *addresses: int) -> None:
        self._launch(addresses + self.tail)

    def taking(self, *names: str):
        """This launch as a function of the addresses of the pointer parameters ``names``, in that order (each of
        the kernel's pointer parameters named once; None otherwise, and the caller keeps no plan): a replay names
        what it passes instead of relying on the kernel's parameter order."""
        if sorted(names) != sorted(self.pointer_names):
            return None
        if names == self.pointer_names:
            return self.__call__
        pick, launch, tail = operator.itemgetter(*(names.index(n) for n in self.pointer_names)), self._launch, self.tail
        return lambda *addresses: launch(pick(addresses) + tail)


def direct_launches(launches: list, expected: tuple[str, ...]) -> tuple[DirectLaunch, ...] | None:
    """The recorded ``launches`` as direct launches, if they are exactly the kernels ``expected`` (by spec name, in
    order; a kernel name ending in ``?`` may be absent), each one's positional arguments are tensors then scalars,
    and its constexprs follow its positional arguments in its signature; else None (the call is not cached: a
    fallback ran, or the interpreter, which compiles nothing). A launch recorded as a ready direct launch (a native
    kernel's ``PreparedLaunch``: ``name``, ``taking``) is matched by its name and kept as it is."""
    names = [entry[0].kernel if is_recorded(entry) else entry.name for entry in launches]
    wanted = [name.rstrip("?") for name in expected if not name.endswith("?") or name.rstrip("?") in names]
    if names != wanted:
        return None
    out = []
    for entry in launches:
        if not is_recorded(entry):
            out.append(entry)
            continue
        plan, kernel, args = entry
        pointers = _leading_tensors(args)
        tail = None if kernel is None else _constexpr_tail(plan, len(args))
        if tail is None or pointers is None:
            return None
        out.append(DirectLaunch(kernel, plan.grid, tuple(plan.fn.arg_names[:pointers]), tuple(args[pointers:]) + tail,
                                torch.cuda.current_device()))
    return tuple(out)


def is_recorded(entry) -> bool:
    """Whether a recorded entry is a ``LaunchPlan``'s ``(plan, kernel, args)`` (a ``RecordedLaunch``) rather than a
    launch that replays itself (``kernels.spec.record``)."""
    return isinstance(entry, tuple)


def _leading_tensors(args: tuple) -> int | None:
    """How many of ``args`` lead as tensors, if no tensor follows the first scalar (None otherwise)."""
    count = 0
    while count < len(args) and isinstance(args[count], torch.Tensor):
        count += 1
    return None if any(isinstance(a, torch.Tensor) for a in args[count:]) else count


def _constexpr_tail(plan, positional: int) -> tuple | None:
    """The values of ``plan.fn``'s parameters after its first ``positional`` ones, which must all be constexprs the
    plan gives or the kernel defaults (the launcher takes every parameter in signature order); None otherwise."""
    names = plan.fn.arg_names
    if any(name in plan.constexprs for name in names[:positional]):
        return None
    defaults = _constexpr_defaults(plan.fn)
    try:
        return tuple(plan.constexprs[name] if name in plan.constexprs else defaults[name]
                     for name in names[positional:])
    except KeyError:
        return None


@functools.lru_cache(maxsize=None)
def _constexpr_defaults(fn) -> dict:
    """A ``@triton.jit`` kernel's parameters with a default (a constexpr a launch may leave out, such as a dense
    cache's key strides), by name."""
    parameters = inspect.signature(fn.fn).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def cached_call(op: str, settings, tensors: tuple, hosts: tuple, first_call):
    """The host path every public op shares: the call's signature (``op``, ``settings``, its ``tensors`` (None for
    an absent one) and ``hosts``, its host arguments) -> a recorded plan under it replays the call
    (``plan.replay(addresses, tensors)``); else ``first_call()`` validates, dispatches and launches, its launches are
    recorded, and the plan it builds from them is kept for the next call.

    ``first_call()`` returns ``(result, plan_of)``: ``plan_of(launches)`` builds the plan (None: not replayable, as
    for a torch path or a fallback), or ``plan_of`` is None."""
    key, addresses = signature((op, id(settings)), tensors, hosts)
    plan = lookup(key)
    if plan is not None:
        return plan.replay(addresses, tensors)
    with recording() as launches:
        result, plan_of = first_call()
    if plan_of is not None:
        store(key, plan_of(launches), settings)
    return result

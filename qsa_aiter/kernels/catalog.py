"""Every kernel of the library, from its family's spec list: what warm-up, the ahead-of-time builds, the tuned
tables and the tests iterate over. ``SPECS`` are the Triton kernels (``KernelSpec``), ``NATIVE_SPECS`` the native
kernel families (``NativeKernelSpec``: CUDA C++ compiled at run time); a tool names a kernel through them, never by
hand."""

from __future__ import annotations

from . import cache, scoring, selection
from .native_spec import NativeKernelSpec
from .scoring import native_scorer
from .selection import fused_select, grid_topk, native_topk
from .spec import KernelSpec

SPECS: tuple[KernelSpec, ...] = scoring.SPECS + selection.SPECS + cache.SPECS
BY_NAME: dict[str, KernelSpec] = {spec.name: spec for spec in SPECS}
NATIVE_SPECS: tuple[NativeKernelSpec, ...] = (native_topk.SPEC, grid_topk.SPEC, native_scorer.SPEC,
                                                fused_select.SPEC)
NATIVE_BY_NAME: dict[str, NativeKernelSpec] = {spec.name: spec for spec in NATIVE_SPECS}


def spec_named(name: str) -> KernelSpec:
    """The spec of kernel ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in BY_NAME:
        raise ValueError(f"kernel must be one of {', '.join(BY_NAME)}; got {name!r}")
    return BY_NAME[name]


def native_spec_named(name: str) -> NativeKernelSpec:
    """The spec of native kernel family ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in NATIVE_BY_NAME:
        raise ValueError(f"kernel must be one of {', '.join(NATIVE_BY_NAME)}; got {name!r}")
    return NATIVE_BY_NAME[name]


def family_names(family: str) -> tuple[str, ...]:
    """The names of the Triton kernels of ``family`` (``scoring``, ``selection``, ``cache``), in catalog order."""
    return tuple(spec.name for spec in SPECS if spec.family == family)


def tunable_specs() -> tuple[KernelSpec, ...]:
    """The kernels the tuner measures (those with a candidate grid): the Triton kernels a tuned row may name."""
    return tuple(spec for spec in SPECS if spec.tune_grid)


def timed_native_specs() -> tuple[NativeKernelSpec, ...]:
    """The native kernel families a tuned row may name too (those with a ``Config``): rows of measured times that
    measured dispatch compares with the Triton kernels' (``registry.measured_choice``)."""
    return tuple(spec for spec in NATIVE_SPECS if getattr(spec, "Config", None) is not None)

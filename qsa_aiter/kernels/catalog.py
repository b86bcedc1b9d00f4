"""Every kernel of the library, from its family's spec list: what warm-up, the ahead-of-time builds, the tuned
tables and the tests iterate over."""

from __future__ import annotations

from . import cache, scoring, selection
from .spec import KernelSpec

SPECS: tuple[KernelSpec, ...] = scoring.SPECS + selection.SPECS + cache.SPECS
BY_NAME: dict[str, KernelSpec] = {spec.name: spec for spec in SPECS}


def spec_named(name: str) -> KernelSpec:
    """The spec of kernel ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in BY_NAME:
        raise ValueError(f"kernel must be one of {', '.join(BY_NAME)}; got {name!r}")
    return BY_NAME[name]


def tunable_specs() -> tuple[KernelSpec, ...]:
    """The kernels the tuner measures (those with a candidate grid): the kernels a tuned row may name."""
    return tuple(spec for spec in SPECS if spec.tune_grid)

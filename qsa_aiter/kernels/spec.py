"""One declaration per kernel: ``KernelSpec`` says what a kernel serves and how it is launched, ``LaunchPlan`` is
one launch of it (function, grid, constexprs, options, config and where the config came from).

The registry, ``explain``, warm-up, the ahead-of-time builds, the tuner and the benchmark all go through
``KernelSpec.plan``: what they report is what runs. A spec knows nothing of settings, tuned files or the registry:
the caller hands it the tuned rows (anything with ``lookup(arch, kernel, problem)``) and a ``Platform``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar, Iterable, NamedTuple

from .platform import triton_runs_on


#: ``dataclasses.field`` metadata of a tile-config field that is a 0/1 switch, or a count where 0 means "derived"
#: (the tuned tables validate a row's cells with it; any other int field must be positive).
FLAG = {"ge": 0, "le": 1}
COUNT_OR_ZERO = {"ge": 0}


def cdiv(a: int, b: int) -> int:
    """Ceiling division on the host (``triton.cdiv`` is a jit function: slow to call from Python per launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


_recording: ContextVar[list | None] = ContextVar("qsa_aiter_recording", default=None)


class RecordedLaunch(NamedTuple):
    """One launch made inside ``recording()``: its plan, the compiled kernel (None under the interpreter) and its
    positional arguments, read by the names of the kernel's parameters (``arg``), not by position."""

    plan: "LaunchPlan"
    kernel: Any
    args: tuple

    def arg(self, name: str):
        """The argument given for the kernel's parameter ``name``."""
        return self.args[self.plan.fn.arg_names.index(name)]


def record(launch) -> None:
    """Add ``launch`` (a launch made without a ``LaunchPlan``, e.g. a native kernel's, that replays itself) to the
    open ``recording()`` block's list, if there is one."""
    launches = _recording.get()
    if launches is not None:
        launches.append(launch)


@contextmanager
def recording():
    """Within the block, every ``LaunchPlan.launch`` appends a ``RecordedLaunch`` to the list this yields, and
    ``record`` the launches it is given (``runtime/replay.py`` keeps a call's launches for its later calls)."""
    launches: list = []
    token = _recording.set(launches)
    try:
        yield launches
    finally:
        _recording.reset(token)


@dataclass(frozen=True)
class LaunchPlan:
    """One launch of ``kernel``: ``fn[grid](*args, **constexprs, **options)``. ``config`` is the tile config the
    constexprs, grid and options came from; ``config_source`` says where it came from (a tuned row, the defaults,
    or given by the caller)."""

    kernel: str
    fn: Any
    grid: tuple[int, ...]
    constexprs: dict = field(hash=False)
    options: dict = field(hash=False)
    config: Any = None
    config_source: str = "defaults"

    @property
    def kwargs(self) -> dict:
        """The launch's keyword arguments: constexprs and compile options."""
        return {**self.constexprs, **self.options}

    def launch(self, *args) -> None:
        """Launch the kernel on ``args`` (the kernel's positional arguments, in the order of its signature); an open
        ``recording()`` block records the compiled kernel."""
        kernel = self.fn[self.grid](*args, **self.constexprs, **self.options)
        launches = _recording.get()
        if launches is not None:
            launches.append(RecordedLaunch(self, kernel, args))

    def describe(self) -> str:
        return f"{self.kernel} grid {self.grid} ({self.config_source}): {self.config}"


class KernelSpec:
    """The declaration of one kernel. Subclasses set the class attributes and implement ``default_config``,
    ``constexprs``, ``grid`` and ``example_args``; ``reasons`` where the kernel has limits.

    ``family`` names the op family (``scoring``, ``selection``, ``cache``); ``fn`` is the ``@triton.jit`` function;
    ``Config`` its frozen tile-config dataclass (its fields are the tuned-table columns it reads).
    """

    name: ClassVar[str]
    family: ClassVar[str]
    description: ClassVar[str]
    fn: ClassVar[Any]
    Config: ClassVar[type]
    #: Candidate axes of the tuner (their product, plus the default config).
    tune_grid: ClassVar[dict[str, tuple[int, ...]]] = {}
    #: (benchmark work point, phase) pairs the tuner measures at.
    tune_points: ClassVar[tuple[tuple[str, str], ...]] = ()

    def reasons(self, problem, platform) -> list[str]:
        """Why this kernel does not serve ``problem`` (which has a ``device_type``) on ``platform`` (sentences;
        empty: it serves): a Triton kernel needs a device Triton runs on."""
        if not triton_runs_on(problem.device_type):
            return ["Triton kernels need a CUDA/HIP tensor or TRITON_INTERPRET=1 (tensors are on "
                    f"{problem.device_type})"]
        return []

    def default_config(self, problem, platform):
        raise NotImplementedError

    def constexprs(self, problem, platform, config) -> dict:
        raise NotImplementedError

    def grid(self, problem, platform, config) -> tuple[int, ...]:
        raise NotImplementedError

    def options(self, config) -> dict:
        """Compile options of a launch with ``config``: its warps, its pipeline stages where it sets them (else
        Triton's default), and its register cap where it sets one (``max_registers`` > 0: ptxas's ``maxnreg``, so
        more programs fit on a multiprocessor; NVIDIA targets only, AMD's backend has no such option)."""
        options = {"num_warps": config.num_warps}
        if hasattr(config, "num_stages"):
            options["num_stages"] = config.num_stages
        if getattr(config, "max_registers", 0):
            options["maxnreg"] = config.max_registers
        return options

    def example_args(self, problem, index_dtype, device) -> tuple:
        """Positional arguments of a small launch with ``problem``'s dtypes and specialisations (index tensors of
        ``index_dtype``) on ``device``: what warm-up and the ahead-of-time builds specialise the kernel on."""
        raise NotImplementedError

    def warm_problems(self, context) -> Iterable[tuple[str, Any]]:
        """``(label, problem)`` for every variant of this kernel a serving process launches (``jit.warmup``)."""
        return ()

    @functools.lru_cache(maxsize=512)
    def plan(self, problem, platform, tuned=None, config=None) -> LaunchPlan:
        """The launch of ``problem`` on ``platform``: ``config`` if given, else the default config with the tuned
        row of ``platform.arch`` applied (``tuned.lookup``; None: no tuned rows). Memoised (every argument is
        frozen, the tuned table by identity), so a steady stream of launches pays one dictionary lookup here."""
        if config is not None:
            source = "config given by the caller"
        else:
            config = self.default_config(problem, platform)
            # Tuned rows exist only for the kernels the tuner measures (those with a grid).
            row = tuned.lookup(platform.arch, self.name, problem) if tuned is not None and self.tune_grid else None
            if row is None:
                source = f"defaults (no tuned row for arch {platform.arch})"
            else:
                config = dataclasses.replace(config, **row.tile())
                source = f"tuned row rows={row.rows} context={row.context} ({row.source})"
        return LaunchPlan(self.name, self.fn, self.grid(problem, platform, config),
                          self.constexprs(problem, platform, config), self.options(config), config, source)

    def __repr__(self) -> str:
        return f"<KernelSpec {self.family}/{self.name}>"

"""The grid select (``grid_topk.cu`` beside this file): an exact block top-k whose rows are each split across several
CTAs of one cooperative grid, declared once (``SPEC``, a ``native_spec.NativeKernelSpec``), in pure Python (no
compiler, no driver: ``runtime/grid_topk.py`` launches it and ``runtime/registries.py`` makes it the
``native_grid`` top-k candidate).

It computes what the native top-k computes (per row the ``block_topk`` best columns of ``[0, clamp(visible, 0,
columns))`` by ``(-score, column)``, ascending, then ``-1``; a row with ``visible <= block_topk`` takes ``0 ..
visible-1`` without reading a score; the expansion fused where asked), by the method at the top of the ``.cu`` file:
a row's CTAs keep their columns' keys in shared memory, add their histograms into a global one, and the last CTA to
arrive finds each radix round's threshold bin for all of them. It is the selection half of a fused score + top-k
kernel, proven first over existing logits.

- ``VARIANTS``: the kernels (256 and 512 threads), each one program (``-DTOPK_SINGLE -DTOPK_KERNEL_<name>``);
  NVIDIA only for now (a HIP build compiles, but no cooperative launch is wired for ROCm: ``variants_for``).
- ``PARAMS``: the kernels' parameters, the one declaration of them.
- ``choose_plan(rows, columns, block_topk, platform)`` / ``split_plan(...)``: the split (CTAs per row), the row slots
  (rows in flight), the kernel and its shared memory (``Plan``), chosen so that the whole grid is co-resident.
- ``launch_arguments(plan, ...)``: the launch (``native_topk.NativeLaunch``), with the fused expansion's scalars
  (``native_topk.Expansion``) where asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..native_spec import NativeKernelSpec, Param, params
from ..platform import Platform
from .native_topk import COMPAT_PATH, EXPANSION_SCALARS, INT_LIMIT, NO_EXPANSION, Expansion, NativeLaunch

#: The CUDA source of the kernels.
SOURCE_PATH = Path(__file__).with_name("grid_topk.cu")
#: Bins of a round's histogram (the top 11 bits of the order-preserving key; the last round has 1024).
HISTOGRAM_BINS = 2048
#: Fixed part of a CTA's shared memory: H[2048] | scan[64] | res[256] (``GRID_FIXED_WORDS``), then the keys.
FIXED_BYTES = 2368 * 4
#: The tail's own shared words (scan | res, ``GRID_TAIL_WORDS``): what a fused kernel adds, its histograms elsewhere.
TAIL_BYTES = 320 * 4
#: The most rows one call of the tail takes through the same rounds (a fused kernel's row group; ``GRID_MAX_ROWS``).
MAX_ROWS = 4
#: A CTA's columns start at a multiple of this (a scorer's column tile; 16-byte aligned rows stay aligned).
TILE = 64
#: The most CTAs a row is split across (the per-CTA words of a workspace slot; ``GRID_MAX_SPLIT``).
MAX_SPLIT = 32
#: Words of one workspace slot (``GRID_SLOT_WORDS``): ``MAX_ROWS`` histograms, the arrival counter, the flag, the
#: payload words, the per-CTA and row words; a slot per row (group) in flight, zeroed once.
SLOT_WORDS = 8800
#: The slot's words a launch leaves zero (the histograms and the arrival counter, ``GRID_ARRIVE_WORD``): the next
#: launch needs no zeroing.
CLEAN_WORDS = MAX_ROWS * HISTOGRAM_BINS + 1
#: The most keys one CTA holds: its counts of keys above and at the threshold share one 32-bit word (16 bits each).
MAX_CHUNK = 32768
#: The most columns a row is split finer than: a CTA takes at least this many (fewer only where the row is shorter).
MIN_CHUNK = 2048
#: block_topk must fit the payload's 20-bit rank field, less its "all" value.
MAX_BLOCK_TOPK = (1 << 20) - 2
#: Rows of at most this many columns a CTA (chunk) go to the 256-thread kernel, longer ones to the 512-thread one.
CHUNK_256_MAX = 4096
#: Shared memory the hardware reserves per CTA (NVIDIA: 1 KB), counted when CTAs share a multiprocessor.
RESERVED_PER_CTA = 1024

#: The kernels' parameters, in order: the one declaration of them (the source's ``GRID_PARAMS`` is tested against
#: it). The pointers with their C types, then the scalars (C ``int``). Pointers 4-7 and the last five scalars are the
#: fused expansion's (``tokens`` null: none); ``workspace`` is the slots' words (``SLOT_WORDS`` each, zeroed once).
PARAMS = params(("logits", "const float*"), ("visible", "const int*"), ("out", "int*"),
                ("positions", "const void*"), ("contexts", "const void*"), ("requests", "const void*"),
                ("tokens", "int*"), ("workspace", "unsigned*"),
                *((name, "int") for name in ("rows", "columns", "ld", "K", "split", "slots", "cap", "vec_ok",
                                             *EXPANSION_SCALARS)))
POINTERS = tuple((p.name, p.ctype) for p in PARAMS if p.pointer)
SCALARS = tuple(p.name for p in PARAMS if not p.pointer)


@lru_cache(maxsize=1)
def _spliced_source() -> str:
    """The source with ``native_compat.h`` spliced in where it is included (read once per process), as
    ``native_topk`` does: NVRTC compiles one text with no include path, and its hash covers both files."""
    text, include = SOURCE_PATH.read_text(), '#include "native_compat.h"\n'
    at = text.index(include)
    line = text.count("\n", 0, at) + 2
    return (f'{text[:at]}#line 1 "native_compat.h"\n{COMPAT_PATH.read_text()}#line {line} "grid_topk.cu"\n'
            f"{text[at + len(include):]}")


def source() -> str:
    """The kernels' source (``native_compat.h`` spliced in)."""
    return _spliced_source()


@dataclass(frozen=True)
class Variant:
    """One kernel: its ``extern "C"`` name, threads per CTA and the CTAs per multiprocessor its
    ``__launch_bounds__`` promise (which caps its registers, and bounds the co-resident grid the plans count on)."""

    name: str
    threads: int
    blocks_per_multiprocessor: int
    cluster: int = 1
    non_portable_cluster: bool = False

    @property
    def defines(self) -> tuple[str, ...]:
        return ("TOPK_SINGLE", f"TOPK_KERNEL_{self.name}")

    @property
    def params(self) -> tuple[Param, ...]:
        return PARAMS

    @property
    def max_registers(self) -> int:
        return 65536 // (self.threads * self.blocks_per_multiprocessor)


VARIANTS = (Variant("grid_topk_256", 256, 4), Variant("grid_topk_512", 512, 2))
BY_NAME = {variant.name: variant for variant in VARIANTS}
#: The NVIDIA compute capability the kernels need (acquire / release loads and stores, ``__nanosleep``; the native
#: tier's floor).
MIN_CAPABILITY = (8, 0)


def variants_for(platform: Platform) -> tuple[Variant, ...]:
    """The variants of ``platform``: both on NVIDIA compute capability ``MIN_CAPABILITY``+, none elsewhere."""
    if platform.backend == "cuda" and platform.capability >= MIN_CAPABILITY:
        return VARIANTS
    return ()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Plan:
    """One launch: ``variant``; ``split`` CTAs per row; ``slots`` rows in flight (the grid is ``slots * split`` CTAs,
    co-resident); ``cap``: the keys a CTA has room for (a multiple of ``TILE``; 0 where no row reads a score)."""

    variant: Variant
    split: int
    slots: int
    cap: int

    @property
    def shared_bytes(self) -> int:
        return FIXED_BYTES + 4 * self.cap

    @property
    def grid(self) -> int:
        return self.slots * self.split

    @property
    def workspace_words(self) -> int:
        """Words of the workspace the launch uses (``SLOT_WORDS`` a slot; zeroed once, reusable)."""
        return self.slots * SLOT_WORDS

    def describe(self) -> str:
        return (f"{self.variant.name} (split {self.split} CTAs a row, {self.slots} rows in flight, grid "
                f"{self.grid}, {self.shared_bytes} B shared memory per CTA, workspace "
                f"{4 * self.workspace_words} B)")


def per_multiprocessor(variant: Variant, shared_bytes: int, platform: Platform) -> int:
    """CTAs of ``variant`` with ``shared_bytes`` of shared memory that surely fit on one multiprocessor together:
    those its launch bounds promise, fewer where the shared memory holds fewer."""
    if shared_bytes > platform.shared_memory_per_block:
        return 0
    fit = platform.shared_memory_per_multiprocessor // (shared_bytes + RESERVED_PER_CTA)
    return min(variant.blocks_per_multiprocessor, fit)


def max_cap(platform: Platform) -> int:
    """The most keys one CTA holds on ``platform`` (shared memory per block, ``MAX_CHUNK``), a multiple of
    ``TILE``."""
    room = (platform.shared_memory_per_block - FIXED_BYTES) // 4 // TILE * TILE
    return min(MAX_CHUNK, max(room, 0))


def split_plan(split: int, rows: int, columns: int, platform: Platform, threads: int | None = None,
               slots: int | None = None) -> Plan:
    """The plan of ``split`` CTAs per row for ``rows`` rows of ``columns`` (tests and benchmarks name it; ``threads``
    256 or 512, default by the chunk; ``slots`` at most the co-resident grid allows, default as many as fit, at most
    ``rows``). ``ValueError`` where the split does not fit (``MAX_SPLIT``, the keys' room, the co-resident grid)."""
    if not 1 <= split <= MAX_SPLIT:
        raise ValueError(f"split must be in [1, {MAX_SPLIT}]; got {split}")
    cap = _round_up(-(-columns // split), TILE)
    if cap > max_cap(platform):
        raise ValueError(f"a split of {split} leaves {cap} keys a CTA; {platform.arch} holds at most "
                         f"{max_cap(platform)}")
    variant = BY_NAME[f"grid_topk_{threads or (256 if cap <= CHUNK_256_MAX else 512)}"]
    resident = platform.multiprocessors * per_multiprocessor(variant, FIXED_BYTES + 4 * cap, platform)
    most = min(max(rows, 1), resident // split)
    if most < 1:
        raise ValueError(f"a split of {split} CTAs does not fit a co-resident grid of {resident} CTAs")
    if slots is not None and not 1 <= slots <= most:
        raise ValueError(f"slots must be in [1, {most}]; got {slots}")
    return Plan(variant, split, slots or most, cap)


def trivial_plan(rows: int, platform: Platform) -> Plan:
    """The plan where no row is wider than ``block_topk``: one CTA a row slot, no score read."""
    variant = BY_NAME["grid_topk_256"]
    resident = max(1, platform.multiprocessors * per_multiprocessor(variant, FIXED_BYTES, platform))
    return Plan(variant, 1, min(max(rows, 1), resident), 0)


def plan_reason(rows: int, columns: int, block_topk: int, platform: Platform) -> str | None:
    """Why no plan serves ``rows`` rows of ``columns`` keeping ``block_topk`` on ``platform`` (None: one does): the
    budget's rank field, the C ``int`` arguments, and shared memory that cannot hold a row's keys across a
    co-resident grid of at most ``MAX_SPLIT`` CTAs a row."""
    if block_topk > MAX_BLOCK_TOPK:
        return f"needs block_topk <= {MAX_BLOCK_TOPK} (got {block_topk})"
    if columns >= INT_LIMIT:
        return f"needs columns below 2**31 (got {columns})"
    if columns <= block_topk:
        return None
    room = max_cap(platform)
    if room < TILE:
        return (f"needs {FIXED_BYTES + 4 * TILE} bytes of shared memory per block ({platform.arch} allows "
                f"{platform.shared_memory_per_block})")
    least = -(-columns // room)
    if least > MAX_SPLIT:
        return (f"shared memory cannot hold a row of {columns} scores across {MAX_SPLIT} CTAs ({room} keys a CTA "
                f"on {platform.arch})")
    try:
        split_plan(least, rows, columns, platform)
    except ValueError as err:
        return f"shared memory cannot hold a row of {columns} scores across a co-resident grid ({err})"
    return None


@lru_cache(maxsize=512)
def choose_plan(rows: int, columns: int, block_topk: int, platform: Platform) -> Plan:
    """The plan for ``rows`` rows of ``columns`` fp32 logits keeping ``block_topk`` on ``platform``:

    - ``columns <= block_topk``: the trivial plan (no row reads a score);
    - else the split: enough CTAs a row that ``rows * split`` CTAs fill about two per multiprocessor, at most one
      per ``MIN_CHUNK`` columns and ``MAX_SPLIT``, at least what the keys' room needs (``max_cap``); the 256-thread
      kernel for chunks up to ``CHUNK_256_MAX`` keys, else the 512-thread one; as many rows in flight as the
      co-resident grid holds (a slot's rows run one after another).

    ``ValueError`` (``plan_reason``) where none fits."""
    reason = plan_reason(rows, columns, block_topk, platform)
    if reason:
        raise ValueError(reason)
    if columns <= block_topk:
        return trivial_plan(rows, platform)
    least = -(-columns // max_cap(platform))
    wanted = min(MAX_SPLIT, max(1, -(-columns // MIN_CHUNK)), max(1, 2 * platform.multiprocessors // max(rows, 1)))
    for split in range(max(least, wanted), least - 1, -1):
        try:
            return split_plan(split, rows, columns, platform)
        except ValueError:
            continue
    return split_plan(least, rows, columns, platform)  # plan_reason found it fits: this raises nothing


def launch_arguments(plan: Plan, rows: int, columns: int, row_stride: int, block_topk: int, vectorised: bool,
                     expansion: Expansion | None = None) -> NativeLaunch:
    """The launch of ``plan`` over ``rows`` rows of ``columns`` fp32 logits ``row_stride`` elements apart (last dim
    contiguous), writing int32 ``[rows, block_topk]`` (rows ``block_topk`` apart), and with ``expansion`` each row's
    token indices too. ``vectorised``: every row starts 16-byte aligned (float4 loads)."""
    if rows < 1 or rows >= INT_LIMIT:
        raise ValueError(f"rows must be in [1, 2**31); got {rows}")
    if row_stride >= INT_LIMIT or columns >= INT_LIMIT or block_topk > MAX_BLOCK_TOPK:
        raise ValueError(f"the row stride and columns must be below 2**31 and block_topk at most {MAX_BLOCK_TOPK} "
                         f"(got {row_stride}, {columns}, {block_topk})")
    if columns > block_topk and plan.cap * plan.split < columns:
        raise ValueError(f"the plan holds {plan.cap} keys a CTA over {plan.split} CTAs: fewer than {columns} columns")
    extra = NO_EXPANSION if expansion is None else expansion.scalars()
    if any(value >= INT_LIMIT for value in extra.values()):
        raise ValueError(f"the expansion's scalars must be below 2**31 (got {extra})")
    values = {"rows": rows, "columns": columns, "ld": row_stride, "K": block_topk, "split": plan.split,
              "slots": plan.slots, "cap": plan.cap, "vec_ok": int(vectorised), **extra}
    return NativeLaunch(plan.variant.name, (plan.grid, 1, 1), (plan.variant.threads, 1, 1), plan.shared_bytes,
                        POINTERS, tuple((name, "int", values[name]) for name in SCALARS))


class GridTopkSpec(NativeKernelSpec):
    """The grid select, declared once: its variants, source, parameters (``PARAMS``), reasons and plans. A problem
    is anything with ``rows``, ``columns`` and ``block_topk`` (the runtime's ``TopkProblem``)."""

    name = "grid_topk"
    family = "selection"
    description = ("grid select (radix select across the CTAs of one cooperative grid, a row split over up to "
                   f"{MAX_SPLIT} CTAs; compiled at run time by NVRTC; the expansion fused)")
    source_path = SOURCE_PATH
    variants = VARIANTS

    def params_of(self, variant: Variant) -> tuple[Param, ...]:
        return variant.params

    def source(self) -> str:
        return _spliced_source()

    def variants_for(self, platform: Platform) -> tuple[Variant, ...]:
        return variants_for(platform)

    def reasons(self, problem, platform: Platform) -> list[str]:
        """The platform's (an NVIDIA GPU of compute capability ``MIN_CAPABILITY``+: no cooperative launch is wired
        for ROCm yet) and the shape's (``plan_reason``)."""
        if platform.backend == "hip":
            return ["no cooperative launch on ROCm yet (the source's cross-CTA primitives have HIP forms in "
                    "native_compat.h; the launcher and the reasons are NVIDIA's)"]
        if platform.backend != "cuda" or platform.capability < MIN_CAPABILITY:
            return [f"needs an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (the "
                    f"device is {platform.arch})"]
        shape = plan_reason(problem.rows, problem.columns, problem.block_topk, platform)
        return [shape] if shape else []

    def plan(self, problem, platform: Platform) -> Plan:
        return choose_plan(problem.rows, problem.columns, problem.block_topk, platform)

    def describe_plan(self, problem, platform: Platform) -> str:
        reasons = self.reasons(problem, platform)
        return f"none ({'; '.join(reasons)})" if reasons else self.plan(problem, platform).describe()


SPEC = GridTopkSpec()

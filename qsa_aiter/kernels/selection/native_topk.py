"""The native block top-k (``native_topk.cu`` beside this file): what its kernels serve and how they are launched,
declared once (``SPEC``, a ``native_spec.NativeKernelSpec``), in pure Python (no compiler, no driver:
``runtime/jit`` compiles, caches, loads and launches, ``runtime/native_topk.py`` launches it and
``runtime/registries.py`` makes it the ``native`` top-k candidate).

The kernels (CUDA C++, compiled at run time by NVRTC on NVIDIA and by hipRTC on AMD, or ahead of time by clang) compute what the Triton top-k computes: per row the
``block_topk`` best columns of ``[0, clamp(visible, 0, columns))`` by ``(-score, column)``, in ascending column order,
then ``-1``; a row with ``visible <= block_topk`` takes ``0 .. visible-1`` without reading a score. The method (a
radix select with shared-memory histograms, one CTA per row or one thread-block cluster per row) is described at the
top of the ``.cu`` file.

- ``VARIANTS``: the kernels, each one program (``-DTOPK_SINGLE -DTOPK_KERNEL_<name>``, and the target's warp width)
  and one JIT-cache entry per arch; the cluster kernels exist from compute capability 9.0, the row kernels on
  gfx942 / gfx950 too (``variants_for``).
- ``ROW_PARAMS`` / ``CLUSTER_PARAMS``: the kernels' parameters, the one declaration of them.
- ``choose_plan(rows, columns, block_topk, platform)``: which kernel, and how its shared memory is laid out
  (``Plan``), from the platform's multiprocessors, compute capability and shared-memory limits: the plan where the
  tuned top-k table has no measured one (``runtime/native_topk.py``).
- ``PLAN_NAMES`` / ``plan_named`` / ``plans_for``: the plans by name (the tuned table's ``plan`` column), and those
  that serve a shape on a platform.
- ``launch_arguments(plan, ..., expansion)``: the launch (``NativeLaunch``): kernel name, grid, block, dynamic shared
  bytes and the kernel's arguments by name with their C types, in the kernel's parameter order; with an
  ``Expansion`` the launch also writes each row's token indices (the expansion fused as in the Triton top-k).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..native_spec import AMD_ARCHS, NativeKernelSpec, Param, params
from ..platform import Platform

#: The CUDA source of the kernels.
SOURCE_PATH = Path(__file__).with_name("native_topk.cu")
#: The vendor facts it includes (``#include "native_compat.h"``), spliced into ``source()``'s text.
COMPAT_PATH = Path(__file__).with_name("native_compat.h")

#: Fixed part of a row kernel's shared memory: H[2048] | scan[128] | res[8] | mbarriers[16 x u64] (``ROW_FIXED_WORDS``
#: in the source).
ROW_FIXED_BYTES = 2216 * 4
#: Fixed part of a cluster kernel's shared memory: H | S0 | S1 (2048 each) | S2[1024] | scan[128] | res[8] | base[8] |
#: mbarriers[16 x u64] (``CL_FIXED_WORDS``).
CLUSTER_FIXED_BYTES = 7344 * 4
#: Keys the uncached row kernel can compact into shared memory (its threshold bin's keys; a multiple of 4).
UNCACHED_BUFFER = 16384
#: Fast-path candidate list (u16 columns): this many entries, fewer where that keeps a CTA at two per multiprocessor,
#: never fewer than ``MIN_CANDIDATES`` (a threshold bin holding more takes the full-scan path, exact but slower).
MAX_CANDIDATES, MIN_CANDIDATES = 4096, 1024
#: Columns a cached row or cluster chunk may hold: candidate columns are u16 and the tie bitmap reuses the 2048-word
#: histogram.
MAX_CACHED_COLUMNS = 65536
#: The cluster path: rows at least this wide, few enough that one CTA per row would leave half the multiprocessors
#: idle (``2 * rows <= multiprocessors``).
CLUSTER_MIN_COLUMNS = 8192
#: Cluster sizes ``choose_plan`` considers, largest first. Cluster 16 (a non-portable size) is a variant a caller may
#: name in a plan (``cluster_plan(16, ...)``), but no automatic choice: it was no faster than 8 for one row and slower
#: for several.
CLUSTER_SIZES = (8, 4, 2)
#: Row kernels: 256 threads (4 CTAs per SM) for rows up to this many columns, 512 (2 per SM) above.
ROWS_256_MAX_COLUMNS = 12288
#: Shared memory a CTA may use and still fit twice on a multiprocessor: half of it less 2 KB (the 1 KB the hardware
#: reserves per block and 1 KB of margin): 112 KB on an H200, the limit its plans were verified with.
TWO_PER_SM_MARGIN = 2 * 1024
#: Bins of the scorer's per-row histogram the kernels start from: the top 11 bits of the order-preserving key
#: (``kernels/scoring/histogram.py``).
HISTOGRAM_BINS = 2048
#: Every launch argument after the three pointers is a C ``int``: the kernels compute row offsets in 64 bits, but
#: columns, the row stride and block_topk must be below 2**31.
INT_LIMIT = 2**31

#: The kernels' parameters, in order: the one declaration of them (the source's ``TOPK_ROW_PARAMS`` /
#: ``TOPK_CL_PARAMS`` macros are tested against it). The pointers with their C types, then the scalars (C ``int``).
#: Pointers 4-7 and the last five scalars are the fused expansion's (``tokens`` null: none); ``histogram`` is the
#: scorer's per-row histogram (``HISTOGRAM_BINS`` int32 per row; null: none).
_POINTER_PARAMS = (("logits", "const float*"), ("visible", "const int*"), ("out", "int*"),
                   ("positions", "const void*"), ("contexts", "const void*"), ("requests", "const void*"),
                   ("tokens", "int*"), ("histogram", "const unsigned*"))
EXPANSION_SCALARS = ("num_requests", "ratio", "width", "tok_ld", "idx_wide")
ROW_PARAMS = params(*_POINTER_PARAMS, *((name, "int") for name in (
    "rows", "columns", "ld", "K", "buf_cap", "cached", "vec_ok", "cand_cap", *EXPANSION_SCALARS)))
CLUSTER_PARAMS = params(*_POINTER_PARAMS, *((name, "int") for name in (
    "rows", "columns", "ld", "K", "vec_ok", "cap", "cand_cap", *EXPANSION_SCALARS)))
#: Derived from the parameter lists: the pointers (the same for every kernel) and each kind's scalar names.
POINTERS = tuple((p.name, p.ctype) for p in ROW_PARAMS if p.pointer)
ROW_SCALARS = tuple(p.name for p in ROW_PARAMS if not p.pointer)
CLUSTER_SCALARS = tuple(p.name for p in CLUSTER_PARAMS if not p.pointer)


def source() -> str:
    """The kernels' source (``NativeTopkSpec.source``: ``native_compat.h`` spliced in)."""
    return SPEC.source()


@lru_cache(maxsize=1)
def _spliced_source() -> str:
    """The kernels' source with ``native_compat.h`` spliced in where it is included (read once per process): NVRTC
    and hipRTC compile one text with no include path, and its hash (the JIT key's) covers both files."""
    text, include = SOURCE_PATH.read_text(), '#include "native_compat.h"\n'
    at = text.index(include)
    line = text.count("\n", 0, at) + 2  # the source's line after the include
    return (f'{text[:at]}#line 1 "native_compat.h"\n{COMPAT_PATH.read_text()}#line {line} "native_topk.cu"\n'
            f"{text[at + len(include):]}")


@dataclass(frozen=True)
class Variant:
    """One kernel of the source: its ``extern "C"`` name, threads per CTA, CTAs per cluster (1: one CTA per row) and
    the CTAs per multiprocessor its ``__launch_bounds__`` promise (which caps its registers)."""

    name: str
    threads: int
    cluster: int
    blocks_per_multiprocessor: int

    @property
    def defines(self) -> tuple[str, ...]:
        """The ``-D`` macros of its NVRTC program: build this kernel only."""
        return ("TOPK_SINGLE", f"TOPK_KERNEL_{self.name}")

    @property
    def params(self) -> tuple[Param, ...]:
        """Its parameters (``ROW_PARAMS`` or ``CLUSTER_PARAMS``)."""
        return CLUSTER_PARAMS if self.cluster > 1 else ROW_PARAMS

    @property
    def min_capability(self) -> tuple[int, int]:
        """The compute capability it needs: thread-block clusters and bulk copies exist from sm_90."""
        return (9, 0) if self.cluster > 1 else (8, 0)

    @property
    def non_portable_cluster(self) -> bool:
        """Clusters of more than 8 CTAs need ``CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED``."""
        return self.cluster > 8

    @property
    def max_registers(self) -> int:
        """Registers per thread its launch bounds allow (a 64K-register file shared by the promised CTAs)."""
        return 65536 // (self.threads * self.blocks_per_multiprocessor)


VARIANTS = (
    Variant("topk_rows_256", 256, 1, 4),
    Variant("topk_rows_512", 512, 1, 2),
    Variant("topk_cluster2_512", 512, 2, 2),
    Variant("topk_cluster4_512", 512, 4, 2),
    Variant("topk_cluster8_512", 512, 8, 2),
    Variant("topk_cluster16_512", 512, 16, 2),
)
BY_NAME = {variant.name: variant for variant in VARIANTS}


#: Why no cluster kernel is planned on AMD: the source compiles thread-block clusters (distributed shared memory,
#: cluster barriers, bulk copies) out under HIP; a row is one workgroup there.
CLUSTERS_ON_ROCM = "clusters compiled out on ROCm (one workgroup per row)"


def variants_for(platform: Platform) -> tuple[Variant, ...]:
    """The variants that exist for ``platform``: on NVIDIA those its compute capability has (clusters from 9.0); on
    gfx942 / gfx950 the row kernels (``CLUSTERS_ON_ROCM``); none elsewhere."""
    if platform.backend == "cuda":
        return tuple(v for v in VARIANTS if platform.capability >= v.min_capability)
    if platform.backend == "hip" and platform.arch in AMD_ARCHS:
        return tuple(v for v in VARIANTS if v.cluster == 1)
    return ()


def has_clusters(platform: Platform) -> bool:
    """Whether the cluster kernels exist on ``platform`` (NVIDIA compute capability 9.0+)."""
    return platform.backend == "cuda" and platform.capability >= (9, 0)


def _round4(count: int) -> int:
    return (count + 3) // 4 * 4


def _bitmap_words(columns: int) -> int:
    """Words of the column bitmap SB of a cached row or chunk (``nwcap`` in the source)."""
    return _round4(-(-columns // 32))


def two_per_multiprocessor_bytes(platform: Platform) -> int:
    """The most shared memory a CTA may use and still fit twice on one of ``platform``'s multiprocessors."""
    return platform.shared_memory_per_multiprocessor // 2 - TWO_PER_SM_MARGIN


def _candidates(fixed_bytes: int, cached_columns: int, platform: Platform) -> int:
    """Fast-path candidate-list entries (a multiple of 8): ``MAX_CANDIDATES`` unless that pushes a CTA that would
    otherwise fit twice per multiprocessor over the limit; then as many as keep it there, at least
    ``MIN_CANDIDATES``."""
    base = fixed_bytes + 4 * (_bitmap_words(cached_columns) + cached_columns)
    limit = two_per_multiprocessor_bytes(platform)
    if base + 2 * MAX_CANDIDATES <= limit or base + 2 * MIN_CANDIDATES > limit:
        return MAX_CANDIDATES
    return max(MIN_CANDIDATES, (limit - base) // 2 // 8 * 8)


@dataclass(frozen=True)
class Plan:
    """How one launch runs: ``variant``; ``cached``: the row (or chunk) is kept in shared memory as keys;
    ``buffer``: the keys one CTA caches (a row, or a cluster's chunk), or the uncached kernel's compaction buffer;
    ``candidates``: the fast-path candidate list (0: none)."""

    variant: Variant
    cached: bool
    buffer: int
    candidates: int

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of one CTA (the layouts of the source's header)."""
        if self.variant.cluster > 1:
            return CLUSTER_FIXED_BYTES + 4 * (_bitmap_words(self.buffer) + self.candidates // 2 + self.buffer)
        bitmap = _bitmap_words(self.buffer) if self.cached else 0
        return ROW_FIXED_BYTES + 4 * (bitmap + self.candidates // 2 + self.buffer)

    def describe(self) -> str:
        mode = "cached" if self.cached else f"uncached, {self.buffer}-key buffer"
        return (f"{self.variant.name} ({mode}, {self.candidates} candidates, {self.shared_bytes} B shared memory "
                "per CTA)")


def rows_plan(threads: int, columns: int, platform: Platform, cached: bool = True,
              buffer: int | None = None) -> Plan:
    """The one-CTA-per-row plan of ``threads`` (256 or 512) for rows of ``columns``: cached (the whole row in shared
    memory, ``buffer`` keys, default the row rounded up to 4) or uncached (``buffer``: the compaction buffer, default
    ``UNCACHED_BUFFER`` keys or as many as fit)."""
    variant = BY_NAME[f"topk_rows_{threads}"]
    if cached:
        cap = _round4(columns) if buffer is None else buffer
        return Plan(variant, True, cap, _candidates(ROW_FIXED_BYTES, cap, platform))
    if buffer is None:  # UNCACHED_BUFFER keys, fewer where the platform's shared memory is smaller (any size works)
        buffer = min(UNCACHED_BUFFER, max(0, (platform.shared_memory_per_block - ROW_FIXED_BYTES) // 16 * 4))
    return Plan(variant, False, buffer, 0)


def cluster_plan(cluster: int, columns: int, platform: Platform) -> Plan:
    """The plan of one ``cluster``-CTA cluster per row (2, 4, 8 or 16): each CTA caches ``ceil(columns / cluster)``
    keys (rounded up to 4)."""
    cap = _round4(-(-columns // cluster))
    return Plan(BY_NAME[f"topk_cluster{cluster}_512"], True, cap, _candidates(CLUSTER_FIXED_BYTES, cap, platform))


def trivial_plan() -> Plan:
    """The plan when every row has at most ``block_topk`` columns: each row writes ``0 .. visible-1`` and ``-1``
    (no score read, no buffers)."""
    return Plan(BY_NAME["topk_rows_256"], False, 0, 0)


def _fits(plan: Plan, platform: Platform) -> bool:
    return plan.shared_bytes <= platform.shared_memory_per_block and (
        not plan.cached or plan.buffer <= MAX_CACHED_COLUMNS)


@lru_cache(maxsize=512)  # a launch asks for it every call; it depends on these arguments only
def choose_plan(rows: int, columns: int, block_topk: int, platform: Platform,
                cluster_sizes: tuple[int, ...] = CLUSTER_SIZES) -> Plan:
    """The launch plan for ``rows`` rows of ``columns`` fp32 logits, ``block_topk`` kept per row, on ``platform``.

    - ``columns <= block_topk``: the trivial plan (no row reads a score).
    - **Cluster** (compute capability 9.0+, ``2 * rows <= multiprocessors``, ``columns >= CLUSTER_MIN_COLUMNS``): one
      row per cluster, the largest size of ``cluster_sizes`` whose CTA fits the per-block shared-memory limit and whose
      grid (``rows * size`` CTAs) fits in one wave (two CTAs per multiprocessor where the CTA fits twice, else one).
    - **Rows** otherwise: one CTA per row, 256 threads up to ``ROWS_256_MAX_COLUMNS`` columns, else 512; the row cached
      in shared memory where it fits (the per-block limit, and ``MAX_CACHED_COLUMNS``), else the uncached 512-thread
      kernel (later passes re-read the row, mostly from L2).

    Raises ``ValueError`` where not even the uncached kernel fits the platform's shared memory (``plan_reason``)."""
    reason = plan_reason(columns, block_topk, platform)
    if reason:
        raise ValueError(reason)
    if columns <= block_topk:
        return trivial_plan()
    if (has_clusters(platform) and 2 * rows <= platform.multiprocessors
            and columns >= CLUSTER_MIN_COLUMNS):
        for size in cluster_sizes:
            plan = cluster_plan(size, columns, platform)
            if not _fits(plan, platform):
                continue
            per_multiprocessor = 2 if plan.shared_bytes <= two_per_multiprocessor_bytes(platform) else 1
            if rows * size <= platform.multiprocessors * per_multiprocessor:
                return plan
    plan = rows_plan(256 if columns <= ROWS_256_MAX_COLUMNS else 512, columns, platform)
    if _fits(plan, platform):
        return plan
    return rows_plan(512, columns, platform, cached=False)


#: The plan names of ``plan_named`` and ``plans_for`` (the tuned top-k table's ``plan`` column): each row kernel
#: cached (``rows_<threads>``), the 512-thread one uncached, and one cluster per size of ``CLUSTER_SIZES``
#: (``cluster<size>``), from the variants.
PLAN_NAMES = (*(f"rows_{v.threads}" for v in VARIANTS if v.cluster == 1), "rows_512_uncached",
              *(f"cluster{size}" for size in sorted(CLUSTER_SIZES)))


def plan_named(name: str, columns: int, platform: Platform) -> Plan:
    """The plan called ``name`` (one of ``PLAN_NAMES``) for rows of ``columns`` on ``platform``, whether or not it
    fits there (``plans_for`` keeps those that do)."""
    if name not in PLAN_NAMES:
        raise ValueError(f"plan must be one of {', '.join(PLAN_NAMES)}; got {name!r}")
    if name.startswith("cluster"):
        return cluster_plan(int(name.removeprefix("cluster")), columns, platform)
    return rows_plan(int(name.split("_")[1]), columns, platform, cached=not name.endswith("_uncached"))


def plans_for(rows: int, columns: int, block_topk: int, platform: Platform) -> dict[str, Plan]:
    """Every plan that can serve ``rows`` rows of ``columns`` keeping ``block_topk`` on ``platform``, by name (for
    the tuner, benchmarks and fuzzing, which time or draw them beside ``choose_plan``'s, and for a tuned row's plan,
    which must be one of them): ``PLAN_NAMES``, both row kernels cached, the 512-thread one uncached, and clusters of
    2, 4 and 8 (compute capability 9.0+), those that fit; the trivial plan alone where no row is wider than
    ``block_topk``."""
    if columns <= block_topk:
        return {"trivial": choose_plan(rows, columns, block_topk, platform)}
    names = [name for name in PLAN_NAMES if has_clusters(platform) or not name.startswith("cluster")]
    plans = {name: plan_named(name, columns, platform) for name in names}
    return {name: plan for name, plan in plans.items() if _fits(plan, platform)}


def plan_reason(columns: int, block_topk: int, platform: Platform) -> str | None:
    """Why no plan serves rows of ``columns`` keeping ``block_topk`` on ``platform`` (None: one does): the C ``int``
    arguments, and the fixed shared memory of a row kernel (the smallest plan: uncached, no buffer)."""
    if columns >= INT_LIMIT or block_topk >= INT_LIMIT:
        return f"needs columns and block_topk below 2**31 (got {columns} and {block_topk})"
    need = ROW_FIXED_BYTES
    if platform.shared_memory_per_block < need:
        return (f"needs {need} bytes of shared memory per block ({platform.arch} allows "
                f"{platform.shared_memory_per_block})")
    return None


@dataclass(frozen=True)
class NativeLaunch:
    """One launch of a native kernel: ``kernel`` (its ``extern "C"`` name), ``grid`` and ``block`` (x, y, z),
    ``shared_bytes`` of dynamic shared memory, and its arguments in the kernel's parameter order: ``pointers``
    (``(name, C type)``, the caller passes the addresses) then ``scalars`` (``(name, C type, value)``)."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    pointers: tuple[tuple[str, str], ...]
    scalars: tuple[tuple[str, str, int], ...]
    cluster: int = 1  # CTAs a thread-block cluster given at launch (1: none, or the kernel's own __cluster_dims__)

    def scalar(self, name: str) -> int:
        """The value of scalar argument ``name``."""
        return next(value for arg, _, value in self.scalars if arg == name)


@dataclass(frozen=True)
class Expansion:
    """The fused expansion of a launch: ``num_requests`` requests, ``ratio`` tokens per group, ``width`` token slots
    per row (``token_topk + ratio - 1``), token rows ``row_stride`` apart, and which of the positions, context
    lengths and request ids are int64 (the others int32)."""

    num_requests: int
    ratio: int
    width: int
    row_stride: int
    wide_positions: bool = False
    wide_contexts: bool = False
    wide_requests: bool = False

    def scalars(self) -> dict[str, int]:
        wide = int(self.wide_positions) | int(self.wide_contexts) << 1 | int(self.wide_requests) << 2
        return {"num_requests": self.num_requests, "ratio": self.ratio, "width": self.width,
                "tok_ld": self.row_stride, "idx_wide": wide}


#: The expansion scalars of a launch without one (its ``tokens`` pointer is null; nothing reads them).
NO_EXPANSION = {name: 0 for name in EXPANSION_SCALARS}


def launch_arguments(plan: Plan, rows: int, columns: int, row_stride: int, block_topk: int,
                     vectorised: bool, expansion: Expansion | None = None) -> NativeLaunch:
    """The launch of ``plan`` over ``rows`` rows of ``columns`` fp32 logits ``row_stride`` elements apart (last dim
    contiguous), writing int32 ``[rows, block_topk]`` (rows ``block_topk`` apart), and with ``expansion`` each row's
    token indices too. ``vectorised``: the logits' base is 16-byte aligned and every row starts 16-byte aligned
    (``row_stride % 4 == 0``, or one row): float4 loads and bulk copies. One CTA per row, or ``cluster`` CTAs per
    row."""
    if rows < 1 or rows * plan.variant.cluster >= INT_LIMIT:
        raise ValueError(f"rows must be in [1, 2**31 / CTAs per row); got {rows}")
    if row_stride >= INT_LIMIT or columns >= INT_LIMIT or block_topk >= INT_LIMIT:
        raise ValueError(f"the row stride, columns and block_topk must be below 2**31 (got {row_stride}, {columns}, "
                         f"{block_topk})")
    extra = NO_EXPANSION if expansion is None else expansion.scalars()
    if any(value >= INT_LIMIT for value in extra.values()):
        raise ValueError(f"the expansion's scalars must be below 2**31 (got {extra})")
    variant = plan.variant
    common = {"rows": rows, "columns": columns, "ld": row_stride, "K": block_topk, "vec_ok": int(vectorised),
              "cand_cap": plan.candidates, **extra}
    if variant.cluster > 1:
        values = {**common, "cap": plan.buffer}
        names = CLUSTER_SCALARS
    else:
        values = {**common, "buf_cap": plan.buffer, "cached": int(plan.cached)}
        names = ROW_SCALARS
    return NativeLaunch(variant.name, (rows * variant.cluster, 1, 1), (variant.threads, 1, 1), plan.shared_bytes,
                        POINTERS, tuple((name, "int", values[name]) for name in names))


#: The NVIDIA compute capability the kernels need (sm_80's shared-memory opt-in; the cluster kernels need sm_90 and
#: are only planned there).
MIN_CAPABILITY = (8, 0)


class NativeTopkSpec(NativeKernelSpec):
    """The native block top-k, declared once: its variants, source, parameters (``ROW_PARAMS`` /
    ``CLUSTER_PARAMS``), targets (``native_spec.target_of``), reasons and plans. A problem is anything with ``rows``,
    ``columns`` and ``block_topk`` (the runtime's ``TopkProblem``)."""

    name = "native_topk"
    family = "selection"
    description = ("native top-k (radix select compiled at run time: NVRTC on NVIDIA, hipRTC on AMD; one CTA or one "
                   "cluster per row; the expansion fused)")
    source_path = SOURCE_PATH
    variants = VARIANTS

    def params_of(self, variant: Variant) -> tuple[Param, ...]:
        return variant.params

    def source(self) -> str:
        return _spliced_source()

    def variants_for(self, platform: Platform) -> tuple[Variant, ...]:
        return variants_for(platform)

    def reasons(self, problem, platform: Platform) -> list[str]:
        """The platform's (an NVIDIA GPU of compute capability ``MIN_CAPABILITY``+, or gfx942 / gfx950) and the
        shape's (``plan_reason``)."""
        if platform.backend == "cuda" and platform.capability < MIN_CAPABILITY:
            return [f"needs an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (the "
                    f"device is {platform.arch})"]
        if not variants_for(platform):
            return [f"needs an NVIDIA GPU (sm_80+) or an AMD {' or '.join(AMD_ARCHS)} (the device is {platform.arch})"]
        shape = plan_reason(problem.columns, problem.block_topk, platform)
        return [shape] if shape else []

    def plan(self, problem, platform: Platform) -> Plan:
        return choose_plan(problem.rows, problem.columns, problem.block_topk, platform)

    def describe_plan(self, problem, platform: Platform) -> str:
        """The plan ``explain`` prints: the kernel and its layout, and on AMD why no cluster is planned (``none``, with
        the reasons, where the platform has no plan)."""
        reasons = self.reasons(problem, platform)
        if reasons:
            return f"none ({'; '.join(reasons)})"
        text = self.plan(problem, platform).describe()
        return f"{text}; {CLUSTERS_ON_ROCM}" if platform.backend == "hip" else text


SPEC = NativeTopkSpec()

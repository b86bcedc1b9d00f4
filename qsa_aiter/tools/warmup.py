"""Warm-up: compile every kernel variant the model's serving path launches into the JIT cache.

``python -m qsa_aiter warmup`` (or ``warmup()``) builds the variant matrix: the model's shapes (``work_points``) x
every kernel of ``catalog.SPECS`` x index-cache formats x page sizes x index-tensor dtypes. Each kernel's spec names its
problems (``KernelSpec.warm_problems``: for the scorers, each phase's work points and the buckets of their tuned
rows), and each variant is that problem's ``LaunchPlan`` as a launch makes it (``registry.plan_for``; tuned rows
apply to the kernels the tuner measures) on the spec's small example inputs (row strides that are multiples of 16;
one request count of each kind Triton specialises on). Then:

- on the present GPU, each launch runs once on a one-program grid inside the cache's scope: Triton
  compiles (or loads) it through its launch path, which records it, and builds its launcher stub;
- for a named arch (``sm_90``, ``gfx942``, ``gfx950``; no GPU needed), each is specialised with Triton's own binder
  for that target, so its key is the one a launch there computes, and compiled with ``triton.compile``. The small
  C launcher stubs Triton builds per argument signature are not made: the GPU machine builds them at first launch
  (into the same directory).

The native kernels (``catalog.NATIVE_SPECS``: the native top-k's variants, ``kernels/selection/native_topk.py``) are
compiled into the cache's ``native/<arch>/`` directory: for the present GPU by its run-time compiler (NVRTC, or hipRTC
on ROCm) and loaded on it; for ``sm_90`` named without its GPU by NVRTC, and for ``gfx942`` / ``gfx950`` by clang
(``runtime/jit/hip_clang.py``: the HIP headers and device bitcode it needs are named where they are missing), compiled
only: a ROCm server with the same source loads those entries without compiling.

Several processes may warm one directory at once: each variant is compiled by one of them (a busy variant is put
back to the end of the queue, then waited for).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..kernels import catalog
from ..kernels.quant.formats import CACHE_FORMATS, canonical_format
from ..runtime import dispatch, registries
from ..kernels.platform import Platform, interpreting
from ..kernels.scoring.problem import PHASES
from ..kernels.scoring.base import ScorerSpec, example_problem, work_problem
from ..kernels.native_spec import NativeKernelSpec, target_of
from ..kernels.selection.problem import SelectionProblem
from ..runtime.settings import QsaSettings, get_settings
from ..runtime import tuned
from .aot import TARGETS, writer_kind
from .build import Specialisation, build_for_target, specialise
from ..runtime.jit.paths import jit_root
from ..runtime.jit.launching import store_for
from ..runtime.jit.store import Store, VariantBusy
from ..runtime.jit.triton_compat import driver
from ..runtime.jit import cuda_driver, hip_clang, hip_driver, hiprtc, native, nvrtc
from ..runtime.jit.native_store import native_store
from .work_points import COMPRESS_RATIO, HEAD_DIM, HEADS, TOKEN_TOPK, rows_per_request, warm_points

#: Index-cache formats (docs/cache_formats.md): each scorer and the writer are built for each. q is bf16 except with
#: an fp16 cache (a 16-bit cache has q's dtype: ``CacheFormat.query_dtype``).
CACHES = tuple(CACHE_FORMATS)
#: The Triton kernels (``catalog.SPECS``).
KERNELS = tuple(catalog.BY_NAME)
#: The native kernel families (``catalog.NATIVE_SPECS``; every variant of each for the arch).
NATIVE_KERNELS = tuple(spec.name for spec in catalog.NATIVE_SPECS)
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
#: Triton specialises an integer argument by value (1, a multiple of 16, or neither): the selection kernels take the
#: request count, so one count of each kind.
REQUEST_COUNTS = (1, 9, 16)
#: Logits width of the selection kernels' example launches (a multiple of 16, like the engine's).
_LOGITS_WIDTH = 1024
#: Long rows (top-k through column-block maxima): 268288-token contexts, the benchmark's 262K points. The variants
#: built for it serve every width in (65536, 131072] that is a multiple of 4 (the maxima's register length is fixed
#: by the next power of two of the block count).
_LONG_LOGITS_WIDTH = 67072


@dataclass(frozen=True)
class Matrix:
    """The axes of a warm-up; the defaults are everything the model's serving path launches."""

    kernels: tuple[str, ...] = KERNELS + NATIVE_KERNELS
    caches: tuple[str, ...] = CACHES
    page_sizes: tuple[int, ...] = registries.BLOCK_SIZES
    index_dtypes: tuple[str, ...] = tuple(INDEX_DTYPES)  # engines pass either (int64 slot mappings, positions)

    def __post_init__(self):
        if isinstance(self.caches, tuple):  # former spellings of the formats, with a DeprecationWarning each
            names = []
            try:
                for spelling in self.caches:
                    names.append(canonical_format(spelling, stacklevel=3))  # names the line that made the Matrix
            except (ValueError, TypeError):
                pass  # an unknown format: named below
            else:
                object.__setattr__(self, "caches", tuple(names))
        for name, allowed in (("kernels", KERNELS + NATIVE_KERNELS), ("caches", CACHES),
                              ("index_dtypes", tuple(INDEX_DTYPES))):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not values or any(v not in allowed for v in values):
                raise ValueError(f"{name} must be a non-empty tuple of {', '.join(allowed)}; got {values!r}")
        pages = self.page_sizes
        if not isinstance(pages, tuple) or not pages or any(isinstance(p, bool) or not isinstance(p, int) or p < 1
                                                            for p in pages):
            raise ValueError(f"page_sizes must be a non-empty tuple of positive ints; got {pages!r}")


@dataclass
class Launch:
    """One launch of a plan: ``fn[grid](*args, **kwargs)``; ``label`` says which variant."""

    kernel: str
    fn: object
    grid: tuple
    args: tuple
    kwargs: dict
    label: str


@dataclass
class WarmupReport:
    """What a warm-up did: variants (by entry id) compiled here, found already built, or failed (with the error);
    ``notes``: what was not built and why (native kernels on AMD targets, or without NVRTC); ``skipped``: the
    kernels of the matrix that were not built at all for that reason."""

    arch: str
    directory: str
    compiled: dict[str, float] = field(default_factory=dict)  # entry id -> compile seconds
    found: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # label -> error
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        total = len(self.compiled) + len(self.found) + len(self.failed)
        line = (f"warm-up {self.arch}: {total} variants, {len(self.compiled)} compiled "
                f"({sum(self.compiled.values()):.1f} s), {len(self.found)} already cached, {len(self.failed)} failed; "
                f"{self.seconds:.1f} s; {self.directory}")
        return "\n".join([line] + [f"  failed {label}: {error}" for label, error in self.failed.items()]
                         + [f"  {note}" for note in self.notes])


@dataclass
class WarmContext:
    """What the kernels' specs make their warm-up problems from (``KernelSpec.warm_problems``)."""

    matrix: Matrix
    platform: Platform
    settings: QsaSettings
    head_dim: int = HEAD_DIM
    request_counts: tuple[int, ...] = REQUEST_COUNTS

    def scorer_problems(self, spec: ScorerSpec):
        """The warmed work points (``work_points.warm_points``) of every phase whose registry order lists ``spec``,
        plus the bucket of every tuned row for it on this arch, for every cache and page size; those the registry
        would not run it for are left out."""
        candidate = registries.SCORING.candidates[spec.name]
        table = tuned.load_tables(tuple(self.settings.tuned_config))
        for cache_name in self.matrix.caches:
            fmt = CACHE_FORMATS[cache_name]
            kv = fmt.kind
            for page in self.matrix.page_sizes:
                base = example_problem(q_dtype=fmt.query_dtype, kv_dtype=kv, cache_dtype=fmt.dtype, block_size=page,
                                       num_heads=HEADS, head_dim=HEAD_DIM, compress_ratio=COMPRESS_RATIO,
                                       e4m3_mma=self.settings.e4m3_mma)
                phases = [p for p in PHASES
                          if spec.name in registries.SCORING_TABLE.get((kv, page, p), registries.SCORING_FALLBACK_ORDER)]
                points = [(phase, (point.requests, point.rows_per_request, point.longest_context))
                          for phase in phases for point in warm_points(phase)]
                for row in table.get((self.platform.arch, spec.name, kv, page, HEADS, HEAD_DIM), []):
                    for phase in phases:
                        per_request = rows_per_request(phase) or row.rows
                        points.append((phase, (max(1, row.rows // per_request), per_request, row.context)))
                for phase, (requests, rows, context) in points:
                    work = work_problem(base, requests, rows, context, phase)
                    if not candidate.reasons(work, self.platform, self.settings):
                        yield f"{spec.name} {cache_name} page {page} ({phase} {requests}x{rows})", work

    def selection_problem(self, requests: int, fused: bool, with_maxima: bool = False,
                          rows: int | None = None) -> SelectionProblem:
        """The model's selection budget on ``rows`` (default: ``requests``, one each) rows of ``_LOGITS_WIDTH``
        logits (``_LONG_LOGITS_WIDTH`` ``with_maxima``: the long rows that take the column-block maxima)."""
        ratio, token_topk = COMPRESS_RATIO, TOKEN_TOPK
        width = _LONG_LOGITS_WIDTH if with_maxima else _LOGITS_WIDTH
        return SelectionProblem(requests if rows is None else rows, width, token_topk // ratio, ratio, token_topk,
                                fused, requests, with_maxima)

    def writer_kinds(self):
        """``(cache format, keys dtype, writer kind)`` of the matrix's caches: keys have the queries' dtype."""
        for cache_name in self.matrix.caches:
            yield cache_name, CACHE_FORMATS[cache_name].query_dtype, writer_kind(cache_name)


def launches(matrix: Matrix, arch: str, device: torch.device, settings: QsaSettings | None = None) -> list[Launch]:
    """Every launch of ``matrix`` for ``arch``: each kernel's plans (``registry.plan_for``, as at launch) on small
    inputs built on ``device`` (the GPU of that arch; or the CPU, for the plans a GPU of ``arch`` would make: its
    tuned rows, decoders and tensor-core choices)."""
    settings = settings or get_settings()
    platform = Platform.of(device) if device.type == "cuda" else Platform.named(arch)
    context = WarmContext(matrix, platform, settings)
    result = []
    for index_name in matrix.index_dtypes:
        for spec in catalog.SPECS:
            if spec.name not in matrix.kernels:
                continue
            for label, problem in spec.warm_problems(context):
                plan = dispatch.plan_for(spec, problem, platform, settings)
                args = spec.example_args(problem, INDEX_DTYPES[index_name], device)
                result.append(Launch(spec.name, plan.fn, plan.grid, args, plan.kwargs, f"{label} {index_name}"))
    return result


# ---------------------------------------------------------------------------------------------------------------
# Running a warm-up
# ---------------------------------------------------------------------------------------------------------------


def present_arch() -> str | None:
    """The arch of the current GPU (``sm_90``, ``gfx942`` ...), or None without one."""
    if not torch.cuda.is_available():
        return None
    return Platform.of(torch.device("cuda", torch.cuda.current_device())).arch


def _unique(items: list[Launch], target) -> list[tuple[Specialisation, Launch]]:
    """The launches that are distinct Triton variants on ``target``, with their specialisations."""
    seen, result = set(), []
    for launch in items:
        spec = specialise(launch.fn, target, launch.args, launch.kwargs)
        if spec.entry_id not in seen:
            seen.add(spec.entry_id)
            result.append((spec, launch))
    return result


def warmup(arch: str | None = None, *, root=None, matrix: Matrix | None = None, progress: bool = True,
           settings: QsaSettings | None = None) -> WarmupReport:
    """Compile the variant matrix for ``arch`` (default: the present GPU's) into the JIT cache under ``root``
    (default: ``jit.jit_root()``). ``arch`` the present GPU's: the launches run on it; one of ``aot.TARGETS``
    otherwise: compiled for it without a GPU."""
    from tqdm.auto import tqdm

    settings = settings or get_settings()
    matrix = matrix or Matrix()
    present = present_arch()
    if arch is None:
        if present is None:
            raise ValueError(f"arch: no GPU here; name one of {', '.join(TARGETS)}")
        arch = present
    elif arch != present and arch not in TARGETS:
        raise ValueError(f"arch must be the present GPU's ({present or 'none here'}) or one of {', '.join(TARGETS)}; "
                         f"got {arch!r}")
    triton_kernels = [name for name in matrix.kernels if name in KERNELS]
    if triton_kernels and interpreting():
        raise RuntimeError("warm-up needs a process without TRITON_INTERPRET=1: interpreted kernels are not compiled")
    start = time.perf_counter()
    root = jit_root(settings) if root is None else root
    store = store_for(root, arch, settings.rebuild)
    if not store.writable():
        raise ValueError(f"root: the JIT cache directory {store.dir} is not writable")
    native_dir = native_store(root, arch, settings.rebuild).dir
    report = WarmupReport(arch, str(store.dir if triton_kernels else native_dir))
    on_gpu = arch == present
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    queue = []
    if triton_kernels:
        target = driver.active.get_current_target() if on_gpu else TARGETS[arch]
        queue = _unique(launches(matrix, arch, device, settings), target)
    natives = _native_variants(matrix, arch, device, settings, report)
    bar = tqdm(total=len(queue) + len(natives), desc=f"warm-up {arch}", unit="kernel", disable=not progress)
    deferred = []
    try:
        for spec, launch in queue:
            if not _warm_one(store, spec, launch, on_gpu, wait=False, report=report, bar=bar):
                deferred.append((spec, launch))  # another process is compiling it: come back at the end
        for spec, launch in deferred:
            _warm_one(store, spec, launch, on_gpu, wait=True, report=report, bar=bar)
        _warm_native(natives, root, arch, device if on_gpu else None, settings, report, bar)
    finally:
        bar.close()
    report.seconds = time.perf_counter() - start
    return report


def _native_variants(matrix: Matrix, arch: str, device: torch.device, settings: QsaSettings,
                     report: WarmupReport) -> list[tuple[NativeKernelSpec, object, tuple]]:
    """``(spec, variant, compiler)`` of every native variant to build for ``arch``: those its platform has
    (``NativeKernelSpec.variants_for``), by the compiler a launch there uses (the present GPU: NVRTC or hipRTC) or
    the offline one of a named target (NVRTC for ``sm_XY``; clang for gfx942 / gfx950, ``hip_clang``); none, with a
    note saying why, where the platform has none or no compiler is here."""
    specs = [spec for spec in catalog.NATIVE_SPECS if spec.name in matrix.kernels]
    platform = Platform.of(device) if device.type == "cuda" else Platform.named(arch)
    result = []
    for spec in specs:
        variants = spec.variants_for(platform)
        if not variants:
            report.notes.append(f"{spec.name}: not built for {arch}: it has no kernel for that arch")
            report.skipped.append(spec.name)
            continue
        compiler, reason = None, None
        try:
            if device.type == "cuda":
                compiler = native.runtime_compiler(arch)
            elif target_of(arch).vendor == "cuda":
                compiler = nvrtc.compiler()
            else:
                found = hip_clang.toolchain(settings, arch)
                compiler, reason = (None, found) if isinstance(found, str) else (found, None)
        except (nvrtc.NvrtcUnavailable, hiprtc.HiprtcUnavailable) as err:
            reason = str(err)
        if compiler is None:
            report.notes.append(f"{spec.name}: not built: {reason}")
            report.skipped.append(spec.name)
            continue
        result += [(spec, variant, compiler) for variant in variants]
    return result


def _warm_native(natives: list, root, arch: str, device: torch.device | None, settings: QsaSettings,
                 report: WarmupReport, bar) -> None:
    """Compile (or find) each native variant into ``root``'s ``native/<arch>/``; on ``device`` (the present GPU)
    also load it there. Another process compiling a variant is waited for."""
    store = native_store(root, arch, settings.rebuild)
    for spec, variant, compiler in natives:
        label = f"{spec.name} {variant.name}"
        try:
            built = store.build(spec.source(), variant.name, spec.defines(variant, arch), compiler,
                                built_by="launch" if device is not None else "target")
            if device is not None and compiler.kind == "hiprtc":
                hip_driver.load_code_object(built.binary, variant.name, built.entry_id, device.index)
            elif device is not None:
                cuda_driver.load_cubin(built.binary, variant.name, built.entry_id, device.index,
                                       variant.non_portable_cluster)
            if built.event.compiled:
                report.compiled[built.entry_id] = built.event.seconds
            else:
                report.found.append(built.entry_id)
        except Exception as err:  # a variant that does not build is reported, and the others still are
            report.failed[label] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        bar.update(1)
        bar.set_postfix(compiled=len(report.compiled), cached=len(report.found), refresh=False)


def _warm_one(store: Store, spec, launch: Launch, on_gpu: bool, *, wait: bool, report: WarmupReport,
              bar) -> bool:
    """Compile (or find) one variant; False if it was busy and ``wait`` is off."""
    eid = spec.entry_id
    try:
        if on_gpu:
            if not wait and store.busy(eid):
                return False
            before = len(store.events)
            with store.activate(torch.cuda.current_device()):
                launch.fn[tuple(1 for _ in launch.grid)](*launch.args, **launch.kwargs)  # one program is enough
            torch.cuda.synchronize()
            compiled = [e for e in store.events[before:] if e.compiled]
            if compiled:
                report.compiled[eid] = sum(e.seconds for e in compiled)
            else:
                report.found.append(eid)
        else:
            event = build_for_target(store, spec, wait=wait)
            if event.compiled:
                report.compiled[eid] = event.seconds
            else:
                report.found.append(eid)
    except VariantBusy:
        return False
    except Exception as err:  # a variant that does not build is reported, and the others still are
        report.failed[launch.label] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    bar.update(1)
    bar.set_postfix(compiled=len(report.compiled), cached=len(report.found), refresh=False)
    return True

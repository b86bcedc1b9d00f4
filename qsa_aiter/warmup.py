"""Warm-up: compile every kernel variant the model's serving path launches into the JIT cache.

``python -m qsa_aiter warmup`` (or ``warmup()``) builds the variant matrix, defined here once: the model's shapes
(``MODEL``) x kernels x index-cache dtypes x page sizes x index-tensor dtypes x the tile configs each phase's work
points get (tuned rows or the kernel's defaults, through the kernel module's own launch). Each variant is one launch
exactly as a kernel module's ``launch`` makes it, on small inputs laid out like the public ops' (row strides that
are multiples of 16; one request count of each kind Triton specialises on), with the launch captured rather than
run. Then:

- on the present GPU, each captured launch runs once on a one-program grid inside the cache's scope: Triton
  compiles (or loads) it through its launch path, which records it, and builds its launcher stub;
- for a named arch (``sm_90``, ``gfx942``, ``gfx950``; no GPU needed), each is specialised with Triton's own binder
  for that target, so its key is the one a launch there computes, and compiled with ``triton.compile``. The small
  C launcher stubs Triton builds per argument signature are not made: the GPU machine builds them at first launch
  (into the same directory).

Several processes may warm one directory at once: each variant is compiled by one of them (a busy variant is put
back to the end of the queue, then waited for).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from dataclasses import dataclass, field

import torch

from . import jit_cache, registry, tuned
from .aot import TARGETS, target_capability
from .cache_formats import allocate_index_cache, cache_kind
from .kernels.common import ScoreLaunch, interpreting
from .kernels.dequant import KV_16BIT, fast_decode_at, fp8_dot, fp8_tensor_cores_at, kernel_view, kv_kind
from .ops import describe_call
from .problem import PHASES
from .settings import QsaSettings, get_settings
from .triton_compat import capture_launches, driver

#: The model's shapes (SPEC section 1): 4 index heads, head_dim 128, R 4, token top-k 2048.
MODEL = dict(heads=4, head_dim=128, compress_ratio=4, token_topk=2048)
#: Index-cache dtypes: name -> (q dtype, ``allocate_index_cache`` kind, fp8 dtype). q is bf16 except with an fp16
#: cache (a 16-bit cache has q's dtype).
CACHES = {
    "bf16": (torch.bfloat16, "bf16", None),
    "fp16": (torch.float16, "fp16", None),
    "fp8_e4m3fn": (torch.bfloat16, "fp8", torch.float8_e4m3fn),
    "fp8_e4m3fnuz": (torch.bfloat16, "fp8", torch.float8_e4m3fnuz),
    "fp4": (torch.bfloat16, "fp4", None),
}
SCORERS = ("tiled", "stacked", "rowwise")
KERNELS = SCORERS + ("cache_writer", "topk", "expand")
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
#: Work points (SPEC section 7) per phase: (requests, rows per request, context tokens). Each scorer's tile config is
#: looked up for each, as at launch; tuned rows' own buckets are added.
WORK_POINTS = {
    "verify": ((9, 4, 128 << 10), (16, 4, 32 << 10), (64, 4, 32 << 10), (64, 4, 98 << 10), (4, 4, 262 << 10)),
    "draft": ((64, 1, 32 << 10), (16, 1, 98 << 10), (1, 1, 262 << 10), (128, 1, 200 << 10)),
    "decode": ((64, 1, 32 << 10), (16, 1, 98 << 10), (1, 1, 262 << 10), (128, 1, 200 << 10)),
    "prefill": ((1, 16 << 10, 96 << 10), (1, 32 << 10, 32 << 10)),
}
#: Rows per request of a phase, for a tuned row's bucket.
_ROWS_PER_REQUEST = {"verify": 4, "draft": 1, "decode": 1, "prefill": None}
#: Triton specialises an integer argument by value (1, a multiple of 16, or neither): the selection kernels take the
#: request count, so one count of each kind.
REQUEST_COUNTS = (1, 9, 16)
#: Row stride of the small inputs' page tables and logits: a multiple of 16, like the engine's tables.
_TABLE_WIDTH = 16
_LOGITS_WIDTH = 1024


@dataclass(frozen=True)
class Matrix:
    """The axes of a warm-up; the defaults are everything the model's serving path launches."""

    kernels: tuple[str, ...] = KERNELS
    caches: tuple[str, ...] = tuple(CACHES)
    page_sizes: tuple[int, ...] = registry.BLOCK_SIZES
    index_dtypes: tuple[str, ...] = tuple(INDEX_DTYPES)  # engines pass either (int64 slot mappings, positions)

    def __post_init__(self):
        for name, allowed in (("kernels", KERNELS), ("caches", tuple(CACHES)), ("index_dtypes", tuple(INDEX_DTYPES))):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not values or any(v not in allowed for v in values):
                raise ValueError(f"{name} must be a non-empty tuple of {', '.join(allowed)}; got {values!r}")
        pages = self.page_sizes
        if not isinstance(pages, tuple) or not pages or any(isinstance(p, bool) or not isinstance(p, int) or p < 1
                                                            for p in pages):
            raise ValueError(f"page_sizes must be a non-empty tuple of positive ints; got {pages!r}")


@dataclass
class Launch:
    """One launch as a kernel module makes it: ``fn[grid](*args, **kwargs)``; ``label`` says which variant."""

    kernel: str
    fn: object
    grid: tuple
    args: tuple
    kwargs: dict
    label: str


@dataclass
class WarmupReport:
    """What a warm-up did: variants (by entry id) compiled here, found already built, or failed (with the error)."""

    arch: str
    directory: str
    compiled: dict[str, float] = field(default_factory=dict)  # entry id -> compile seconds
    found: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # label -> error
    seconds: float = 0.0

    def summary(self) -> str:
        total = len(self.compiled) + len(self.found) + len(self.failed)
        line = (f"warm-up {self.arch}: {total} variants, {len(self.compiled)} compiled "
                f"({sum(self.compiled.values()):.1f} s), {len(self.found)} already cached, {len(self.failed)} failed; "
                f"{self.seconds:.1f} s; {self.directory}")
        return "\n".join([line] + [f"  failed {label}: {error}" for label, error in self.failed.items()])


def _module(name: str):
    return importlib.import_module(f"qsa_aiter.kernels.{name}")


# ---------------------------------------------------------------------------------------------------------------
# The launches of the matrix (built on small inputs; each calls a kernel module's launch function)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TargetLaunch(ScoreLaunch):
    """``ScoreLaunch`` whose device-dependent choices are those of a named arch (NVIDIA compute capability, (0, 0)
    for AMD), for building without that GPU: ``dequant.fast_decode`` needs 9.0, e4m3 tensor cores 8.9."""

    capability: tuple[int, int] = (0, 0)
    target_arch: str = ""

    @property
    def arch(self) -> str:
        return self.target_arch

    @property
    def upcast(self) -> bool:
        return False

    @property
    def fast_decode(self) -> bool:
        return kv_kind(self.k_cache.dtype) != KV_16BIT and fast_decode_at(self.capability)

    @property
    def fp8_dot(self) -> bool:
        return fp8_dot(self.q.dtype, self.k_cache.dtype, self.q.shape[2],
                       self.fp8_mma and fp8_tensor_cores_at(self.capability))


def _cache(name: str, pages: int, page_size: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    _, kind, fp8 = CACHES[name]
    extra = {"fp8_dtype": fp8} if fp8 is not None else {}
    return allocate_index_cache(kind, pages, page_size, MODEL["head_dim"], device=device, **extra)


def _scorer_launch(kernel: str, cache_name: str, page_size: int, index_dtype: torch.dtype, phase: str,
                   point: tuple[int, int, int], device, launch_cls, extra: dict, settings: QsaSettings) -> bool:
    """Call scorer ``kernel``'s launch for ``point`` (requests, rows per request, context) of ``phase`` on small
    inputs (its tile config is chosen for the work point, as at launch). False if the registry would not run it."""
    requests, rows, context = point
    q_dtype = CACHES[cache_name][0]
    heads, head_dim, ratio = MODEL["heads"], MODEL["head_dim"], MODEL["compress_ratio"]
    small_requests, small_rows = 2, 2
    cache, k_scale = _cache(cache_name, small_requests * 2 + 1, page_size, device)
    table = torch.full((small_requests, _TABLE_WIDTH), -1, dtype=index_dtype)
    table[:, :2] = torch.arange(small_requests * 2).view(small_requests, 2)
    contexts = torch.full((small_requests,), 2 * page_size * ratio, dtype=index_dtype)
    t2r = torch.arange(small_requests).repeat_interleave(small_rows).to(index_dtype)
    pos = (contexts[t2r.long()] - small_rows + torch.arange(small_rows).repeat(small_requests)).to(index_dtype)
    q = torch.zeros(small_requests * small_rows, heads, head_dim, dtype=q_dtype, device=device)
    table, contexts, t2r, pos = (t.to(device) for t in (table, contexts, t2r, pos))
    scale = {"k_scale": k_scale} if k_scale is not None else {}
    problem = describe_call(q, cache, table, t2r, pos, contexts, ratio, **scale, phase=phase, max_query_len=small_rows)
    width = max(1, math.ceil(context / ratio / page_size))
    work = dataclasses.replace(problem, device_type="cuda", num_tokens=requests * rows, num_requests=requests,
                               table_width=width, num_columns=width * page_size, max_query_len=rows,
                               num_pages=requests * width)
    if registry.CANDIDATES[kernel].reasons(work, settings):
        return False
    logits = torch.empty((q.shape[0], problem.num_columns), dtype=torch.float32, device=device)
    visible = torch.empty((q.shape[0],), dtype=torch.int32, device=device)
    args = launch_cls(q, cache, table, t2r, pos, contexts, logits, visible, problem.num_columns, ratio,
                      1.0 / math.sqrt(head_dim), k_scale, settings.fp8_mma, tuple(settings.tuned_config), **extra)
    _module(kernel).launch(work, args)
    return True


def _writer_launch(cache_name: str, page_size: int, index_dtype: torch.dtype, device) -> None:
    """The cache writer's launch as ``qsa_write_index_cache`` makes it, for new keys of q's dtype."""
    from .kernels import cache_writer

    pages, tokens = 2, 4
    cache, k_scale = _cache(cache_name, pages, page_size, device)
    keys = torch.zeros(tokens, MODEL["head_dim"], dtype=CACHES[cache_name][0], device=device)
    slots = torch.arange(tokens, dtype=index_dtype, device=device)
    name = cache_writer.kind_of(cache, cache_kind(cache))
    cache_writer.launch(keys, slots, kernel_view(cache), kernel_view(k_scale), name, MODEL["head_dim"],
                        pages * page_size)


def _selection_inputs(requests: int, index_dtype: torch.dtype, device):
    ratio, token_topk = MODEL["compress_ratio"], MODEL["token_topk"]
    block_topk = token_topk // ratio
    logits = torch.zeros(requests, _LOGITS_WIDTH, dtype=torch.float32, device=device)
    visible = torch.full((requests,), _LOGITS_WIDTH, dtype=torch.int32, device=device)
    groups = torch.full((requests, block_topk), -1, dtype=torch.int32, device=device)
    contexts = torch.full((requests,), _LOGITS_WIDTH * ratio, dtype=index_dtype, device=device)
    t2r = torch.arange(requests, dtype=index_dtype, device=device)
    pos = (contexts - 1).to(index_dtype)
    out = torch.empty((requests, token_topk + ratio - 1), dtype=torch.int32, device=device)
    return logits, visible, groups, pos, contexts, t2r, out, ratio, token_topk, block_topk


def _topk_launch(requests: int | None, index_dtype: torch.dtype, device) -> None:
    """Block top-k as ``qsa_block_topk`` launches it (``requests`` None), or fused with the expansion as
    ``qsa_select_paged_tokens`` does, for ``requests`` requests."""
    from .kernels import topk

    logits, visible, groups, pos, ctx, t2r, out, ratio, token_topk, block_topk = _selection_inputs(
        requests or 2, index_dtype, device)
    if requests is None:
        topk.launch(logits, visible, groups, block_topk)
    else:
        topk.launch(logits, visible, groups, block_topk, expand_into=(pos, ctx, t2r, out, ratio, token_topk))


def _expand_launch(requests: int, index_dtype: torch.dtype, device) -> None:
    """The expansion as ``qsa_expand_block_indices`` launches it, for ``requests`` requests."""
    from .kernels import expand

    _, _, groups, pos, ctx, t2r, out, ratio, token_topk, _ = _selection_inputs(requests, index_dtype, device)
    expand.launch(groups, pos, ctx, t2r, out, ratio, token_topk)


def _scorer_points(kernel: str, kv: str, page_size: int, arch: str, settings: QsaSettings):
    """(phase, work point) pairs for scorer ``kernel``: SPEC's work points of every phase whose registry row lists
    it, plus the bucket of every tuned row for it on ``arch``."""
    phases = [p for p in PHASES if kernel in registry.TABLE.get((kv, page_size, p), registry.FALLBACK_ORDER)]
    points = [(phase, point) for phase in phases for point in WORK_POINTS[phase]]
    rows = tuned.load_tables(tuple(settings.tuned_config)).get(
        (arch, kernel, kv, page_size, MODEL["heads"], MODEL["head_dim"]), [])
    for row in rows:
        for phase in phases:
            per_request = _ROWS_PER_REQUEST[phase] or row.rows
            points.append((phase, (max(1, row.rows // per_request), per_request, row.context)))
    return points


def _thunks(matrix: Matrix, arch: str, device, launch_cls, extra: dict, settings: QsaSettings):
    """``(label, call)`` for every launch of the matrix; each call makes one kernel module launch (or none, where
    the registry would not run that scorer)."""
    for index_name in matrix.index_dtypes:
        idx = INDEX_DTYPES[index_name]
        for cache_name in matrix.caches:
            kv = {"bf16": "bf16", "fp16": "bf16", "fp4": "fp4"}.get(cache_name, "fp8")
            for page in matrix.page_sizes:
                for kernel in (k for k in SCORERS if k in matrix.kernels):
                    for phase, point in _scorer_points(kernel, kv, page, arch, settings):
                        label = f"{kernel} {cache_name} page {page} {index_name} ({phase} {point[0]}x{point[1]})"
                        yield label, (lambda k=kernel, c=cache_name, p=page, i=idx, ph=phase, pt=point:
                                      _scorer_launch(k, c, p, i, ph, pt, device, launch_cls, extra, settings))
                if "cache_writer" in matrix.kernels:
                    yield (f"cache_writer {cache_name} page {page} {index_name}",
                           lambda c=cache_name, p=page, i=idx: _writer_launch(c, p, i, device))
        if "topk" in matrix.kernels:
            yield f"topk {index_name}", lambda i=idx: _topk_launch(None, i, device)
            for n in REQUEST_COUNTS:
                yield f"topk+expand {n} requests {index_name}", lambda n=n, i=idx: _topk_launch(n, i, device)
        if "expand" in matrix.kernels:
            for n in REQUEST_COUNTS:
                yield f"expand {n} requests {index_name}", lambda n=n, i=idx: _expand_launch(n, i, device)


def launches(matrix: Matrix, arch: str, device: torch.device, settings: QsaSettings | None = None) -> list[Launch]:
    """Every launch of ``matrix`` for ``arch``, built on ``device`` (the GPU of that arch; or the CPU, which makes
    the launches a GPU of ``arch`` would make: its tuned rows, decoders and tensor-core choices)."""
    settings = settings or get_settings()
    named = device.type != "cuda"
    launch_cls, extra = ((_TargetLaunch, {"capability": target_capability(arch), "target_arch": arch}) if named
                         else (ScoreLaunch, {}))
    result = []
    for label, call in _thunks(matrix, arch, device, launch_cls, extra, settings):
        with capture_launches([_module(name).KERNEL for name in KERNELS]) as captured:
            call()
        for fn, grid, args, kwargs in captured:
            kernel = fn.fn.__module__.rsplit(".", 1)[-1]
            result.append(Launch(kernel, fn, tuple(grid) if not callable(grid) else grid, args, kwargs, label))
    return result


# ---------------------------------------------------------------------------------------------------------------
# Running a warm-up
# ---------------------------------------------------------------------------------------------------------------


def present_arch() -> str | None:
    """The arch of the current GPU (``sm_90``, ``gfx942`` ...), or None without one."""
    if not torch.cuda.is_available():
        return None
    return tuned.device_arch(torch.device("cuda", torch.cuda.current_device()))


def _unique(items: list[Launch], target) -> list[tuple[jit_cache.Specialisation, Launch]]:
    """The launches that are distinct Triton variants on ``target``, with their specialisations."""
    seen, result = set(), []
    for launch in items:
        spec = jit_cache.specialise(launch.fn, target, launch.args, launch.kwargs)
        if spec.entry_id not in seen:
            seen.add(spec.entry_id)
            result.append((spec, launch))
    return result


def warmup(arch: str | None = None, *, root=None, matrix: Matrix | None = None, progress: bool = True,
           settings: QsaSettings | None = None) -> WarmupReport:
    """Compile the variant matrix for ``arch`` (default: the present GPU's) into the JIT cache under ``root``
    (default: ``jit_cache.jit_root()``). ``arch`` the present GPU's: the launches run on it; one of ``aot.TARGETS``
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
    if interpreting():
        raise RuntimeError("warm-up needs a process without TRITON_INTERPRET=1: interpreted kernels are not compiled")
    start = time.perf_counter()
    store = jit_cache.store_for(jit_cache.jit_root(settings) if root is None else root, arch, settings.rebuild)
    if not store.writable():
        raise ValueError(f"root: the JIT cache directory {store.dir} is not writable")
    report = WarmupReport(arch, str(store.dir))
    on_gpu = arch == present
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if on_gpu:
        target = driver.active.get_current_target()
    else:
        target = TARGETS[arch]
    queue = _unique(launches(matrix, arch, device, settings), target)
    bar = tqdm(total=len(queue), desc=f"warm-up {arch}", unit="kernel", disable=not progress)
    deferred = []
    try:
        for spec, launch in queue:
            if not _warm_one(store, spec, launch, on_gpu, wait=False, report=report, bar=bar):
                deferred.append((spec, launch))  # another process is compiling it: come back at the end
        for spec, launch in deferred:
            _warm_one(store, spec, launch, on_gpu, wait=True, report=report, bar=bar)
    finally:
        bar.close()
    report.seconds = time.perf_counter() - start
    return report


def _warm_one(store: jit_cache.Store, spec, launch: Launch, on_gpu: bool, *, wait: bool, report: WarmupReport,
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
            event = jit_cache.build_for_target(store, spec, wait=wait)
            if event.compiled:
                report.compiled[eid] = event.seconds
            else:
                report.found.append(eid)
    except jit_cache.VariantBusy:
        return False
    except Exception as err:  # a variant that does not build is reported, and the others still are
        report.failed[launch.label] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
    bar.update(1)
    bar.set_postfix(compiled=len(report.compiled), cached=len(report.found), refresh=False)
    return True

"""GPU checks: the work points of docs/benchmarks.md, caches and outputs beyond 32-bit offsets, CUDA-graph capture.

Run with ``python3 -m pytest tests -m gpu`` on a machine with a GPU (no ``TRITON_INTERPRET``). Every kernel is forced
in turn (and the automatic choice), and compared with the torch reference run on the same GPU in fp32. The kernels
multiply bf16/fp16 operands on tensor cores with fp32 accumulation, so the tolerance is rtol = atol = 1e-4 (plus
``E4M3_MMA_TOL`` of the magnitude bound where e4m3 tensor cores score an e4m3fn or MXFP4 cache, helpers.py). Where a
call has many rows, the reference is computed for an evenly spaced subset of them (every row's visible count is still
checked exactly).
"""

from __future__ import annotations

import functools
import zlib

import pytest
import torch

import qsa_aiter
from qsa_aiter.runtime import registries
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits, visible_groups
from qsa_aiter.tools.timing import capture_graph
from qsa_aiter.tools.workloads import ScoringBatch, make_batch

from helpers import (
    E4M3_MMA_TOL, KERNELS, assert_matches_reference, auto_kernel, force_backend, magnitude_args, poisoned_out,
    run_poisoned, skip_unless_serves, uses_e4m3_mma, visible_bits,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU"),
]

RTOL = ATOL = 1e-4
K = 1024
CHOICES = KERNELS + ("auto",)
MAX_REFERENCE_ROWS = 64


def gpu_batch(contexts, rows, page_size, *, seed, **kwargs) -> ScoringBatch:
    """``make_batch`` on the GPU (q and keys are drawn there), seeded; other arguments as ``make_batch``'s."""
    return make_batch(contexts, rows, page_size=page_size, device="cuda",
                      generator=torch.Generator().manual_seed(seed), **kwargs)


def sample_rows(tokens: int, limit: int = MAX_REFERENCE_ROWS) -> torch.Tensor:
    """All rows, or ``limit`` evenly spaced ones (first and last included)."""
    if tokens <= limit:
        return torch.arange(tokens)
    return torch.linspace(0, tokens - 1, limit).round().long().unique()


def reference_rows(args: tuple, rows: torch.Tensor, **kwargs):
    """The reference of the given rows only (the op is row-independent)."""
    q, cache, table, t2r, pos, ctx = args[:6]
    rows = rows.to(q.device)
    extra = {k: kwargs[k] for k in ("score_divisor", "max_columns", "k_scale") if k in kwargs}
    ratio = args[6] if len(args) > 6 else 4
    return reference_paged_mqa_logits(q[rows], cache, table, t2r[rows], pos[rows], ctx, ratio, **extra)


def gpu_atol(args: tuple, rows: torch.Tensor, **kwargs):
    """``ATOL``, plus ``E4M3_MMA_TOL`` of the sampled rows' magnitude bound where e4m3 tensor cores score the call."""
    if not uses_e4m3_mma(args, **kwargs):
        return ATOL
    plain = {k: v for k, v in kwargs.items() if k != "k_scale"}
    return ATOL + E4M3_MMA_TOL * reference_rows(magnitude_args(args, kwargs.get("k_scale")), rows, **plain)[0]


def check_gpu_call(args: tuple, *, label: str = "", repeat: bool = False, **kwargs):
    """Poison, run, check every row's visible count and the sampled rows' logits; optionally run again, bitwise."""
    logits, visible = run_poisoned(args, **kwargs)
    ratio = args[6] if len(args) > 6 else 4
    num_columns = logits.shape[1]
    expected_visible = visible_groups(args[3], args[4], args[5], ratio, num_columns)
    assert torch.equal(visible, expected_visible), f"{label}: visible differs from the reference"
    rows = sample_rows(args[0].shape[0])
    ref_logits, ref_visible = reference_rows(args, rows, **kwargs)
    assert_matches_reference(logits, visible, ref_logits, ref_visible, rtol=RTOL, atol=gpu_atol(args, rows, **kwargs),
                             rows=rows.to(logits.device), label=label)
    if repeat:
        again, visible2 = run_poisoned(args, **kwargs)
        assert torch.equal(visible2, visible)
        assert torch.equal(visible_bits(again, visible2), visible_bits(logits, visible)), \
            f"{label}: a second call gave different bits"
    return logits, visible


# ---------------------------------------------------------------------------------------------------------------
# The work points (docs/benchmarks.md)
# ---------------------------------------------------------------------------------------------------------------


def _spread(lo: int, hi: int, n: int) -> list[int]:
    """``n`` contexts from ``lo`` to ``hi`` tokens, not in sorted order and not multiples of a page."""
    values = [lo + (hi - lo) * i // max(n - 1, 1) + 13 * (i % 7) for i in range(n)]
    return [values[(i * 37) % n] for i in range(n)] if n > 1 else values


WORK_POINTS = {
    # name: (contexts in tokens, rows per request, phase the registry should infer)
    "9x4@64K-128K": (_spread(64 * K, 128 * K, 9), 4, "verify"),
    "16x4@32K": ([32 * K] * 16, 4, "verify"),
    "64x4@98K": ([98 * K] * 64, 4, "verify"),
    "4x4@262K": ([262 * K] * 4, 4, "verify"),
    "64x1@32K": ([32 * K] * 64, 1, "draft"),
    "16x1@98K": ([98 * K] * 16, 1, "draft"),
    "1x1@262K": ([262 * K], 1, "draft"),
    "128x1@8K-200K": (_spread(8 * K, 200 * K, 128), 1, "draft"),
    "prefill-4096@96K": ([96 * K], 4096, "prefill"),
}


def seed_of(*key) -> int:
    return zlib.crc32("/".join(map(str, key)).encode())


@functools.lru_cache(maxsize=1)
def work_point(name: str, page_size: int):
    """One work point's batch, sampled rows and their reference, kept while the tests of its backends run (one work
    point at a time, to bound memory)."""
    contexts, rows, _ = WORK_POINTS[name]
    batch = gpu_batch(contexts, rows, page_size, seed=seed_of(name, page_size))
    sampled = sample_rows(batch.q.shape[0]).cuda()
    return batch, sampled, reference_rows(batch.args(), sampled)


def _hints(name: str, batch: ScoringBatch) -> dict:
    return {} if WORK_POINTS[name][2] == "prefill" else dict(max_query_len=batch.max_query_len)


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("point", list(WORK_POINTS))
def test_work_point(monkeypatch, point, page_size, backend):
    batch, rows, (ref_logits, ref_visible) = work_point(point, page_size)
    args, hints = batch.args(), _hints(point, batch)
    phase = WORK_POINTS[point][2]
    assert describe_call(*args, **hints).phase == phase
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    expected = backend if backend != "auto" else auto_kernel(args, **hints)
    assert qsa_aiter.selected_kernel(*args, **hints) == expected
    label = f"{point}/page{page_size}/{backend}"
    logits, visible = run_poisoned(args, **hints)
    assert torch.equal(visible, visible_groups(*args[3:7], logits.shape[1])), f"{label}: visible"
    assert_matches_reference(logits, visible, ref_logits, ref_visible, rtol=RTOL, atol=ATOL, rows=rows, label=label)
    again, visible2 = run_poisoned(args, **hints)
    assert torch.equal(visible2, visible)
    assert torch.equal(visible_bits(again, visible2), visible_bits(logits, visible)), f"{label}: not bitwise repeatable"


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("phase", ["verify", "prefill"])
def test_fp16(monkeypatch, phase, page_size, backend):
    rows = {"verify": 4, "decode": 1, "prefill": 300}[phase]
    contexts = [20 * K] if phase == "prefill" else _spread(8 * K, 40 * K, 8)
    batch = gpu_batch(contexts, rows, page_size, dtype=torch.float16, seed=11)
    args = batch.args()
    hints = dict(phase=phase, max_query_len=rows)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_gpu_call(args, label=f"fp16/{phase}/page{page_size}/{backend}", **hints)


#: Tests that hold several GiB on the GPU: with ``-n N --dist loadgroup`` they run one after another on one worker, so
#: parallel workers do not run the card out of memory together (on an 80 GB H100, 16 workers did).
LARGE_GPU_MEMORY = pytest.mark.xdist_group("large_gpu_memory")
QUANTISED_POINTS = ("9x4@64K-128K", "4x4@262K", pytest.param("128x1@8K-200K", marks=LARGE_GPU_MEMORY),
                    pytest.param("prefill-4096@96K", marks=LARGE_GPU_MEMORY))


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("cache", ["fp8", "fp8_fnuz", "fp4"])
@pytest.mark.parametrize("point", QUANTISED_POINTS)
def test_quantised_work_point(monkeypatch, point, cache, page_size, backend):
    """fp8 and MXFP4 caches (written by the project's writer) at work points of each phase, every kernel."""
    contexts, rows, phase = WORK_POINTS[point]
    batch = gpu_batch(contexts, rows, page_size, cache=cache, seed=seed_of(point, cache, page_size))
    args, hints = batch.args(), dict(batch.kwargs(), **_hints(point, batch))
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    assert qsa_aiter.selected_kernel(*args, **hints) == (backend if backend != "auto" else auto_kernel(args, **hints))
    check_gpu_call(args, label=f"{point}/{cache}/page{page_size}/{backend}", repeat=True, **hints)


def test_decode_with_the_stacked_switch_off_uses_rowwise(monkeypatch):
    monkeypatch.setenv("ATOM_QSA_STACKED_DECODE_SCORER", "0")
    batch = gpu_batch(_spread(8 * K, 64 * K, 16), 1, 64, seed=5)
    args = batch.args()
    assert qsa_aiter.selected_kernel(*args, max_query_len=1) == "rowwise"
    check_gpu_call(args, max_query_len=1)


# ---------------------------------------------------------------------------------------------------------------
# Edge cases on the GPU (the compiled kernels run without the interpreter's fp32 upcast)
# ---------------------------------------------------------------------------------------------------------------


def _edge_case(name: str, page_size: int):
    """``(args, hints)`` of one edge case."""
    seed = seed_of(name, page_size)
    if name == "padded-and-empty-rows":
        b = gpu_batch([3, 9, 7000], [2, 9, 4], page_size, padded_rows=3, seed=seed)
        return b.args(), dict(max_query_len=9)
    if name == "bad-pages":
        b = gpu_batch([6000, 9000, 3000], 4, page_size, seed=seed)
        table = b.page_table.clone()
        pages = b.compressed_k_cache.shape[0]
        for r, slot, value in [(0, 1, -3), (1, 0, pages), (1, 2, pages + 100), (2, 0, -(2**31)), (2, 1, 2**31 - 1)]:
            table[r, slot] = value
        return (b.q, b.compressed_k_cache, table, *b.args()[3:]), dict(max_query_len=4)
    if name == "max-columns":
        b = gpu_batch([9000, 15000, 500], 4, page_size, seed=seed)
        return b.args(), dict(max_query_len=4, max_columns=1000)
    if name == "table-width-and-stride":
        b = gpu_batch([5000, 2000, 9000], [2, 1, 3], page_size, seed=seed, table_width=9000 // 4 // page_size + 7)
        wide = torch.full((3, b.page_table.shape[1] + 5), 10**6, dtype=torch.int32, device="cuda")
        wide[:, : b.page_table.shape[1]] = b.page_table
        return (b.q, b.compressed_k_cache, wide[:, : b.page_table.shape[1]], *b.args()[3:]), dict(max_query_len=3)
    if name in ("heads-3", "heads-6"):
        b = gpu_batch([6400, 13000], 4, page_size, heads=int(name[-1]), seed=seed)
        return b.args(), dict(max_query_len=4)
    if name == "head-dim-96":
        b = gpu_batch([5300, 10000], 3, page_size, head_dim=96, seed=seed)
        return b.args(), dict(max_query_len=3)
    if name == "int64-indices":
        b = gpu_batch([7000, 13000, 2222], [1, 4, 2], page_size, padded_rows=1, seed=seed)
        q, cache, *idx = b.args()[:6]
        table, t2r, pos, ctx = [t.long() for t in idx]
        table[1, 1] = 2**40
        return (q, cache, table, t2r, pos, ctx), dict(max_query_len=4)
    if name == "ratio-8-divisor-3":
        b = gpu_batch([1500, 40000], 2, page_size, compress_ratio=8, seed=seed)
        return b.args(), dict(max_query_len=2, score_divisor=3.0)
    if name == "draft-many-requests":
        b = gpu_batch([120, 19000, 3333, 64, 10001, 7777, 250, 15000, 17], 1, page_size, seed=seed)
        return b.args(), dict(phase="draft", max_query_len=1)
    if name == "prefill-chunk-of-short-requests":
        b = gpu_batch([40, 6100, 1300], [5, 7, 3], page_size, seed=seed)
        return b.args(), dict(phase="prefill")
    if name == "rows-shuffled":
        b = gpu_batch([5000, 12000, 3000, 9000], [2, 3, 1, 2], page_size, padded_rows=1, seed=seed)
        perm = torch.randperm(b.q.shape[0], generator=torch.Generator().manual_seed(seed)).cuda()
        return (b.q[perm].contiguous(), b.compressed_k_cache, b.page_table, b.token_to_request[perm].contiguous(),
                b.query_positions[perm].contiguous(), b.context_lens), dict(max_query_len=3)
    raise KeyError(name)


#: (case, page size): the layout-sensitive cases at both page sizes, the others at 64 (fewer compilations).
EDGE_CASES = [(case, page) for case in ("padded-and-empty-rows", "bad-pages", "table-width-and-stride")
              for page in (16, 64)] + [
    (case, 64) for case in ("max-columns", "heads-3", "heads-6", "head-dim-96", "int64-indices", "ratio-8-divisor-3",
                            "draft-many-requests", "prefill-chunk-of-short-requests", "rows-shuffled")
]


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("case,page_size", EDGE_CASES, ids=[f"{c}-page{p}" for c, p in EDGE_CASES])
def test_edge_case(monkeypatch, case, page_size, backend):
    args, hints = _edge_case(case, page_size)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_gpu_call(args, label=f"{case}/page{page_size}/{backend}", **hints)


def test_device_mismatch_is_named():
    b = gpu_batch([5000, 3000], 2, 64, seed=3)
    base = dict(zip(("q", "compressed_k_cache", "page_table", "token_to_request", "query_positions",
                     "context_lens"), b.args()[:6], strict=True))
    for name in ("compressed_k_cache", "page_table", "token_to_request", "query_positions", "context_lens"):
        kw = dict(base, **{name: base[name].cpu()})
        with pytest.raises(ValueError, match=f"`{name}`"):
            qsa_aiter.qsa_paged_mqa_logits(**kw)
    out = torch.full((b.q.shape[0], b.page_table.shape[1] * 64), float("nan"))
    with pytest.raises(ValueError, match="`out`"):
        qsa_aiter.qsa_paged_mqa_logits(**base, out=out)
    with pytest.raises(ValueError, match="`row_starts`"):
        qsa_aiter.qsa_paged_mqa_logits(**base, row_starts=torch.zeros(b.q.shape[0], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------------
# 64-bit offsets: a cache beyond 2**31 elements, an output beyond 2**31 elements
# ---------------------------------------------------------------------------------------------------------------


@LARGE_GPU_MEMORY
@pytest.mark.parametrize("page_size", [16, 64])
def test_cache_beyond_32_bit_offsets(monkeypatch, page_size):
    """A > 4 GiB bf16 cache (more than 2**31 elements); requests' pages at the highest ids and across 2**31."""
    head_dim = 128
    per_page = page_size * head_dim
    pages = -(-(2**31 + 2**25) // per_page)
    boundary = 2**31 // per_page  # first page whose first element lies at or past 2**31
    assert pages * per_page * 2 > 4 * 2**30
    cache = torch.zeros(pages, page_size, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    contexts = [40000, 20000, 30000]
    need = [-(-(c // 4) // page_size) for c in contexts]
    gen = torch.Generator().manual_seed(page_size)
    ids = [
        pages - 1 - torch.randperm(need[0], generator=gen),  # the highest page ids
        boundary - need[1] // 2 + torch.randperm(need[1], generator=gen),  # across the 2**31-element boundary
        torch.randperm(2000, generator=gen)[: need[2]],  # low ids
    ]
    width = max(need)
    table = torch.full((3, width), -1, dtype=torch.int32)
    for r, page_ids in enumerate(ids):
        table[r, : need[r]] = page_ids.to(torch.int32)
    used = torch.cat(ids).cuda()
    cache[used] = torch.randn(used.numel(), page_size, 1, head_dim, device="cuda").to(torch.bfloat16)
    rows = 4
    t2r = torch.tensor([r for r in range(3) for _ in range(rows)] + [-1], dtype=torch.int32, device="cuda")
    pos = torch.tensor([c - rows + i for c in contexts for i in range(rows)] + [-1], dtype=torch.int32, device="cuda")
    q = torch.randn(t2r.numel(), 4, head_dim, device="cuda").to(torch.bfloat16)
    args = (q, cache, table.cuda(), t2r, pos, torch.tensor(contexts, dtype=torch.int32, device="cuda"))
    for backend in CHOICES:
        force_backend(monkeypatch, backend)
        check_gpu_call(args, label=f"cache>4GiB/page{page_size}/{backend}", max_query_len=rows)
    del cache, used
    torch.cuda.empty_cache()


@LARGE_GPU_MEMORY
def test_output_beyond_32_bit_offsets(monkeypatch):
    """4096 rows x 540672 columns of fp32 logits: the last rows start past element 2**31."""
    page_size = 64
    width = 8448
    batch = gpu_batch([4096 + 100 * r for r in range(4)], 1024, page_size, table_width=width, seed=7)
    args = batch.args()
    assert batch.q.shape[0] * width * page_size > 2**31
    rows = torch.cat([sample_rows(batch.q.shape[0], 32), torch.arange(batch.q.shape[0] - 8, batch.q.shape[0])])
    rows = rows.unique()
    for backend in CHOICES:
        force_backend(monkeypatch, backend)
        logits, visible = run_poisoned(args)
        assert torch.equal(visible, visible_groups(*args[3:6], 4, logits.shape[1]))
        ref_logits, ref_visible = reference_rows(args, rows)
        assert_matches_reference(logits, visible, ref_logits, ref_visible, rtol=RTOL, atol=ATOL,
                                 rows=rows.cuda(), label=f"out>2**31/{backend}")
        del logits
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("phase", ["verify", "decode", "prefill"])
def test_cuda_graph_replay_equals_eager(monkeypatch, phase, backend):
    rows = {"verify": 4, "decode": 1, "prefill": 96}[phase]
    contexts = [12000] if phase == "prefill" else [8001 + 37 * r for r in range(9)]
    batch = gpu_batch(contexts, rows, 64, seed=17)
    q, cache, table, t2r, pos, ctx = batch.args()[:6]
    hints = dict(phase=phase, max_query_len=rows)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, batch.args(), **hints)
    out = poisoned_out(batch.args())
    row_starts = torch.full((q.shape[0],), 5, dtype=torch.int32, device="cuda")

    def call():
        return qsa_aiter.qsa_paged_mqa_logits(q, cache, table, t2r, pos, ctx, 4, None, None, row_starts, out=out,
                                              **hints)

    graph, (graph_logits, graph_visible) = capture_graph(call, warmups=2)
    assert graph_logits is out

    def eager_now():
        fresh = poisoned_out(batch.args())
        logits, visible = qsa_aiter.qsa_paged_mqa_logits(q, cache, table, t2r, pos, ctx, out=fresh, **hints)
        return logits, visible

    gen = torch.Generator(device="cuda").manual_seed(99)
    for step in range(2):
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype))  # new queries, same storage
        if step == 1 and phase != "prefill":
            pos.add_(1)  # one more token per request: positions and contexts change on the device only
            ctx.add_(1)
        out.fill_(float("nan"))
        row_starts.fill_(5)
        graph.replay()
        torch.cuda.synchronize()
        eager_logits, eager_visible = eager_now()
        assert torch.equal(graph_visible, eager_visible)
        assert torch.equal(visible_bits(out, graph_visible), visible_bits(eager_logits, eager_visible)), \
            f"replay {step} differs from an eager call"
        assert row_starts.eq(0).all()
        ref_logits, ref_visible = reference_paged_mqa_logits(q, cache, table, t2r, pos, ctx)
        assert_matches_reference(out, graph_visible, ref_logits, ref_visible, rtol=RTOL, atol=ATOL,
                                 label=f"graph/{phase}/{backend}/replay {step}")


def test_registry_reasons_are_empty_for_model_shapes():
    """On a GPU every Triton kernel serves the model's shape, in every phase."""
    for phase in ("prefill", "verify", "draft", "decode"):
        b = gpu_batch([5000, 3000], 4 if phase in ("verify", "prefill") else 1, 64, seed=1)
        problem = describe_call(*b.args(), phase=phase)
        assert problem.device_type == "cuda"
        for name in KERNELS:
            assert registries.SCORING.reasons(name, problem) == [], name
        assert registries.SCORING.select(problem).chosen == auto_kernel(b.args(), phase=phase)

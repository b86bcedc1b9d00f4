"""The grid select (``kernels/selection/grid_topk.py`` and ``.cu``, ``runtime/grid_topk.py``): on the CPU, the
declarations against the source (parameters, layouts, kernels), the split and plan choice against their rules, the
launch arguments, the cooperative launch's configuration, the reasons and the registry's order; with NVRTC
(``nvrtc``), every kernel built for sm_90 and sm_80 without spills; on the GPU (``gpu``), the kernels against the oracle
on the native top-k's cases and long rows (64K+ columns, 1 to 256 rows), every split forced, the fused expansion,
repeats, the workspace left clean and CUDA-graph replays with new lengths. Its device code on the CPU, through the
emulator: ``test_grid_emulated.py``."""

from __future__ import annotations

import ctypes
import dataclasses
import random
import re
import zlib

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.native_spec import macro_params
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import grid_topk as gt
from qsa_aiter.kernels.selection.native_topk import Expansion
from qsa_aiter.kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from qsa_aiter.runtime import dispatch, grid_topk as runtime, registries
from qsa_aiter.runtime.jit import cuda_driver, native, nvrtc
from qsa_aiter.runtime.jit.cuda_driver import LoadedKernel

from native_cases import edge_visible, nan_past_visible, native_case_logits

ON_GPU = torch.cuda.is_available()
H200 = Platform.named("sm_90")
A100 = Platform("sm_80", "cuda", (8, 0), 108, False, 163 * 1024, 164 * 1024)
SOURCE = gt.source()


def _define(name: str) -> int:
    return int(re.search(rf"#define {name} (\d+)", SOURCE).group(1))


# ---------------------------------------------------------------------------------------------------------------
# The declarations against the source
# ---------------------------------------------------------------------------------------------------------------


def test_the_source_spells_the_declared_parameters():
    assert macro_params(SOURCE, "GRID_PARAMS") == gt.PARAMS
    assert gt.SPEC.pointers(gt.VARIANTS[0]) == gt.POINTERS and gt.SPEC.scalars(gt.VARIANTS[1]) == gt.SCALARS
    binding = {name: (pointers, count) for name, pointers, count in gt.SPEC.emulator_kernels()}
    assert binding["grid_topk_256"] == (tuple(c for _, c in gt.POINTERS), len(gt.SCALARS))


def test_the_layouts_match_the_source():
    assert gt.FIXED_BYTES == 4 * _define("GRID_FIXED_WORDS") and gt.SLOT_WORDS == _define("GRID_SLOT_WORDS")
    assert (gt.TILE, gt.MAX_SPLIT, gt.HISTOGRAM_BINS) == (_define("GRID_TILE"), _define("GRID_MAX_SPLIT"),
                                                          _define("GRID_BINS"))
    # the slot: a histogram a row | counter (its own 128-byte line) | flag (u64) | payload words | two u64 words per
    # CTA and row
    assert gt.MAX_ROWS == _define("GRID_MAX_ROWS") and gt.CLEAN_WORDS == _define("GRID_ARRIVE_WORD") + 1
    assert _define("GRID_ARRIVE_WORD") == gt.MAX_ROWS * gt.HISTOGRAM_BINS and _define("GRID_FLAG_WORD") % 32 == 0
    assert _define("GRID_FLAG_WORD") - _define("GRID_ARRIVE_WORD") >= 32
    assert _define("GRID_PAYLOAD_WORD") - _define("GRID_FLAG_WORD") >= 32
    assert _define("GRID_ENTRY_WORD") - _define("GRID_PAYLOAD_WORD") >= gt.MAX_ROWS
    assert _define("GRID_ENTRY_WORD") + 4 * gt.MAX_ROWS * gt.MAX_SPLIT <= gt.SLOT_WORDS and gt.SLOT_WORDS % 32 == 0
    # shared memory: H | scan | res, then the keys 16-byte aligned; scan | res is the tail's own part
    assert _define("GRID_SCAN_WORD") == gt.HISTOGRAM_BINS and _define("GRID_RES_WORD") == _define("GRID_SCAN_WORD") + 64
    assert _define("GRID_FIXED_WORDS") == _define("GRID_RES_WORD") + 256 and gt.FIXED_BYTES % 16 == 0
    assert gt.TAIL_BYTES == 4 * _define("GRID_TAIL_WORDS") == gt.FIXED_BYTES - 4 * gt.HISTOGRAM_BINS
    assert gt.MAX_CHUNK < 1 << 16 and gt.MAX_BLOCK_TOPK < 0xFFFFF  # the packed counts and the payload's rank field


@pytest.mark.parametrize("variant", gt.VARIANTS, ids=lambda v: v.name)
def test_every_variant_is_a_kernel_of_the_source(variant):
    pattern = (rf'extern "C" __global__ void TOPK_LAUNCH_BOUNDS\({variant.threads}, '
               rf"{variant.blocks_per_multiprocessor}\) {variant.name}\(")
    assert re.search(pattern, SOURCE), pattern
    assert f"defined(TOPK_KERNEL_{variant.name})" in SOURCE and variant.max_registers == 64
    assert gt.SPEC.defines(variant, "sm_90") == ("TOPK_SINGLE", f"TOPK_KERNEL_{variant.name}", "TOPK_WARP_SIZE=32")


def test_the_source_is_self_contained_and_names_its_vendor_facts_through_the_header():
    text = gt.SOURCE_PATH.read_text()
    assert re.findall(r"^[ \t]*#[ \t]*include.*$", text, re.M) == ['#include "native_compat.h"']
    assert not re.search(r"^\s*#\s*include", SOURCE, re.M)
    assert "asm" not in text and "__HIP" not in text  # the cross-CTA primitives are native_compat.h's
    for primitive in ("grid_load_acquire", "grid_store_release", "grid_fence", "grid_pause"):
        assert primitive in text and primitive in gt.COMPAT_PATH.read_text()


# ---------------------------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows, columns, split, threads, slots", [
    (1, 65536, 32, 256, 1),  # decode 1x1 @ 262K: 32 CTAs of 2048 columns
    (16, 65536, 16, 256, 16),  # verify 4x4 @ 262K
    (36, 32768, 7, 512, 36),  # verify 9x4 @ 64K-128K: 4736-column chunks, 2 CTAs of 512 a multiprocessor
    (128, 25088, 2, 512, 128),
    (4096, 8192, 1, 512, 264),  # prefill: one CTA a row, 264 rows in flight
    (1, 300000, 32, 512, 1),  # a row longer than 32 x 2048: 9408-column chunks
    (3, 1000, 1, 256, 3),  # shorter than MIN_CHUNK: not split
])
def test_plan_choice(rows, columns, split, threads, slots):
    plan = gt.choose_plan(rows, columns, 512, H200)
    assert (plan.split, plan.variant.threads, plan.slots) == (split, threads, slots), plan.describe()
    assert plan.cap * plan.split >= columns and plan.cap % gt.TILE == 0


def test_every_plan_fits_a_co_resident_grid():
    gen = random.Random(5)
    for platform in (H200, A100):
        for _ in range(300):
            rows, columns = gen.randint(1, 20000), gen.randint(1, 1_000_000)
            k = gen.choice([1, 16, 512, 2048])
            if gt.plan_reason(rows, columns, k, platform):
                assert -(-columns // gt.max_cap(platform)) > gt.MAX_SPLIT
                continue
            plan = gt.choose_plan(rows, columns, k, platform)
            per_sm = gt.per_multiprocessor(plan.variant, plan.shared_bytes, platform)
            assert 1 <= plan.grid <= platform.multiprocessors * per_sm and plan.slots <= rows
            assert plan.shared_bytes <= platform.shared_memory_per_block and plan.split <= gt.MAX_SPLIT
            assert columns <= k or plan.cap * plan.split >= columns


def test_rows_no_wider_than_the_budget_take_the_trivial_plan():
    plan = gt.choose_plan(9, 512, 512, H200)
    assert (plan.split, plan.cap, plan.slots, plan.variant.name) == (1, 0, 9, "grid_topk_256")
    assert gt.choose_plan(5000, 7, 512, H200).slots == 132 * 4


def test_split_plan_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match=r"split must be in \[1, 32\]; got 33"):
        gt.split_plan(33, 1, 1000, H200)
    with pytest.raises(ValueError, match="a split of 1 leaves 65536 keys a CTA; sm_90 holds at most 32768"):
        gt.split_plan(1, 1, 65536, H200)
    with pytest.raises(ValueError, match=r"slots must be in \[1, 3\]; got 4"):
        gt.split_plan(2, 3, 1000, H200, slots=4)
    tiny = dataclasses.replace(H200, multiprocessors=2)
    with pytest.raises(ValueError, match="a split of 9 CTAs does not fit a co-resident grid of 8 CTAs"):
        gt.split_plan(9, 1, 20000, tiny, threads=256)


def test_plan_reasons():
    assert gt.plan_reason(1, 1_000_000, 512, H200) is None
    assert gt.plan_reason(1, 2_000_000, 512, H200) == (
        "shared memory cannot hold a row of 2000000 scores across 32 CTAs (32768 keys a CTA on sm_90)")
    assert gt.plan_reason(1, 100, 1 << 20, H200) == f"needs block_topk <= {gt.MAX_BLOCK_TOPK} (got 1048576)"
    tiny = dataclasses.replace(H200, multiprocessors=1, shared_memory_per_multiprocessor=64 * 1024)
    assert "across a co-resident grid" in gt.plan_reason(1, 500_000, 512, tiny)
    with pytest.raises(ValueError, match="shared memory cannot hold"):
        gt.choose_plan(1, 2_000_000, 512, H200)


def test_launch_arguments():
    plan = gt.split_plan(4, 3, 9000, H200)
    call = gt.launch_arguments(plan, 3, 9000, 9004, 64, True)
    assert (call.kernel, call.grid, call.block, call.shared_bytes) == ("grid_topk_256", (12, 1, 1), (256, 1, 1),
                                                                       gt.FIXED_BYTES + 4 * 2304)
    assert call.pointers == gt.POINTERS and tuple(name for name, _, _ in call.scalars) == gt.SCALARS
    assert [call.scalar(n) for n in ("rows", "columns", "ld", "K", "split", "slots", "cap", "vec_ok", "tokens")
            if n != "tokens"] == [3, 9000, 9004, 64, 4, 3, 2304, 1]
    fused = gt.launch_arguments(plan, 3, 9000, 9004, 64, False, Expansion(2, 4, 259, 300, wide_contexts=True))
    assert [fused.scalar(n) for n in ("num_requests", "ratio", "width", "tok_ld", "idx_wide")] == [2, 4, 259, 300, 2]
    with pytest.raises(ValueError, match="holds 2304 keys a CTA over 4 CTAs: fewer than 9217 columns"):
        gt.launch_arguments(plan, 3, 9217, 9217, 64, True)
    with pytest.raises(ValueError, match="block_topk at most"):
        gt.launch_arguments(plan, 3, 9000, 9000, 1 << 20, True)


def test_variants_and_reasons_per_platform():
    class Problem:
        rows, columns, block_topk = 4, 40000, 512

    assert gt.variants_for(H200) == gt.VARIANTS and gt.variants_for(A100) == gt.VARIANTS
    assert gt.SPEC.reasons(Problem(), H200) == [] and gt.SPEC.reasons(Problem(), A100) == []
    turing = dataclasses.replace(H200, arch="sm_75", capability=(7, 5))
    assert gt.variants_for(turing) == () and "compute capability 8.0 or newer (the device is sm_75)" in (
        gt.SPEC.reasons(Problem(), turing)[0])
    for arch in ("gfx942", "gfx950"):
        assert gt.variants_for(Platform.named(arch)) == ()
        assert gt.SPEC.reasons(Problem(), Platform.named(arch))[0].startswith("no cooperative launch on ROCm yet")
    assert gt.SPEC.describe_plan(Problem(), H200).startswith("grid_topk_256 (split 20 CTAs a row, 4 rows in flight, grid 80")
    cpu = registries.TopkProblem("cpu", 4, 40000, 512)
    reasons = runtime.grid_topk_reasons(cpu, H200, None)
    assert reasons[0] == "needs CUDA GPU tensors (tensors are on cpu)"


def test_the_candidate_is_ranked_right_after_the_native_topk(monkeypatch):
    order, _ = registries.TOPK.order(registries.TopkProblem("cuda", 4, 40000, 512))
    assert order.index("native_grid") == order.index("native") + 1
    assert registries.TOPK.candidates["native_grid"].reasons is runtime.grid_topk_reasons
    if not ON_GPU:
        logits, visible = torch.randn(3, 200), torch.tensor([200, 150, 9], dtype=torch.int32)
        monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "native_grid")
        dispatch.clear_decisions()
        with pytest.raises(ValueError, match=r"native_grid: needs CUDA GPU tensors \(tensors are on cpu\)"):
            qsa_aiter.qsa_block_topk(logits, visible, 16)


def test_a_cooperative_launch_is_configured_with_the_attribute():
    config, attribute = cuda_driver.cooperative_config((12, 1, 1), (256, 1, 1), 20000)
    assert (attribute.id, attribute.value[0]) == (cuda_driver.CU_LAUNCH_ATTRIBUTE_COOPERATIVE, 1) == (2, 1)
    assert (list(config.grid), list(config.block), config.shared_bytes, config.attribute_count) == (
        [12, 1, 1], [256, 1, 1], 20000, 1)
    assert ctypes.addressof(config.attributes.contents) == ctypes.addressof(attribute)
    kernel = LoadedKernel("grid_topk_256", "entry", 0, ctypes.c_void_p(), ctypes.c_void_p(), shared_limit=1 << 20)
    launch = native.PreparedLaunch("grid_topk", kernel, (12, 1, 1), (256, 1, 1), 20000, ("a",), (), cooperative=True)
    assert launch.cooperative and not launch.programmatic
    with pytest.raises(ValueError, match="programmatic, cooperative or clustered, one at most"):
        native.PreparedLaunch("x", kernel, (1, 1, 1), (32, 1, 1), 0, (), (), programmatic=True, cooperative=True)
    with pytest.raises(ValueError, match="programmatic, cooperative or clustered, one at most"):
        native.PreparedLaunch("x", kernel, (4, 1, 1), (32, 1, 1), 0, (), (), cooperative=True, cluster=4)
    amd = dataclasses.replace(kernel, vendor="hip")
    with pytest.raises(ValueError, match="wired for CUDA only"):
        native.PreparedLaunch("x", amd, (1, 1, 1), (64, 1, 1), 0, (), (), cooperative=True)
    with pytest.raises(ValueError, match="wired for CUDA only"):
        native.PreparedLaunch("x", amd, (4, 1, 1), (64, 1, 1), 0, (), (), cluster=4)


def test_a_clustered_launch_is_configured_with_the_attribute():
    """The fused selection's cluster plans: the cluster's size along x given at launch."""
    config, attribute = cuda_driver.cluster_config((32, 1, 1), (128, 1, 1), 90000, 16)
    assert attribute.id == cuda_driver.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION == 4
    assert list(attribute.value[:3]) == [16, 1, 1]
    assert (list(config.grid), list(config.block), config.shared_bytes, config.attribute_count) == (
        [32, 1, 1], [128, 1, 1], 90000, 1)
    assert ctypes.addressof(config.attributes.contents) == ctypes.addressof(attribute)
    kernel = LoadedKernel("qsa_fused_bf16_page64", "entry", 0, ctypes.c_void_p(), ctypes.c_void_p(),
                          shared_limit=1 << 20)
    launch = native.PreparedLaunch("fused_select", kernel, (32, 1, 1), (128, 1, 1), 90000, ("a",), (), cluster=16)
    assert launch.cluster == 16 and not launch.programmatic and not launch.cooperative


def test_the_rows_in_flight_follow_the_drivers_count(monkeypatch):
    """The driver's count of co-resident CTAs (here faked) caps the row slots, never the split; a count below one
    row's CTAs is an error (the registry falls back) rather than a launch that would wait forever."""
    plan = gt.split_plan(8, 100, 20000, H200)
    assert (plan.slots, plan.variant.name) == (66, "grid_topk_256")  # 4 CTAs a multiprocessor, as promised
    counts = iter([3, 0])
    monkeypatch.setattr(runtime, "resident_blocks", lambda kernel, threads, shared: next(counts))
    kernel = LoadedKernel("grid_topk_256", "entry", 0, ctypes.c_void_p(), ctypes.c_void_p(1))
    assert runtime.resident_plan(plan, kernel, H200, 100) == dataclasses.replace(plan, slots=49)
    assert runtime.resident_plan(plan, kernel, H200, 100).slots == 49  # asked once per kernel and size
    other = LoadedKernel("grid_topk_256", "entry", 0, ctypes.c_void_p(), ctypes.c_void_p(2))
    with pytest.raises(RuntimeError, match="the driver fits 0 CTAs a multiprocessor, fewer than one row's 8"):
        runtime.resident_plan(plan, other, H200, 100)


# ---------------------------------------------------------------------------------------------------------------
# NVRTC
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.nvrtc
@pytest.mark.parametrize("variant", gt.VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_every_variant_compiles_without_spills(variant, arch):
    built = nvrtc.compile_cubin(SOURCE, arch, tuple(f"-D{d}" for d in gt.SPEC.defines(variant, arch)),
                                name="grid_topk.cu")
    report = nvrtc.ptxas_report(built.log)
    assert set(report) == {variant.name}
    found = report[variant.name]
    assert (found.spill_store_bytes, found.spill_load_bytes, found.stack_bytes) == (0, 0, 0), found
    assert found.registers <= variant.max_registers


# ---------------------------------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------------------------------

SHAPES = [  # (rows, columns, block_topk): the selection tests' small shapes, the work points' and long rows
    (11, 1500, 16), (6, 1400, 64), (3, 333, 5), (9, 7, 512), (36, 32768, 512), (16, 67072, 512), (1, 65536, 512),
    (2, 131072, 512), (1, 262144, 512), (128, 25088, 512), (256, 70000, 512), (4096, 8192, 512),
]
KINDS = ["random", "ties", "equal", "relu", "constant", "neg_inf"]


def _forced(monkeypatch):
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "native_grid")


def _oracle(logits, visible, k) -> torch.Tensor:
    want = torch.empty((logits.shape[0], k), dtype=torch.int32, device=logits.device)
    torch_block_topk(logits, visible, k, want)
    return want


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, columns, block_topk", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_grid_select_equals_the_oracle(monkeypatch, rows, columns, block_topk, kind):
    """``qsa_block_topk`` forced to the grid select (its automatic plan) on NaN-poisoned rows equals the torch path,
    repeats bitwise, and leaves its workspace clean."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rows} {columns} {block_topk} {kind}".encode()))
    logits = native_case_logits(gen, rows, columns, kind)
    visible = edge_visible(gen, rows, columns, block_topk)
    want = _oracle(logits, visible, block_topk)
    _forced(monkeypatch)
    poisoned = nan_past_visible(logits, visible)
    out = torch.full_like(want, -7)
    assert torch.equal(qsa_aiter.qsa_block_topk(poisoned, visible, block_topk, out=out), want)
    assert torch.equal(qsa_aiter.qsa_block_topk(poisoned, visible, block_topk), want), "not bitwise repeatable"
    plan = gt.choose_plan(rows, columns, block_topk, Platform.of(logits.device))
    workspace = runtime.workspace_for(logits.device, plan.workspace_words)
    assert not workspace[: plan.workspace_words].view(-1, gt.SLOT_WORDS)[:, : gt.CLEAN_WORDS].any()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, columns, block_topk", [(7, 9000, 512), (3, 70000, 512), (20, 3000, 64), (2, 640, 639)])
@pytest.mark.parametrize("kind", ["random", "ties", "relu", "constant"])
def test_every_split_equals_the_oracle(rows, columns, block_topk, kind):
    """Every split from 1 to 32 that fits, both kernels, one and several row slots: the same output."""
    gen = torch.Generator().manual_seed(7)
    logits = native_case_logits(gen, rows, columns, kind)
    visible = edge_visible(gen, rows, columns, block_topk)
    want = _oracle(logits, visible, block_topk)
    poisoned = nan_past_visible(logits, visible)
    platform = Platform.of(logits.device)
    for split in range(1, gt.MAX_SPLIT + 1):
        for threads in (256, 512):
            for slots in (None, 1):
                try:
                    plan = gt.split_plan(split, rows, columns, platform, threads=threads, slots=slots)
                except ValueError:
                    continue
                out = torch.full_like(want, -7)
                runtime.grid_block_topk(poisoned, visible, out, block_topk, plan=plan)
                assert torch.equal(out, want), plan.describe()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
def test_the_fused_expansion_equals_the_torch_expansion(wide):
    rows, columns, k, ratio, token_topk = 8, 40000, 512, 4, 2048
    gen = torch.Generator().manual_seed(3)
    logits = native_case_logits(gen, rows, columns, "relu")
    visible = edge_visible(gen, rows, columns, k)
    want = _oracle(logits, visible, k)
    index = torch.int64 if wide else torch.int32
    requests = torch.tensor([0, 1, 2, 3, 4, 2, -1, 5], device="cuda").to(index)
    contexts = torch.tensor([4 * columns, 100, 4 * int(want[2, 5]) + 2, 0, 4 * columns, 4 * columns],
                            device="cuda").to(index)
    positions = torch.randint(-1, 4 * columns, (rows,), generator=gen).to(index).cuda()
    want_tokens = torch.empty((rows, token_topk + ratio - 1), dtype=torch.int32, device="cuda")
    torch_expand_block_indices(want, positions, contexts, requests, ratio, token_topk, want_tokens)
    for split in (2, 5, 20):  # a CTA holds at most MAX_CHUNK keys: 40000 columns need 2 CTAs at least
        plan = gt.split_plan(split, rows, columns, Platform.of(logits.device))
        groups, tokens = torch.full_like(want, -7), torch.full_like(want_tokens, -7)
        runtime.grid_block_topk(logits, visible, groups, k, plan=plan,
                                expand_into=(positions, contexts, requests, tokens, ratio, token_topk))
        assert torch.equal(groups, want) and torch.equal(tokens, want_tokens), split


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, columns", [(1, 65536), (16, 67072), (36, 32768), (256, 25088), (9, 700)])
def test_cuda_graph_replay_with_new_lengths(monkeypatch, rows, columns):
    """Captured once (its workspace zeroed inside the capture), replayed with new visible counts written in place."""
    from qsa_aiter.tools.timing import capture_graph

    gen = torch.Generator().manual_seed(rows)
    k = 512
    logits = native_case_logits(gen, rows, columns, "random")
    visible = edge_visible(gen, rows, columns, k)
    out = torch.empty((rows, k), dtype=torch.int32, device="cuda")
    _forced(monkeypatch)
    qsa_aiter.qsa_block_topk(logits, visible, k, out=out)  # loads the kernel before the capture
    graph, _ = capture_graph(lambda: qsa_aiter.qsa_block_topk(logits, visible, k, out=out))
    for step in range(4):
        visible.copy_(torch.randint(-3, columns + 4, (rows,), generator=gen, dtype=torch.int32))
        graph.replay()
        assert torch.equal(out, _oracle(logits, visible, k)), f"replay {step}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("contexts, rows_per_request", [([65536, 98304, 131072] * 3, 4), ([262144], 1),
                                                        ([8000, 30000], 1)])
def test_selection_through_the_grid_select_equals_selection_through_native(monkeypatch, contexts, rows_per_request):
    from qsa_aiter.tools.workloads import make_batch

    batch = make_batch(contexts, rows_per_request, page_size=64, device="cuda",
                       generator=torch.Generator().manual_seed(11))
    args, hints = batch.args()[:6], dict(max_query_len=rows_per_request)
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "native")
    native_tokens = qsa_aiter.qsa_select_paged_tokens(*args, 2048, 4, **batch.kwargs(), **hints)
    _forced(monkeypatch)
    grid_tokens = qsa_aiter.qsa_select_paged_tokens(*args, 2048, 4, **batch.kwargs(), **hints)
    assert torch.equal(grid_tokens, native_tokens)
    report = qsa_aiter.explain_selection(*args, 2048, 4, max_query_len=rows_per_request)
    assert "* native_grid: serves" in report and "plan (arch sm_" in report

"""The native CUDA block top-k (``kernels/selection/native_topk.py`` and ``.cu``): on the CPU, the declarations against
the source (shared-memory layouts, parameters, kernels), the plan choice against its documented rules, the launch
arguments, and a Python emulation of the kernels' key mapping and selection rule against the oracle; on the GPU
(``gpu``), the kernels against the oracle on the selection tests' cases, every plan forced, CUDA-graph replay with
new lengths written in place, and selection through the native top-k equal to selection through the Triton one.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from pathlib import Path

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring.histogram import score_keys
from qsa_aiter.kernels.selection import native_topk as nt
from qsa_aiter.kernels.selection.reference import reference_block_topk, torch_block_topk
from qsa_aiter.runtime.jit import nvrtc

from helpers import random_logits, visible_counts, write_new_lengths
from native_cases import edge_visible, nan_past_visible, native_case_logits, native_plans

ON_GPU = torch.cuda.is_available()
H200 = Platform.named("sm_90")
SOURCE = nt.source()
ALL = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------------------------
# The declarations against the source
# ---------------------------------------------------------------------------------------------------------------


def _define(name: str) -> int:
    return int(re.search(rf"#define {name} (\d+)", SOURCE).group(1))


def test_shared_memory_layouts_match_the_source():
    assert nt.ROW_FIXED_BYTES == 4 * _define("ROW_FIXED_WORDS")
    assert nt.CLUSTER_FIXED_BYTES == 4 * _define("CL_FIXED_WORDS")
    # the fixed parts hold what the header lists: H, scan, res, 16 mbarriers (row); H, S0, S1, S2, scan, res, base,
    # 16 mbarriers (cluster)
    assert _define("ROW_FIXED_WORDS") == 2048 + 128 + 8 + 32
    assert _define("CL_FIXED_WORDS") == 3 * 2048 + 1024 + 128 + 8 + 8 + 32


@pytest.mark.parametrize("macro, scalars", [("TOPK_ROW_PARAMS", nt.ROW_SCALARS),
                                            ("TOPK_CL_PARAMS", nt.CLUSTER_SCALARS)])
def test_kernel_parameters_match_the_source(macro, scalars):
    body = re.search(rf"#define {macro}\s*\\\n(.*?)\n#define", SOURCE, re.S).group(1).replace("\\\n", " ")
    params = [" ".join(p.split()) for p in body.split(",")]
    declared = [f"{ctype.replace('*', ' *')} __restrict__ {name}" if "*" in ctype else f"{ctype} {name}"
                for name, ctype in nt.POINTERS] + [f"int {name}" for name in scalars]
    normalised = [p.replace(" *__restrict__", " * __restrict__") for p in params]
    assert normalised == declared


@pytest.mark.parametrize("variant", nt.VARIANTS, ids=lambda v: v.name)
def test_every_variant_is_a_kernel_of_the_source(variant):
    cluster = rf"__cluster_dims__\({variant.cluster}, 1, 1\) " if variant.cluster > 1 else ""
    pattern = (rf'extern "C" __global__ void {cluster}TOPK_LAUNCH_BOUNDS\({variant.threads}, '
               rf"{variant.blocks_per_multiprocessor}\) {variant.name}\(")
    assert re.search(pattern, SOURCE), pattern
    assert f"defined(TOPK_KERNEL_{variant.name})" in SOURCE
    assert variant.defines == ("TOPK_SINGLE", f"TOPK_KERNEL_{variant.name}")
    assert variant.max_registers == 64


def test_the_source_is_portable_and_self_contained():
    """``source()`` is one text (no include path for NVRTC or hipRTC): the file includes only ``native_compat.h``, which
    is spliced in; the vendor is tested there only, and the warp width is checked against the target's."""
    text = nt.SOURCE_PATH.read_text()
    assert re.findall(r"^[ \t]*#[ \t]*include.*$", text, re.M) == ['#include "native_compat.h"']
    assert not re.search(r"^\s*#\s*include", SOURCE, re.M)
    assert nt.COMPAT_PATH.read_text() in SOURCE
    assert "TOPK_HIP" not in re.sub(r"//.*", "", text), "the .cu tests the vendor: native_compat.h's job"
    assert "static_assert(TOPK_WARP_SIZE == TOPK_TARGET_WARP_SIZE" in SOURCE and "#define WS TOPK_WARP_SIZE" in SOURCE
    # the CUDA-only features sit behind their switches, decided by the target
    for switch in ("TOPK_CLUSTERS", "TOPK_BULK"):
        assert f"#ifndef {switch}\n#if !TOPK_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)" in SOURCE
    assert " us " not in SOURCE and "µs" not in SOURCE, "measurements belong in docs/, not in the source"


#: The measured candidate switches the source had (docs/design-log/2026-12-06-native-topk-switches.md): only their
#: shipped side is left, as plain code.
REMOVED_SWITCHES = ("TOPK_KEY_FADD", "TOPK_OWNER_ZERO", "TOPK_EARLY_COPY", "TOPK_GATHER", "TOPK_VECTOR_SMEM",
                    "TOPK_FUSED_TOKENS_ROWS", "TOPK_FUSED_TOKENS_CLUSTERS", "TOPK_CLASSIFY_SKIP", "TOPK_HIST",
                    "TOPK_PIECE_QUADS", "TOPK_EXPAND_SMEM", "TOPK_EXPAND_VEC", "TOPK_CLASSIFY_UNITS",
                    "TOPK_CLASSIFY_FULL_QUADS", "TOPK_FAST")
#: The macros a build may set: what to build and for which target, not measured alternatives.
BUILD_MACROS = {"TOPK_WARP_SIZE", "TOPK_EMULATE", "TOPK_CLUSTERS", "TOPK_BULK", "TOPK_TRACE", "TOPK_SINGLE",
                "TOPK_NO_CLUSTER16"}


def test_no_measured_switch_is_left_in_the_source():
    """Every macro a build may set (``#ifndef`` / ``#ifdef`` / ``defined``) is a build fact; the measured switches are
    gone from the source, and the design log keeps each with the side that ships."""
    settable = set(re.findall(r"#\s*ifn?def\s+(TOPK_\w+)", SOURCE)) | set(re.findall(r"defined\((TOPK_\w+)\)", SOURCE))
    settable = {name for name in settable if not name.startswith("TOPK_KERNEL_")}
    assert settable <= BUILD_MACROS, settable - BUILD_MACROS
    for name in REMOVED_SWITCHES:
        assert not re.search(rf"\b{name}\b", SOURCE), name
    log = (Path(__file__).resolve().parents[3] / "docs" / "design-log" / "2026-12-06-native-topk-switches.md")
    rows = dict(re.findall(r"^\| `(TOPK_\w+)` \| (\d+) \|", log.read_text(), flags=re.M))
    assert set(rows) | {"TOPK_FAST"} == set(REMOVED_SWITCHES)
    doc = (Path(__file__).resolve().parents[3] / "docs" / "selection.md").read_text()
    assert "design-log/2026-12-06-native-topk-switches.md" in doc


@pytest.mark.nvrtc
def test_a_warp_width_that_is_not_the_targets_does_not_compile():
    """``-DTOPK_WARP_SIZE`` is checked against the target's width (32 on every NVIDIA target); a cluster kernel asked
    for where clusters do not exist (below sm_90) stops the build naming why."""
    rows = ("-DTOPK_SINGLE", "-DTOPK_KERNEL_topk_rows_256")
    built = nvrtc.compile_cubin(SOURCE, "sm_90", (*rows, "-DTOPK_WARP_SIZE=32"), name="native_topk.cu")
    assert "topk_rows_256" in nvrtc.ptxas_report(built.log)
    with pytest.raises(nvrtc.NvrtcError, match="not the target's warp width"):
        nvrtc.compile_cubin(SOURCE, "sm_90", (*rows, "-DTOPK_WARP_SIZE=64"), name="native_topk.cu")
    with pytest.raises(nvrtc.NvrtcError, match="the cluster kernels are compiled out on this target"):
        nvrtc.compile_cubin(SOURCE, "sm_80", ("-DTOPK_SINGLE", "-DTOPK_KERNEL_topk_cluster4_512"),
                            name="native_topk.cu")


def test_variants_per_platform():
    assert nt.variants_for(H200) == nt.VARIANTS
    ampere = dataclasses.replace(H200, arch="sm_80", capability=(8, 0))
    assert [v.name for v in nt.variants_for(ampere)] == ["topk_rows_256", "topk_rows_512"]
    for arch in ("gfx942", "gfx950"):  # the row kernels: clusters are compiled out on ROCm
        assert [v.name for v in nt.variants_for(Platform.named(arch))] == ["topk_rows_256", "topk_rows_512"]
    assert nt.variants_for(Platform("cpu", "cpu", (0, 0), 0, False)) == ()
    assert [v.non_portable_cluster for v in nt.VARIANTS] == [False] * 5 + [True]


# ---------------------------------------------------------------------------------------------------------------
# The plan choice
# ---------------------------------------------------------------------------------------------------------------


def test_h200_facts():
    assert H200.multiprocessors == 132 and H200.capability == (9, 0)
    assert H200.shared_memory_per_block == 227 * 1024 and H200.shared_memory_per_multiprocessor == 228 * 1024
    assert nt.two_per_multiprocessor_bytes(H200) == 112 * 1024


@pytest.mark.parametrize("rows, columns, name, cached", [
    (36, 32768, "topk_cluster4_512", True),  # verify 9x4 @ 64K-128K: cluster 8 would need two waves
    (16, 65536, "topk_cluster8_512", True),  # verify 4x4 @ 262K
    (1, 65536, "topk_cluster8_512", True),  # decode 1x1 @ 262K
    (66, 32768, "topk_cluster4_512", True),  # the most rows the cluster path takes (2 * 66 = 132 SMs)
    (67, 32768, "topk_rows_512", True),
    (256, 25088, "topk_rows_512", True),  # verify 64x4 @ 98K
    (128, 25088, "topk_rows_512", True),  # decode 128x1 @ 98K: 2 * 128 > 132
    (4096, 8192, "topk_rows_256", True),  # prefill 4096 @ 32K
    (16384, 24576, "topk_rows_512", True),  # prefill 16K @ 96K
    (1, 8191, "topk_rows_256", True),  # too short for a cluster
    (5, 12288, "topk_cluster8_512", True),  # few rows from 8192 columns: a cluster each
    (200, 12288, "topk_rows_256", True),  # the widest row of the 256-thread kernel
    (200, 12289, "topk_rows_512", True),
    (200, 70000, "topk_rows_512", False),  # too long to cache
    (1, 1 << 20, "topk_rows_512", False),  # too long for any cluster's chunk
])
def test_plan_choice(rows, columns, name, cached):
    plan = nt.choose_plan(rows, columns, 512, H200)
    assert (plan.variant.name, plan.cached) == (name, cached)
    assert plan.shared_bytes <= H200.shared_memory_per_block
    if plan.variant.cluster > 1:
        assert plan.buffer == (-(-columns // plan.variant.cluster) + 3) // 4 * 4
        per_sm = 2 if plan.shared_bytes <= nt.two_per_multiprocessor_bytes(H200) else 1
        assert rows * plan.variant.cluster <= H200.multiprocessors * per_sm, "one wave"
    elif cached:
        assert plan.buffer == (columns + 3) // 4 * 4 and plan.buffer <= nt.MAX_CACHED_COLUMNS
    else:
        assert (plan.buffer, plan.candidates) == (nt.UNCACHED_BUFFER, 0)


def test_candidate_list_keeps_a_cta_at_two_per_multiprocessor():
    plan = nt.choose_plan(256, 25088, 512, H200)
    assert plan.candidates == 1168  # 4096 would push the 98K rows' CTA over 112 KB
    assert plan.shared_bytes <= nt.two_per_multiprocessor_bytes(H200)
    assert nt.choose_plan(4096, 8192, 512, H200).candidates == nt.MAX_CANDIDATES  # fits twice anyway
    wide = nt.choose_plan(200, 40000, 512, H200)  # never fits twice: the whole list
    assert wide.candidates == nt.MAX_CANDIDATES and wide.shared_bytes > nt.two_per_multiprocessor_bytes(H200)
    for columns in range(8, 60000, 997):
        plan = nt.rows_plan(512, columns, H200)
        assert plan.candidates % 8 == 0 and nt.MIN_CANDIDATES <= plan.candidates <= nt.MAX_CANDIDATES


def test_rows_no_wider_than_the_budget_take_the_trivial_plan():
    plan = nt.choose_plan(5, 512, 512, H200)
    assert plan == nt.trivial_plan()
    assert (plan.variant.name, plan.cached, plan.buffer, plan.candidates) == ("topk_rows_256", False, 0, 0)
    assert plan.shared_bytes == nt.ROW_FIXED_BYTES
    assert nt.choose_plan(5, 513, 512, H200).cached


def test_plans_for_lists_the_plans_that_fit():
    plans = nt.plans_for(4, 9000, 512, H200)
    assert list(plans) == ["rows_256", "rows_512", "rows_512_uncached", "cluster2", "cluster4", "cluster8"]
    assert plans["rows_512_uncached"] == nt.rows_plan(512, 9000, H200, cached=False)
    assert plans["cluster4"] == nt.cluster_plan(4, 9000, H200)
    ampere = dataclasses.replace(H200, arch="sm_80", capability=(8, 0))
    assert not any(name.startswith("cluster") for name in nt.plans_for(4, 9000, 512, ampere))
    assert "rows_256" not in nt.plans_for(2, 70000, 512, H200)  # a cached row holds at most 65536 columns
    assert nt.plans_for(3, 500, 512, H200) == {"trivial": nt.trivial_plan()}


def test_shared_bytes_follow_the_layouts():
    row = nt.rows_plan(256, 1000, H200)
    assert row.shared_bytes == nt.ROW_FIXED_BYTES + 4 * (32 + row.candidates // 2 + 1000)
    uncached = nt.rows_plan(512, 100000, H200, cached=False)
    assert uncached.shared_bytes == nt.ROW_FIXED_BYTES + 4 * nt.UNCACHED_BUFFER
    cluster = nt.cluster_plan(4, 32768, H200)
    assert cluster.buffer == 8192
    assert cluster.shared_bytes == nt.CLUSTER_FIXED_BYTES + 4 * (256 + cluster.candidates // 2 + 8192)


def test_cluster_sizes_can_be_named():
    assert nt.choose_plan(1, 65536, 512, H200, cluster_sizes=(16,)).variant.name == "topk_cluster16_512"
    assert nt.choose_plan(1, 65536, 512, H200, cluster_sizes=()).variant.name == "topk_rows_512"


def test_plans_on_other_platforms():
    ampere = dataclasses.replace(H200, arch="sm_80", capability=(8, 0), multiprocessors=108,
                                 shared_memory_per_block=163 * 1024, shared_memory_per_multiprocessor=164 * 1024)
    plan = nt.choose_plan(1, 65536, 512, ampere)
    assert plan.variant.cluster == 1 and plan.variant.name == "topk_rows_512" and not plan.cached  # 256 KB of keys
    plan = nt.choose_plan(36, 32768, 512, ampere)
    assert plan.variant.name == "topk_rows_512" and plan.cached
    assert plan.shared_bytes <= ampere.shared_memory_per_block
    tiny = dataclasses.replace(H200, shared_memory_per_block=48 * 1024)
    plan = nt.choose_plan(400, 20000, 512, tiny)
    assert not plan.cached and plan.buffer == (48 * 1024 - nt.ROW_FIXED_BYTES) // 16 * 4  # the buffer that fits
    assert plan.shared_bytes <= 48 * 1024
    assert nt.plan_reason(4096, 512, Platform.named("gfx942")) is None  # 64 KB of LDS hold an uncached row
    cpu = Platform.of(torch.device("cpu"))
    assert "bytes of shared memory per block" in nt.plan_reason(4096, 512, cpu)
    with pytest.raises(ValueError, match="shared memory"):
        nt.choose_plan(4, 4096, 512, cpu)
    assert "below 2**31" in nt.plan_reason(2**31, 512, H200)


def test_every_plan_fits_and_fills_at_most_one_wave(rng):
    for _ in range(300):
        rows = int(torch.randint(1, 20000, (), generator=rng))
        columns = int(torch.randint(1, 300000, (), generator=rng))
        k = int(torch.randint(1, 4096, (), generator=rng))
        plan = nt.choose_plan(rows, columns, k, H200)
        assert plan.shared_bytes <= H200.shared_memory_per_block
        if plan.cached:
            assert plan.buffer <= nt.MAX_CACHED_COLUMNS and plan.buffer * plan.variant.cluster >= columns
        if plan.variant.cluster > 1:
            assert 2 * rows <= H200.multiprocessors and columns >= nt.CLUSTER_MIN_COLUMNS
            assert rows * plan.variant.cluster <= 2 * H200.multiprocessors


# ---------------------------------------------------------------------------------------------------------------
# Launch arguments
# ---------------------------------------------------------------------------------------------------------------


def test_row_launch_arguments():
    plan = nt.choose_plan(256, 25088, 512, H200)
    call = nt.launch_arguments(plan, 256, 25088, 25100, 512, True)
    assert (call.kernel, call.grid, call.block, call.shared_bytes) == ("topk_rows_512", (256, 1, 1), (512, 1, 1),
                                                                       plan.shared_bytes)
    assert call.pointers == (("logits", "const float*"), ("visible", "const int*"), ("out", "int*"),
                             ("positions", "const void*"), ("contexts", "const void*"), ("requests", "const void*"),
                             ("tokens", "int*"), ("histogram", "const unsigned*"))
    assert call.scalars == (("rows", "int", 256), ("columns", "int", 25088), ("ld", "int", 25100), ("K", "int", 512),
                            ("buf_cap", "int", 25088), ("cached", "int", 1), ("vec_ok", "int", 1),
                            ("cand_cap", "int", 1168), ("num_requests", "int", 0), ("ratio", "int", 0),
                            ("width", "int", 0), ("tok_ld", "int", 0), ("idx_wide", "int", 0))
    assert call.scalar("ld") == 25100
    fused = nt.launch_arguments(plan, 256, 25088, 25100, 512, True,
                                nt.Expansion(64, 4, 2051, 2060, wide_contexts=True, wide_requests=True))
    assert [value for name, _, value in fused.scalars if name in nt.EXPANSION_SCALARS] == [64, 4, 2051, 2060, 6]
    assert fused.scalars[:8] == call.scalars[:8]


def test_cluster_launch_arguments():
    plan = nt.choose_plan(36, 32768, 512, H200)
    call = nt.launch_arguments(plan, 36, 32768, 32768, 512, False)
    assert (call.kernel, call.grid, call.block) == ("topk_cluster4_512", (144, 1, 1), (512, 1, 1))
    assert [name for name, _, _ in call.scalars] == list(nt.CLUSTER_SCALARS)
    assert (call.scalar("cap"), call.scalar("vec_ok"), call.scalar("cand_cap")) == (8192, 0, plan.candidates)


def test_launch_arguments_refuse_what_a_c_int_cannot_hold():
    plan = nt.rows_plan(512, 1000, H200)
    with pytest.raises(ValueError, match="below 2\\*\\*31"):
        nt.launch_arguments(plan, 2, 1000, 2**31, 16, True)
    with pytest.raises(ValueError, match="rows must be"):
        nt.launch_arguments(plan, 0, 1000, 1000, 16, True)


# ---------------------------------------------------------------------------------------------------------------
# A Python emulation of the kernels' key mapping and selection rule
# ---------------------------------------------------------------------------------------------------------------


def emulate_row(scores: torch.Tensor, k: int) -> list[int]:
    """The kernels' radix select on one row of ``n > k`` scores: digits of 11, 11 and 10 bits from the top; in each
    pass the threshold bin is the one where the count of keys above it is below the rank still owed and the count
    including it reaches it; a bin taken whole ends the search (threshold: the bin's lowest key, every tie taken).
    Then a column is selected iff its key is above the threshold, or equal to it and among the first ``e`` equal
    ones in column order."""
    keys = score_keys(scores)
    prefix, mask, owed, threshold, ties = 0, 0, k, None, ALL
    for shift, width in ((21, 11), (10, 11), (0, 10)):
        digits = (keys >> shift) & ((1 << width) - 1)
        hist = torch.bincount(digits[(keys & mask) == prefix], minlength=1 << width)
        above = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0]) - hist  # keys in higher bins
        chosen = int(torch.nonzero((above < owed) & (above + hist >= owed)).max())
        owed, count = owed - int(above[chosen]), int(hist[chosen])
        prefix |= chosen << shift
        mask |= ((1 << width) - 1) << shift
        if count == owed:
            threshold = prefix
            break
    else:
        threshold, ties = prefix, owed
    equal = keys == threshold
    rank = torch.cumsum(equal.long(), 0)
    selected = (keys > threshold) | (equal & (rank <= ties))
    return torch.nonzero(selected).flatten().tolist()


def emulate_block_topk(logits: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.full((logits.shape[0], k), -1, dtype=torch.int32)
    for r in range(logits.shape[0]):
        n = min(max(int(visible[r]), 0), logits.shape[1])
        chosen = list(range(n)) if n <= k else emulate_row(logits[r, :n], k)
        out[r, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def test_order_keys_sort_as_the_floats():
    values = torch.tensor([float("-inf"), -3.4e38, -1.5, -1e-45, -0.0, 0.0, 1e-45, 1e-38, 1.0, 3.4e38, float("inf")])
    keys = score_keys(values)
    assert bool((keys[1:] >= keys[:-1]).all()) and int(keys[4]) == int(keys[5]) == 0x80000000
    assert bool((keys[1:4] > keys[:3]).all()) and bool((keys[6:] > keys[5:-1]).all())
    assert int(keys[0]) == 0x007FFFFF  # -inf: the lowest key a float has


@pytest.mark.parametrize("kind", ["random", "ties", "equal", "zeros", "spread"])
def test_the_selection_rule_equals_the_oracle(rng, kind):
    tokens, columns, k = 9, 700, 64
    logits = random_logits(rng, tokens, columns, "random" if kind in ("zeros", "spread") else kind).cpu()
    if kind == "zeros":  # long runs of exact 0.0 after the ReLU
        logits = logits.clamp_min(0.0)
        logits[2, :500] = 0.0
    elif kind == "spread":  # keys apart only in their low bits, and huge/denormal magnitudes
        logits[2] = 1.0 + torch.arange(columns) * 2**-23
        logits[3] = torch.randn(columns, generator=rng) * 1e-40
        logits[4, ::2] = float("inf")
    visible = visible_counts(tokens, columns, k, rng).cpu()
    visible[6], visible[7] = -5, columns + 9  # clamped
    assert torch.equal(emulate_block_topk(logits, visible, k), reference_block_topk(logits, visible, k))


# ---------------------------------------------------------------------------------------------------------------
# On the GPU
# ---------------------------------------------------------------------------------------------------------------

def _native(monkeypatch):
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "native")


SHAPES = [  # (rows, columns, block_topk): the work points' shapes and the selection tests' small ones
    (11, 1500, 16), (11, 1500, 100), (6, 1400, 64), (3, 333, 5), (9, 7, 512),
    (36, 32768, 512), (16, 67072, 512), (1, 65536, 512), (2, 131072, 512),
    (128, 25088, 512), (256, 25088, 512), (200, 70000, 512), (4096, 8192, 512), (16384, 1000, 512),
]
KINDS = ["random", "ties", "equal", "relu", "relu_sparse", "constant", "neg_inf"]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, columns, block_topk", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_native_topk_equals_the_oracle(monkeypatch, rows, columns, block_topk, kind):
    """``qsa_block_topk`` forced to the native top-k (its automatic plan) on NaN-poisoned rows equals the torch path
    (and the row-by-row oracle where it is quick), and repeats bitwise."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{rows} {columns} {block_topk} {kind}".encode()))
    logits = native_case_logits(gen, rows, columns, kind)
    visible = edge_visible(gen, rows, columns, block_topk)
    poisoned = nan_past_visible(logits, visible)
    want = torch.empty((rows, block_topk), dtype=torch.int32, device="cuda")
    torch_block_topk(logits, visible, block_topk, want)
    if rows <= 64:
        assert torch.equal(want, reference_block_topk(logits, visible, block_topk))
    _native(monkeypatch)
    out = torch.full_like(want, -7)
    got = qsa_aiter.qsa_block_topk(poisoned, visible, block_topk, out=out)
    assert got is out and torch.equal(got, want)
    again = qsa_aiter.qsa_block_topk(poisoned, visible, block_topk)
    assert torch.equal(again, got), "not bitwise repeatable"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, columns, block_topk", [(7, 9000, 512), (3, 40000, 512), (20, 3000, 64)])
@pytest.mark.parametrize("kind", ["random", "ties", "relu", "constant"])
def test_every_plan_equals_the_oracle(rows, columns, block_topk, kind):
    from qsa_aiter.runtime.native_topk import native_block_topk

    gen = torch.Generator().manual_seed(7)
    logits = native_case_logits(gen, rows, columns, kind)
    visible = edge_visible(gen, rows, columns, block_topk)
    want = torch.empty((rows, block_topk), dtype=torch.int32, device="cuda")
    torch_block_topk(logits, visible, block_topk, want)
    poisoned = nan_past_visible(logits, visible)
    for plan in native_plans(rows, columns, block_topk):
        out = torch.full_like(want, -7)
        native_block_topk(poisoned, visible, out, block_topk, plan=plan)
        assert torch.equal(out, want), plan.describe()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, columns, block_topk", [(7, 9000, 512), (3, 40000, 512), (20, 3000, 64),
                                                       (300, 8192, 512), (9, 700, 16), (2, 65536, 512)])
@pytest.mark.parametrize("kind", KINDS)
def test_every_plan_from_the_scorers_histogram_equals_the_oracle(rows, columns, block_topk, kind):
    from qsa_aiter.kernels.scoring.histogram import torch_score_histogram
    from qsa_aiter.runtime.native_topk import native_block_topk

    gen = torch.Generator().manual_seed(zlib.crc32(f"hist {rows} {columns} {kind}".encode()))
    logits = native_case_logits(gen, rows, columns, kind)
    visible = edge_visible(gen, rows, columns, block_topk)
    want = torch.empty((rows, block_topk), dtype=torch.int32, device="cuda")
    torch_block_topk(logits, visible, block_topk, want)
    histogram = torch_score_histogram(logits, visible)
    poisoned = nan_past_visible(logits, visible)
    for plan in native_plans(rows, columns, block_topk):
        out = torch.full_like(want, -7)
        native_block_topk(poisoned, visible, out, block_topk, plan=plan, histogram=histogram)
        assert torch.equal(out, want), plan.describe()
        again = torch.full_like(want, -7)
        native_block_topk(poisoned, visible, again, block_topk, plan=plan, histogram=histogram)
        assert torch.equal(again, out), f"{plan.describe()}: not bitwise repeatable"


@pytest.mark.parametrize("shape, dtype", [((4, 2047), torch.int32), ((3, 2048), torch.int32), ((4, 2048), torch.int64)])
def test_a_histogram_of_another_shape_or_dtype_is_refused(shape, dtype):
    from qsa_aiter.runtime.native_topk import native_block_topk

    logits, visible = torch.zeros(4, 9000), torch.full((4,), 9000, dtype=torch.int32)
    out = torch.empty(4, 512, dtype=torch.int32)
    with pytest.raises(ValueError, match="histogram must be a contiguous int32"):
        native_block_topk(logits, visible, out, 512, histogram=torch.zeros(shape, dtype=dtype))
    with pytest.raises(ValueError, match="histogram must be a contiguous int32"):
        native_block_topk(logits, visible, out, 512, histogram=torch.zeros(2048, 4, dtype=torch.int32).t())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("wide", [False, True])
def test_the_fused_expansion_equals_the_torch_expansion(wide):
    """The fused expansion of every plan (with and without the scorer's histogram) equals the torch expansion of the
    oracle's groups, with groups past their request's context (the lengths here do not bound the visible counts),
    bad request ids and int32/int64 indices."""
    from qsa_aiter.kernels.scoring.histogram import torch_score_histogram
    from qsa_aiter.kernels.selection.reference import torch_expand_block_indices
    from qsa_aiter.runtime.native_topk import native_block_topk

    gen = torch.Generator().manual_seed(11)
    rows, columns, k, ratio, token_topk = 6, 9000, 128, 4, 512
    logits = native_case_logits(gen, rows, columns, "relu")
    visible = edge_visible(gen, rows, columns, k)
    index = torch.int64 if wide else torch.int32
    requests = torch.tensor([0, 1, 2, 3, 4, -1]).to(index).cuda()
    contexts = torch.tensor([4 * columns, 100, 3 * columns + 2, 0]).to(index).cuda()
    positions = torch.randint(-1, 4 * columns, (rows,), generator=gen).to(index).cuda()
    want = torch.empty((rows, k), dtype=torch.int32, device="cuda")
    torch_block_topk(logits, visible, k, want)
    want_tokens = torch.empty((rows, token_topk + ratio - 1), dtype=torch.int32, device="cuda")
    torch_expand_block_indices(want, positions, contexts, requests, ratio, token_topk, want_tokens)
    histogram = torch_score_histogram(logits, visible)
    for plan in native_plans(rows, columns, k):
        for hist in (None, histogram):
            groups = torch.full((rows, k), -7, dtype=torch.int32, device="cuda")
            tokens = torch.full_like(want_tokens, -7)
            native_block_topk(logits, visible, groups, k, plan=plan, histogram=hist,
                              expand_into=(positions, contexts, requests, tokens, ratio, token_topk))
            assert torch.equal(groups, want) and torch.equal(tokens, want_tokens), plan.describe()


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_layouts_the_kernel_does_not_take_directly(monkeypatch):
    """A row stride that is not a multiple of 4 and a misaligned base (no float4 loads, no bulk copies), a strided
    ``visible`` and an ``out`` whose rows are not ``block_topk`` apart."""
    gen = torch.Generator().manual_seed(9)
    rows, columns, k = 40, 5000, 128
    wide = native_case_logits(gen, rows, columns + 3, "random")
    logits = wide[:, 1:columns + 1]
    visible = edge_visible(gen, 2 * rows, columns, k)[::2]
    want = torch.empty((rows, k), dtype=torch.int32, device="cuda")
    torch_block_topk(logits, visible, k, want)
    _native(monkeypatch)
    out = torch.full((rows, k + 5), -7, dtype=torch.int32, device="cuda")[:, :k]
    assert torch.equal(qsa_aiter.qsa_block_topk(logits, visible, k, out=out), want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, columns", [(16, 67072), (36, 32768), (256, 25088), (9, 700)])
def test_cuda_graph_replay_with_new_lengths(monkeypatch, rows, columns):
    from qsa_aiter.tools.timing import capture_graph

    gen = torch.Generator().manual_seed(rows)
    k = 512
    logits = native_case_logits(gen, rows, columns, "random")
    visible = edge_visible(gen, rows, columns, k)
    out = torch.empty((rows, k), dtype=torch.int32, device="cuda")
    want = torch.empty_like(out)
    _native(monkeypatch)
    graph, _ = capture_graph(lambda: qsa_aiter.qsa_block_topk(logits, visible, k, out=out))
    for step in range(4):
        visible.copy_(torch.randint(-3, columns + 4, (rows,), generator=gen, dtype=torch.int32))
        graph.replay()
        torch_block_topk(logits, visible, k, want)
        assert torch.equal(out, want), f"replay {step}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("contexts, rows_per_request", [([65536, 98304, 131072] * 3, 4), ([8000, 30000], 1),
                                                        ([20000], 600)])
def test_selection_through_native_equals_selection_through_triton(monkeypatch, contexts, rows_per_request):
    from qsa_aiter.tools.workloads import make_batch

    gen = torch.Generator().manual_seed(11)
    batch = make_batch(contexts, rows_per_request, page_size=64, device="cuda", generator=gen)
    args = batch.args()[:6]
    hints = dict(max_query_len=rows_per_request)
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "triton")
    triton_tokens = qsa_aiter.qsa_select_paged_tokens(*args, 2048, 4, **batch.kwargs(), **hints)
    _native(monkeypatch)
    native_tokens = qsa_aiter.qsa_select_paged_tokens(*args, 2048, 4, **batch.kwargs(), **hints)
    assert torch.equal(native_tokens, triton_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows, columns", [(16, 67072), (4096, 8192)])
def test_a_programmatic_launch_waits_for_the_kernel_before_it(rows, columns):
    """A programmatic dependent launch (``QSA_AITER_TOPK_PDL``) right after the kernel that writes its logits, in a
    CUDA graph replayed on new logits and lengths: each replay equals the oracle on that replay's inputs."""
    from qsa_aiter.runtime.native_topk import native_block_topk
    from qsa_aiter.tools.timing import capture_graph

    gen = torch.Generator().manual_seed(rows)
    k = 512
    source = native_case_logits(gen, rows, columns, "random")
    logits, visible = torch.empty_like(source), edge_visible(gen, rows, columns, k)
    out, want = (torch.empty((rows, k), dtype=torch.int32, device="cuda") for _ in range(2))

    def call():
        torch.mul(source, 3.0, out=logits)  # the producer: the top-k must see all of its writes
        native_block_topk(logits, visible, out, k, programmatic=True)

    graph, _ = capture_graph(call)
    for step in range(4):
        source.copy_(native_case_logits(gen, rows, columns, ("random", "relu", "ties", "random")[step]))
        visible.copy_(torch.randint(-3, columns + 4, (rows,), generator=gen, dtype=torch.int32))
        out.fill_(-7)
        graph.replay()
        torch_block_topk(source * 3.0, visible, k, want)
        assert torch.equal(out, want), f"replay {step}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_selection_through_native_in_a_cuda_graph(monkeypatch, pdl):
    from qsa_aiter.tools.timing import capture_graph
    from qsa_aiter.tools.workloads import make_batch

    gen = torch.Generator().manual_seed(3)
    batch = make_batch([40000] * 8, 4, page_size=64, device="cuda", generator=gen)
    q, cache, table, t2r, pos, ctx = batch.args()[:6]
    out = torch.empty((q.shape[0], 2048 + 3), dtype=torch.int32, device="cuda")
    monkeypatch.setenv("QSA_AITER_TOPK_PDL", pdl)
    _native(monkeypatch)

    def call():
        return qsa_aiter.qsa_select_paged_tokens(q, cache, table, t2r, pos, ctx, 2048, 4, out=out, max_seq_len=40000,
                                                 phase="verify", max_query_len=4)

    graph, _ = capture_graph(call)
    for step in range(3):
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        write_new_lengths(gen, ctx, pos, 2000, 40000, 4)
        graph.replay()
        replayed = out.clone()
        monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "triton")
        eager = qsa_aiter.qsa_select_paged_tokens(q, cache, table, t2r, pos, ctx, 2048, 4, max_seq_len=40000,
                                                  phase="verify", max_query_len=4)
        _native(monkeypatch)
        assert torch.equal(replayed, eager), f"replay {step}"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_explain_selection_shows_native_first_and_triton_forced(monkeypatch):
    from qsa_aiter.tools.workloads import make_batch

    batch = make_batch([65536] * 9, 4, page_size=64, device="cuda", generator=torch.Generator().manual_seed(1))
    report = qsa_aiter.explain_selection(*batch.args()[:6], 2048, 4, max_query_len=4)
    assert "* native: serves" in report and "- triton: serves, but an earlier candidate is preferred" in report
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "triton")
    assert "* triton: serves" in qsa_aiter.explain_selection(*batch.args()[:6], 2048, 4, max_query_len=4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("contexts, rows_per_request", [([65536, 98304, 131072] * 3, 4), ([20000], 600)])
def test_a_repeated_native_call_replays_its_launches(monkeypatch, contexts, rows_per_request):
    """The second call of a signature through the native top-k replays the recorded launches (scorer, native
    top-k, expansion; the top-k alone) on fresh buffers and returns what the first call did; outputs poisoned first."""
    from qsa_aiter.ops import selection_plans
    from qsa_aiter.runtime import replay
    from qsa_aiter.tools.workloads import make_batch

    _native(monkeypatch)
    replay.clear()
    gen = torch.Generator().manual_seed(21)
    batch = make_batch(contexts, rows_per_request, page_size=64, device="cuda", generator=gen)
    args, hints = batch.args()[:6], {"max_query_len": rows_per_request}
    first = qsa_aiter.qsa_select_paged_tokens(*args, 2048, 4, **batch.kwargs(), **hints)
    assert any(isinstance(p, selection_plans.SelectionPlan) for p in replay.kept_plans()), "recorded for replay"
    out = torch.full_like(first, -7)
    again = qsa_aiter.qsa_select_paged_tokens(*args, 2048, 4, **batch.kwargs(), **hints, out=out)
    assert again is out and torch.equal(out, first)
    assert torch.equal(qsa_aiter.qsa_select_paged_tokens(*args, 2048, 4, **batch.kwargs(), **hints), first)

    logits = torch.randn(36, 32768, generator=gen).cuda()
    visible = edge_visible(gen, 36, 32768, 512)
    want = torch.empty((36, 512), dtype=torch.int32, device="cuda")
    torch_block_topk(logits, visible, 512, want)
    for _ in range(3):  # the first call, then two replays
        groups = torch.full_like(want, -7)
        assert torch.equal(qsa_aiter.qsa_block_topk(logits, visible, 512, out=groups), want)
    assert any(isinstance(p, selection_plans.TopkPlan) for p in replay.kept_plans())

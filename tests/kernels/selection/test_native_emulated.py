"""The native CUDA top-k's device code on the CPU, through the CUDA emulator (``runtime/jit/cuda_emulator.h``): every
plan against the torch oracle on the GPU tests' score kinds and edge lengths, with NaN past ``visible`` and the
output poisoned first; the scorer's histogram; the fused expansion; unaligned rows; the same output whatever order
the emulator runs the threads in; a seeded fuzz over random shapes. Every test runs at both emulated warp widths
(the ``warp`` fixture): 32, an NVIDIA target (every kernel, plans made for an TARGETS[warp]), and 64, an AMD wave64 target as
HIP defines it (the row kernels, the only ones a ROCm build has; plans made for an MI300X, gfx942, whose 64 KB of
shared memory per CTA sends long rows to the uncached kernel). What the emulator itself catches is tested in
``tests/runtime/jit/test_emulated.py``."""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring.histogram import torch_score_histogram
from qsa_aiter.kernels.selection import native_topk as nt
from qsa_aiter.kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from qsa_aiter.runtime.jit import emulated
from qsa_aiter.runtime.native_topk import emulated_block_topk

from native_cases import edge_visible, nan_past_visible, native_case_logits, native_plans

pytestmark = pytest.mark.skipif(emulated.unavailable_reason() is not None,
                                reason=f"cannot emulate: {emulated.unavailable_reason()}")

#: The emulated targets by warp width, as the platforms their plans are made for.
TARGETS = {32: Platform.named("sm_90"), 64: Platform.named("gfx942")}
KINDS = ["random", "ties", "equal", "relu", "relu_sparse", "constant", "neg_inf"]


def _case(label: str, rows: int, columns: int, k: int, kind: str):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{label} {rows} {columns} {k} {kind}".encode()))
    logits = native_case_logits(gen, rows, columns, kind, device="cpu")
    visible = edge_visible(gen, rows, columns, k, device="cpu")
    want = torch.empty((rows, k), dtype=torch.int32)
    torch_block_topk(logits, visible, k, want)
    return gen, logits, visible, want


@pytest.fixture(params=sorted(TARGETS), ids=lambda w: f"warp{w}")
def warp(request) -> int:
    """The emulated warp width (32 or 64)."""
    return request.param


def _emulated(warp, logits, visible, k, plan, **kwargs) -> torch.Tensor:
    out = torch.full((logits.shape[0], k), -7, dtype=torch.int32)
    emulated_block_topk(logits, visible, out, k, plan, defines=(f"TOPK_WARP_SIZE={warp}",), **kwargs)
    return out


def test_the_widths_emulate_their_targets():
    """64 is HIP's wave64: its collectives only, no cluster kernel (refused at its launch); 32 is CUDA's: every
    kernel. A width the emulator has not is refused naming the defines."""
    rows, columns, k = 2, 9000, 64
    _, logits, visible, want = _case("targets", rows, columns, k, "random")
    cluster = nt.cluster_plan(2, columns, TARGETS[32])
    assert torch.equal(_emulated(32, logits, visible, k, cluster), want)
    with pytest.raises(emulated.EmulationError, match="topk_cluster2_512 is compiled out of this build"):
        _emulated(64, logits, visible, k, cluster)
    assert not any(plan.variant.cluster > 1 for plan in native_plans(rows, columns, k, TARGETS[64]))
    assert emulated.warp_size_of(()) == 32 and emulated.warp_size_of(("TOPK_WARP_SIZE=64",)) == 64
    with pytest.raises(ValueError, match="defines: TOPK_WARP_SIZE"):
        emulated.warp_size_of(("TOPK_WARP_SIZE=48",))


@pytest.mark.parametrize("kind", ["random", "ties", "relu", "constant", "neg_inf"])
def test_every_plan_equals_the_oracle(kind, warp):
    """Both row kernels (cached, with an 8-entry candidate list, uncached with a full and an 8-key buffer) and every
    cluster size, on NaN-poisoned rows of the edge lengths."""
    rows, columns, k = 9, 9000, 512
    _, logits, visible, want = _case("plans", rows, columns, k, kind)
    poisoned = nan_past_visible(logits, visible)
    for plan in native_plans(rows, columns, k, TARGETS[warp]):
        assert torch.equal(_emulated(warp, poisoned, visible, k, plan), want), plan.describe()


@pytest.mark.parametrize("rows, columns, k", [(11, 1500, 100), (6, 1400, 64), (3, 333, 5), (9, 7, 512),
                                              (2, 20000, 512), (1, 65536, 512)])
@pytest.mark.parametrize("kind", KINDS)
def test_the_chosen_plan_equals_the_oracle(rows, columns, k, kind, warp):
    """The plan ``choose_plan`` makes for an TARGETS[warp] (the trivial one, a row kernel or a cluster)."""
    _, logits, visible, want = _case("chosen", rows, columns, k, kind)
    plan = nt.choose_plan(rows, columns, k, TARGETS[warp])
    assert torch.equal(_emulated(warp, nan_past_visible(logits, visible), visible, k, plan), want), plan.describe()


@pytest.mark.parametrize("kind", ["random", "relu", "constant", "neg_inf"])
def test_every_plan_from_the_scorers_histogram_equals_the_oracle(kind, warp):
    rows, columns, k = 7, 9000, 512
    _, logits, visible, want = _case("histogram", rows, columns, k, kind)
    histogram = torch_score_histogram(logits, visible)
    poisoned = nan_past_visible(logits, visible)
    for plan in native_plans(rows, columns, k, TARGETS[warp]):
        assert torch.equal(_emulated(warp, poisoned, visible, k, plan, histogram=histogram), want), plan.describe()


@pytest.mark.parametrize("wide", [False, True])
def test_the_fused_expansion_equals_the_torch_expansion(wide, warp):
    """Groups past their request's context, bad request ids, int32 and int64 indices; every plan, with and without
    the scorer's histogram; the row kernels' expansion after the top-k from the groups copied into shared memory, the
    clusters' tokens written with the groups; 16-byte token stores (the row kernels' aligned blocks of every row, the
    clusters' groups in rows whose tokens are 16-byte aligned, every fourth row here); a context that ends inside a
    selected group; rows with fewer groups than ``k`` in requests with tokens."""
    rows, columns, k, ratio, token_topk = 8, 9000, 128, 4, 512
    gen, logits, visible, want = _case("expansion", rows, columns, k, "relu")
    index = torch.int64 if wide else torch.int32
    # rows 4 and 5 (visible 0 and 3: fewer groups than k) in requests with tokens; rows 6 and 7 in bad requests
    requests = torch.tensor([0, 1, 2, 3, 4, 2, -1, 5]).to(index)
    # request 2's context ends inside row 2's sixth group: that group keeps 2 of its tokens, the later ones none
    assert int(want[2, 5]) >= 0
    contexts = torch.tensor([4 * columns, 100, 4 * int(want[2, 5]) + 2, 0, 4 * columns]).to(index)
    positions = torch.randint(-1, 4 * columns, (rows,), generator=gen).to(index)
    want_tokens = torch.empty((rows, token_topk + ratio - 1), dtype=torch.int32)
    torch_expand_block_indices(want, positions, contexts, requests, ratio, token_topk, want_tokens)
    histogram = torch_score_histogram(logits, visible)
    for plan in native_plans(rows, columns, k, TARGETS[warp]):
        for hist in (None, histogram):
            tokens = torch.full_like(want_tokens, -7)
            groups = _emulated(warp, logits, visible, k, plan, histogram=hist,
                               expand_into=(positions, contexts, requests, tokens, ratio, token_topk))
            assert torch.equal(groups, want) and torch.equal(tokens, want_tokens), plan.describe()


def test_the_expansion_of_more_groups_than_shared_memory_holds(warp):
    """``block_topk`` above 2048: the row kernels' expansion reads the groups back from global memory (their copies in
    shared memory are for at most 2048), and equals the torch expansion."""
    rows, columns, k, ratio, token_topk = 3, 9000, 2304, 4, 9216
    gen, logits, visible, want = _case("many groups", rows, columns, k, "relu")
    requests = torch.arange(rows, dtype=torch.int32)
    contexts = torch.tensor([4 * columns, 5000, 3 * columns + 2], dtype=torch.int32)
    positions = torch.randint(0, 4 * columns, (rows,), generator=gen, dtype=torch.int32)
    want_tokens = torch.empty((rows, token_topk + ratio - 1), dtype=torch.int32)
    torch_expand_block_indices(want, positions, contexts, requests, ratio, token_topk, want_tokens)
    for plan in (nt.rows_plan(256, columns, TARGETS[warp]), nt.rows_plan(512, columns, TARGETS[warp])):
        tokens = torch.full_like(want_tokens, -7)
        groups = _emulated(warp, logits, visible, k, plan,
                           expand_into=(positions, contexts, requests, tokens, ratio, token_topk))
        assert torch.equal(groups, want) and torch.equal(tokens, want_tokens), plan.describe()


def test_contexts_that_end_at_a_chunk_boundary(warp):
    """Contexts ending exactly at, just before and just after the start of a cluster CTA's chunk (the CTA that
    writes the token tail is the highest one whose chunk starts at or below the context's end), and a row of at most
    ``block_topk`` columns."""
    rows, columns, k, ratio, token_topk = 5, 9000, 128, 4, 512
    gen, logits, _, _ = _case("boundaries", rows, columns, k, "random")
    visible = torch.tensor([columns] * 4 + [100], dtype=torch.int32)
    want = torch.empty((rows, k), dtype=torch.int32)
    torch_block_topk(logits, visible, k, want)
    chunk = 2252  # a cluster of 4 over 9000 columns: chunks start at 0, 2252, 4504, 6756
    contexts = torch.tensor([ratio * chunk, ratio * chunk + 1, ratio * chunk - 1, ratio * 2 * chunk, 390])
    requests = torch.arange(rows, dtype=torch.int32)
    positions = torch.randint(0, ratio * columns, (rows,), generator=gen)
    want_tokens = torch.empty((rows, token_topk + ratio - 1), dtype=torch.int32)
    torch_expand_block_indices(want, positions, contexts, requests, ratio, token_topk, want_tokens)
    for plan in native_plans(rows, columns, k, TARGETS[warp]):
        tokens = torch.full_like(want_tokens, -7)
        groups = _emulated(warp, logits, visible, k, plan,
                           expand_into=(positions, contexts, requests, tokens, ratio, token_topk))
        assert torch.equal(groups, want) and torch.equal(tokens, want_tokens), plan.describe()


def test_rows_that_are_not_16_byte_aligned_take_plain_loads(warp):
    """A row stride that is not a multiple of 4 floats: no float4 loads, no bulk copies (``vec_ok`` 0)."""
    rows, columns, k = 5, 9000, 512
    gen = torch.Generator().manual_seed(3)
    wide = native_case_logits(gen, rows, columns + 3, "random", device="cpu")
    logits = wide[:, :columns]
    visible = edge_visible(gen, rows, columns, k, device="cpu")
    want = torch.empty((rows, k), dtype=torch.int32)
    torch_block_topk(logits, visible, k, want)
    target = TARGETS[warp]
    second = nt.cluster_plan(4, columns, target) if warp == 32 else nt.rows_plan(512, columns, target, cached=False)
    for plan in (nt.rows_plan(256, columns, target), second):
        call = nt.launch_arguments(plan, rows, columns, logits.stride(0), k, False)
        assert call.scalar("vec_ok") == 0
        assert torch.equal(_emulated(warp, logits, visible, k, plan), want), plan.describe()


@pytest.mark.parametrize("kind", ["ties", "relu"])
def test_the_output_does_not_depend_on_the_threads_order(kind, warp):
    """Atomics only count or set bits: runs that resume the waiting threads in other orders write the same bits."""
    rows, columns, k = 4, 20000, 512
    _, logits, visible, want = _case("order", rows, columns, k, kind)
    target = TARGETS[warp]
    if warp == 32:
        plans = (nt.rows_plan(512, columns, target), nt.cluster_plan(4, columns, target),
                 dataclasses.replace(nt.cluster_plan(2, columns, target), candidates=8))
    else:  # 20000 columns do not fit an MI300X CTA's shared memory: the uncached kernels (an 8-key buffer: global reads)
        plans = (nt.rows_plan(512, columns, target, cached=False),
                 nt.rows_plan(256, columns, target, cached=False, buffer=8))
    for plan in plans:
        for seed in (0, 1, 2):
            assert torch.equal(_emulated(warp, logits, visible, k, plan, order_seed=seed), want), (plan.describe(), seed)


def test_fuzz_random_shapes_and_plans(warp):
    """A seeded fuzz over shapes, budgets, score kinds, plans and thread orders."""
    rng = random.Random(38)
    for case in range(24):
        rows = rng.randint(1, 6)
        columns = rng.choice([rng.randint(1, 700), rng.randint(700, 5000), rng.randint(5000, 40000)])
        k = rng.choice([1, 7, 16, 64, 100, 512, 2048])
        kind = rng.choice(KINDS)
        _, logits, visible, want = _case(f"fuzz {case}", rows, columns, k, kind)
        plans = native_plans(rows, columns, k, TARGETS[warp]) if columns > k else [nt.choose_plan(rows, columns, k, TARGETS[warp])]
        plan = rng.choice(plans)
        got = _emulated(warp, nan_past_visible(logits, visible), visible, k, plan, order_seed=rng.randint(0, 3))
        assert torch.equal(got, want), f"case {case}: {rows} x {columns}, k {k}, {kind}, {plan.describe()}"

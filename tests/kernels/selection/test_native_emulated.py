"""The native CUDA top-k's device code on the CPU, through the CUDA emulator (``runtime/jit/cuda_emulator.h``): every
plan against the torch oracle on the GPU tests' score kinds and edge lengths, with NaN past ``visible`` and the
output poisoned first; the scorer's histogram; the fused expansion; unaligned rows; the same output whatever order
the emulator runs the threads in; a seeded fuzz over random shapes. What the emulator itself catches is tested in
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

H200 = Platform.named("sm_90")
KINDS = ["random", "ties", "equal", "relu", "relu_sparse", "constant", "neg_inf"]


def _case(label: str, rows: int, columns: int, k: int, kind: str):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{label} {rows} {columns} {k} {kind}".encode()))
    logits = native_case_logits(gen, rows, columns, kind, device="cpu")
    visible = edge_visible(gen, rows, columns, k, device="cpu")
    want = torch.empty((rows, k), dtype=torch.int32)
    torch_block_topk(logits, visible, k, want)
    return gen, logits, visible, want


def _emulated(logits, visible, k, plan, **kwargs) -> torch.Tensor:
    out = torch.full((logits.shape[0], k), -7, dtype=torch.int32)
    emulated_block_topk(logits, visible, out, k, plan, **kwargs)
    return out


@pytest.mark.parametrize("kind", ["random", "ties", "relu", "constant", "neg_inf"])
def test_every_plan_equals_the_oracle(kind):
    """Both row kernels (cached, with an 8-entry candidate list, uncached with a full and an 8-key buffer) and every
    cluster size, on NaN-poisoned rows of the edge lengths."""
    rows, columns, k = 9, 9000, 512
    _, logits, visible, want = _case("plans", rows, columns, k, kind)
    poisoned = nan_past_visible(logits, visible)
    for plan in native_plans(rows, columns, k, H200):
        assert torch.equal(_emulated(poisoned, visible, k, plan), want), plan.describe()


@pytest.mark.parametrize("rows, columns, k", [(11, 1500, 100), (6, 1400, 64), (3, 333, 5), (9, 7, 512),
                                              (2, 20000, 512), (1, 65536, 512)])
@pytest.mark.parametrize("kind", KINDS)
def test_the_chosen_plan_equals_the_oracle(rows, columns, k, kind):
    """The plan ``choose_plan`` makes for an H200 (the trivial one, a row kernel or a cluster)."""
    _, logits, visible, want = _case("chosen", rows, columns, k, kind)
    plan = nt.choose_plan(rows, columns, k, H200)
    assert torch.equal(_emulated(nan_past_visible(logits, visible), visible, k, plan), want), plan.describe()


@pytest.mark.parametrize("kind", ["random", "relu", "constant", "neg_inf"])
def test_every_plan_from_the_scorers_histogram_equals_the_oracle(kind):
    rows, columns, k = 7, 9000, 512
    _, logits, visible, want = _case("histogram", rows, columns, k, kind)
    histogram = torch_score_histogram(logits, visible)
    poisoned = nan_past_visible(logits, visible)
    for plan in native_plans(rows, columns, k, H200):
        assert torch.equal(_emulated(poisoned, visible, k, plan, histogram=histogram), want), plan.describe()


@pytest.mark.parametrize("wide, defines", [(False, ()), (True, ()), (False, nt.CANDIDATE_SWITCHES["fused_tokens_rows"]),
                                           (False, nt.CANDIDATE_SWITCHES["unfused_tokens_clusters"]),
                                           (True, nt.CANDIDATE_SWITCHES["expand_from_global"]),
                                           (False, nt.CANDIDATE_SWITCHES["scalar_tokens"]),
                                           (True, nt.CANDIDATE_SWITCHES["all_plain_atomics"])])
def test_the_fused_expansion_equals_the_torch_expansion(wide, defines):
    """Groups past their request's context, bad request ids, int32 and int64 indices; every plan, with and without
    the scorer's histogram; the expansion after the top-k and written with the groups (``TOPK_FUSED_TOKENS_ROWS`` and
    ``_CLUSTERS``: the row kernels' default is after, the clusters' with the groups; each built the other way too),
    and the row kernels' expansion from the groups copied into shared memory (``TOPK_EXPAND_SMEM``, the default) and
    read back from global memory; 16-byte token stores (``TOPK_EXPAND_VEC``: the row kernels' aligned blocks of
    every row, the clusters' groups in rows whose tokens are 16-byte aligned, every fourth row here) and word stores
    only; a context that ends inside a selected group; rows with fewer groups than ``k`` in requests with tokens."""
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
    for plan in native_plans(rows, columns, k, H200):
        for hist in (None, histogram):
            tokens = torch.full_like(want_tokens, -7)
            groups = _emulated(logits, visible, k, plan, histogram=hist, defines=defines,
                               expand_into=(positions, contexts, requests, tokens, ratio, token_topk))
            assert torch.equal(groups, want) and torch.equal(tokens, want_tokens), plan.describe()


@pytest.mark.parametrize("defines", [(), nt.CANDIDATE_SWITCHES["expand_from_global"]])
def test_the_expansion_of_more_groups_than_shared_memory_holds(defines):
    """``block_topk`` above 2048: the row kernels' expansion reads the groups back from global memory (with
    ``TOPK_EXPAND_SMEM`` their copies in shared memory are for at most 2048), and equals the torch expansion."""
    rows, columns, k, ratio, token_topk = 3, 9000, 2304, 4, 9216
    gen, logits, visible, want = _case("many groups", rows, columns, k, "relu")
    requests = torch.arange(rows, dtype=torch.int32)
    contexts = torch.tensor([4 * columns, 5000, 3 * columns + 2], dtype=torch.int32)
    positions = torch.randint(0, 4 * columns, (rows,), generator=gen, dtype=torch.int32)
    want_tokens = torch.empty((rows, token_topk + ratio - 1), dtype=torch.int32)
    torch_expand_block_indices(want, positions, contexts, requests, ratio, token_topk, want_tokens)
    for plan in (nt.rows_plan(256, columns, H200), nt.rows_plan(512, columns, H200)):
        tokens = torch.full_like(want_tokens, -7)
        groups = _emulated(logits, visible, k, plan, defines=defines,
                           expand_into=(positions, contexts, requests, tokens, ratio, token_topk))
        assert torch.equal(groups, want) and torch.equal(tokens, want_tokens), plan.describe()


@pytest.mark.parametrize("defines", [(), nt.CANDIDATE_SWITCHES["unfused_tokens_clusters"],
                                     nt.CANDIDATE_SWITCHES["all"]])
def test_contexts_that_end_at_a_chunk_boundary(defines):
    """Contexts ending exactly at, just before and just after the start of a cluster CTA's chunk (with
    ``TOPK_FUSED_TOKENS_CLUSTERS``, the default, the CTA that writes the token tail is the highest one whose chunk
    starts at or below the context's end), and a row of at most ``block_topk`` columns."""
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
    for plan in native_plans(rows, columns, k, H200):
        tokens = torch.full_like(want_tokens, -7)
        groups = _emulated(logits, visible, k, plan, defines=defines,
                           expand_into=(positions, contexts, requests, tokens, ratio, token_topk))
        assert torch.equal(groups, want) and torch.equal(tokens, want_tokens), plan.describe()


def test_rows_that_are_not_16_byte_aligned_take_plain_loads():
    """A row stride that is not a multiple of 4 floats: no float4 loads, no bulk copies (``vec_ok`` 0)."""
    rows, columns, k = 5, 9000, 512
    gen = torch.Generator().manual_seed(3)
    wide = native_case_logits(gen, rows, columns + 3, "random", device="cpu")
    logits = wide[:, :columns]
    visible = edge_visible(gen, rows, columns, k, device="cpu")
    want = torch.empty((rows, k), dtype=torch.int32)
    torch_block_topk(logits, visible, k, want)
    for plan in (nt.rows_plan(256, columns, H200), nt.cluster_plan(4, columns, H200)):
        call = nt.launch_arguments(plan, rows, columns, logits.stride(0), k, False)
        assert call.scalar("vec_ok") == 0
        assert torch.equal(_emulated(logits, visible, k, plan), want), plan.describe()


@pytest.mark.parametrize("kind", ["ties", "relu"])
def test_the_output_does_not_depend_on_the_threads_order(kind):
    """Atomics only count or set bits: runs that resume the waiting threads in other orders write the same bits."""
    rows, columns, k = 4, 20000, 512
    _, logits, visible, want = _case("order", rows, columns, k, kind)
    for plan in (nt.rows_plan(512, columns, H200), nt.cluster_plan(4, columns, H200),
                 dataclasses.replace(nt.cluster_plan(2, columns, H200), candidates=8)):
        for seed in (0, 1, 2):
            assert torch.equal(_emulated(logits, visible, k, plan, order_seed=seed), want), (plan.describe(), seed)


#: The source's candidate switches that change the top-k (the token switches change the expansion only: the expansion
#: tests run them), each alone and together.
SWITCHES = {name: defines for name, defines in nt.CANDIDATE_SWITCHES.items()
            if name not in ("fused_tokens_rows", "unfused_tokens_clusters", "expand_from_global", "scalar_tokens",
                            "all")}


@pytest.mark.parametrize("defines", SWITCHES.values(), ids=SWITCHES.keys())
@pytest.mark.parametrize("kind", ["random", pytest.param("relu", marks=pytest.mark.slow), pytest.param("neg_inf", marks=pytest.mark.slow)])
def test_the_candidate_switches_equal_the_oracle(defines, kind):
    """Every plan built with each candidate switch, every other one from the scorer's histogram, in three thread
    orders."""
    rows, columns, k = 6, 9000, 512
    _, logits, visible, want = _case("switches", rows, columns, k, kind)
    poisoned = nan_past_visible(logits, visible)
    histogram = torch_score_histogram(logits, visible)
    for i, plan in enumerate(native_plans(rows, columns, k, H200)):
        got = _emulated(poisoned, visible, k, plan, histogram=histogram if i % 2 else None, order_seed=i % 3,
                        defines=defines)
        assert torch.equal(got, want), plan.describe()


def test_fuzz_random_shapes_and_plans():
    """A seeded fuzz over shapes, budgets, score kinds, plans and thread orders."""
    rng = random.Random(38)
    for case in range(24):
        rows = rng.randint(1, 6)
        columns = rng.choice([rng.randint(1, 700), rng.randint(700, 5000), rng.randint(5000, 40000)])
        k = rng.choice([1, 7, 16, 64, 100, 512, 2048])
        kind = rng.choice(KINDS)
        _, logits, visible, want = _case(f"fuzz {case}", rows, columns, k, kind)
        plans = native_plans(rows, columns, k, H200) if columns > k else [nt.choose_plan(rows, columns, k, H200)]
        plan = rng.choice(plans)
        got = _emulated(nan_past_visible(logits, visible), visible, k, plan, order_seed=rng.randint(0, 3))
        assert torch.equal(got, want), f"case {case}: {rows} x {columns}, k {k}, {kind}, {plan.describe()}"

"""The grid select's device code on the CPU, through the CUDA emulator's cooperative mode (every CTA of the grid run
together: ``runtime/jit/cuda_emulator_grid.h``): rows split across 1 to 8 CTAs against the torch oracle on the
native top-k's score kinds, NaN inside and past ``visible``, the edge lengths (shorter than K, 0, negative, past the
columns), the output poisoned first; the same row alone, in a batch and under every split; repeats and thread
orders; one workspace across launches with new lengths (and left clean by each); the fused expansion; a corrupted
workspace reported as a deadlock."""

from __future__ import annotations

import zlib

import pytest
import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import grid_topk as gt
from qsa_aiter.kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from qsa_aiter.runtime.grid_topk import emulated_grid_topk
from qsa_aiter.runtime.jit import emulated

from native_cases import edge_visible, nan_past_visible, native_case_logits

pytestmark = pytest.mark.skipif(emulated.unavailable_reason() is not None,
                                reason=f"cannot emulate: {emulated.unavailable_reason()}")

H200 = Platform.named("sm_90")
KINDS = ["random", "ties", "equal", "relu", "relu_sparse", "constant", "neg_inf", "nan"]


def _logits(gen, rows: int, columns: int, kind: str) -> torch.Tensor:
    """The native top-k's score kinds, and ``nan``: random scores with NaNs of both signs inside the visible range
    (they rank above ``+inf``, by column)."""
    if kind != "nan":
        return native_case_logits(gen, rows, columns, kind, device="cpu")
    logits = torch.randn(rows, columns, generator=gen)
    spots = torch.rand(rows, columns, generator=gen)
    logits[spots < 0.01] = float("nan")
    logits[spots > 0.995] = -float("nan")
    logits[:, 7] = float("inf")
    return logits


def _case(label: str, rows: int, columns: int, k: int, kind: str):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{label} {rows} {columns} {k} {kind}".encode()))
    logits = _logits(gen, rows, columns, kind)
    visible = edge_visible(gen, rows, columns, k, device="cpu")
    return gen, logits, visible, _oracle(logits, visible, k)


def _oracle(logits, visible, k) -> torch.Tensor:
    want = torch.empty((logits.shape[0], k), dtype=torch.int32)
    torch_block_topk(logits, visible, k, want)
    return want


def _grid(logits, visible, k, plan, **kwargs) -> torch.Tensor:
    out = torch.full((logits.shape[0], k), -7, dtype=torch.int32)
    emulated_grid_topk(logits, visible, out, k, plan, **kwargs)
    return out


def _assert_clean(workspace: torch.Tensor, plan: gt.Plan) -> None:
    """Every slot's histogram and arrival counter are zero again after a launch (the next one needs no zeroing)."""
    slots = workspace[: plan.workspace_words].view(plan.slots, gt.SLOT_WORDS)
    assert not slots[:, : gt.CLEAN_WORDS].any()


@pytest.mark.parametrize("kind", KINDS)
def test_every_split_equals_the_oracle(kind):
    """9 rows of the edge lengths over 4 row slots (a slot takes several rows), NaN past ``visible``, split over 1, 3
    and 8 CTAs: exactly the oracle's K columns, ascending, and the workspace left clean."""
    rows, columns, k = 9, 2500, 64
    _, logits, visible, want = _case("splits", rows, columns, k, kind)
    poisoned = nan_past_visible(logits, visible)
    for split in (1, 3, 8):
        plan = gt.split_plan(split, rows, columns, H200, threads=256, slots=4)
        workspace = torch.zeros(plan.workspace_words, dtype=torch.int32)
        assert torch.equal(_grid(poisoned, visible, k, plan, workspace=workspace), want), plan.describe()
        _assert_clean(workspace, plan)


@pytest.mark.parametrize("rows, columns, k, split, threads", [
    (4, 700, 4, 2, 256), (5, 4000, 300, 6, 256), (3, 3000, 200, 4, 512), (6, 1500, 1, 5, 256),
    (2, 640, 639, 7, 256),
])
def test_shapes_budgets_and_both_kernels(rows, columns, k, split, threads):
    """K from 1 to a few hundred, widths to a few thousand, both kernels, chunks that leave the last CTAs empty."""
    for kind in ("random", "ties", "constant"):
        _, logits, visible, want = _case("shapes", rows, columns, k, kind)
        plan = gt.split_plan(split, rows, columns, H200, threads=threads, slots=min(rows, 2))
        assert torch.equal(_grid(logits, visible, k, plan), want), (kind, plan.describe())


def test_a_constant_row_takes_its_tie_quota_across_ctas():
    """Every score equal: the whole refinement runs and the ties go to the lowest columns, whichever CTAs hold them;
    a quota that ends inside a CTA's chunk (K = 1000 of 8 x 256-column chunks)."""
    rows, columns, k = 3, 2048, 1000
    logits = torch.full((rows, columns), 0.25)
    logits[1, 1500:] = 0.5  # the top 548 go to the last CTAs, the rest of the quota to the first ones
    visible = torch.tensor([columns, columns, 1700], dtype=torch.int32)
    want = _oracle(logits, visible, k)
    for split in (1, 2, 5, 8):
        plan = gt.split_plan(split, rows, columns, H200, threads=256)
        assert torch.equal(_grid(logits, visible, k, plan), want), split


def test_a_row_alone_equals_the_row_in_a_batch_under_every_split():
    rows, columns, k = 6, 3000, 128
    _, logits, visible, want = _case("alone", rows, columns, k, "ties")
    for split in (1, 2, 7):
        batch = _grid(logits, visible, k, gt.split_plan(split, rows, columns, H200, threads=256, slots=3))
        assert torch.equal(batch, want), split
        for row in (0, 1, 3):
            alone = _grid(logits[row:row + 1], visible[row:row + 1], k, gt.split_plan(split, 1, columns, H200))
            assert torch.equal(alone[0], want[row]), (split, row)


def test_repeats_and_thread_orders_give_the_same_output():
    rows, columns, k = 4, 2000, 100
    _, logits, visible, want = _case("orders", rows, columns, k, "relu")
    plan = gt.split_plan(4, rows, columns, H200, threads=256, slots=2)
    workspace = torch.zeros(plan.workspace_words, dtype=torch.int32)
    for seed in (0, 0, 1, 2):
        assert torch.equal(_grid(logits, visible, k, plan, workspace=workspace, order_seed=seed), want), seed


def test_one_workspace_across_launches_with_new_lengths():
    """A workspace zeroed once serves launch after launch (as in a CUDA graph's replays): new visible counts written
    into the same tensor, other plans on the same workspace (another split, fewer slots), the trivial plan."""
    rows, columns, k = 5, 2400, 50
    gen, logits, visible, _ = _case("replay", rows, columns, k, "random")
    plans = [gt.split_plan(3, rows, columns, H200, threads=256, slots=5),
             gt.split_plan(6, rows, columns, H200, threads=256, slots=2),
             gt.split_plan(3, rows, columns, H200, threads=256, slots=5)]
    workspace = torch.zeros(max(p.workspace_words for p in plans), dtype=torch.int32)
    for step, plan in enumerate(plans * 2):
        visible.copy_(torch.randint(-3, columns + 4, (rows,), generator=gen, dtype=torch.int32))
        assert torch.equal(_grid(logits, visible, k, plan, workspace=workspace), _oracle(logits, visible, k)), step
        _assert_clean(workspace, plan)
    trivial = gt.choose_plan(rows, k, k, H200)
    assert (trivial.split, trivial.cap) == (1, 0)
    short = logits[:, :k].contiguous()
    assert torch.equal(_grid(short, visible, k, trivial, workspace=workspace), _oracle(short, visible, k))


@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
def test_the_fused_expansion_equals_the_torch_expansion(wide):
    """Every row's tokens: groups past their request's context (a context that ends inside a selected group: the
    CTAs sum their token counts), a bad request id, a context covering every visible group (no exchange), rows with
    fewer groups than ``k``."""
    rows, columns, k, ratio, token_topk = 8, 2000, 64, 4, 256
    gen, logits, visible, want = _case("expansion", rows, columns, k, "relu")
    index = torch.int64 if wide else torch.int32
    requests = torch.tensor([0, 1, 2, 3, 4, 2, -1, 5]).to(index)
    assert int(want[2, 5]) >= 0
    contexts = torch.tensor([4 * columns, 100, 4 * int(want[2, 5]) + 2, 0, 4 * columns, 4 * columns]).to(index)
    positions = torch.randint(-1, 4 * columns, (rows,), generator=gen).to(index)
    want_tokens = torch.empty((rows, token_topk + ratio - 1), dtype=torch.int32)
    torch_expand_block_indices(want, positions, contexts, requests, ratio, token_topk, want_tokens)
    for split in (1, 3, 8):
        tokens = torch.full_like(want_tokens, -7)
        plan = gt.split_plan(split, rows, columns, H200, threads=256, slots=3)
        groups = _grid(logits, visible, k, plan, expand_into=(positions, contexts, requests, tokens, ratio,
                                                              token_topk))
        assert torch.equal(groups, want) and torch.equal(tokens, want_tokens), split


def test_a_corrupted_workspace_is_reported_as_a_deadlock():
    """An arrival counter that was not left at zero: no CTA ever arrives last, every CTA waits, and the emulator says
    so rather than hang."""
    rows, columns, k = 2, 1000, 16
    _, logits, visible, _ = _case("deadlock", rows, columns, k, "random")
    plan = gt.split_plan(2, rows, columns, H200, threads=256, slots=1)
    workspace = torch.zeros(plan.workspace_words, dtype=torch.int32)
    workspace[gt.CLEAN_WORDS - 1] = 5  # the slot's arrival counter (GRID_ARRIVE_WORD)
    with pytest.raises(emulated.EmulationError, match="deadlock"):
        _grid(logits, torch.full((rows,), columns, dtype=torch.int32), k, plan, workspace=workspace)


def test_the_emulator_runs_small_cooperative_grids_only():
    rows, columns, k = 40, 1000, 16
    _, logits, visible, _ = _case("big", rows, columns, k, "random")
    plan = gt.split_plan(4, rows, columns, H200, threads=512, slots=8)
    with pytest.raises(emulated.EmulationError, match="cooperative grid of 16384 threads"):
        _grid(logits, visible, k, plan)

"""The fused selection's debug phase stamps (``fused_select.cu``'s ``stamps``, native_compat.h's ``qsa_stamp``): the
source's record size is the declared one; an emulated launch with a stamps buffer fills every record of a group a CTA
takes, in order, leaves the others zero and selects exactly as without; ``phase_times`` turns a synthetic buffer into
the expected medians."""

from __future__ import annotations

import re

import pytest
import torch

from qsa_aiter.kernels.selection import fused_select as fs
from qsa_aiter.kernels.selection.native_topk import COMPAT_PATH
from qsa_aiter.runtime.fused_select import emulated_fused_select, phase_times, stamp_buffer
from qsa_aiter.runtime.jit import emulated
from qsa_aiter.tools.inputs import selection_call
from qsa_aiter.tools.workloads import make_batch

SM90 = fs.Platform.named("sm_90")
needs_emulator = pytest.mark.skipif(emulated.unavailable_reason() is not None,
                                    reason=f"cannot emulate: {emulated.unavailable_reason()}")


def test_the_source_s_record_is_the_declared_one():
    compat = COMPAT_PATH.read_text()
    assert re.search(rf"#define QSA_STAMP_COUNT {fs.STAMP_COUNT}\b", compat)
    assert len(fs.PHASES) + 1 == fs.STAMP_COUNT
    assert ("stamps", "unsigned long long*") in fs.POINTERS
    plan = fs.Plan(fs.VARIANTS[0], 4, 7, 2, 3, 256)
    assert plan.slot_groups == 3 and plan.stamp_words == 6 * 3 * fs.STAMP_COUNT
    assert stamp_buffer(plan).shape == (plan.stamp_words,) and not stamp_buffer(plan).any()


def plan_of(problem, batch, split: int, slots: int) -> fs.Plan:
    score = problem.score
    variant = fs.variant_for(batch.compressed_k_cache.dtype, batch.compressed_k_cache.shape[1], batch.q.dtype)
    rows = fs.scorer.group_rows_of(score)
    groups = -(-score.num_tokens // rows)
    return fs.split_plan(split, variant, rows, groups, score.num_columns, SM90, slots=slots)


@needs_emulator
def test_emulated_stamps_are_ordered_and_leave_the_selection_alone(rng):
    """Verify rows in 3 row groups over 2 slots (the second slot takes one group: its second records stay zero), a
    request shorter than the budget (its group is not scored: its stamps still go in order)."""
    batch = make_batch([1500, 40, 900], [4, 4, 2], page_size=16, generator=rng)
    hints = dict(max_query_len=4)
    problem, args = selection_call(batch, 64, hints)
    plan = plan_of(problem, batch, 2, 2)
    assert plan.row_groups == 3 and plan.slot_groups == 2
    plain, _ = emulated_fused_select(problem, args, plan)
    tokens = args.out.clone()
    args.out.fill_(-5)
    stamps = stamp_buffer(plan)
    stamped, _ = emulated_fused_select(problem, args, plan, stamps=stamps)
    assert torch.equal(stamped, plain) and torch.equal(args.out, tokens)
    records = stamps.view(plan.grid, plan.slot_groups, fs.STAMP_COUNT)
    for cta in range(plan.grid):
        slot = cta // plan.split
        taken = len(range(slot, plan.row_groups, plan.slots))
        for i in range(plan.slot_groups):
            record = records[cta, i]
            if i >= taken:
                assert not record.any(), (cta, i)
                continue
            assert (record > 0).all(), (cta, i, record)
            assert (record[1:] >= record[:-1]).all(), (cta, i, record)
        if taken > 1:
            assert records[cta, 1, 0] >= records[cta, 0, -1]
    times = phase_times(stamps, plan)
    assert set(times) == {*fs.PHASES, "span"} and all(t >= 0 for t in times.values())


def test_phase_times_are_the_medians_of_the_records():
    """Three CTAs of one group each (a slot of 3 CTAs, 2 groups: the second records zero), phases of known lengths."""
    plan = fs.Plan(fs.VARIANTS[0], 4, 1, 3, 1, 256)
    assert plan.slot_groups == 1
    plan = fs.Plan(fs.VARIANTS[0], 4, 2, 3, 1, 256)  # one slot takes both groups
    stamps = stamp_buffer(plan).view(plan.grid, plan.slot_groups, fs.STAMP_COUNT)
    steps = {0: [1, 2, 3, 4, 5, 6, 7], 1: [3, 2, 1, 4, 5, 6, 9], 2: [2, 2, 2, 2, 2, 2, 2]}
    for cta, lengths in steps.items():
        start = 1_000_000 * (cta + 1)
        stamps[cta, 0] = torch.tensor([start] + [start + 1000 * sum(lengths[:i + 1]) for i in range(7)])
        if cta < 2:  # a second group for CTAs 0 and 1, each phase 10 us, after a 5 us gap
            second = int(stamps[cta, 0, -1]) + 5000
            stamps[cta, 1] = torch.tensor([second + 10_000 * i for i in range(8)])
    times = phase_times(stamps.flatten(), plan)
    # records: CTA 0's two, CTA 1's two, CTA 2's one (5 records; the median is the third value in order)
    expected = {}
    for i, name in enumerate(fs.PHASES):
        values = sorted([steps[0][i], steps[1][i], steps[2][i], 10, 10])
        expected[name] = float(values[2])
    assert times == {**expected, "span": pytest.approx(times["span"])}
    spans = sorted([sum(steps[0]) + 5 + 70, sum(steps[1]) + 5 + 70, sum(steps[2])])
    assert times["span"] == pytest.approx(float(spans[1]))

"""The fused selection's debug phase stamps (``fused_select.cu``'s ``stamps``, native_compat.h's ``qsa_stamp``): the
source's record size is the declared one; an emulated launch with a stamps buffer fills every CTA's record in order
(the finish's stamps only in the CTA of each row group that arrived last and in the selectors) and selects exactly as without;
``phase_times`` turns a synthetic buffer into the expected medians."""

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
    plan = fs.Plan(fs.VARIANTS[0], 4, 7, 3, 256)  # 21 scoring CTAs and 3 selectors a group
    assert plan.stamp_words == (21 + 21) * fs.STAMP_COUNT
    assert stamp_buffer(plan).shape == (plan.stamp_words,) and not stamp_buffer(plan).any()


def plan_of(problem, batch, split: int) -> fs.Plan:
    score = problem.score
    variant = fs.variant_for(batch.compressed_k_cache.dtype, batch.compressed_k_cache.shape[1], batch.q.dtype)
    rows = fs.scorer.group_rows_of(score)
    groups = -(-score.num_tokens // rows)
    return fs.split_plan(split, variant, rows, groups, score.num_columns, SM90)


@needs_emulator
def test_emulated_stamps_are_ordered_and_leave_the_selection_alone(rng):
    """Verify rows in 3 row groups of 3 CTAs and 3 selectors, a request shorter than the budget (its group is not
    scored: its stamps still go in order); a finish stamp in each group's last arriver and in every selector."""
    batch = make_batch([1500, 40, 900], [4, 4, 2], page_size=16, generator=rng)
    hints = dict(max_query_len=4)
    problem, args = selection_call(batch, 64, hints)
    plan = plan_of(problem, batch, 3)
    assert plan.row_groups == 3 and plan.selectors == 9 and plan.grid == 18
    plain, _ = emulated_fused_select(problem, args, plan)
    tokens = args.out.clone()
    args.out.fill_(-5)
    stamps = stamp_buffer(plan)
    stamped, _ = emulated_fused_select(problem, args, plan, stamps=stamps, order_seed=4)
    assert torch.equal(stamped, plain) and torch.equal(args.out, tokens)
    records = stamps.view(plan.grid, fs.STAMP_COUNT)
    finish = len(fs.PHASES) - len(fs.FINISH_PHASES) + 1  # the first of the finish's stamps
    before = records[:, :finish]
    assert (before > 0).all() and (before[:, 1:] >= before[:, :-1]).all(), records
    finished = records[:, -1] != 0
    assert (finished == (records[:, finish:] != 0).any(1)).all() and (records[finished, finish:] != 0).all()
    scoring = plan.row_groups * plan.split
    assert finished[:scoring].view(plan.row_groups, plan.split).sum(1).tolist() == [1, 1, 1]  # the last arrivers
    assert finished[scoring:].all()  # every selector
    assert (records[finished, finish - 1:][:, 1:] >= records[finished, finish - 1:][:, :-1]).all()
    times = phase_times(stamps, plan)
    assert set(times) == {*fs.PHASES, "finish", "span", "last"} and all(t >= 0 for t in times.values())


def test_phase_times_are_the_medians_of_the_records():
    """Three CTAs of one one-row group (no selectors), phases of known lengths, the last one's finish 7 us (gather 1,
    select 2, output 4)."""
    plan = fs.Plan(fs.VARIANTS[0], 1, 1, 3, 256)
    stamps = stamp_buffer(plan).view(plan.grid, fs.STAMP_COUNT)
    steps = {0: [1, 2, 1, 3, 4], 1: [3, 2, 0, 1, 8], 2: [2, 2, 1, 2, 2]}
    for cta, lengths in steps.items():
        start = 1_000_000 * (cta + 1)
        stamps[cta, :6] = torch.tensor([start] + [start + 1000 * sum(lengths[:i + 1]) for i in range(5)])
    stamps[1, 6:] = stamps[1, 5] + torch.tensor([1000, 3000, 7000])
    times = phase_times(stamps.flatten(), plan)
    # spans to the arrival 11, 14 and 9 us; the launch from CTA 0's start (1 ms) to CTA 1's finish (2 ms + 21 us)
    assert times == {"query": 2.0, "score": 2.0, "merge": 1.0, "offer": 2.0, "arrive": 4.0, "gather": 1.0,
                     "select": 2.0, "output": 4.0, "finish": 7.0, "span": 11.0, "last": 1021.0}, times

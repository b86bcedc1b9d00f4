"""The work points, declared once (``qsa_aiter/tools/work_points.py``): what the benchmarks and the tuner time, what
the warm-up plans for (the serving path's points), and the names the kernels' tuning plans and the scripts use."""

from __future__ import annotations

import pytest

from qsa_aiter.kernels.catalog import tunable_specs
from qsa_aiter.kernels.scoring.problem import PHASES
from qsa_aiter.tools import work_points as wp

K = 1024


def test_names_are_unique_and_phases_known():
    names = [p.name for p in wp.WORK_POINTS]
    assert len(names) == len(set(names))
    assert {p.phase for p in wp.WORK_POINTS} <= set(PHASES)
    for point in wp.WORK_POINTS:
        assert point.requests == len(point.context_lens) >= 1 and point.rows_per_request >= 1


def test_the_timed_points_and_their_targets():
    points = wp.work_points()
    assert [p.name for p in points] == [
        "9x4@64K-128K", "16x4@32K", "64x4@32K", "64x4@98K", "4x4@262K", "64x1@32K", "16x1@98K", "1x1@262K",
        "128x1@98K", "128x1@8K-200K", "prefill 4096@32K", "prefill 16K@96K"]
    assert [p.name for p in wp.work_points(quick=True)] == [p.name for p in points][:-1]
    targets = {p.name: (p.target_us, p.target_pct) for p in points if p.target_us or p.target_pct}
    assert targets == {"9x4@64K-128K": (None, 80), "16x4@32K": (9.5, None), "64x4@98K": (None, 95),
                       "4x4@262K": (15, None), "64x1@32K": (None, 90), "1x1@262K": (6.5, None),
                       "128x1@98K": (None, 90), "prefill 4096@32K": (90, None)}
    verify = wp.point_named("9x4@64K-128K")
    assert verify.context_lens == tuple(64 * K + i * 8 * K for i in range(9)) and verify.phase == "verify"


def test_the_warmed_points_are_the_specs():
    """The serving path's points, as ``(requests, rows per request, longest context)``: a draft step is planned at
    the decode points; the mixed point at its range's end."""
    def shapes(phase):
        return [(p.requests, p.rows_per_request, p.longest_context) for p in wp.warm_points(phase)]

    assert shapes("verify") == [(9, 4, 128 * K), (16, 4, 32 * K), (64, 4, 32 * K), (64, 4, 98 * K), (4, 4, 262 * K)]
    decode = [(64, 1, 32 * K), (16, 1, 98 * K), (1, 1, 262 * K), (128, 1, 200 * K)]
    assert shapes("draft") == shapes("decode") == decode
    assert shapes("prefill") == [(1, 16 * K, 96 * K), (1, 32 * K, 32 * K)]
    mixed = next(p for p in wp.WORK_POINTS if p.name == "128x1@8K-200K")
    assert max(mixed.context_lens) < mixed.longest_context == 200 * K
    assert min(mixed.context_lens) >= 8 * K


def test_rows_per_request_of_a_phase():
    assert [wp.rows_per_request(phase) for phase in ("verify", "draft", "decode", "prefill")] == [4, 1, 1, None]


def test_points_by_name():
    assert [p.name for p in wp.points_named("1x1@262K,9x4@64K-128K")] == ["9x4@64K-128K", "1x1@262K"]
    with pytest.raises(ValueError, match="no work point named 3x3@1K"):
        wp.points_named("9x4@64K-128K,3x3@1K")
    with pytest.raises(ValueError, match="prefill 32K@32K"):  # warmed, not timed
        wp.point_named("prefill 32K@32K")


def test_every_tuning_plan_names_a_timed_point():
    for spec in tunable_specs():
        for name, phase in spec.tune_points:
            point = wp.point_named(name)  # a draft step has a decode point's shape
            assert point.phase == ("decode" if phase == "draft" else phase), (spec.name, name)

"""The top-k mode of the tuner (``tools/topk_tuning.py``, ``python -m qsa_aiter tune --op topk``): the sweeps of the
work points, the candidates and plans from the registry, the check against the torch path, the rows written (with
a fake timer, on this machine's CPU), the command's wiring and its refusal without a GPU."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import native_topk as nt
from qsa_aiter.runtime import dispatch, registries, tuned
from qsa_aiter.runtime.settings import get_settings
from qsa_aiter.tools import topk_tuning, tuner
from qsa_aiter.tools.work_points import WorkPoint, work_points

ROOT = Path(__file__).resolve().parents[2]
#: A small point (two requests, two rows each, 3000 and 2600 tokens: 750 columns, the second request's rows see
#: fewer), kept 64 groups per row: quick under the interpreter.
SMALL = topk_tuning.TopkSweep(WorkPoint("small", (3000, 2600), 2, "verify"), 64)


def fake_timer():
    """A timer that launches once, on the second input set, and says 5 µs."""

    def timer(inputs, launch, replays):
        launch(inputs.problems[0], inputs.launches[1])
        return 5.0

    return timer


def test_the_candidates_are_the_registry_ones_with_tuned_rows():
    assert topk_tuning.tuned_candidates() == tuple(
        name for name in registries.TOPK.ranked("any") if registries.TOPK.candidates[name].measurement is not None)
    assert set(topk_tuning.tuned_candidates()) == set(tuned.topk_candidate_plans())
    assert "torch" not in topk_tuning.tuned_candidates() and "aiter" not in topk_tuning.tuned_candidates()


def test_the_native_plans_timed_are_its_plans_for_the_shape():
    sm90 = Platform.named("sm_90")
    problem = registries.TopkProblem("cuda", 64, 8192, 512, fused=True)
    assert topk_tuning.candidate_plans("native", problem, sm90) == nt.plans_for(64, 8192, 512, sm90)
    assert list(topk_tuning.candidate_plans("native", problem, sm90)) == list(nt.PLAN_NAMES)
    assert topk_tuning.candidate_plans("triton", problem, sm90) == {"": None}
    gfx942 = topk_tuning.candidate_plans("native", problem, Platform.named("gfx942"))
    assert gfx942 and not any(name.startswith("cluster") for name in gfx942)


def test_the_sweeps_are_the_work_points_one_per_shape():
    sweeps = topk_tuning.plan_sweeps()
    shapes = [(s.rows, s.columns) for s in sweeps]
    assert len(shapes) == len(set(shapes))
    assert {p.name for p in work_points()} == {s.point.name for s in sweeps} | {
        name.split(" (")[0] for s in sweeps for name in s.also}
    (wide,) = topk_tuning.plan_sweeps("16x4@32K")
    assert (wide.rows, wide.columns, wide.block_topk) == (64, 8192, 512)
    (both,) = [s for s in sweeps if (s.rows, s.columns) == (64, 8192)]
    assert both.source == "python -m qsa_aiter tune --op topk at 16x4@32K (verify), 64x1@32K (decode)"
    assert topk_tuning.plan_sweeps("nothing") == []
    assert topk_tuning.plan_sweeps("1x1@262K", block_topk=70000) == []  # every row takes its visible groups


def test_the_inputs_see_what_the_point_sees():
    inputs = topk_tuning.topk_inputs(SMALL, "cpu")
    first = inputs.launches[0]
    assert first.logits.shape == (4, 750) and first.groups.shape == (4, 64)
    assert first.visible.tolist() == [749, 750, 649, 650]  # positions 2998, 2999 and 2598, 2599 at R 4
    assert len(inputs.launches) >= 2 and not torch.equal(inputs.launches[1].logits, first.logits)
    assert inputs.tokens.shape == (4, 64 * 4 + 3)


def test_a_sweep_checks_times_and_writes_one_row_per_candidate_and_plan(tmp_path):
    timer = fake_timer()
    result = topk_tuning.time_sweep(SMALL, ("native", "triton"), 3, "cpu", get_settings(), timer)
    # The native top-k does not serve CPU tensors: reported with its reasons, not timed.
    assert "needs CUDA GPU tensors (tensors are on cpu)" in result.skipped["native"]
    assert [(t.candidate, t.plan, t.us, t.error) for t in result.timings] == [("triton", "", 5.0, "")]
    rows = topk_tuning.topk_rows(result, "sm_90")
    path = tmp_path / "topk.csv"
    path.write_text("arch,block_topk,rows,columns,candidate,plan,us,measured,source\n"
                    "sm_90,64,4,750,triton,,99.00,1,an older run\nsm_80,64,4,750,triton,,7.00,1,another GPU\n")
    tuner.merge_rows(path, rows, tuned.TOPK_TABLE)
    loaded = tuned.read_table(path)
    assert [(r.arch, r.rows, r.columns, r.candidate, r.us, r.measured) for r in loaded] == [
        ("sm_90", 4, 750, "triton", 5.0, True), ("sm_80", 4, 750, "triton", 7.0, True)]
    assert loaded[0].source == "python -m qsa_aiter tune --op topk at small (verify)"
    with pytest.raises(ValueError, match="is not a scoring table"):
        tuner.merge_rows(path, [], tuned.SCORING_TABLE)


def _native_serving(monkeypatch, launch, platform):
    candidate = registries.TOPK.candidates["native"]
    monkeypatch.setitem(registries.TOPK.candidates, "native", dataclasses.replace(
        candidate, reasons=lambda problem, p, settings: [], launch=launch,
        plans=lambda problem, p: nt.plans_for(problem.rows, problem.columns, problem.block_topk, platform)))
    dispatch.clear_decisions()


def test_every_native_plan_is_timed_and_a_wrong_one_dropped(monkeypatch):
    """The native top-k (stood in for by the torch path, one plan made to select wrongly) as if on an sm_90: each
    plan is launched with its plan, checked, and the wrong one is dropped with why."""
    sm90 = Platform.named("sm_90")
    launched = []

    def stand_in(problem, args, settings):
        launched.append(args.plan)
        registries.torch_block_topk(args.logits, args.visible, args.block_topk, args.groups)
        if args.plan == nt.plans_for(4, 750, 64, sm90)["cluster2"]:
            args.groups[0, 0] += 1
        positions, contexts, requests, tokens, ratio, token_topk = args.expand_into
        registries.torch_expand_block_indices(args.groups, positions, contexts, requests, ratio, token_topk, tokens)

    _native_serving(monkeypatch, stand_in, sm90)
    result = topk_tuning.time_sweep(SMALL, ("native",), 3, "cpu", get_settings(), fake_timer())
    plans = nt.plans_for(4, 750, 64, sm90)
    assert [t.plan for t in result.timings] == list(plans)
    assert {t.plan: t.error for t in result.timings if t.error} == {"cluster2": "groups differ from the torch path's"}
    assert all(plan in launched for plan in plans.values())
    rows = topk_tuning.topk_rows(result, "sm_90")
    assert {row["plan"] for row in rows} == set(plans) - {"cluster2"} and all(row["measured"] == 1 for row in rows)
    assert "failed native cluster2: groups differ" in topk_tuning.summary(result)


def test_the_command_writes_the_rows_of_every_sweep(monkeypatch, tmp_path, capsys):
    """``tune --op topk --csv``, with the GPU, the device's name and the sweeps' timings faked: each sweep's rows
    land in the table as it ends."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a fake GPU")
    monkeypatch.setattr(Platform, "of", classmethod(lambda cls, device: Platform.named("sm_90")))

    def fake_sweep(sweep, candidates, replays, device, settings, timer):
        timings = [topk_tuning.TopkTiming("triton", "", 11.2),
                   topk_tuning.TopkTiming("native", "rows_256", 16.7), topk_tuning.TopkTiming("native", "cluster4",
                                                                                              error="boom")]
        return topk_tuning.TopkSweepResult(sweep, timings, {}, "cluster4")

    monkeypatch.setattr(topk_tuning, "time_sweep", fake_sweep)
    out, results = tmp_path / "topk.csv", tmp_path / "all.csv"
    assert tuner.main(["--op", "topk", "--points", "32K", "--no-progress", "--csv", str(out),
                       "--results", str(results)]) == 0
    rows = tuned.read_table(out)
    assert {(r.rows, r.columns) for r in rows} == {(64, 8192), (256, 8192), (4096, 8192)}
    assert {(r.candidate, r.plan, r.us) for r in rows} == {("triton", "", 11.2), ("native", "rows_256", 16.7)}
    printed = capsys.readouterr().out
    assert "a fake GPU (sm_90): 3 top-k sweeps" in printed
    assert "triton 11.20, native rows_256 16.70 us; choose_plan: cluster4" in printed
    assert "failed native cluster4: boom" in printed
    assert "boom" in results.read_text()


@pytest.mark.parametrize("args, message", [
    (["--op", "topk", "--grid", "block_n=64"], "--grid: an option of --op scoring only (this run is --op topk)"),
    (["--op", "topk", "--caches", "fp8"], "--caches: an option of --op scoring only"),
    (["--block-topk", "256"], "--block-topk: an option of --op topk only (this run is --op scoring)"),
    (["--op", "topk", "--candidates", "torch"], "argument --candidates: expected a comma-separated subset of "
                                                "native,native_grid,triton"),
    (["--op", "sort"], "argument --op: invalid choice: 'sort'"),
])
def test_bad_arguments_are_named(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        tuner.main(args)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_no_matching_point_and_a_scoring_csv_are_refused(capsys):
    assert tuner.main(["--op", "topk", "--points", "nothing"]) == 2
    assert "matches none of the work points" in capsys.readouterr().err
    assert tuner.main(["--op", "topk", "--csv", str(ROOT / "configs" / "scoring.csv")]) == 2
    assert "scoring.csv is not a top-k table" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_without_a_gpu_the_command_refuses():
    proc = subprocess.run([sys.executable, "-m", "qsa_aiter", "tune", "--op", "topk", "--points", "1x1@262K"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: the tuner needs a GPU" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.gpu
def test_a_small_topk_sweep_on_the_gpu(tmp_path):
    out = tmp_path / "topk.csv"
    proc = subprocess.run([sys.executable, "-m", "qsa_aiter", "tune", "--op", "topk", "--points", "1x1@262K",
                           "--replays", "5", "--no-progress", "--csv", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = tuned.read_table(out)
    assert {row.candidate for row in rows} >= {"triton"} and all(row.measured and row.us > 0 for row in rows)
    assert all((row.rows, row.columns, row.block_topk) == (1, 67072, 512) for row in rows)

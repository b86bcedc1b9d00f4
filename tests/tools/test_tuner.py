"""The tuner (``python -m qsa_aiter tune``): candidate lists, the plan of sweeps, rows written into a table in place,
argument errors; on the GPU, one small sweep end to end."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qsa_aiter.kernels.catalog import tunable_specs
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.scoring import rowwise, stacked
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.runtime import tuned
from qsa_aiter.tools import tuner

from helpers import phase_batch

ROOT = Path(__file__).resolve().parents[2]


def _problem():
    gen = torch.Generator().manual_seed(0)
    batch, hints = phase_batch("verify", 16, gen)
    return describe_call(*batch.args(), **hints)


def test_candidates_start_with_the_default_and_drop_duplicates():
    default = stacked.StackedConfig(block_n=128, num_stages=3)
    out = tuner.candidates("stacked", default, {"block_n": (64, 128), "num_stages": (3,)})
    assert out[0] == default
    assert out == [default, stacked.StackedConfig(block_n=64, num_stages=3)]
    outside = stacked.StackedConfig(block_n=32)  # not in the grid: the grid's product, then the default
    assert len(tuner.candidates("stacked", outside, stacked.SPEC.tune_grid)) == 2 * 3 * 2 * 3 + 1


def test_a_grid_field_the_kernel_lacks_is_named():
    with pytest.raises(ValueError, match="d_chunk is not a setting of the stacked kernel"):
        tuner.candidates("stacked", stacked.StackedConfig(), {"d_chunk": (32,)})


def test_every_grid_names_settings_of_its_kernel():
    for spec in tunable_specs():
        default = spec.default_config(_problem(), Platform.of(torch.device("cpu")))
        assert len(tuner.candidates(spec.name, default, spec.tune_grid)) > 1


def test_the_plan_covers_every_kernel_dtype_and_page_and_filters_points():
    sweeps = tuner.plan(tuner.KERNELS, tuner.CACHES, [64, 16])
    assert {(s.kernel, s.cache, s.page_size) for s in sweeps} == {
        (k, cache, p) for k in tuner.KERNELS for cache in tuner.CACHES for p in (64, 16)}
    assert {s.phase for s in sweeps if s.kernel == "rowwise"} == {"decode"}
    only = tuner.plan(["stacked"], ["fp8"], [64], point_filter="64x4")
    assert [(s.point, s.phase) for s in only] == [("64x4@98K", "verify")]
    for sweep in sweeps:  # every planned point is a work point
        assert tuner._point(sweep).phase == sweep.phase


def _result(us: float, default_us: float, cfg) -> tuner.SweepResult:
    sweep = tuner.Sweep("stacked", "9x4@64K-128K", "verify", "bf16", 16)
    return tuner.SweepResult(sweep, cfg, default_us, [(us, cfg)], [], _problem())


def test_rows_are_written_in_place_and_load_back(tmp_path):
    path = tmp_path / "tuned.csv"
    problem = _problem()
    cfg = stacked.SPEC.default_config(problem, Platform.of(torch.device("cpu")))
    path.write_text("arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context,block_n,measured,source\n"
                    "gfx950,stacked,bf16,64,4,128,36,131072,32,0,field report\n")
    tuner.merge_rows(path, [tuner.tuned_row(_result(12.5, 14.0, cfg), "sm_90")])
    tuner.merge_rows(path, [tuner.tuned_row(_result(11.0, 14.0, cfg), "sm_90")])  # same key and buckets: replaced
    other = tuner.tuned_row(_result(9.0, 9.5, cfg), "sm_90") | {"rows": problem.num_tokens * 2}
    tuner.merge_rows(path, [other])  # another bucket: added
    rows = tuned.read_table(path)
    assert [(r.arch, r.us, r.default_us) for r in rows] == [("gfx950", None, None), ("sm_90", 11.0, 14.0),
                                                            ("sm_90", 9.0, 9.5)]
    assert rows[1].tile() == {k: v for k, v in cfg.__dict__.items()}
    assert rows[1].measured and rows[1].source == "python -m qsa_aiter tune at 9x4@64K-128K (verify)"
    assert rows[1].context == problem.num_columns * problem.compress_ratio
    with open(path, newline="") as handle:
        header, *lines = list(csv.reader(handle))
    # The file's own columns first, in its order; then only the columns the merged rows fill.
    original = "arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context,block_n,measured,source".split(",")
    assert header[:len(original)] == original and {"us", "default_us", "block_rows"} <= set(header)
    assert all(any(line[i] for line in lines) for i in range(len(original), len(header)))
    assert set(header) <= set(tuned.TunedRow.model_fields)
    assert not list(tmp_path.glob("*.tmp"))
    assert b"\r" not in path.read_bytes()  # line endings as the shipped tables have them


def test_a_row_written_for_another_kernel_keeps_its_own_fields(tmp_path):
    problem = _problem()
    sweep = tuner.Sweep("rowwise", "128x1@98K", "decode", "fp8", 64)
    cfg = rowwise.RowwiseConfig(block_n=128, programs_per_sm=16)
    row = tuner.tuned_row(tuner.SweepResult(sweep, cfg, 20.0, [(18.0, cfg)], [], problem), "sm_90")
    path = tmp_path / "t.csv"
    tuner.merge_rows(path, [row])
    (loaded,) = tuned.read_table(path)
    assert loaded.kernel == "rowwise" and loaded.tile()["block_n"] == 128 and loaded.block_rows is None


@pytest.mark.parametrize("args, message", [
    (["--kernels", "foo"], "argument --kernels: expected a comma-separated subset of"),
    (["--caches", "fp6"], "index-cache format must be one of bf16, fp16, fp8, fp8_fnuz, fp4"),
    (["--grid", "block_n=64"], "--grid applies to one kernel"),
    (["--kernels", "stacked", "--grid", "block_n"], "--grid: expected field=v1,v2"),
    (["--kernels", "stacked", "--grid", "block_n=a,b"], "--grid: expected field=v1,v2"),
    (["--kernels", "stacked", "--grid", "d_chunk=32"], "d_chunk is not a setting of the stacked kernel"),
])
def test_bad_arguments_are_named(args, message):
    proc = subprocess.run([sys.executable, "-m", "qsa_aiter", "tune", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and message in proc.stdout + proc.stderr


@pytest.mark.gpu
def test_a_small_sweep_times_the_default_and_writes_a_row(tmp_path):
    out, results = tmp_path / "tuned.csv", tmp_path / "all.csv"
    proc = subprocess.run(
        [sys.executable, "-m", "qsa_aiter", "tune", "--kernels", "rowwise", "--caches", "bf16", "--page-sizes", "64",
         "--points", "1x1@262K", "--grid", "programs_per_sm=4,8", "--replays", "5", "--jobs", "2", "--no-progress",
         "--csv", str(out), "--results", str(results)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = tuned.read_table(out)
    assert row.arch == Platform.of(torch.device("cuda")).arch and row.kernel == "rowwise" and row.measured
    assert row.us <= row.default_us
    timed = list(csv.DictReader(open(results)))
    assert len(timed) >= 2 and all(float(r["us"]) > 0 for r in timed if r["us"])


def test_config_check_tolerance_infinities_and_nan():
    """The tuner's check of a config against the default: within the tolerance (a float or per logit), equal
    infinities match, NaN (an unwritten logit) never does."""
    import torch

    from qsa_aiter.tools.tuner import _close

    expected = torch.tensor([[1.0, float("-inf"), 0.0]])
    assert _close(expected + torch.tensor([[5e-5, 0.0, 0.0]]), expected, 1e-4)
    assert not _close(expected + torch.tensor([[5e-3, 0.0, 0.0]]), expected, 1e-4)
    assert _close(expected + torch.tensor([[5e-3, 0.0, 0.0]]), expected, torch.tensor([[1e-2, 1e-4, 1e-4]]))
    assert not _close(torch.tensor([[1.0, float("-inf"), float("nan")]]), expected, 1.0)
    assert not _close(torch.tensor([[1.0, 0.0, 0.0]]), expected, 1.0)  # -inf expected, a finite logit got


def test_config_check_allows_e4m3_rounding_only_where_a_config_uses_e4m3_mmas():
    """1e-4 where neither config scores with e4m3 tensor cores (a 16-bit cache); with them (an e4m3fn cache, which
    the interpreter emulates) 1e-4 plus ``E4M3_MMA_TOL`` of the per-logit magnitude bound."""
    from types import SimpleNamespace

    import torch

    from qsa_aiter.kernels.platform import Platform
    from qsa_aiter.kernels.scoring.base import example_problem, example_score_args
    from qsa_aiter.kernels.scoring.stacked import SPEC
    from qsa_aiter.tools.testing import E4M3_MMA_TOL
    from qsa_aiter.tools.tuner import Sweep, _atol, _close

    for kv, cache_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        problem = example_problem(device_type="cpu", kv_dtype=kv, cache_dtype=cache_dtype, num_tokens=4,
                                  num_requests=2, num_columns=1024, max_query_len=2)
        args = example_score_args(problem, torch.int32, "cpu")
        args.q.normal_()
        cfg = SPEC.default_config(problem, Platform.of(torch.device("cpu")))
        atol = _atol(Sweep("stacked", f"check {kv}", "verify", kv, 64), SimpleNamespace(problems=[problem],
                     launches=[args]), cfg, cfg)
        if kv == "bf16":
            assert atol == 1e-4
        else:
            assert atol.shape == args.logits.shape
            # Finite everywhere: past a row's visible count (the two rows of a request see different counts)
            # the bound is -inf, and the scores compared there are zeros, which must match.
            assert bool(torch.isfinite(atol).all()) and bool((atol >= 1e-4).all())
            assert bool((atol <= 1e-4 + E4M3_MMA_TOL * args.q.abs().sum() * 64).all())
            zeros = torch.zeros_like(args.logits)
            assert _close(zeros, zeros, atol)

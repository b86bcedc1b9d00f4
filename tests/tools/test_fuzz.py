"""Seeded fuzzing over random metadata (``qsa_aiter.fuzz``): every path against its oracle, outputs poisoned, exactly
``[0, visible)`` compared. CI runs a couple of hundred cases per path under the interpreter; ``python -m qsa_aiter
fuzz --cases N`` runs more (on the GPU where there is one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.runtime import registries
from qsa_aiter.tools import fuzz

#: Cases per path in the suite: the kernels', fewer for ``auto`` (it runs one of them) and more for the cheap paths.
CASES = {"tiled": 200, "stacked": 200, "keys_major": 120, "rowwise": 200, "torch": 200, "auto": 60, "topk": 200,
         "topk_torch": 200, "topk_native": 120, "expand": 300, "expand_torch": 300}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("part", ["first", pytest.param("rest", marks=pytest.mark.slow)])
@pytest.mark.parametrize("path", fuzz.PATHS)
def test_fuzz_path_matches_its_oracle(path, part):
    # Each path draws its own cases (seeds offset by path), so the suite covers more metadata than one shared draw.
    # The default set runs the first quarter of a path's seeds, the slow set the rest: CI runs all CASES[path].
    seed, first = 1000 * fuzz.PATHS.index(path), CASES[path] // 4
    cases, seed = (first, seed) if part == "first" else (CASES[path] - first, seed + first)
    (result,) = fuzz.run((path,), cases, seed, DEVICE)
    assert result.cases == cases
    assert not result.mismatches, "\n".join([result.line()] + result.mismatches[:5])
    if path in ("tiled", "stacked"):
        # Their reasons refuse some shapes (head counts, head dims), not most of them.
        assert result.refused < result.cases * 3 // 4, result.line()


def test_cases_replay_from_their_seed():
    first, again = fuzz.scoring_case(7, torch.device("cpu")), fuzz.scoring_case(7, torch.device("cpu"))
    assert first.label == again.label
    assert all(torch.equal(a, b) for a, b in zip(first.args[:6], again.args[:6]))


def test_the_draws_reach_the_edges():
    """The metadata the fuzzer is there for is drawn: odd page sizes, int64 values past 2**31, bad and huge page ids,
    positions past the context, ties, every cache format."""
    cases = [fuzz.scoring_case(seed, torch.device("cpu")) for seed in range(150)]
    pages = {c.args[1].shape[1] for c in cases}
    assert {1, 5, 33, 100} <= pages
    assert {c.args[1].dtype for c in cases} >= {torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                                 torch.float8_e4m3fnuz, torch.float4_e2m1fn_x2}
    assert any(int(c.args[4].max()) > 2**31 for c in cases)  # a position past 2**31
    assert any(int(c.args[5].max()) > 2**31 for c in cases)  # a context past 2**31
    assert any(int(c.args[2].max()) > 2**31 for c in cases)  # a page id past 2**31
    assert any(int(c.args[3].max()) >= c.args[2].shape[0] for c in cases)  # a request id past the table
    assert any(bool(c.tied.any()) for c in cases)
    assert any(c.args[2].dtype == torch.int32 for c in cases) and any(c.args[2].dtype == torch.int64 for c in cases)


def test_the_command_line_reports_each_path(capsys):
    assert fuzz.main(["--cases", "2", "--paths", "torch,expand", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "torch: 2 cases" in out and "expand: 2 cases" in out and "0 mismatches" in out


def _refused_by(path: str) -> int:
    """A seed whose scoring case ``path``'s kernel refuses (its reasons name the case's shape)."""
    for seed in range(200):
        case = fuzz.scoring_case(seed, torch.device("cpu"))
        if registries.SCORING.reasons(path, describe_call(*case.args, **case.kwargs)):
            return seed
    raise AssertionError(f"no case of the first 200 seeds is refused by {path}")


def test_a_path_that_checked_nothing_fails_the_command(capsys):
    """A path whose every case its kernel refused was not exercised at all: the command says so and fails, rather
    than reporting refusals and exiting 0."""
    seed = _refused_by("stacked")
    assert fuzz.main(["--cases", "1", "--paths", "stacked", "--seed", str(seed), "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    assert "stacked: 1 cases, 1 refused by the kernel's reasons, 0 mismatches  NOT EXERCISED" in captured.out
    assert "every case of stacked was refused by the kernel's reasons: nothing was checked there" in captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is what a machine without a GPU fuzzes on")
def test_without_a_gpu_the_command_runs_the_kernels_in_the_interpreter():
    """``python -m qsa_aiter fuzz`` in a process without TRITON_INTERPRET runs itself again under the interpreter:
    the row-wise kernel (it serves every case) is checked, not refused."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [sys.executable, "-m", "qsa_aiter", "fuzz", "--cases", "1", "--paths", "rowwise,expand"]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "running the fuzzer again with TRITON_INTERPRET=1" in result.stderr
    assert "on the Triton interpreter" in result.stdout
    assert "rowwise: 1 cases, 0 refused by the kernel's reasons, 0 mismatches" in result.stdout

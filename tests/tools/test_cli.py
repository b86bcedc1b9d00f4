"""The command line: ``python -m qsa_aiter explain`` and the environment check shared by every subcommand."""

from __future__ import annotations

import pytest
import torch

from qsa_aiter.tools.cli import main
from qsa_aiter.tools.demo import main as demo_main


def test_explain_prints_the_decision(capsys):
    argv = ["explain", "--requests", "3", "--rows-per-request", "4", "--context", "1K-2K", "--page-size", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "phase verify" in out
    assert "* " in out  # exactly one candidate is marked as the one that serves
    assert out.count("* ") == 1


def test_explain_rejects_a_context_shorter_than_the_rows(capsys):
    assert main(["explain", "--requests", "1", "--rows-per-request", "8", "--context", "4"]) == 2
    assert "shorter than 8 rows" in capsys.readouterr().err


def test_bad_environment_value_exits_2_naming_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("QSA_AITER_STRICT", "maybe")
    assert main(["explain"]) == 2
    err = capsys.readouterr().err
    assert "QSA_AITER_STRICT" in err and "maybe" in err


def test_explain_on_a_quantised_cache(capsys):
    argv = ["explain", "--requests", "2", "--rows-per-request", "4", "--context", "1K-2K", "--page-size", "16",
            "--cache", "fp4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "kv=fp4(float4_e2m1fn_x2)" in out and "registry row ('fp4', 16, 'verify')" in out


def test_cache_choices_match_the_workload_formats():
    from qsa_aiter.tools.cli import _build_parser
    from qsa_aiter.tools.workloads import CACHES

    explain = _build_parser()._subparsers._group_actions[0].choices["explain"]
    choices = next(a.choices for a in explain._actions if a.dest == "cache")
    assert tuple(choices) == CACHES


def test_explain_on_cuda_without_a_gpu_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["explain", "--device", "cuda", "--requests", "2", "--context", "1K"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "no CUDA device" in err and "Traceback" not in err


def test_a_negative_context_is_quoted_whole(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "--context", "-5"])
    assert exit_info.value.code == 2
    assert "got '-5'" in capsys.readouterr().err


def test_demo_rejects_a_non_positive_iteration_count(capsys):
    for value in ("-1", "0", "x"):
        with pytest.raises(SystemExit) as exit_info:
            demo_main(["--iters", value])
        assert exit_info.value.code == 2
        assert f"--iters: expected a positive integer; got '{value}'" in capsys.readouterr().err

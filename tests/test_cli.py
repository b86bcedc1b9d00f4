"""The command line: ``python -m qsa_aiter explain`` and the environment check shared by every subcommand."""

from __future__ import annotations

from qsa_aiter.__main__ import main


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
    from qsa_aiter.__main__ import _build_parser
    from qsa_aiter.workloads import CACHES

    explain = _build_parser()._subparsers._group_actions[0].choices["explain"]
    choices = next(a.choices for a in explain._actions if a.dest == "cache")
    assert tuple(choices) == CACHES

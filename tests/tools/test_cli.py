"""The command line: ``python -m qsa_aiter explain``, the environment check shared by every subcommand, and the
cache formats' one vocabulary in every command's options (former spellings and option names accepted with a note)."""

from __future__ import annotations

import argparse

import pytest
import torch

from qsa_aiter.kernels.quant.formats import CACHE_FORMATS
from qsa_aiter.tools.bench import main as bench_main
from qsa_aiter.tools.cli import main
from qsa_aiter.tools.demo import main as demo_main
from qsa_aiter.tools.tuner import main as tune_main


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


@pytest.mark.parametrize("spelling", list(CACHE_FORMATS))
def test_explain_takes_every_cache_format_by_name(spelling, capsys):
    argv = ["explain", "--requests", "1", "--rows-per-request", "1", "--context", "1K", "--page-size", "16",
            "--cache", spelling]
    assert main(argv) == 0
    captured = capsys.readouterr()
    kind = CACHE_FORMATS[spelling].kind
    assert f"registry row ('{kind}', 16," in captured.out and "note:" not in captured.err


@pytest.mark.parametrize("spelling, name", [("16bit", "bf16"), ("fp8_e4m3fn", "fp8"), ("fp8_e4m3fnuz", "fp8_fnuz")])
def test_former_cache_spellings_work_with_a_note(spelling, name, capsys):
    assert main(["explain", "--requests", "1", "--rows-per-request", "1", "--context", "1K", "--cache", spelling]) == 0
    err = capsys.readouterr().err
    assert f"'{spelling}' is now spelled '{name}'" in err and err.count("is now spelled") == 1


def test_former_16bit_follows_the_query_dtype(capsys):
    argv = ["explain", "--requests", "1", "--rows-per-request", "1", "--context", "1K", "--dtype", "fp16",
            "--cache", "16bit"]
    assert main(argv) == 0
    assert "float16" in capsys.readouterr().out


def test_a_16bit_cache_of_another_dtype_than_q_is_a_clear_error(capsys):
    argv = ["explain", "--requests", "1", "--rows-per-request", "1", "--context", "1K", "--dtype", "fp16",
            "--cache", "bf16"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "a 16-bit cache has q's dtype" in err and "Traceback" not in err


def test_an_unknown_cache_format_names_the_accepted_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["explain", "--cache", "fp6"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'fp6'" in err and all(name in err for name in CACHE_FORMATS)


@pytest.mark.parametrize("command, former, new", [
    (bench_main, "--kv", "--caches"), (tune_main, "--kv", "--caches")])
def test_renamed_cache_options_still_parse_with_a_note(command, former, new, capsys, monkeypatch):
    """``bench --kv`` and ``tune --kv`` are now ``--caches``: parsed alike, with a note (``--help`` shows the new
    name only)."""
    seen = {}

    def stop(self, args=None, namespace=None):  # what was parsed, before any GPU work
        seen.update(vars(original(self, args, namespace)))
        raise SystemExit(0)

    original = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(SystemExit):
        command([former, "bf16,fp8_e4m3fn"])
    err = capsys.readouterr().err
    assert seen["caches"] == ("bf16", "fp8")
    assert f"note: {former} is now {new}" in err and "'fp8_e4m3fn' is now spelled 'fp8'" in err
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    with pytest.raises(SystemExit):
        command(["--help"])
    help_text = capsys.readouterr().out
    assert new in help_text and former not in help_text


def test_warmup_caches_take_format_names_and_former_ones(monkeypatch, capsys):
    from qsa_aiter.tools.cli import _build_parser

    opts = _build_parser().parse_args(["warmup", "--caches", "fp8_fnuz,fp8_e4m3fn,bf16"])
    assert opts.caches == ("fp8_fnuz", "fp8", "bf16")
    assert "'fp8_e4m3fn' is now spelled 'fp8'" in capsys.readouterr().err


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

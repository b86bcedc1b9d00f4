"""The command line: ``python -m qsa_aiter explain``, the environment check shared by every subcommand, honest exit
statuses (a bad variable exits 2 with one line, a command that did nothing exits non-zero, a closed pipe ends a
command quietly), every command's ``--help``, and one option vocabulary in every command (the cache formats' names,
``--page-size`` / ``--page-sizes``, comma lists; former spellings and option names accepted with a note)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

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


def _parsers():
    """Every command's parser by name (``python -m qsa_aiter`` and its subcommands, the tools' own), with the
    subcommands' parsers reached through the dispatcher's."""
    from qsa_aiter.tools import bench, demo, fuzz, isa, quality, static_model, tuner
    from qsa_aiter.tools.cli import _build_parser

    found = {"bench": bench.build_parser(), "tune": tuner.build_parser(), "fuzz": fuzz.build_parser(),
             "demo": demo.build_parser(), "isa": isa.build_parser(), "model-configs": static_model.build_parser(),
             "quality": quality.build_parser()}
    pending = [("python -m qsa_aiter", _build_parser())]
    while pending:
        name, parser = pending.pop()
        found.setdefault(name, parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending += [(f"{name} {sub}", p) for sub, p in action.choices.items() if p.add_help]
    return found


def test_every_option_of_every_command_says_what_it_does():
    parsers = _parsers()
    assert {"bench", "tune", "fuzz", "demo", "isa", "model-configs", "quality", "python -m qsa_aiter explain",
            "python -m qsa_aiter warmup",
            "python -m qsa_aiter jit list", "python -m qsa_aiter jit clear"} <= set(parsers)
    silent = []
    for name, parser in parsers.items():
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue  # a former option name (RenamedOption), --help
            if isinstance(action, argparse._SubParsersAction):
                silent += [f"{name} {a.dest}" for a in action._choices_actions if not a.help]
            elif not action.help:
                silent.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not silent, f"options without help: {silent}"


def test_every_page_size_option_says_it_counts_compressed_groups():
    """vLLM and SGLang count a block in tokens; here a page counts compressed key groups: each option says so."""
    asked = []
    for name, parser in _parsers().items():
        for action in parser._actions:
            if any("page" in option for option in action.option_strings) and action.help != argparse.SUPPRESS:
                asked.append(name)
                assert "page_size compressed key groups" in action.help, (name, action.help)
                assert "page_size x compress_ratio tokens" in action.help, (name, action.help)
    assert sorted(asked) == ["bench", "isa", "model-configs", "python -m qsa_aiter explain",
                             "python -m qsa_aiter warmup", "tune"]


def test_the_demo_says_what_its_page_size_counts(monkeypatch, capsys):
    from qsa_aiter.tools import demo

    monkeypatch.setattr(demo, "run_phase", lambda *args: True)  # the header alone
    assert demo_main([]) == 0
    assert "page size 64 compressed key groups (256 tokens per page)" in capsys.readouterr().out


@pytest.mark.parametrize("given", ["variable", "flag"])
def test_warmup_into_a_directory_it_cannot_write_names_where_it_came_from(monkeypatch, capsys, given):
    """An existing directory that takes no files (``/proc``, even for root) is a valid read-only cache, but warmup
    writes into it: refused before any work, naming the variable or flag that chose it."""
    if given == "variable":
        monkeypatch.setenv("QSA_AITER_JIT_DIR", "/proc")
        argv = ["warmup", "--arch", "sm_90", "--no-progress"]
    else:
        argv = ["warmup", "--arch", "sm_90", "--no-progress", "--jit-dir", "/proc"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    source = "environment variable QSA_AITER_JIT_DIR='/proc'" if given == "variable" else "--jit-dir"
    assert f"error: the JIT cache directory /proc ({source}) is not writable: warmup compiles into it" in err


def test_isa_refuses_a_native_kernel_and_an_unknown_index_dtype(capsys):
    """``isa`` reports Triton builds only: a native kernel or an unknown index dtype is an error naming the option,
    before anything is compiled."""
    from qsa_aiter.tools import isa

    assert isa.main(["--arch", "gfx950", "--kernels", "native_topk", "--no-progress"]) == 2
    assert "--kernels" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        isa.main(["--arch", "gfx950", "--index-dtypes", "int16", "--no-progress"])
    assert info.value.code == 2
    assert "argument --index-dtypes: expected a comma-separated subset of int32,int64" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# Exit statuses: configuration errors, commands that did nothing, closed pipes, --help
# ---------------------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
#: One cheap invocation of every subcommand (what runs after the environment check does not matter here).
EVERY_COMMAND = [["explain"], ["demo"], ["bench"], ["tune"], ["fuzz"], ["quality"], ["isa", "--arch", "gfx950"],
                 ["model-configs", "--csv", "rows.csv"], ["warmup"], ["native-resources"], ["jit", "list"],
                 ["jit", "clear"]]


def _cli(argv: list[str], env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    """``python -m qsa_aiter argv`` in a child process (``env`` added to this one's)."""
    return subprocess.run([sys.executable, "-m", "qsa_aiter", *argv], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=300, check=False, **kwargs)


@pytest.mark.parametrize("argv, variable", [(["demo"], "QSA_AITER_BACKEND"), (["explain"], "QSA_AITER_TOPK_BACKEND")])
def test_a_bad_backend_variable_is_one_line_and_exit_2(argv, variable):
    """The issue's two commands: a forced backend that does not exist is a configuration error, named, before any
    work (the demo used to end in a traceback, ``explain`` with a bad top-k backend used to exit 0)."""
    proc = _cli(argv, {variable: "foo"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        proc.stderr.strip().splitlines()[0]] and f"error: environment variable {variable}='foo' is invalid" in \
        proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("variable", ["QSA_AITER_BACKEND", "QSA_AITER_TOPK_BACKEND", "QSA_AITER_STRICT",
                                      "QSA_AITER_LOGITS_WORKSPACE_MB"])
@pytest.mark.parametrize("argv", EVERY_COMMAND, ids=lambda argv: argv[0] if argv[0] != "jit" else " ".join(argv))
def test_every_command_refuses_a_bad_variable_before_any_work(argv, variable, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, "foo")
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"error: environment variable {variable}='foo' is invalid")
    assert captured.out == "" and not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv", EVERY_COMMAND, ids=lambda argv: argv[0] if argv[0] != "jit" else " ".join(argv))
def test_every_command_prints_its_help(argv, monkeypatch, capsys):
    """``--help`` exits 0 and prints the command's usage, whatever the environment holds."""
    monkeypatch.setenv("QSA_AITER_BACKEND", "foo")
    command = argv[:2] if argv[0] == "jit" else argv[:1]
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m qsa_aiter {' '.join(command)}"), out[:200]


def test_the_package_and_a_tool_module_print_their_help():
    for argv in (["--help"], ["quality", "--help"]):
        proc = _cli(argv)
        assert proc.returncode == 0 and proc.stdout.startswith("usage: python -m qsa_aiter"), proc.stderr
    module = subprocess.run([sys.executable, "-m", "qsa_aiter.tools.quality", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=False)
    assert module.returncode == 0 and module.stdout.startswith("usage: python -m qsa_aiter quality")
    assert "--caches" in module.stdout and "--seeds" in module.stdout
    # A tool module run on its own checks the environment as the package's command line does.
    bad = subprocess.run([sys.executable, "-m", "qsa_aiter.tools.quality"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "QSA_AITER_TOPK_BACKEND": "foo"}, timeout=300, check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: environment variable QSA_AITER_TOPK_BACKEND='foo'")


def test_the_quality_command_prints_its_table(capsys):
    assert main(["quality", "--caches", "fp8", "--numerics", "decoded", "--seeds", "1", "--rows", "2",
                 "--groups", "256", "--topk", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| cache | numerics | mean overlap") and lines[2].startswith("| fp8 | decoded | ")
    assert len(lines) == 3
    assert main(["quality", "--groups", "256", "--topk", "512"]) == 2
    assert "--topk 512 is more than --groups 256" in capsys.readouterr().err


def test_jit_clear_that_removes_nothing_fails(tmp_path):
    """An arch the cache has no directory for, or an empty cache: nothing was cleared, said on stderr, exit 1; a
    name that is no arch at all is an argument error, exit 2."""
    proc = _cli(["jit", "clear", "--arch", "sm_999", "--jit-dir", str(tmp_path)])
    assert proc.returncode == 1 and proc.stdout == ""
    assert f"error: nothing to remove under {tmp_path} for sm_999 (the cache is empty)" in proc.stderr
    (tmp_path / "native" / "sm_90").mkdir(parents=True)
    assert main(["jit", "clear", "--arch", "sm_999", "--jit-dir", str(tmp_path)]) == 1
    assert (tmp_path / "native" / "sm_90").is_dir()
    with pytest.raises(SystemExit) as info:
        main(["jit", "clear", "--arch", "nonsense", "--jit-dir", str(tmp_path)])
    assert info.value.code == 2


def test_jit_clear_names_the_archs_the_cache_holds(tmp_path, capsys):
    (tmp_path / "native" / "sm_90").mkdir(parents=True)
    assert main(["jit", "clear", "--arch", "sm_100", "--jit-dir", str(tmp_path)]) == 1
    assert "for sm_100 (the cache holds sm_90)" in capsys.readouterr().err


@pytest.mark.parametrize("arch, why", [("sm_90", "no NVRTC"), ("gfx950", "no clang or HIP headers")])
def test_a_warmup_that_built_nothing_fails(arch, why, monkeypatch, tmp_path, capsys):
    """The native tier without its compiler (NVRTC for NVIDIA, clang and the HIP headers for AMD) builds nothing:
    the notes say why and the exit is 1."""
    from qsa_aiter.runtime.jit import hip_clang, nvrtc

    def no_nvrtc():
        raise nvrtc.NvrtcUnavailable("NVRTC not found (test)")

    monkeypatch.setattr(nvrtc, "unavailable_reason", lambda: "NVRTC not found (test)")
    monkeypatch.setattr(nvrtc, "compiler", no_nvrtc)
    monkeypatch.setattr(hip_clang, "toolchain", lambda settings=None, arch="gfx942": "clang not found (test)")
    argv = ["warmup", "--arch", arch, "--kernels", "native_topk", "--jit-dir", str(tmp_path), "--no-progress"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "0 compiled" in captured.out and f"error: nothing was built for {arch}: native_topk: not built" in \
        captured.err


def test_output_to_a_closed_pipe_ends_quietly():
    """``jit list | head``: the reader went away; the command ends as one killed by SIGPIPE would (141), without
    a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write the child makes meets a closed pipe
    try:
        proc = subprocess.run([sys.executable, "-m", "qsa_aiter", "jit", "list"], cwd=ROOT, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=300, check=False)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# One option vocabulary
# ---------------------------------------------------------------------------------------------------------------


def _parsed(command, argv, monkeypatch) -> dict:
    """What ``command`` (a tool's ``main``) parses from ``argv``, before any work."""
    seen = {}
    original = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        seen.update(vars(original(self, args, namespace)))
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(SystemExit):
        command(argv)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    return seen


@pytest.mark.parametrize("command", [bench_main, tune_main])
def test_page_sizes_are_one_option_with_the_former_name_noted(command, monkeypatch, capsys):
    assert _parsed(command, ["--page-sizes", "64,16"], monkeypatch)["page_sizes"] == (64, 16)
    assert "note:" not in capsys.readouterr().err
    assert _parsed(command, ["--pages", "16"], monkeypatch)["page_sizes"] == (16,)
    assert "note: --pages is now --page-sizes" in capsys.readouterr().err


def test_fuzz_paths_are_a_comma_list(monkeypatch, capsys):
    from qsa_aiter.tools.fuzz import main as fuzz_main

    assert _parsed(fuzz_main, ["--paths", "torch,expand"], monkeypatch)["paths"] == ("torch", "expand")
    with pytest.raises(SystemExit) as info:
        fuzz_main(["--paths", "torch,nope"])
    assert info.value.code == 2 and "argument --paths: expected a comma-separated subset of" in \
        capsys.readouterr().err


def test_tune_grid_takes_one_axis_per_flag(monkeypatch):
    seen = _parsed(tune_main, ["--kernels", "stacked", "--grid", "block_n=64,128", "--grid", "num_stages=2,3"],
                   monkeypatch)
    assert seen["grid"] == ["block_n=64,128", "num_stages=2,3"]


def test_the_benchmark_scripts_take_page_size_with_the_former_page_noted(capsys):
    import benchmark_scripts

    parser = benchmark_scripts.load("selection").build_parser()
    assert parser.parse_args(["--page-size", "16"]).page == 16
    assert parser.parse_args(["--page", "16"]).page == 16
    assert "note: --page is now --page-size" in capsys.readouterr().err
    floor = benchmark_scripts.load("traffic_floor").build_parser()
    assert floor.parse_args(["--page-sizes", "64", "--block-n", "64,128"]).page_sizes == (64,)


@pytest.mark.parametrize("command, argv", [(bench_main, ["--points", "no-such-point"]),
                                           (bench_main, ["--eager", "--points", "no-such-point"]),
                                           (tune_main, ["--kernels", "stacked", "--points", "no-such-point"])])
def test_a_point_filter_that_keeps_nothing_is_an_error(command, argv, capsys):
    """A benchmark or a tuning run over no work point would time nothing (and write an empty table): refused,
    naming the filter, before any GPU work."""
    assert command(argv) == 2
    assert "error: --points 'no-such-point'" in capsys.readouterr().err

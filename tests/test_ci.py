"""CI runs what README.md tells a newcomer to run: its test command verbatim, before NVRTC is installed, and then
everything that command leaves out but the GPU tests; the tests marked ``nvrtc`` skip without NVRTC unless
``--require-nvrtc``, those marked ``amd`` without the offline AMD toolchain unless ``--require-amd``, and CI runs
each where it cannot skip. Its AMD step sets the toolchain up with the project's own script, then holds every native
variant to no scratch and no VGPR spills before the ``amd`` tests."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import conftest
from qsa_aiter.runtime.jit import hip_clang, nvrtc

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()
README = (ROOT / "README.md").read_text()
MARKERS = ("gpu", "slow", "nvrtc", "amd")
#: The markers whose tests skip where a tool is missing, and the option that makes them run (and fail) there.
REQUIRED_BY = {"nvrtc": "--require-nvrtc", "amd": "--require-amd"}


def readme_test_command() -> str:
    """The one line of the bash block under README.md's "Run the tests"."""
    section = README[README.index("Run the tests"):]
    block = section[section.index("```bash\n") + len("```bash\n"):]
    return block[:block.index("```")].strip()


def _line(predicate) -> int:
    return next(i for i, line in enumerate(CI.splitlines()) if predicate(line))


def test_ci_runs_the_readme_test_command_verbatim_before_installing_nvrtc():
    command = readme_test_command()
    assert "\n" not in command and "python -m pytest" in command, command
    at = _line(lambda line: line.startswith(f"{command} || failed $?"))  # verbatim, and a failure stops CI
    removed = _line(lambda line: line.startswith("pip uninstall") and "nvidia-cuda-nvrtc-cu12" in line)
    installed = _line(lambda line: line.startswith("pip install nvidia-cuda-nvrtc-cu12"))
    assert removed < at < installed


def _selects(expression: str, markers: dict[str, bool]) -> bool:
    """Whether pytest's ``-m expression`` selects a test with these markers (the expressions are Python's too)."""
    return eval(expression, {"__builtins__": {}}, dict(markers))


def test_ci_runs_every_test_but_the_gpu_ones_and_the_readme_none_of_the_slow():
    """The marker expressions of CI's runs over the whole suite (those naming no paths) select, together, a test of
    every combination of markers that is not ``gpu``, an ``nvrtc`` or ``amd`` one in a run that requires its tool
    (where it cannot skip); none selects a ``gpu`` one; README.md's command selects no ``slow`` one."""
    lines = [line for line in CI.splitlines() if "python -m pytest" in line and " tests/" not in line]
    runs = [(re.search(r'-m "([^"]+)"', line).group(1), {m for m, option in REQUIRED_BY.items() if option in line})
            for line in lines]
    assert len(runs) == 3, lines
    readme = re.search(r'-m "([^"]+)"', readme_test_command()).group(1)
    assert (readme, set()) in runs
    for values in itertools.product((False, True), repeat=len(MARKERS)):
        markers = dict(zip(MARKERS, values))
        needs = {m for m in REQUIRED_BY if markers[m]}
        selected = [required for expression, required in runs if _selects(expression, markers)]
        if markers["gpu"]:
            assert not selected, markers
        else:
            assert any(needs <= required for required in selected), markers
        assert not (_selects(readme, markers) and (markers["slow"] or markers["gpu"])), markers


def test_ci_sets_the_amd_toolchain_up_then_checks_the_builds_then_runs_the_amd_tests():
    setup = _line(lambda line: line.startswith("bash .ci/amd-toolchain.sh || failed $?"))
    check = _line(lambda line: line.startswith("python -m qsa_aiter native-resources") and "--fail-on-spills" in line)
    tests = _line(lambda line: "python -m pytest" in line and "--require-amd" in line)
    assert setup < check < tests
    assert CI.splitlines()[check + 1].strip().startswith("|| failed $?")
    assert "--arch gfx942,gfx950" in CI.splitlines()[check]


def test_the_toolchain_script_installs_the_clang_that_hip_clang_looks_for():
    script = (ROOT / ".ci" / "amd-toolchain.sh").read_text()
    assert re.search(r"^LLVM=(\d+)\b", script, flags=re.M).group(1) == str(hip_clang.LLVM_VERSION)
    assert "${HIP_COMPILE_HOME:-${TMPDIR:-/tmp}/hip-compile}/sdk" in script  # hip_clang.sdk_candidates' first
    assert script.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in script


class _Item:
    def __init__(self, *markers: str):
        self.keywords = dict.fromkeys(markers)
        self.added = []

    def add_marker(self, mark):
        self.added.append(mark)


class _Config:
    def __init__(self, require_nvrtc: bool, require_amd: bool = False):
        self.options = {"--require-nvrtc": require_nvrtc, "--require-amd": require_amd}

    def getoption(self, name: str):
        return self.options[name]


def _skips(missing: str | None, require_nvrtc: bool, monkeypatch) -> list[str]:
    monkeypatch.setattr(nvrtc, "unavailable_reason", lambda: missing)
    marked, plain = _Item("nvrtc"), _Item()
    conftest.pytest_collection_modifyitems(_Config(require_nvrtc), [marked, plain])
    assert not plain.added
    return [mark.kwargs["reason"] for mark in marked.added if mark.name == "skip"]


def test_nvrtc_tests_skip_without_nvrtc_unless_it_is_required(monkeypatch):
    (reason,) = _skips("NVRTC not found (here)", False, monkeypatch)
    assert reason.startswith("needs NVRTC (pip install nvidia-cuda-nvrtc-cu12") and "NVRTC not found (here)" in reason
    assert _skips("NVRTC not found (here)", True, monkeypatch) == []  # --require-nvrtc: they run, and fail
    assert _skips(None, False, monkeypatch) == []  # NVRTC is here: they run


def _amd_skips(missing: str | None, require_amd: bool, monkeypatch) -> list[str]:
    monkeypatch.setattr(conftest, "amd_toolchain_missing", lambda: missing)
    monkeypatch.setattr(nvrtc, "unavailable_reason", lambda: None)
    marked, plain = _Item("amd"), _Item()
    conftest.pytest_collection_modifyitems(_Config(False, require_amd), [marked, plain])
    assert not plain.added
    return [mark.kwargs["reason"] for mark in marked.added if mark.name == "skip"]


def test_amd_tests_skip_without_the_toolchain_unless_it_is_required(monkeypatch):
    (reason,) = _amd_skips("clang-22 not found (here)", False, monkeypatch)
    assert reason == "needs the offline AMD toolchain (bash .ci/amd-toolchain.sh): clang-22 not found (here)"
    assert _amd_skips("clang-22 not found (here)", True, monkeypatch) == []  # --require-amd: they run, and fail
    assert _amd_skips(None, False, monkeypatch) == []  # the toolchain is here: they run

"""CI runs what README.md tells a newcomer to run: its test command verbatim, before NVRTC is installed, and then
everything that command leaves out but the GPU tests; the tests marked ``nvrtc`` skip without NVRTC unless
``--require-nvrtc``."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import conftest
from qsa_aiter.runtime.jit import nvrtc

ROOT = Path(__file__).resolve().parents[1]
CI = (ROOT / ".ci" / "run").read_text()
README = (ROOT / "README.md").read_text()
MARKERS = ("gpu", "slow", "nvrtc")


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
    every combination of markers that is not ``gpu``, an ``nvrtc`` one in a run with ``--require-nvrtc`` (where it
    cannot skip); README.md's command selects no ``slow`` one."""
    lines = [line for line in CI.splitlines() if "python -m pytest" in line and " tests/" not in line]
    runs = [(re.search(r'-m "([^"]+)"', line).group(1), "--require-nvrtc" in line) for line in lines]
    assert len(runs) == 2, lines
    readme = re.search(r'-m "([^"]+)"', readme_test_command()).group(1)
    assert (readme, False) in runs
    for values in itertools.product((False, True), repeat=len(MARKERS)):
        markers = dict(zip(MARKERS, values))
        runs_it = [required for expression, required in runs if _selects(expression, markers)]
        assert (any(runs_it) if markers["nvrtc"] else bool(runs_it)) == (not markers["gpu"]), markers
        assert not (_selects(readme, markers) and (markers["slow"] or markers["gpu"])), markers


class _Item:
    def __init__(self, *markers: str):
        self.keywords = dict.fromkeys(markers)
        self.added = []

    def add_marker(self, mark):
        self.added.append(mark)


class _Config:
    def __init__(self, require_nvrtc: bool):
        self.require_nvrtc = require_nvrtc

    def getoption(self, name: str):
        assert name == "--require-nvrtc", name
        return self.require_nvrtc


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

"""What the JIT-cache and warm-up tests share: a frozen copy of the package for their child processes, and running
those children.

Compilations run in child processes without ``TRITON_INTERPRET`` (the test process's kernels are interpreted on a
CPU-only machine, and an interpreted kernel cannot be compiled). Every child of a test module runs the same copy of
the kernel sources (an edit to them in between would, rightly, make every cached entry stale); a module that spawns
children imports the ``sources`` and ``same_sources_here`` fixtures from here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import filelock
import pytest

from qsa_aiter.runtime.jit import paths as jit_paths

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_90", "gfx942", "gfx950")
#: A small matrix for the compiling tests: per arch the row-wise scorer (bf16, page 64) and the expansion for each
#: kind of request count (1, a multiple of 16, neither): 4 variants.
SMALL = dict(kernels=["rowwise", "expand"], caches=["bf16"], page_sizes=[64], index_dtypes=["int32"])
SMALL_CLI = ["--kernels", "rowwise,expand", "--caches", "bf16", "--page-sizes", "64", "--index-dtypes", "int32"]

_SOURCES: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def sources(tmp_path_factory):
    """The package and its tuned configs, copied once per module: the sources its children run."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "qsa_aiter", src / "qsa_aiter", ignore=ignore)
    shutil.copytree(ROOT / "configs", src / "configs", ignore=ignore)
    _SOURCES[:] = [src]
    yield src
    _SOURCES.clear()


@pytest.fixture(autouse=True)
def same_sources_here(sources, monkeypatch):
    """Entries the children built are checked here against the sources they were built from (``paths`` is the
    module whose ``kernel_sources_hash`` reads ``KERNEL_SOURCES``)."""
    monkeypatch.setattr(jit_paths, "KERNEL_SOURCES", sources / "qsa_aiter" / "kernels")
    jit_paths.kernel_sources_hash.cache_clear()
    yield
    jit_paths.kernel_sources_hash.cache_clear()


def source_dir() -> Path:
    """The current module's copy of the sources (the children's working directory)."""
    return _SOURCES[0]


def child_env(**extra) -> dict:
    """The environment of a compiling child: no TRITON_INTERPRET, no qsa_aiter switches but ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("QSA_AITER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(_SOURCES[0])] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def run_child(code: str, *args: str, env: dict | None = None, timeout: int = 600) -> tuple[dict, str]:
    """Run ``code`` in a child; returns the JSON it printed after ``JIT-RESULT`` and its stderr."""
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=_SOURCES[0], env=env or child_env(),
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("JIT-RESULT ")]
    assert proc.returncode == 0 and lines, (f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                           f"{proc.stderr[-5000:]}")
    return json.loads(lines[-1].removeprefix("JIT-RESULT ")), proc.stderr


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m qsa_aiter ARGS`` in a child of the copied sources."""
    return subprocess.run([sys.executable, "-m", "qsa_aiter", *args], cwd=_SOURCES[0], env=env or child_env(),
                          capture_output=True, text=True, timeout=timeout)


def once_per_run(tmp_path_factory, name: str, make: Callable[[Path], dict]) -> tuple[Path, dict]:
    """``(directory, make(directory))`` made once per pytest run, shared by every pytest-xdist worker (the
    workers' temporary directories share a parent): the first worker to get here makes it, under a file lock, and
    the others read its JSON result. ``make`` fills ``directory``; the tests that change it work on copies."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    directory, result = base / name, base / f"{name}.json"
    with filelock.FileLock(str(base / f"{name}.lock")):
        if not result.is_file():
            shutil.rmtree(directory, ignore_errors=True)  # a worker that failed part-way left it
            directory.mkdir()
            result.write_text(json.dumps(make(directory)))
    return directory, json.loads(result.read_text())

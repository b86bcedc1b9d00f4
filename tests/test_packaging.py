"""A built wheel is complete: it ships the native kernels' CUDA source and the changelog, installed on its own it
reads the shipped tuned rows from inside itself, and using it writes nothing into the installed package."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from qsa_aiter.runtime import tuned

ROOT = Path(__file__).resolve().parents[1]

# Run against the installed wheel alone: -S skips the environment's .pth files, so the source checkout's editable
# install cannot shadow the wheel; the environment's packages (torch, triton, pydantic, ...) stay importable.
PROBE = """
import torch, qsa_aiter
from qsa_aiter import jit
from qsa_aiter.runtime import tuned
from qsa_aiter.tools.workloads import make_batch
table = tuned.load_tables(())
rows = sum(len(v) for v in table.rows.values()) + sum(len(v) for v in table.topk.values())
batch = make_batch([300, 200], 2, head_dim=32, page_size=16)
qsa_aiter.qsa_paged_mqa_logits(*batch.args(), max_query_len=2)
print(tuned.CONFIG_DIR, rows, jit.jit_root())
"""


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_a_built_wheel_ships_the_tuned_tables_and_stays_unwritten(tmp_path):
    dist, site = tmp_path / "dist", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)], check=True)
    wheel = next(dist.glob("qsa_aiter-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                    str(wheel)], check=True)
    installed = _files(site)
    assert "qsa_aiter/kernels/selection/native_topk.cu" in installed  # the native kernels compile from it at run time
    assert {"qsa_aiter/kernels/scoring/native_scorer.cu", "qsa_aiter/kernels/scoring/native_mma.h"} <= installed
    assert "qsa_aiter/py.typed" in installed  # type checkers read the package's hints
    # The changelog travels with the package (qsa_aiter/CHANGELOG.md links to the top-level one): its text, not a link.
    changelog = site / "qsa_aiter" / "CHANGELOG.md"
    assert not changelog.is_symlink() and changelog.read_text() == (ROOT / "CHANGELOG.md").read_text()
    info = next(site.glob("qsa_aiter-*.dist-info"))
    metadata = (info / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    urls = dict(line.removeprefix("Project-URL: ").split(", ", 1) for line in metadata.splitlines()
                if line.startswith("Project-URL: "))
    assert set(urls) == set(PROJECT_URLS) and all(url.startswith(REPOSITORY) for url in urls.values()), urls
    assert (info / "licenses" / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]),
               PYTHONDONTWRITEBYTECODE="1", HOME=str(tmp_path / "home"))
    env.pop("TRITON_INTERPRET", None)  # the CPU call takes the torch path: no compiled kernel to cache
    result = subprocess.run([sys.executable, "-S", "-c", PROBE], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    config_dir, rows, jit_root = result.stdout.split()
    assert Path(config_dir) == site / "qsa_aiter" / "configs"
    shipped = sum(len(tuned.read_table(ROOT / "configs" / name)) for name in tuned.SHIPPED)
    assert int(rows) == shipped > 0
    assert not Path(jit_root).is_relative_to(site), jit_root  # compiled kernels go to the user's cache
    assert _files(site) == installed, "using the wheel wrote into the installed package"


#: Where the repository lives; the project's URLs point into it.
REPOSITORY = "https://github.com/qsa-aiter/qsa_aiter"
PROJECT_URLS = ("Homepage", "Documentation", "Changelog", "Issues")


def test_the_project_urls_point_into_the_repository():
    """A package index shows these links: the repository, its docs, its changelog and its issues, and the docs and
    changelog links name paths that this checkout has."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the wheel's metadata is checked on every version above
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert set(urls) == set(PROJECT_URLS)
    assert urls["Homepage"] == REPOSITORY and urls["Issues"] == f"{REPOSITORY}/issues"
    for name in ("Documentation", "Changelog"):
        prefix, _, path = urls[name].partition("/main/")
        assert prefix in (f"{REPOSITORY}/tree", f"{REPOSITORY}/blob") and path, urls[name]
        assert (ROOT / path).exists(), f"{name} names {path}, which the repository does not have"
    assert urls["Documentation"].endswith("/docs") and urls["Changelog"].endswith("/CHANGELOG.md")

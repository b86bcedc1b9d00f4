"""The public API's types, as a user's type checker sees them (``py.typed`` ships): mypy, with pyproject.toml's
``[tool.mypy]`` settings, over the package's public modules and a typed user program (tests/typing/public_api.py)
that calls every public name, checks each result's type with ``assert_type``, sees no ``Any``, and marks the calls
that must be type errors (a lost signature leaves their ``# type: ignore`` unused, which fails).

mypy is a declared test dependency (the ``test`` extra): without it the test fails, naming the install command.
Its first run reads torch's annotations (about 17 s of CPU on one core); later runs reuse ``.mypy_cache`` in the
repository root (2-3 s).
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import qsa_aiter

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = ROOT / "tests" / "typing" / "public_api.py"


def _require_mypy() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed; it is part of the test extra: pip install -e '.[test]'", pytrace=False)


def test_the_public_api_type_checks_as_a_user_sees_it():
    _require_mypy()
    # From the repository root, so that mypy reads [tool.mypy] (its files and settings) and this checkout's package.
    result = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"mypy found type errors in the public API:\n{report}"
    assert "Success: no issues found" in report, report


def test_the_typed_program_uses_every_public_name():
    """A public name added to ``qsa_aiter.__all__`` must be typed and checked too: the program imports each one."""
    tree = ast.parse(PROGRAM.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "qsa_aiter"
                for alias in node.names}
    assert sorted(set(qsa_aiter.__all__) - imported) == []
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    assert sorted(imported - used) == []


def test_the_typed_program_runs():
    """The calls the type checker accepts are the documented ones: the program runs them on CPU tensors."""
    spec = importlib.util.spec_from_file_location("public_api", PROGRAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main()

"""How the offline tools import one another: only the dispatcher (``tools/cli.py``) imports a command-line module
(``bench``, ``tune``, ``demo``, ``fuzz``, ``quality``, ``isa``, ``model-configs``); what they share lives in library modules (``work_points``, ``inputs``,
``timing``, ``workloads`` ...), which the tools import at module level, without a circle (lazy imports included).
The scripts in ``benchmarks/`` import no command-line module either."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import MODULES, PACKAGE, all_imports, assert_no_import_circle, top_level_imports

TOOLS = {name: path for name, path in MODULES.items() if name.startswith("qsa_aiter.tools.")}
DISPATCHER = "qsa_aiter.tools.cli"
BENCHMARKS = sorted((PACKAGE.parent / "benchmarks").glob("*.py"))


def _has_command_line(path: Path) -> bool:
    """Whether the module defines ``main(argv)``: a command line of its own."""
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" and node.args.args
               and node.args.args[0].arg == "argv" for node in ast.parse(path.read_text()).body)


COMMANDS = {name for name, path in TOOLS.items() if _has_command_line(path)} - {DISPATCHER}


def _script_imports(path: Path) -> set[str]:
    """The ``qsa_aiter`` modules a script imports (absolute imports; ``from pkg import name`` as ``pkg.name`` too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {name for name in names if name.startswith("qsa_aiter")}


def test_the_command_modules_are_known():
    assert COMMANDS == {"qsa_aiter.tools.bench", "qsa_aiter.tools.tuner", "qsa_aiter.tools.demo",
                        "qsa_aiter.tools.fuzz", "qsa_aiter.tools.isa", "qsa_aiter.tools.static_model",
                        "qsa_aiter.tools.quality"}


def test_only_the_dispatcher_imports_a_command_module():
    importers = {(name, command) for name, path in MODULES.items() if name != DISPATCHER
                 for command in all_imports(path) & COMMANDS if command != name}
    importers |= {(path.name, command) for path in BENCHMARKS for command in _script_imports(path) & COMMANDS}
    assert not importers, sorted(importers)
    assert COMMANDS <= all_imports(MODULES[DISPATCHER])


def test_no_import_circle_among_the_tools():
    """No circle even counting the lazy imports (the package-wide test counts module-level ones)."""
    assert_no_import_circle({name: {m for m in all_imports(path) if m in TOOLS and m != name}
                             for name, path in TOOLS.items()})


def test_tools_import_each_other_at_module_level():
    """A function-local import of another tools module is left only in the dispatcher (each subcommand loads what
    it runs, so ``--help`` stays fast)."""
    lazy = {(name, m) for name, path in TOOLS.items() if name != DISPATCHER
            for m in (all_imports(path) - top_level_imports(path)) if m in TOOLS}
    assert not lazy, sorted(lazy)

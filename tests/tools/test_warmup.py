"""Warm-up into the JIT cache (``qsa_aiter/tools/warmup.py``) for sm_90, gfx942 and gfx950 without their GPUs.

A cache warmed ahead of time for the three targets into a temporary directory: every variant of a small matrix is
compiled and recorded with its files; a second process compiles nothing and every entry loads under the key a launch
computes. Corrupted entries and an unreadable manifest are rebuilt with a warning; ``QSA_AITER_REBUILD`` replaces
every entry once; ``jit list`` / ``jit clear`` and the commands' argument errors. The compiling runs in child
processes of a copy of the sources (``jit_children``).
"""

from __future__ import annotations

import collections
import hashlib
import json
import shutil
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import triton

from qsa_aiter.tools import inventory
from qsa_aiter.tools.cli import main
from qsa_aiter.runtime.jit.store import Store
from qsa_aiter.kernels.platform import interpreting

from jit_children import (  # noqa: F401 (sources, same_sources_here: the module's autouse fixtures)
    ARCHS,
    SMALL,
    SMALL_CLI,
    child_env,
    once_per_run,
    run_child,
    run_cli,
    same_sources_here,
    sources,
)

# A child that warms ``archs`` with ``matrix`` into ``root`` and reports what it compiled and found; with ``check``,
# it then loads every entry (files checked) and places them in fresh in-memory Triton caches, and looks up the key
# each launch of the matrix computes there: every one must resolve to the loaded kernel.
_WARM = r"""
import json, sys
from pathlib import Path
import torch
from qsa_aiter.kernels import catalog
from qsa_aiter.tools import warmup as w
from qsa_aiter.tools.aot import TARGETS
from qsa_aiter.runtime.jit.store import Store

args = json.loads(sys.argv[1])
out = {}
for n, arch in enumerate(args["archs"]):
    matrix = w.Matrix(**{k: tuple(v) for k, v in args["matrix"].items()})
    report = w.warmup(arch, root=args["root"], matrix=matrix, progress=False)
    result = {"compiled": report.compiled, "found": report.found, "failed": report.failed}
    if args.get("check"):
        store = Store(Path(args["root"]), arch)
        entries = store.read().entries
        result["problems"] = {eid: store.problem(e, full=True) for eid, e in entries.items()}
        device = 1000 + n  # an in-memory cache slot no driver has: placement needs no GPU
        fns = {spec.fn for spec in catalog.SPECS}
        for fn in fns:
            fn.device_caches[device] = ({}, {}, None, None, None)
        result["placed"] = store.place(device)
        specs = [spec for spec, _ in w._unique(w.launches(matrix, arch, torch.device("cpu")), TARGETS[arch])]
        resolved = {}
        for spec in specs:
            held = spec.fn.device_caches[device][0].get(spec.key)
            kernel = held.result() if hasattr(held, "result") else None
            resolved[spec.entry_id] = (type(kernel).__name__, spec.fn.device_caches[device][0].get(spec.key) is kernel,
                                       kernel.metadata.target.arch if kernel is not None else None)
        result["resolved"] = resolved
    out[arch] = result
print("JIT-RESULT " + json.dumps(out, default=str))
"""


def warm(root: Path, archs=ARCHS, matrix=SMALL, check=False, env=None) -> tuple[dict, str]:
    payload = json.dumps({"root": str(root), "archs": list(archs), "matrix": matrix, "check": check})
    return run_child(_WARM, payload, env=env)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A cache warmed ahead of time for the three targets (first process), then warmed again and checked by a
    second process: ``(root, first report, second report)``, made once per pytest run (the tests that change the
    cache work on copies)."""
    def make(root: Path) -> dict:
        first, _ = warm(root)
        second, _ = warm(root, check=True)
        return {"first": first, "second": second}

    root, reports = once_per_run(tmp_path_factory, "warmed-jit", make)
    return root, reports["first"], reports["second"]


# ---------------------------------------------------------------------------------------------------------------
# Ahead-of-time warm-up for the three targets, and a second process
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_warmup_compiles_every_variant_for_the_target(warmed, arch):
    root, first, _ = warmed
    report = first[arch]
    assert report["failed"] == {}
    assert len(report["compiled"]) == 4 and report["found"] == []
    assert all(seconds > 0 for seconds in report["compiled"].values())
    manifest = json.loads((root / f"triton-{triton.__version__}" / arch / "manifest.json").read_text())
    assert manifest["arch"] == arch and set(manifest["entries"]) == set(report["compiled"])
    kinds = collections.Counter(e["kernel"] for e in manifest["entries"].values())
    assert kinds == {"rowwise": 1, "expand": 3}
    binary = ".cubin" if arch.startswith("sm_") else ".hsaco"
    for entry in manifest["entries"].values():
        assert entry["binary"].endswith(binary) and entry["binary"] in entry["files"]
        assert entry["built_by"] == "target" and entry["compile_seconds"] > 0
        assert datetime.now(timezone.utc) - datetime.fromisoformat(entry["date"]) < timedelta(hours=1)
        data = (root / f"triton-{triton.__version__}" / arch / "triton" / entry["group"]
                / entry["binary"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["files"][entry["binary"]]["sha256"]
    # the three expansions differ only by how Triton specialised the request count: 1, a multiple of 16, neither
    requests = sorted(str(e["constexprs"].get("num_requests", e["arguments"].get("num_requests")))
                      for e in manifest["entries"].values() if e["kernel"] == "expand")
    assert requests == ["1", "i32", "i32%16"]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_second_process_compiles_nothing_and_every_entry_loads(warmed, arch):
    _, first, second = warmed
    report = second[arch]
    assert report["compiled"] == {} and sorted(report["found"]) == sorted(first[arch]["compiled"])
    assert set(report["problems"].values()) == {None}
    assert report["placed"] == 4
    # the key each launch computes finds its entry, which loads as a cached kernel for this target and takes the
    # placeholder's place
    assert set(report["resolved"]) == set(first[arch]["compiled"])
    want_arch = 90 if arch == "sm_90" else arch
    assert all(r == ["_CachedKernel", True, want_arch] for r in report["resolved"].values()), report["resolved"]


# ---------------------------------------------------------------------------------------------------------------
# Corruption, an unreadable manifest, QSA_AITER_REBUILD (through the command line)
# ---------------------------------------------------------------------------------------------------------------


def _copy(warmed, tmp_path) -> Path:
    root = tmp_path / "jit"
    shutil.copytree(warmed[0], root)
    return root


def _summary(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def test_corrupted_entries_are_rebuilt_with_a_warning(warmed, tmp_path):
    root = _copy(warmed, tmp_path)
    store = Store(root, "gfx942")
    entries = store.read().entries
    victims = sorted(entries)[:3]
    truncated, missing, altered = (entries[eid] for eid in victims)
    binary = store.triton_dir / truncated.group / truncated.binary
    binary.write_bytes(binary.read_bytes()[:100])
    (store.triton_dir / missing.group / missing.metadata).unlink()
    ir = next(store.triton_dir / altered.group / n for n in altered.files if n.endswith(".ttir"))
    text = bytearray(ir.read_bytes())
    text[10] ^= 1  # same size, other bytes
    ir.write_bytes(bytes(text))
    proc = run_cli("warmup", "--arch", "gfx942", "--jit-dir", str(root), *SMALL_CLI)  # with the progress bar
    assert "4 variants, 3 compiled" in _summary(proc) and "1 already cached, 0 failed" in _summary(proc)
    warnings = [line for line in proc.stderr.replace("\r", "\n").splitlines() if "JIT cache entry" in line]
    for eid, why in zip(victims, ("has 100 bytes", "is missing", "does not match its recorded sha256")):
        assert any(eid in line and why in line and line.endswith("rebuilding it") for line in warnings), warnings
    assert "warm-up gfx942" in proc.stderr and "100%" in proc.stderr  # the progress bar
    after = Store(root, "gfx942")
    assert set(after.read().entries) == set(entries)
    assert all(after.problem(e, full=True) is None for e in after.read().entries.values())


def test_an_unreadable_manifest_is_rebuilt_with_a_warning(warmed, tmp_path):
    root = _copy(warmed, tmp_path)
    store = Store(root, "sm_90")
    entries = store.read().entries
    store.manifest_path.write_text('{"format": 1, "entries": {"trunc')
    proc = run_cli("warmup", "--arch", "sm_90", "--jit-dir", str(root), "--no-progress", *SMALL_CLI)
    assert "4 variants, 4 compiled" in _summary(proc)
    assert "manifest.json is unreadable" in proc.stderr
    rebuilt = Store(root, "sm_90").read().entries
    assert set(rebuilt) == set(entries)
    assert all(Store(root, "sm_90").problem(e, full=True) is None for e in rebuilt.values())


def test_rebuild_switch_replaces_every_entry_once(warmed, tmp_path):
    root = _copy(warmed, tmp_path)
    before = Store(root, "sm_90").read().entries
    env = child_env(QSA_AITER_JIT_DIR=str(root), QSA_AITER_REBUILD="1")
    proc = run_cli("warmup", "--arch", "sm_90", "--no-progress", *SMALL_CLI, env=env)
    assert "4 variants, 4 compiled" in _summary(proc) and str(root) in _summary(proc)
    after = Store(root, "sm_90").read().entries
    assert set(after) == set(before)
    assert all(after[eid].date > before[eid].date for eid in before)
    # without the switch the rebuilt entries serve
    proc = run_cli("warmup", "--arch", "sm_90", "--no-progress", *SMALL_CLI, env=child_env(QSA_AITER_JIT_DIR=str(root)))
    assert "4 variants, 0 compiled" in _summary(proc) and "4 already cached" in _summary(proc)


# ---------------------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------------------


def test_jit_list_and_clear(warmed, tmp_path, capsys):
    root = _copy(warmed, tmp_path)
    (root / "README.md").write_text("kept")
    assert main(["jit", "list", "--jit-dir", str(root)]) == 0
    listing = capsys.readouterr().out
    for arch in ARCHS:
        assert f"/ {arch}: 4 entries" in listing
    assert listing.count("  ok") == 12 and "num_requests=1" in listing and "expand-" in listing
    assert main(["jit", "clear", "--jit-dir", str(root), "--arch", "gfx942"]) == 0
    assert "removed" in capsys.readouterr().out
    assert {s.arch for s in inventory.stores_in(root)} == {"sm_90", "gfx950"}
    assert main(["jit", "clear", "--jit-dir", str(root)]) == 0
    assert inventory.stores_in(root) == [] and (root / "README.md").read_text() == "kept"
    assert main(["jit", "list", "--jit-dir", str(root)]) == 0
    assert "(empty)" in capsys.readouterr().out


def test_jit_list_uses_the_jit_dir_variable(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("QSA_AITER_JIT_DIR", str(tmp_path))
    assert main(["jit", "list"]) == 0
    assert f"JIT cache: {tmp_path}" in capsys.readouterr().out


@pytest.mark.parametrize("command", (["jit", "list"], ["jit", "clear"], ["warmup", "--arch", "sm_90"]))
def test_jit_dir_flag_that_is_a_file(tmp_path, capsys, command):
    """``--jit-dir`` naming a file is refused as ``QSA_AITER_JIT_DIR`` is, and the file is left alone."""
    (tmp_path / "file").write_text("kept")
    with pytest.raises(SystemExit) as info:
        main([*command, "--jit-dir", str(tmp_path / "file")])
    assert info.value.code == 2
    assert f"argument --jit-dir: {tmp_path / 'file'} is not a directory" in capsys.readouterr().err
    assert (tmp_path / "file").read_text() == "kept"


@pytest.mark.parametrize("argv", [["warmup", "--kernels", "flash"], ["warmup", "--arch", "sm_80"],
                                  ["warmup", "--page-sizes", "0"], ["warmup", "--caches", ""], ["jit"]])
def test_bad_command_arguments(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2


@pytest.mark.skipif(not interpreting(), reason="only a process with TRITON_INTERPRET=1 refuses")
def test_warmup_refuses_the_interpreter(tmp_path, capsys):
    assert main(["warmup", "--arch", "sm_90", "--jit-dir", str(tmp_path), "--no-progress"]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err

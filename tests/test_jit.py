"""The compiled-kernel cache (qsa_aiter/jit_cache.py) and the warm-up (qsa_aiter/warmup.py).

CPU: manifest logic, where the cache lives, the variant matrix, ahead-of-time warm-up for sm_90 / gfx942 / gfx950
into a temporary cache (a second process compiles nothing and every entry loads under the key a launch computes),
8 processes warming one directory at once, corrupted entries and an unreadable manifest rebuilt with a warning,
QSA_AITER_REBUILD, the commands. Compilations run in child processes without TRITON_INTERPRET (this process's kernels
are interpreted on a CPU-only machine, and an interpreted kernel cannot be compiled).

GPU (``-m gpu``): a fresh process after a warm-up launches every kernel with no compilation, from a warm-up on the
GPU and from one for the named arch made without it.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
import triton

from qsa_aiter import jit_cache, tuned, warmup
from qsa_aiter.__main__ import main
from qsa_aiter.jit_cache import Entry, FileRecord, Store
from qsa_aiter.kernels.common import interpreting
from qsa_aiter.settings import get_settings

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("sm_90", "gfx942", "gfx950")
#: A small matrix for the compiling tests: per arch the row-wise scorer (bf16, page 64) and the expansion for each
#: kind of request count (1, a multiple of 16, neither): 4 variants.
SMALL = dict(kernels=["rowwise", "expand"], caches=["bf16"], page_sizes=[64], index_dtypes=["int32"])
SMALL_CLI = ["--kernels", "rowwise,expand", "--caches", "bf16", "--page-sizes", "64", "--index-dtypes", "int32"]


_SOURCES: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def sources(tmp_path_factory):
    """The package and its tuned configs, copied once: every child of this module runs the same kernel sources (an
    edit to them in between would, rightly, make every cached entry stale)."""
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "qsa_aiter", src / "qsa_aiter", ignore=ignore)
    shutil.copytree(ROOT / "configs", src / "configs", ignore=ignore)
    _SOURCES[:] = [src]
    yield src
    _SOURCES.clear()


@pytest.fixture(autouse=True)
def same_sources_here(sources, monkeypatch):
    """Entries the children built are checked here against the sources they were built from."""
    monkeypatch.setattr(jit_cache, "KERNEL_SOURCES", sources / "qsa_aiter" / "kernels")
    jit_cache.kernel_sources_hash.cache_clear()
    yield
    jit_cache.kernel_sources_hash.cache_clear()


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
    return subprocess.run([sys.executable, "-m", "qsa_aiter", *args], cwd=_SOURCES[0], env=env or child_env(),
                          capture_output=True, text=True, timeout=timeout)


# A child that warms ``archs`` with ``matrix`` into ``root`` and reports what it compiled and found; with ``check``,
# it then loads every entry (files checked) and places them in fresh in-memory Triton caches, and looks up the key
# each launch of the matrix computes there: every one must resolve to the loaded kernel.
_WARM = r"""
import json, sys
from pathlib import Path
import torch
from qsa_aiter import jit_cache, warmup as w
from qsa_aiter.aot import TARGETS

args = json.loads(sys.argv[1])
out = {}
for n, arch in enumerate(args["archs"]):
    matrix = w.Matrix(**{k: tuple(v) for k, v in args["matrix"].items()})
    report = w.warmup(arch, root=args["root"], matrix=matrix, progress=False)
    result = {"compiled": report.compiled, "found": report.found, "failed": report.failed}
    if args.get("check"):
        store = jit_cache.Store(Path(args["root"]), arch)
        entries = store.read().entries
        result["problems"] = {eid: store.problem(e, full=True) for eid, e in entries.items()}
        device = 1000 + n  # an in-memory cache slot no driver has: placement needs no GPU
        fns = {w._module(k).KERNEL for k in w.KERNELS}
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
    second process."""
    root = tmp_path_factory.mktemp("jit")
    first, _ = warm(root)
    second, _ = warm(root, check=True)
    return root, first, second


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
# The launch path: Triton's own compile on an in-memory miss, with the cache's hooks; placeholders
# ---------------------------------------------------------------------------------------------------------------

# ``compile``: the compiles a launch makes on an in-memory miss (``JITFunction._do_compile``), inside the cache's
# scope. ``place``: the entries placed in a fresh in-memory cache and resolved, as a launch resolves them. The
# per-device slot a launch's binder creation makes on a GPU is made here for a named target, without a driver.
_LAUNCH_PATH = r"""
import json, sys
from pathlib import Path
import torch, triton
from qsa_aiter.triton_compat import ASTSource, CompiledKernel, make_backend
from qsa_aiter import jit_cache, warmup as w
from qsa_aiter.aot import TARGETS

root, arch, stage = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
target = TARGETS[arch]
matrix = w.Matrix(kernels=("expand",), caches=("bf16",), page_sizes=(64,), index_dtypes=("int32",))
specs = [spec for spec, _ in w._unique(w.launches(matrix, arch, torch.device("cpu")), target)]
DEVICE = 7
fn = specs[0].fn
fn.device_caches[DEVICE] = ({}, {}, target, make_backend(target), None)
fn.compile, fn.ASTSource, fn.CompiledKernel = triton.compile, ASTSource, CompiledKernel
store = jit_cache.store_for(root, arch)
out = {"ids": [spec.entry_id for spec in specs]}
if stage == "compile":
    with store.activate():
        for spec in specs:
            fn._do_compile(spec.key, spec.signature, DEVICE, spec.constexprs, spec.options, spec.attrs, warmup=False)
    out["files_here"] = all(Path(p).is_relative_to(store.triton_dir) for k in fn.device_caches[DEVICE][0].values()
                            for p in k.metadata_group.values())
else:
    out["placed"] = store.place(DEVICE)
    kernels = [fn.device_caches[DEVICE][0][spec.key].result() for spec in specs]
    out["types"] = [type(k).__name__ for k in kernels]
    out["replaced"] = all(fn.device_caches[DEVICE][0][s.key] is k for s, k in zip(specs, kernels))
out["events"] = [[e.entry_id, e.compiled] for e in store.events]
out["busy"] = [store.busy(i) for i in out["ids"]]
print("JIT-RESULT " + json.dumps(out))
"""


def test_launch_compiles_go_into_the_cache_once_and_corrupt_placeholders_rebuild(tmp_path):
    root = tmp_path / "jit"
    first, _ = run_child(_LAUNCH_PATH, str(root), "sm_90", "compile")
    ids = first["ids"]
    assert len(ids) == 3 and first["events"] == [[i, True] for i in ids] and first["files_here"]
    assert first["busy"] == [False] * 3, "the compile locks are released"
    store = Store(root, "sm_90")
    entries = store.read().entries
    assert set(entries) == set(ids) and {e.built_by for e in entries.values()} == {"launch"}
    # a second process's launch finds each build: Triton loads it from the cache, nothing is recorded again
    second, _ = run_child(_LAUNCH_PATH, str(root), "sm_90", "compile")
    assert second["events"] == [[i, False] for i in ids]
    assert Store(root, "sm_90").read().entries == entries
    # a third process places the entries; the one whose binary was truncated is rebuilt when first launched
    victim = entries[ids[1]]
    binary = store.triton_dir / victim.group / victim.binary
    binary.write_bytes(binary.read_bytes()[:64])
    third, stderr = run_child(_LAUNCH_PATH, str(root), "sm_90", "place")
    assert third["placed"] == 3 and third["types"] == ["_CachedKernel"] * 3 and third["replaced"]
    assert third["events"] == [[ids[1], True]]
    assert f"JIT cache entry {ids[1]}" in stderr and "has 64 bytes" in stderr and "rebuilding it" in stderr
    after = Store(root, "sm_90")
    assert all(after.problem(e, full=True) is None for e in after.read().entries.values())


# ---------------------------------------------------------------------------------------------------------------
# Several processes warming one directory
# ---------------------------------------------------------------------------------------------------------------

_RACER = r"""
import json, os, sys, time
from pathlib import Path
from qsa_aiter import jit_cache, warmup as w

root, n, barrier = sys.argv[1], sys.argv[2], Path(sys.argv[3])
(barrier / f"ready-{n}").touch()
while not (barrier / "go").exists():  # all start compiling together
    time.sleep(0.01)
matrix = w.Matrix(kernels=("expand", "cache_writer"), caches=("bf16", "fp8_e4m3fn"), page_sizes=(16,),
                  index_dtypes=("int32",))
report = w.warmup("gfx950", root=root, matrix=matrix, progress=False)
store = jit_cache.Store(Path(root), "gfx950")
loaded = 0
for eid, entry in store.read().entries.items():
    store.load_entry(entry, jit_cache._jit_function(entry.function))  # raises if a file is partial
    loaded += 1
print("JIT-RESULT " + json.dumps({"compiled": sorted(report.compiled), "found": report.found,
                                  "failed": report.failed, "loaded": loaded}))
"""


def test_eight_processes_warming_one_directory_compile_each_variant_once(tmp_path):
    root, barrier = tmp_path / "jit", tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(root), str(n), str(barrier)], cwd=_SOURCES[0],
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in range(8)]
    deadline = time.monotonic() + 300
    while len(list(barrier.glob("ready-*"))) < 8 and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    (barrier / "go").touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith("JIT-RESULT ")]
        assert proc.returncode == 0 and lines, err[-4000:]
        results.append(json.loads(lines[-1].removeprefix("JIT-RESULT ")))
    entries = Store(root, "gfx950").read().entries
    assert len(entries) == 5  # expansions for 3 request-count kinds, the writer for 2 cache dtypes
    compiled = collections.Counter(eid for r in results for eid in r["compiled"])
    assert compiled == collections.Counter(set(entries)), "every variant compiled by exactly one process"
    for r in results:
        assert r["failed"] == {} and sorted(r["compiled"] + r["found"]) == sorted(entries)
        assert r["loaded"] == 5
    store = Store(root, "gfx950")
    assert all(store.problem(e, full=True) is None for e in entries.values())
    leftovers = [p.name for p in store.dir.iterdir() if p.name.startswith(".manifest.")]
    assert leftovers == [], "no partial manifest left behind"


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
# The variant matrix
# ---------------------------------------------------------------------------------------------------------------

_MATRIX = r"""
import collections, json, torch
from qsa_aiter import warmup as w
from qsa_aiter.aot import TARGETS

out = {}
for arch in ("sm_90", "gfx950"):
    specs = [(spec, launch) for spec, launch in
             w._unique(w.launches(w.Matrix(), arch, torch.device("cpu")), TARGETS[arch])]
    variants = []
    for spec, launch in specs:
        names = spec.fn.arg_names
        constexprs = {names[k[0]]: str(v) for k, v in spec.constexprs.items()}
        variants.append({"kernel": launch.kernel, "constexprs": constexprs, "num_warps": spec.options.num_warps,
                         "num_stages": spec.options.num_stages, "label": launch.label})
    out[arch] = variants
print("JIT-RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def matrix_variants():
    return run_child(_MATRIX)[0]


def test_the_matrix_covers_every_kernel_cache_page_and_index_dtype(matrix_variants):
    for arch, variants in matrix_variants.items():
        kinds = collections.Counter(v["kernel"] for v in variants)
        # scorers: 5 cache dtypes x 2 page sizes x 2 index dtypes, at least one config each; the writer: 5 x 2;
        # top-k: alone (no index tensors: one variant), and fused with the expansion for 3 request-count kinds x 2;
        # the expansion: 3 x 2. Tuned rows add their buckets' configs (sm_90 has rows for every scorer).
        assert kinds["rowwise"] >= 20 and kinds["tiled"] >= 20 and kinds["stacked"] >= 20
        if arch == "gfx950":  # rows for the stacked scorer only
            assert kinds["rowwise"] == kinds["tiled"] == 20
        assert (kinds["cache_writer"], kinds["topk"], kinds["expand"]) == (10, 7, 6)
        for kernel in ("rowwise", "stacked", "tiled"):
            mine = [v for v in variants if v["kernel"] == kernel]
            assert {v["constexprs"]["KV_KIND"] for v in mine} == {"0", "1", "2", "3"}
            assert {v["constexprs"]["PAGE_SIZE"] for v in mine} == {"16", "64"}
            # PTX decoders on NVIDIA for quantised caches, never on AMD
            fast = {v["constexprs"]["FAST_DECODE"] for v in mine if v["constexprs"]["KV_KIND"] != "0"}
            assert fast == ({"True"} if arch == "sm_90" else {"False"})


def test_tuned_rows_give_their_configs(matrix_variants):
    # configs/scoring.csv ships gfx950 stacked rows for bf16 (BMT 4, BN 32, 2 warps): warm-up compiles that tile for
    # gfx950 (as its launches look it up), and not for sm_90, whose rows are other tiles
    def tuned_tiles(arch):
        return [v for v in matrix_variants[arch] if v["kernel"] == "stacked" and v["constexprs"]["BLOCK_N"] == "32"
                and v["num_warps"] == 2 and v["constexprs"]["KV_KIND"] == "0"]

    assert tuned_tiles("gfx950") and not tuned_tiles("sm_90")
    # every H200 row's tile is among the sm_90 variants, for its kernel, cache kind and page size
    kinds = {"bf16": {"0"}, "fp8": {"1", "2"}, "fp4": {"3"}}
    rows = [row for key, rows in tuned.load_tables(()).items() if key[0] == "sm_90" for row in rows]
    assert rows
    for row in rows:
        assert any(v["kernel"] == row.kernel and v["constexprs"]["KV_KIND"] in kinds[row.kv_dtype]
                   and v["constexprs"]["PAGE_SIZE"] == str(row.page_size)
                   and v["constexprs"]["BLOCK_N"] == str(row.block_n) and v["num_warps"] == row.num_warps
                   and v["num_stages"] == row.num_stages for v in matrix_variants["sm_90"]), row


def test_matrix_rejects_bad_axes():
    with pytest.raises(ValueError, match="kernels must be"):
        warmup.Matrix(kernels=("flash",))
    with pytest.raises(ValueError, match="caches must be"):
        warmup.Matrix(caches=("fp6",))
    with pytest.raises(ValueError, match="page_sizes must be"):
        warmup.Matrix(page_sizes=(0,))
    with pytest.raises(ValueError, match="index_dtypes must be"):
        warmup.Matrix(index_dtypes=())
    with pytest.raises(ValueError, match="page_sizes must be"):
        warmup.Matrix(page_sizes=[16])  # a list, not a tuple


@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_warmup_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="arch must be"):
        warmup.warmup("sm_80", root=tmp_path)
    with pytest.raises(ValueError, match="arch: no GPU here"):
        warmup.warmup(None, root=tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Manifest and store logic (no compilation)
# ---------------------------------------------------------------------------------------------------------------


def fake_entry(store: Store, group: str = "G1", date: datetime | None = None, **files: bytes) -> Entry:
    """An entry whose files (``name=bytes``; default a metadata and a binary file) are written into ``group``."""
    files = files or {"k.json": b'{"name": "k"}', "k.cubin": bytes(range(256)) * 4}
    directory = store.triton_dir / group
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return Entry(
        kernel="expand", function="qsa_aiter.kernels.expand._expand_kernel", constexprs={"RATIO": 4},
        options={"num_warps": 4}, arguments={"out_stride": "i32%16"}, runtime_key="key", specialization="{}",
        group=group, metadata="k.json", binary="k.cubin",
        files={n: FileRecord(size=len(d), sha256=hashlib.sha256(d).hexdigest()) for n, d in files.items()},
        sources=jit_cache.kernel_sources_hash(), triton_env=jit_cache._triton_env(), built_by="launch",
        compile_seconds=1.5, date=date or datetime.now(timezone.utc),
    )


def test_manifest_round_trip_and_atomic_write(tmp_path):
    store = Store(tmp_path, "sm_90")
    entry = fake_entry(store)
    store.record("expand-a", entry)
    again = Store(tmp_path, "sm_90").read()
    assert again.arch == "sm_90" and again.entries["expand-a"] == entry
    assert json.loads(store.manifest_path.read_text())["format"] == 1
    assert [p.name for p in store.dir.iterdir() if p.name.startswith(".manifest.")] == []
    assert store.problem(entry, full=True) is None


def test_problems_name_what_is_wrong(tmp_path):
    store = Store(tmp_path, "sm_90")
    entry = fake_entry(store, **{"k.json": b"{}", "k.cubin": b"x" * 64, "k.ptx": b"ptx"})
    directory = store.triton_dir / "G1"
    (directory / "k.ptx").write_bytes(b"PTX")  # same size, other bytes: only a full check reads it
    assert store.problem(entry) is None
    assert store.problem(entry, full=True) == "corrupt: k.ptx does not match its recorded sha256"
    (directory / "k.cubin").write_bytes(b"x" * 10)
    assert store.problem(entry) == "corrupt: k.cubin has 10 bytes, 64 recorded"
    (directory / "k.cubin").unlink()
    assert store.problem(entry) == "corrupt: k.cubin is missing"
    with pytest.raises(jit_cache.EntryUnusable, match="k.cubin"):
        store.load_entry(entry, None)
    stale = entry.model_copy(update={"sources": "0" * 64})
    assert store.problem(stale) == "stale: built from other kernel sources"
    other_env = entry.model_copy(update={"triton_env": {"TRITON_SOMETHING": "1"}})
    assert store.problem(other_env).startswith("stale: built under other Triton")


def test_an_unreadable_manifest_reads_as_empty_with_a_warning(tmp_path, caplog):
    store = Store(tmp_path, "gfx950")
    store.record("expand-a", fake_entry(store))
    store.manifest_path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="qsa_aiter"):
        assert Store(tmp_path, "gfx950").read().entries == {}
    assert "is unreadable" in caplog.text and str(store.manifest_path) in caplog.text
    # a manifest of another arch is not trusted either
    other = Store(tmp_path, "sm_90")
    other.record("expand-a", fake_entry(other))
    shutil.copy(other.manifest_path, store.manifest_path)
    assert Store(tmp_path, "gfx950").read().entries == {}


def test_replacing_an_entry_removes_the_old_build(tmp_path):
    store = Store(tmp_path, "sm_90")
    store.record("expand-a", fake_entry(store, group="OLD"))
    store.record("expand-b", fake_entry(store, group="SHARED"))
    store.record("expand-a", fake_entry(store, group="NEW"))
    assert not (store.triton_dir / "OLD").exists() and (store.triton_dir / "NEW").is_dir()
    store.record("expand-c", fake_entry(store, group="SHARED"))
    store.record("expand-c", fake_entry(store, group="NEWER"))
    assert (store.triton_dir / "SHARED").is_dir(), "still used by expand-b"


def test_rebuild_only_replaces_entries_older_than_the_store(tmp_path):
    old = fake_entry(Store(tmp_path, "sm_90"), date=datetime.now(timezone.utc) - timedelta(minutes=5))
    rebuilding = Store(tmp_path, "sm_90", rebuild=True)
    fresh = fake_entry(rebuilding, group="G2", date=datetime.now(timezone.utc) + timedelta(seconds=1))
    assert rebuilding.needs_rebuild(old) and not rebuilding.needs_rebuild(fresh)
    assert not Store(tmp_path, "sm_90").needs_rebuild(old)


def test_a_variant_lock_held_elsewhere_is_busy(tmp_path):
    store = Store(tmp_path, "sm_90")
    lock = store.variant_lock("expand-a")
    with lock:
        assert store.busy("expand-a")
        with pytest.raises(jit_cache.VariantBusy):
            store._claim("expand-a", wait=False)
    assert not store.busy("expand-a")


def test_entry_ids_name_the_kernel_and_separate_keys():
    a = jit_cache.entry_id("qsa_aiter.kernels.stacked._stacked_scorer_kernel", "k1")
    b = jit_cache.entry_id("qsa_aiter.kernels.stacked._stacked_scorer_kernel", "k2")
    assert a.startswith("stacked-") and b.startswith("stacked-") and a != b
    assert jit_cache.entry_id("qsa_aiter.kernels.stacked._stacked_scorer_kernel", "k1") == a


def test_placeholders_only_for_this_librarys_compiled_kernels():
    assert jit_cache._jit_function("os.path.join") is None
    assert jit_cache._jit_function("qsa_aiter.kernels.nowhere._kernel") is None
    fn = jit_cache._jit_function("qsa_aiter.kernels.expand._expand_kernel")
    assert (fn is None) == interpreting()  # an interpreted kernel has no in-memory cache to place entries in


def test_scope_is_a_no_op_off_the_gpu():
    assert isinstance(jit_cache.scope(torch.device("cpu")), type(jit_cache._NULL))


# ---------------------------------------------------------------------------------------------------------------
# Where the cache lives (QSA_AITER_JIT_DIR, a checkout's jit/, a read-only install)
# ---------------------------------------------------------------------------------------------------------------


def test_jit_dir_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("QSA_AITER_JIT_DIR", f" {tmp_path / 'cache'} ")
    assert jit_cache.jit_root() == tmp_path / "cache"
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("QSA_AITER_JIT_DIR", str(tmp_path / "file"))
    with pytest.raises(ValueError, match="QSA_AITER_JIT_DIR=.*file'? is invalid: allowed: a directory"):
        jit_cache.jit_root()


def test_a_checkouts_jit_dir_is_the_default(monkeypatch, tmp_path):
    checkout = tmp_path / "jit"
    checkout.mkdir()
    (checkout / "README.md").write_text("x")
    monkeypatch.setattr(jit_cache, "CHECKOUT_JIT_DIR", checkout)
    assert jit_cache.jit_root() == checkout


def test_an_installed_package_uses_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    # a wheel has no jit/ beside the package
    monkeypatch.setattr(jit_cache, "CHECKOUT_JIT_DIR", tmp_path / "site-packages" / "jit")
    assert jit_cache.jit_root() == tmp_path / "home" / ".cache" / "qsa_aiter" / "jit"


def test_a_read_only_checkout_uses_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    checkout = tmp_path / "ro" / "jit"
    checkout.mkdir(parents=True)
    (checkout / "README.md").write_text("x")
    monkeypatch.setattr(jit_cache, "CHECKOUT_JIT_DIR", checkout)
    monkeypatch.setattr(jit_cache, "writable", lambda path: path != checkout)
    assert jit_cache.jit_root() == tmp_path / "home" / ".cache" / "qsa_aiter" / "jit"


def test_writable_probes_the_directory(tmp_path):
    assert jit_cache.writable(tmp_path)
    assert jit_cache.writable(tmp_path / "not" / "yet")  # created under a writable parent
    (tmp_path / "file").write_text("")
    assert not jit_cache.writable(tmp_path / "file" / "jit")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_writable_sees_a_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert not jit_cache.writable(ro) and not jit_cache.writable(ro / "jit")
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("word,value", [("1", True), ("yes", True), (" On ", True), ("0", False), ("off", False)])
def test_rebuild_setting(monkeypatch, word, value):
    monkeypatch.setenv("QSA_AITER_REBUILD", word)
    assert get_settings().rebuild is value


def test_bad_rebuild_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("QSA_AITER_REBUILD", "sometimes")
    with pytest.raises(ValueError, match="QSA_AITER_REBUILD='sometimes' is invalid"):
        get_settings()


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
    assert {s.arch for s in jit_cache.stores_in(root)} == {"sm_90", "gfx950"}
    assert main(["jit", "clear", "--jit-dir", str(root)]) == 0
    assert jit_cache.stores_in(root) == [] and (root / "README.md").read_text() == "kept"
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


# ---------------------------------------------------------------------------------------------------------------
# GPU: a fresh process after warm-up compiles nothing
# ---------------------------------------------------------------------------------------------------------------

GPU_MATRIX = ["--caches", "bf16,fp8_e4m3fn", "--page-sizes", "64"]

# Scores (every phase: tiled, stacked, rowwise), writes a cache (bf16 and fp8), selects (top-k fused with the
# expansion) and runs block top-k and expansion alone, for 1, 9 and 16 requests; counts Triton compiles (cache hits
# included) and new files in the JIT and Triton cache directories.
_FRESH = r"""
import json, sys, time
from pathlib import Path
import torch
from triton import knobs

compiles = []
knobs.compilation.listener = lambda **kw: compiles.append(getattr(kw["src"], "name", "?"))
import qsa_aiter
from qsa_aiter import jit_cache, warmup as w
from qsa_aiter.reference import reference_paged_mqa_logits
from qsa_aiter.workloads import make_batch

jit_dir, triton_dir = Path(sys.argv[1]), Path(sys.argv[2])
files = lambda: {p for d in (jit_dir, triton_dir) for p in d.rglob("*") if p.is_file() and not p.name.endswith(".lock")}
before = files()
ms = {}

def timed(name, call):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = call()
    torch.cuda.synchronize()
    ms[name] = (time.perf_counter() - start) * 1e3
    return result

error = 0.0
for cache in ("16bit", "fp8"):
    for phase, (n, rows) in {"verify": (9, 4), "draft": (16, 1), "decode": (1, 1), "prefill": (1, 300)}.items():
        batch = make_batch([8192] * n, rows, page_size=64, cache=cache, device="cuda")
        logits, visible = timed(f"score {cache} {phase}", lambda: qsa_aiter.qsa_paged_mqa_logits(
            *batch.args(), **batch.kwargs(), phase=phase, max_query_len=rows))
        if cache == "16bit" and phase == "verify":
            want, _ = reference_paged_mqa_logits(*batch.args(), **batch.kwargs())
            ok = torch.arange(want.shape[1], device="cuda")[None, :] < visible[:, None].long()
            error = float((logits - want).abs()[ok].max())
        for requests in (1, 9, 16):
            sel = make_batch([8192] * requests, 1, page_size=64, cache=cache, device="cuda")
            timed(f"select {cache} {phase} {requests}", lambda: qsa_aiter.qsa_select_paged_tokens(
                *sel.args()[:6], 2048, 4, **sel.kwargs(), phase="decode" if phase == "decode" else "draft"))
            lg, vis = qsa_aiter.qsa_paged_mqa_logits(*sel.args(), **sel.kwargs(), phase="draft")
            groups = timed(f"topk {requests}", lambda: qsa_aiter.qsa_block_topk(lg, vis, 512))
            timed(f"expand {requests}", lambda: qsa_aiter.qsa_expand_block_indices(
                groups, sel.query_positions, sel.context_lens, sel.token_to_request, 4, 2048))
kernels = {}
for name in w.KERNELS:
    fn = w._module(name).KERNEL
    kernels[name] = sum(isinstance(k, jit_cache._CachedKernel)
                        for c in fn.device_caches.values() for k in c[0].values())
new = sorted(str(p) for p in files() - before)
print("JIT-RESULT " + json.dumps({"compiles": compiles, "new_files": new, "ms": ms, "error": error,
                                  "cached_kernels": kernels}))
"""


def _fresh_process(jit_dir: Path, triton_dir: Path) -> dict:
    env = child_env(QSA_AITER_JIT_DIR=str(jit_dir), TRITON_CACHE_DIR=str(triton_dir))
    return run_child(_FRESH, str(jit_dir), str(triton_dir), env=env)[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
def test_a_fresh_process_after_warmup_launches_every_kernel_without_compiling(tmp_path):
    jit_dir, triton_dir = tmp_path / "jit", tmp_path / "triton"
    env = child_env(TRITON_CACHE_DIR=str(triton_dir))
    proc = run_cli("warmup", "--jit-dir", str(jit_dir), "--no-progress", *GPU_MATRIX, env=env, timeout=1800)
    assert proc.returncode == 0 and " 0 failed" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    result = _fresh_process(jit_dir, triton_dir)
    assert result["compiles"] == [], f"compiled in a warm process: {result['compiles']}"
    assert result["new_files"] == [], f"built in a warm process: {result['new_files']}"
    assert all(count > 0 for count in result["cached_kernels"].values()), result["cached_kernels"]
    assert result["error"] < 1e-3
    print(json.dumps(result["ms"], indent=1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
def test_a_warmup_for_the_named_arch_made_without_the_gpu_serves_it(tmp_path):
    """The keys computed for a named arch without its GPU are the ones its launches compute: a fresh process on the
    GPU compiles no kernel (it builds only Triton's small launcher stubs, into the cache)."""
    arch = warmup.present_arch()
    if arch not in warmup.TARGETS:
        pytest.skip(f"{arch} is not a named target")
    jit_dir, triton_dir = tmp_path / "jit", tmp_path / "triton"
    env = child_env(TRITON_CACHE_DIR=str(triton_dir), CUDA_VISIBLE_DEVICES="")
    proc = run_cli("warmup", "--arch", arch, "--jit-dir", str(jit_dir), "--no-progress", *GPU_MATRIX, env=env,
                   timeout=1800)
    assert proc.returncode == 0 and " 0 failed" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    result = _fresh_process(jit_dir, triton_dir)
    assert result["compiles"] == [], f"compiled in a warm process: {result['compiles']}"
    launchers = [f for f in result["new_files"] if "__triton_launcher" in f]
    drivers = [f for f in result["new_files"] if "cuda_utils" in f or "hip_utils" in f]  # Triton's, once per install
    assert sorted(launchers + drivers) == result["new_files"]
    assert launchers and all(f.startswith(str(jit_dir)) for f in launchers), "launcher stubs are kept in the cache"
    assert all(count > 0 for count in result["cached_kernels"].values()), result["cached_kernels"]

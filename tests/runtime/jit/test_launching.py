"""The JIT cache on Triton's launch path (``qsa_aiter/runtime/jit``): a launch's compile on an in-memory miss goes into the
cache once, with its lock, and placeholders of corrupt entries rebuild; 8 processes warming one directory at once
compile each variant once.

GPU (``-m gpu``): a fresh process after a warm-up launches every kernel with no compilation, from a warm-up on the
GPU and from one for the named arch made without it.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qsa_aiter.tools import warmup
from qsa_aiter.runtime.jit.store import Store

from jit_children import child_env, run_child, run_cli, same_sources_here, source_dir, sources  # noqa: F401 (sources, same_sources_here: the module's autouse fixtures)

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
from qsa_aiter.runtime.jit.triton_compat import ASTSource, CompiledKernel, make_backend
from qsa_aiter import jit
from qsa_aiter.tools import warmup as w
from qsa_aiter.tools.aot import TARGETS

root, arch, stage = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
target = TARGETS[arch]
matrix = w.Matrix(kernels=("expand",), caches=("bf16",), page_sizes=(64,), index_dtypes=("int32",))
specs = [spec for spec, _ in w._unique(w.launches(matrix, arch, torch.device("cpu")), target)]
DEVICE = 7
fn = specs[0].fn
fn.device_caches[DEVICE] = ({}, {}, target, make_backend(target), None)
fn.compile, fn.ASTSource, fn.CompiledKernel = triton.compile, ASTSource, CompiledKernel
store = jit.store_for(root, arch)
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


@pytest.mark.slow
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
from qsa_aiter.tools import warmup as w
from qsa_aiter.runtime.jit.store import Store, _jit_function

root, n, barrier = sys.argv[1], sys.argv[2], Path(sys.argv[3])
(barrier / f"ready-{n}").touch()
while not (barrier / "go").exists():  # all start compiling together
    time.sleep(0.01)
matrix = w.Matrix(kernels=("expand", "cache_writer"), caches=("bf16", "fp8"), page_sizes=(16,),
                  index_dtypes=("int32",))
report = w.warmup("gfx950", root=root, matrix=matrix, progress=False)
store = Store(Path(root), "gfx950")
loaded = 0
for eid, entry in store.read().entries.items():
    store.load_entry(entry, _jit_function(entry.function))  # raises if a file is partial
    loaded += 1
print("JIT-RESULT " + json.dumps({"compiled": sorted(report.compiled), "found": report.found,
                                  "failed": report.failed, "loaded": loaded}))
"""


@pytest.mark.slow
def test_eight_processes_warming_one_directory_compile_each_variant_once(tmp_path):
    root, barrier = tmp_path / "jit", tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(root), str(n), str(barrier)], cwd=source_dir(),
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
# GPU: a fresh process after warm-up compiles nothing
# ---------------------------------------------------------------------------------------------------------------

GPU_MATRIX = ["--caches", "bf16,fp8", "--page-sizes", "64"]

# Scores (every phase: tiled, stacked, rowwise), writes a cache (bf16 and fp8), selects and runs block top-k and
# expansion alone, for 1, 9 and 16 requests (the native top-k where it serves, then the Triton one forced); counts
# Triton compiles (cache hits included) and new files in the JIT and Triton cache directories.
_FRESH = r"""
import json, os, sys, time
from pathlib import Path
import torch
from triton import knobs

compiles = []
knobs.compilation.listener = lambda **kw: compiles.append(getattr(kw["src"], "name", "?"))
import qsa_aiter
from qsa_aiter.kernels import catalog
from qsa_aiter.tools import warmup as w
from qsa_aiter.runtime.jit.store import _CachedKernel
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits
from qsa_aiter.tools.workloads import make_batch

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
for cache in ("bf16", "fp8"):
    for phase, (n, rows) in {"verify": (9, 4), "draft": (16, 1), "decode": (1, 1), "prefill": (1, 300)}.items():
        batch = make_batch([8192] * n, rows, page_size=64, cache=cache, device="cuda")
        logits, visible = timed(f"score {cache} {phase}", lambda: qsa_aiter.qsa_paged_mqa_logits(
            *batch.args(), **batch.kwargs(), phase=phase, max_query_len=rows))
        if cache == "bf16" and phase == "verify":
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
# The Triton top-k (where the native one serves first) and its long rows, through the column-block maxima.
os.environ["QSA_AITER_TOPK_BACKEND"] = "triton"
for requests in (1, 9, 16):
    sel = make_batch([8192] * requests, 1, page_size=64, device="cuda")
    timed(f"select triton {requests}", lambda: qsa_aiter.qsa_select_paged_tokens(
        *sel.args()[:6], 2048, 4, **sel.kwargs(), phase="draft"))
    lg, vis = qsa_aiter.qsa_paged_mqa_logits(*sel.args(), **sel.kwargs(), phase="draft")
    timed(f"topk triton {requests}", lambda: qsa_aiter.qsa_block_topk(lg, vis, 512))
long_logits = torch.randn(2, 70000, device="cuda")
long_visible = torch.tensor([70000, 69000], dtype=torch.int32, device="cuda")
timed("topk long rows", lambda: qsa_aiter.qsa_block_topk(long_logits, long_visible, 512))
del os.environ["QSA_AITER_TOPK_BACKEND"]
# Where measurements send decode to the stacked scorer, the row-wise one still serves with the switch off.
os.environ["ATOM_QSA_STACKED_DECODE_SCORER"] = "0"
for cache in ("bf16", "fp8"):
    batch = make_batch([8192], 1, page_size=64, cache=cache, device="cuda")
    timed(f"score {cache} decode, stacked off", lambda: qsa_aiter.qsa_paged_mqa_logits(
        *batch.args(), **batch.kwargs(), phase="decode", max_query_len=1))
kernels = {}
for name in w.KERNELS:
    fn = catalog.spec_named(name).fn
    kernels[name] = sum(isinstance(k, _CachedKernel)
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

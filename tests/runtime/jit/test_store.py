"""The JIT cache's logic without compiling (``qsa_aiter/runtime/jit``): the manifest and one store's records, files, locks
and rebuild rule; entry ids; which kernels get placeholders; where the cache lives (``QSA_AITER_JIT_DIR``, a
checkout's ``jit/``, a read-only install); the package's shape (the facade re-exports
the defining modules' objects, Triton's private names come through ``triton_compat`` only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from qsa_aiter.runtime import jit
from qsa_aiter.runtime.jit import manifest, paths, launching as runtime
from qsa_aiter.runtime.jit import store as jit_store
from qsa_aiter.runtime.jit.manifest import Entry, FileRecord
from qsa_aiter.runtime.jit.store import Store
from qsa_aiter.kernels.platform import interpreting
from qsa_aiter.runtime.settings import get_settings

from helpers import top_level_imports

PACKAGE = Path(jit.__file__).resolve().parents[2]  # qsa_aiter/


# ---------------------------------------------------------------------------------------------------------------
# Manifest and store logic
# ---------------------------------------------------------------------------------------------------------------


def fake_entry(store: Store, group: str = "G1", date: datetime | None = None, **files: bytes) -> Entry:
    """An entry whose files (``name=bytes``; default a metadata and a binary file) are written into ``group``."""
    files = files or {"k.json": b'{"name": "k"}', "k.cubin": bytes(range(256)) * 4}
    directory = store.triton_dir / group
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return Entry(
        kernel="expand", function="qsa_aiter.kernels.selection.expand._expand_kernel", constexprs={"RATIO": 4},
        options={"num_warps": 4}, arguments={"out_stride": "i32%16"}, runtime_key="key", specialization="{}",
        group=group, metadata="k.json", binary="k.cubin",
        files={n: FileRecord(size=len(d), sha256=hashlib.sha256(d).hexdigest()) for n, d in files.items()},
        sources=paths.kernel_sources_hash(), triton_env=paths.triton_env(), built_by="launch",
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
    with pytest.raises(jit.EntryUnusable, match="k.cubin"):
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
        with pytest.raises(jit.VariantBusy):
            store.claim("expand-a", wait=False)
    assert not store.busy("expand-a")


def test_entry_ids_name_the_kernel_and_separate_keys():
    a = jit.entry_id("qsa_aiter.kernels.scoring.stacked._stacked_scorer_kernel", "k1")
    b = jit.entry_id("qsa_aiter.kernels.scoring.stacked._stacked_scorer_kernel", "k2")
    assert a.startswith("stacked-") and b.startswith("stacked-") and a != b
    assert jit.entry_id("qsa_aiter.kernels.scoring.stacked._stacked_scorer_kernel", "k1") == a


def test_placeholders_only_for_this_librarys_compiled_kernels():
    assert jit_store._jit_function("os.path.join") is None
    assert jit_store._jit_function("qsa_aiter.kernels.scoring.nowhere._kernel") is None
    fn = jit_store._jit_function("qsa_aiter.kernels.selection.expand._expand_kernel")
    assert (fn is None) == interpreting()  # an interpreted kernel has no in-memory cache to place entries in


def test_scope_is_a_no_op_off_the_gpu():
    assert isinstance(jit.scope(torch.device("cpu")), contextlib.nullcontext)


# ---------------------------------------------------------------------------------------------------------------
# The package's shape
# ---------------------------------------------------------------------------------------------------------------


def test_the_package_reexports_the_defining_modules_objects():
    defining = {"load": runtime, "scope": runtime, "store_for": runtime, "jit_root": paths, "Store": jit_store, "VariantBusy": jit_store, "Entry": manifest, "FileRecord": manifest,
                "EntryUnusable": manifest, "entry_id": paths, "kernel_sources_hash": paths, "writable": paths}
    for name, module in defining.items():
        assert getattr(jit, name) is getattr(module, name), name
    assert set(defining) <= set(jit.__all__)


def test_triton_internals_are_imported_by_triton_compat_only():
    public = {"triton", "triton.language"}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "triton_compat.py":
            continue
        internal = [m for m in top_level_imports(path) if m.split(".")[0] == "triton" and m not in public
                    and not m.startswith("triton.language.")]
        assert internal == [], f"{path.relative_to(PACKAGE)} imports {internal}"



# ---------------------------------------------------------------------------------------------------------------
# Where the cache lives (QSA_AITER_JIT_DIR, a checkout's jit/, a read-only install)
# ---------------------------------------------------------------------------------------------------------------


def test_jit_dir_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("QSA_AITER_JIT_DIR", f" {tmp_path / 'cache'} ")
    assert jit.jit_root() == tmp_path / "cache"
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("QSA_AITER_JIT_DIR", str(tmp_path / "file"))
    with pytest.raises(ValueError, match="QSA_AITER_JIT_DIR=.*file'? is invalid: allowed: a directory"):
        jit.jit_root()


def test_a_checkouts_jit_dir_is_the_default(monkeypatch, tmp_path):
    checkout = tmp_path / "jit"
    checkout.mkdir()
    (checkout / "README.md").write_text("x")
    monkeypatch.setattr(paths, "CHECKOUT_JIT_DIR", checkout)
    assert jit.jit_root() == checkout


def test_an_installed_package_uses_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    # a wheel has no jit/ beside the package
    monkeypatch.setattr(paths, "CHECKOUT_JIT_DIR", tmp_path / "site-packages" / "jit")
    assert jit.jit_root() == tmp_path / "home" / ".cache" / "qsa_aiter" / "jit"


def test_a_read_only_checkout_uses_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    checkout = tmp_path / "ro" / "jit"
    checkout.mkdir(parents=True)
    (checkout / "README.md").write_text("x")
    monkeypatch.setattr(paths, "CHECKOUT_JIT_DIR", checkout)
    monkeypatch.setattr(paths, "writable", lambda path: path != checkout)
    assert jit.jit_root() == tmp_path / "home" / ".cache" / "qsa_aiter" / "jit"


def test_writable_probes_the_directory(tmp_path):
    assert jit.writable(tmp_path)
    assert jit.writable(tmp_path / "not" / "yet")  # created under a writable parent
    (tmp_path / "file").write_text("")
    assert not jit.writable(tmp_path / "file" / "jit")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_writable_sees_a_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert not jit.writable(ro) and not jit.writable(ro / "jit")
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

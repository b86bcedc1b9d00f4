"""``jit list`` and ``jit clear`` (``qsa_aiter.tools.inventory``) on a cache written by hand: variants that differ only
in their arguments' dtypes are told apart, and a clear says what it removed. (Caches that warm-up compiled are listed
and cleared in ``tests/tools/test_warmup.py``.)"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import triton

from qsa_aiter.runtime.jit.manifest import Entry, FileRecord, Manifest
from qsa_aiter.tools.cli import main

ARCH = "sm_90"


def _entry(arguments: dict[str, str]) -> Entry:
    """A rowwise variant's manifest entry whose only varying part is ``arguments``."""
    return Entry(
        kernel="rowwise", function="qsa_aiter.kernels.scoring.rowwise.rowwise_kernel",
        constexprs={"BLOCK_N": 64, "KV_KIND": 0}, options={"num_warps": 4, "num_stages": 1}, arguments=arguments,
        runtime_key="key", specialization="{}", group="group", metadata="kernel.json", binary="kernel.cubin",
        files={"kernel.cubin": FileRecord(size=3000, sha256="0" * 64)}, sources="sources", triton_env={},
        built_by="target", compile_seconds=1.5, date=datetime(2026, 1, 2, tzinfo=timezone.utc),
    )


def _write_cache(root: Path) -> Path:
    """Two variants under ``root`` that differ only in q's and the page table's dtypes; returns their directory."""
    directory = root / f"triton-{triton.__version__}" / ARCH
    directory.mkdir(parents=True)
    entries = {
        "rowwise-a": _entry({"q_ptr": "*bf16", "pt_ptr": "*i32", "num_tokens": "i32%16"}),
        "rowwise-b": _entry({"q_ptr": "*fp16", "pt_ptr": "*i64 unaligned", "num_tokens": "i32%16"}),
    }
    manifest = Manifest(arch=ARCH, triton_version=triton.__version__, entries=entries)
    (directory / "manifest.json").write_text(manifest.model_dump_json(indent=1))
    (directory / "triton").mkdir()
    (directory / "triton" / "kernel.cubin").write_bytes(b"\0" * 3000)
    return directory


def test_jit_list_tells_apart_variants_that_differ_only_in_dtype(tmp_path, capsys):
    _write_cache(tmp_path)
    assert main(["jit", "list", "--jit-dir", str(tmp_path), "--no-verify"]) == 0
    listing = capsys.readouterr().out
    assert "      arguments: q_ptr:*bf16 pt_ptr:*i32 num_tokens:i32%16" in listing
    assert "      arguments: q_ptr:*fp16 pt_ptr:*i64-unaligned num_tokens:i32%16" in listing
    entry_lines = [line for line in listing.splitlines() if line.startswith("      ")]
    assert len(entry_lines) == 4 and len(set(entry_lines)) == 3  # the same constexprs and options, other dtypes


def test_jit_clear_says_what_it_removed(tmp_path, capsys):
    directory = _write_cache(tmp_path)
    size = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    assert main(["jit", "clear", "--jit-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"removed triton {triton.__version__} / {ARCH}: 2 entries, {size / 1024:.1f} KiB "
                      f"({directory})")
    assert out[1] == f"removed 2 entries, {size / 1024:.1f} KiB in 1 directory under {tmp_path}"
    assert not directory.exists()
    assert main(["jit", "clear", "--jit-dir", str(tmp_path)]) == 1  # nothing cleared: said on stderr, exit 1
    assert capsys.readouterr().err.strip() == f"error: nothing to remove under {tmp_path} (the cache is empty)"

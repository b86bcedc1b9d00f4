"""The static model that picks tile configs for the AMD targets (``tools/static_model.py``): its rules on given
candidates, that it never replaces a row that is not its own, and one row chosen end to end from real builds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qsa_aiter.kernels.scoring.keys_major import KeysMajorConfig
from qsa_aiter.kernels.scoring.stacked import StackedConfig
from qsa_aiter.kernels.scoring.tiled import TiledConfig
from qsa_aiter.tools import static_model
from qsa_aiter.tools.static_model import Candidate, choose, fill_programs

ROOT = Path(__file__).resolve().parents[2]


def candidate(config, waves: int, scratch: int = 0, vgprs: int = 100) -> Candidate:
    return Candidate(config, {"v_mfma_f32_16x16x128_f8f6f4": 8}, vgprs, 0, 16384, scratch, waves, "registers")


def test_spilling_and_thin_candidates_are_out_and_the_rest_ranked():
    """No scratch, at least 2 waves for decode/verify; then more waves (up to 4), then the wider key tile."""
    spills = candidate(StackedConfig(block_n=128, num_stages=3), waves=4, scratch=16)
    thin = candidate(StackedConfig(block_n=128), waves=1)
    narrow = candidate(StackedConfig(block_n=32), waves=4)
    wide = candidate(StackedConfig(block_n=64), waves=4)
    more = candidate(StackedConfig(block_n=64, num_stages=3), waves=5)
    assert choose([spills, thin, narrow, wide], "verify") is wide
    assert choose([spills, thin, narrow, wide, more], "verify") is more  # 5 waves rank as 4: then staging decides
    assert choose([spills, thin], "decode") is None
    assert choose([thin], "prefill") is thin  # one wave is enough for prefill tiles


def test_prefill_prefers_the_larger_output_tile():
    small = candidate(TiledConfig(block_m=16, block_n=64, keys_major=1, stack_heads=1), waves=4)
    big = candidate(TiledConfig(block_m=32, block_n=128, keys_major=1, stack_heads=1), waves=1)
    assert choose([small, big], "prefill") is big


def test_programs_per_sm_fill_one_cu():
    chosen = candidate(StackedConfig(num_warps=4), waves=3)
    assert fill_programs(chosen).programs_per_sm == 3  # 3 waves x 4 SIMDs / 4 waves per workgroup
    assert fill_programs(candidate(KeysMajorConfig(), waves=2)) == KeysMajorConfig()  # no such field: unchanged


def test_rows_that_are_not_the_models_are_kept(tmp_path):
    table = tmp_path / "rows.csv"
    table.write_text(
        "arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context,block_n,measured,source\n"
        "gfx950,stacked,bf16,64,4,128,36,131072,32,0,field report from the hardware\n"
        "gfx950,stacked,fp8,64,4,128,36,131072,64,0,\"model, not measured: 3 waves/SIMD\"\n")
    kept = static_model.other_rows(table)
    assert kept == {("gfx950", "stacked", "bf16", "64", "4", "128", "36", "131072")}


def test_bad_command_line_values_are_named(capsys):
    with pytest.raises(SystemExit) as info:
        static_model.main(["--arch", "sm_90", "--csv", "x.csv"])
    assert info.value.code == 2
    assert "argument --arch: expected a comma-separated subset of gfx942,gfx950; got 'sm_90'" in capsys.readouterr().err


def test_every_cache_format_name_is_taken_one_row_per_kind(monkeypatch, tmp_path):
    """``--caches`` takes the library's format names (fp8_fnuz and fp16 included): one model row per kind."""
    made = []
    monkeypatch.setattr(static_model, "model_row", lambda kernel, arch, fmt, page: made.append(fmt) or
                        {"arch": arch, "kernel": kernel, "kv_dtype": fmt, "page_size": page})
    monkeypatch.setattr(static_model, "merge_rows", lambda path, rows: None)
    argv = ["--arch", "gfx942", "--kernels", "stacked", "--page-sizes", "64", "--csv", str(tmp_path / "t.csv")]
    assert static_model.main([*argv, "--caches", "fp8_fnuz,fp8,fp16,bf16"]) == 0
    assert made == ["fp8", "bf16"]


_CHILD = r"""
import json
from qsa_aiter.tools.static_model import model_row
print("ROW " + json.dumps(model_row("keys_major", "gfx950", "fp8", 64)))
"""


def test_one_row_end_to_end():
    """``keys_major`` x fp8 x page 64 on gfx950, compiled and read: a model row with no scratch, 2+ waves, the f8f6f4
    MFMAs named in its source, at the kernel's first tuning point's bucket."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    row = json.loads(lines[-1][4:])
    assert row["arch"] == "gfx950" and row["kernel"] == "keys_major" and row["measured"] == 0
    assert row["source"].startswith(static_model.MODEL_SOURCE) and "no scratch" in row["source"]
    assert "_f8f6f4" in row["source"]
    waves = int(row["source"].split(static_model.MODEL_SOURCE)[1].split()[0])
    assert waves >= 2
    assert (row["rows"], row["context"]) == (36, 131072)

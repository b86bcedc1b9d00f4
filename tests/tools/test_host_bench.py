"""``bench --eager`` (``qsa_aiter.tools.host_bench``): the calls it times, with every output given (``out=``) and
without (the op allocates), on a small batch where the timings themselves cannot be taken (no GPU); and
``benchmarks/host_path_cpu.py``, which times the same calls with the launches stubbed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import qsa_aiter
from qsa_aiter.tools import host_bench
from qsa_aiter.tools.inputs import selection_inputs
from qsa_aiter.tools.work_points import TOKEN_TOPK, WorkPoint

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: A small verify batch: 2 requests x 2 rows (the interpreter runs every call on the CPU).
POINT = WorkPoint("tiny", (700, 1500), 2, "verify")
#: The ops that take ``out``; the writer writes in place and has nothing to allocate.
TAKES_OUT = ("qsa_paged_mqa_logits", "qsa_select_paged_tokens", "qsa_block_topk", "qsa_expand_block_indices")


def test_every_op_is_timed_with_and_without_out():
    inputs = selection_inputs(POINT, 64, device=DEVICE)
    calls = host_bench.op_calls(inputs)
    assert set(calls) == set(TAKES_OUT) | {"qsa_write_index_cache"}
    assert all(set(calls[name]) == set(host_bench.VARIANTS) for name in TAKES_OUT)
    assert set(calls["qsa_write_index_cache"]) == {host_bench.GIVEN}

    # The `out=` call returns the buffers it was given; the other one allocates new ones holding the same result.
    logits, visible = calls["qsa_paged_mqa_logits"][host_bench.GIVEN]()
    assert logits is inputs.logits
    new_logits, new_visible = calls["qsa_paged_mqa_logits"][host_bench.ALLOCATED]()
    assert new_logits.data_ptr() != inputs.logits.data_ptr() and torch.equal(new_visible, visible)
    seen = torch.arange(logits.shape[1], device=DEVICE)[None, :] < visible[:, None].long()
    assert torch.equal(new_logits[seen], logits[seen])
    for name, given in (("qsa_select_paged_tokens", inputs.picked), ("qsa_block_topk", inputs.groups),
                        ("qsa_expand_block_indices", inputs.picked)):
        assert calls[name][host_bench.GIVEN]() is given
        allocated = calls[name][host_bench.ALLOCATED]()
        assert allocated.data_ptr() != given.data_ptr() and torch.equal(allocated, given), name
    ratio = inputs.batch.compress_ratio
    assert torch.equal(inputs.picked, qsa_aiter.qsa_select_paged_tokens(*inputs.args, TOKEN_TOPK, ratio,
                                                                        **inputs.hints))


def test_the_report_has_a_column_per_variant():
    host = {host_bench.GIVEN: 21.0, host_bench.ALLOCATED: 24.5}
    line = host_bench.report_line("9x4@64K-128K", "qsa_paged_mqa_logits", host, 150.0, 14.25)
    assert line.split() == ["9x4@64K-128K", "qsa_paged_mqa_logits", "21.0", "24.5", "150.0", "14.25", "<=", "25",
                            "us:", "met"]
    line = host_bench.report_line("9x4@64K-128K", "qsa_write_index_cache", {host_bench.GIVEN: 9.0}, 50.0, 3.0)
    assert line.split() == ["9x4@64K-128K", "qsa_write_index_cache", "9.0", "-", "50.0", "3.00"]
    assert [f"host {v}" in host_bench.REPORT_HEADER for v in host_bench.VARIANTS] == [True, True]


def test_the_cpu_host_path_benchmark_times_both_variants():
    """``benchmarks/host_path_cpu.py`` (launches stubbed) runs, and reports each op with and without ``out=``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_path_cpu.py"), "--calls", "3",
                             "--batches", "1"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "cached out=" in lines[1] and "cached no out=" in lines[1]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert set(rows) == set(TAKES_OUT) | {"qsa_write_index_cache"}
    assert all(len(rows[name]) == 3 and "-" not in rows[name] for name in TAKES_OUT)
    assert rows["qsa_write_index_cache"][1] == "-"

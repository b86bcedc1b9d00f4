"""Configuration errors are raised at the first call, never absorbed by the registry's fallback.

A missing or malformed ``QSA_AITER_TUNED_CONFIG`` file (or one that is no tuned table at all),
``QSA_AITER_JIT_DIR`` naming a file or a directory that can be neither found nor created, and a bad
``QSA_AITER_LOG_LEVEL`` raise ``ConfigurationError`` (a ``ValueError``) naming the variable, its value and the
reason, on every path: the Triton kernels (on the GPU, or under the interpreter), the torch path, selection, the
writer and the command line. No kernel is marked broken by them, so once the variable is fixed the preferred kernel
runs again.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qsa_aiter
from qsa_aiter.runtime import dispatch, registries
from qsa_aiter.tools.cli import main
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.runtime.settings import ConfigurationError
from qsa_aiter.tools.workloads import make_batch

from helpers import force_backend, phase_batch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
HEADER = "arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context,block_n,measured\n"


def _bad_files(tmp_path) -> dict[str, tuple[str, str]]:
    """Variable settings that are configuration errors: name -> (variable, value), with the reason's words."""
    malformed = tmp_path / "malformed.csv"
    malformed.write_text(HEADER + "sm_90,stacked,bf16,64,4,128,36,98304,-64,1\n")
    unknown = tmp_path / "unknown_kernel.csv"
    unknown.write_text(HEADER + "sm_90,bogus,bf16,64,4,128,36,98304,64,1\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    hostname = tmp_path / "hostname"  # a one-line text file, such as /etc/hostname: a header without rows to csv
    hostname.write_text("gpu-node-17\n")
    return {
        "missing tuned file": ("QSA_AITER_TUNED_CONFIG", str(tmp_path / "nowhere.csv"), "is not a file"),
        "malformed tuned row": ("QSA_AITER_TUNED_CONFIG", str(malformed), "malformed.csv:2: block_n"),
        "unknown kernel": ("QSA_AITER_TUNED_CONFIG", str(unknown), "unknown kernel 'bogus'"),
        "not a tuned table": ("QSA_AITER_TUNED_CONFIG", str(hostname),
                              "hostname:1: not a tuned-table header: unknown column(s) 'gpu-node-17'"),
        "jit dir is a file": ("QSA_AITER_JIT_DIR", str(a_file), "allowed: a directory"),
        # /proc takes no new entries, even from root: the directory can be neither found nor made.
        "jit dir cannot be created": ("QSA_AITER_JIT_DIR", "/proc/qsa_aiter_jit",
                                      "it does not exist, and no file can be created in /proc"),
        "log level": ("QSA_AITER_LOG_LEVEL", "loud", "allowed: debug, info, warning, error"),
    }


CASES = ("missing tuned file", "malformed tuned row", "unknown kernel", "not a tuned table", "jit dir is a file",
         "jit dir cannot be created", "log level")


def _expect_configuration_error(call, variable: str, value: str, reason: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        call()
    text = str(info.value)
    assert variable in text and value in text and reason in text, text


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("case", CASES)
def test_scoring_raises_and_marks_nothing_broken(monkeypatch, tmp_path, rng, case, backend, device):
    variable, value, reason = _bad_files(tmp_path)[case]
    batch, hints = phase_batch("verify", 16, rng, device=device)
    args = batch.args()
    force_backend(monkeypatch, backend)
    chosen = qsa_aiter.selected_kernel(*args, **hints)
    monkeypatch.setenv(variable, value)
    out = torch.full((batch.q.shape[0], batch.page_table.shape[1] * 16), float("nan"), device=device)
    _expect_configuration_error(lambda: qsa_aiter.qsa_paged_mqa_logits(*args, out=out, **hints), variable, value,
                                reason)
    assert torch.isnan(out).all(), "nothing is written when the configuration is rejected"
    _expect_configuration_error(
        lambda: qsa_aiter.qsa_select_paged_tokens(*args[:6], 64, 4, **hints), variable, value, reason)
    assert not dispatch._broken, dispatch._broken
    monkeypatch.delenv(variable)
    assert qsa_aiter.selected_kernel(*args, **hints) == chosen
    assert registries.SCORING.dispatch(describe_call(*args, **hints), _launch_args(args, hints)) == chosen


def _launch_args(args, hints):
    """The launch arguments ``qsa_paged_mqa_logits`` builds for ``args`` (to see which kernel ``registries.SCORING.dispatch`` ran)."""
    from qsa_aiter.kernels.scoring.base import ScoreArgs

    q, cache, table, t2r, pos, ctx, ratio = args
    columns = table.shape[1] * cache.shape[1]
    logits = torch.empty((q.shape[0], columns), device=q.device)
    visible = torch.empty((q.shape[0],), dtype=torch.int32, device=q.device)
    return ScoreArgs(q, cache, table, t2r, pos, ctx, logits, visible, columns, ratio, 1.0 / q.shape[2] ** 0.5,
                       hints.get("k_scale"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["jit dir is a file", "jit dir cannot be created", "log level"])
def test_the_writer_and_the_selection_steps_raise(monkeypatch, tmp_path, rng, case, device):
    variable, value, reason = _bad_files(tmp_path)[case]
    monkeypatch.setenv(variable, value)
    cache, scale = qsa_aiter.allocate_index_cache("fp8", 4, 16, 64, device=device)
    keys = torch.randn(5, 64, generator=rng).to(device)
    slots = torch.arange(5, device=device)
    _expect_configuration_error(lambda: qsa_aiter.qsa_write_index_cache(keys, slots, cache, scale), variable, value,
                                reason)
    logits = torch.randn(3, 100, generator=rng).to(device)
    visible = torch.full((3,), 100, dtype=torch.int32, device=device)
    _expect_configuration_error(lambda: qsa_aiter.qsa_block_topk(logits, visible, 10), variable, value, reason)


@pytest.mark.parametrize("case", CASES)
def test_the_command_line_exits_2_naming_the_variable(monkeypatch, tmp_path, capsys, case):
    variable, value, reason = _bad_files(tmp_path)[case]
    monkeypatch.setenv(variable, value)
    assert main(["explain", "--requests", "2", "--context", "1K"]) == 2
    err = capsys.readouterr().err
    assert variable in err and value in err and reason in err, err


def test_a_kernel_failure_still_falls_back(monkeypatch, rng):
    """The fallback itself is unchanged: a launch that raises marks its kernel broken and the next one serves."""
    batch = make_batch([300, 500], 2, head_dim=32, page_size=16, generator=rng)
    args = batch.args()

    def broken(*_):
        raise RuntimeError("compile failed")

    scoring = registries.SCORING.candidates
    monkeypatch.setitem(scoring, "stacked", dataclasses.replace(scoring["stacked"], launch=broken))
    dispatch.clear_broken()
    logits, _ = qsa_aiter.qsa_paged_mqa_logits(*args, max_query_len=2)
    assert any(key[1] == "stacked" for key in dispatch._broken)
    assert qsa_aiter.selected_kernel(*args, max_query_len=2) != "stacked"

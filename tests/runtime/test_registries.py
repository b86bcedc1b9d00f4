"""The op families' registries (``runtime/registries.py``) through the one dispatch mechanism: the top-k, expansion
and writer candidates with their reasons, forcing by ``QSA_AITER_TOPK_BACKEND``, ``explain_selection``, and the
fallback past a failing kernel (marked broken, or raised with ``QSA_AITER_STRICT=1``)."""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.cache import writer
from qsa_aiter.kernels.selection import expand, topk
from qsa_aiter.kernels.selection.reference import reference_block_topk, reference_expand_block_indices
from qsa_aiter.runtime import dispatch, registries
from qsa_aiter.runtime.settings import ConfigurationError
from qsa_aiter.tools.workloads import make_batch


def _batch(rng):
    batch = make_batch([900, 700], [2, 1], page_size=16, head_dim=32, dtype=torch.bfloat16, generator=rng)
    return batch.args()[:6]


def _scores(rng):
    logits = torch.randn(3, 200, generator=rng)
    return logits, torch.tensor([200, 150, 9], dtype=torch.int32)


def test_every_family_has_a_universal_last_resort():
    for registry in (registries.SCORING, registries.TOPK, registries.EXPAND, registries.WRITER):
        assert registry.candidates["torch"].ranks and registry.candidates["torch"].spec is None
    assert registries.TOPK.order(registries.TopkProblem("cpu", 1, 8, 2))[0] == ("aiter", "triton", "torch")


def test_explain_selection_reports_scoring_and_topk(rng):
    args = _batch(rng)
    report = qsa_aiter.explain_selection(*args, 64, 4)
    assert report.startswith("qsa_select_paged_tokens: 3 rows in 1 chunk(s)")
    assert "\nqsa_paged_mqa_logits: " in report and "  plan (arch " in report
    assert "\nblock top-k: rows=3 " in report and "expansion fused" in report
    assert "* triton: serves" in report  # the interpreter runs the Triton kernels on this CPU machine
    assert "- aiter: used only when the AITER path is asked for" in report
    assert "- torch: serves, but an earlier candidate is preferred" in report
    with pytest.raises(ValueError, match="`token_topk`"):
        qsa_aiter.explain_selection(*args, 63, 4)


def test_topk_backend_forces_a_candidate(monkeypatch, rng):
    logits, visible = _scores(rng)
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "torch")
    problem = registries.TopkProblem("cpu", 3, 200, 16)
    decision = registries.TOPK.select(problem)
    assert decision.chosen == "torch" and decision.forced
    assert "forced by QSA_AITER_TOPK_BACKEND" in registries.TOPK.explain(problem)
    assert torch.equal(qsa_aiter.qsa_block_topk(logits, visible, 16), reference_block_topk(logits, visible, 16))
    args = _batch(rng)
    forced = qsa_aiter.qsa_select_paged_tokens(*args, 64, 4)
    monkeypatch.delenv("QSA_AITER_TOPK_BACKEND")
    assert torch.equal(forced, qsa_aiter.qsa_select_paged_tokens(*args, 64, 4))


def test_topk_backend_errors(monkeypatch, rng):
    logits, visible = _scores(rng)
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "fastest")
    with pytest.raises(ConfigurationError, match="QSA_AITER_TOPK_BACKEND='fastest' is invalid: allowed: auto, aiter"):
        qsa_aiter.qsa_block_topk(logits, visible, 16)
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "aiter")  # forced where it cannot run: an error with its reasons
    with pytest.raises(ValueError, match="aiter: needs ROCm GPU tensors"):
        qsa_aiter.qsa_block_topk(logits, visible, 16)


def _failing(*args, **kwargs):
    raise RuntimeError("simulated launch failure")


def test_a_failing_triton_topk_falls_back_to_torch_and_is_marked_broken(monkeypatch, rng, caplog):
    logits, visible = _scores(rng)
    monkeypatch.setattr(topk, "launch", _failing)
    with caplog.at_level("WARNING", logger="qsa_aiter"):
        assert torch.equal(qsa_aiter.qsa_block_topk(logits, visible, 16), reference_block_topk(logits, visible, 16))
    assert "topk kernel triton failed" in caplog.text and "simulated launch failure" in caplog.text
    report = registries.TOPK.explain(registries.TopkProblem("cpu", 3, 200, 16))
    assert "- triton: marked broken in this process: RuntimeError: simulated launch failure" in report
    assert "* torch: serves" in report
    dispatch.clear_broken()
    monkeypatch.setenv("QSA_AITER_STRICT", "1")
    with pytest.raises(RuntimeError, match="simulated launch failure"):
        qsa_aiter.qsa_block_topk(logits, visible, 16)


def test_a_failing_triton_expansion_falls_back_to_torch(monkeypatch, rng):
    logits, visible = _scores(rng)
    groups = reference_block_topk(logits, visible, 16)
    pos = torch.tensor([799, 560, 36], dtype=torch.int32)
    ctx = torch.tensor([900, 700], dtype=torch.int32)
    t2r = torch.tensor([0, 0, 1], dtype=torch.int32)
    monkeypatch.setattr(expand, "launch", _failing)
    got = qsa_aiter.qsa_expand_block_indices(groups, pos, ctx, t2r, 4, 64)
    assert torch.equal(got, reference_expand_block_indices(groups, pos, ctx, t2r, 4, 64))
    assert "marked broken" in registries.EXPAND.explain(registries.ExpandProblem("cpu", 3, 16, 4, 64))


def test_a_failing_triton_writer_falls_back_to_the_reference_writer(monkeypatch, rng):
    keys = torch.randn(40, 32, generator=rng)
    slots = torch.randperm(64, generator=rng)[:40]
    want, want_scale = qsa_aiter.allocate_index_cache("fp8", 4, 16, 32)
    qsa_aiter.qsa_write_index_cache(keys, slots, want, want_scale)
    monkeypatch.setattr(writer, "launch", _failing)
    got, got_scale = qsa_aiter.allocate_index_cache("fp8", 4, 16, 32)
    qsa_aiter.qsa_write_index_cache(keys, slots, got, got_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(got_scale, want_scale)
    problem = registries.WriteProblem("cpu", 40, "fp8", 32)
    assert "- triton: marked broken" in registries.WRITER.explain(problem)

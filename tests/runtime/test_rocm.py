"""ROCm candidates (``qsa_aiter.rocm``): gating, reasons, logging, dispatch and fallback, with stand-in modules.

Neither ``aiter`` nor ``flydsl`` (nor ATOM, which holds the FlyDSL scorer) is installed here, and there is no ROCm GPU.
The tests put *stand-ins* under the real module names in ``sys.modules`` (functions with the real signatures, read
from the public ROCm/aiter and ROCm/ATOM sources, computing with the torch reference) and make the platform look
like ROCm by replacing ``rocm._rocm_runtime`` and ``rocm._gpu_arch``. Dispatch is exercised with problems marked as
GPU problems while the tensors stay on the CPU, where the stand-ins and the interpreted kernels run.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import logging
import sys
import types

import pytest
import torch

import qsa_aiter
from qsa_aiter.runtime import dispatch, registries
from qsa_aiter.runtime import rocm
from qsa_aiter.kernels.platform import Platform, interpreting
from qsa_aiter.kernels.scoring.base import ScoreArgs, example_problem
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits
from qsa_aiter.kernels.selection.reference import reference_block_topk
from qsa_aiter.runtime.settings import get_settings
from qsa_aiter.tools.workloads import make_batch

from helpers import assert_matches_reference, poisoned_out

FLYDSL_PROBLEM = example_problem(phase="prefill", block_size=16, num_tokens=512, num_requests=1, table_width=40,
                                 num_columns=640, num_pages=64, cache_bytes=64 * 16 * 128 * 2)

def module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__spec__ = importlib.machinery.ModuleSpec(name, None)
    m.__dict__.update(attrs)
    return m

def aiter_scorer_standin(calls: list, *, old: bool = False):
    """Stand-in for ``aiter.ops.triton.attention.qsa`` with the real ``qsa_paged_mqa_logits`` signature."""
    if old:
        def qsa_paged_mqa_logits(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                 context_lens, compress_ratio=4):
            raise AssertionError("an aiter without num_columns must not be called")
    else:
        def qsa_paged_mqa_logits(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                 context_lens, compress_ratio=4, num_columns=None, score_divisor=None, *,
                                 backend=None):
            calls.append(dict(compress_ratio=compress_ratio, num_columns=num_columns, score_divisor=score_divisor))
            return reference_paged_mqa_logits(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                              context_lens, compress_ratio, score_divisor, num_columns)
    return module(rocm.AITER_SCORER[0], qsa_paged_mqa_logits=qsa_paged_mqa_logits)

def flydsl_scorer_standin(calls: list, *, raises: bool = False, page_size: int = 16):
    """Stand-in for ATOM's ``qsa_flydsl_layout`` (its constants and ``qsa_paged_mqa_logits_flydsl`` signature)."""
    def qsa_paged_mqa_logits_flydsl(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                    context_lens, compress_ratio, divisor, logits, visible_groups, row_starts):
        if raises:
            raise RuntimeError("stand-in FlyDSL launch failure")
        calls.append(dict(compress_ratio=compress_ratio, divisor=divisor, row_starts=row_starts))
        ref, vis = reference_paged_mqa_logits(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                              context_lens, compress_ratio, divisor, logits.shape[1])
        logits.copy_(ref)
        visible_groups.copy_(vis)
    return module(rocm.FLYDSL_SCORER[0], qsa_paged_mqa_logits_flydsl=qsa_paged_mqa_logits_flydsl, Q_HEADS=4,
                  HDIMS=128, PAGE_SIZE=page_size, COMPRESS_RATIO=4)

def topk_standin(calls: list, *, stable: bool = True):
    """Stand-in for ``aiter.ops.topk.top_k_per_row_prefill``: the right groups, in a scrambled order (AITER does not
    promise one), ``-1`` in the unused slots."""
    def ranked(logits, row_starts, row_ends, indices, values, num_rows, stride0, stride1, k, **kw):
        calls.append(dict(kw, num_rows=num_rows, k=k, strides=(stride0, stride1)))
        picked = reference_block_topk(logits, row_ends, k)
        indices.copy_(picked.flip(1))

    if stable:
        def top_k_per_row_prefill(logits, row_starts, row_ends, indices, values, num_rows, stride0, stride1, k,
                                  stable=False):
            ranked(logits, row_starts, row_ends, indices, values, num_rows, stride0, stride1, k, stable=stable)
    else:
        def top_k_per_row_prefill(logits, row_starts, row_ends, indices, values, num_rows, stride0, stride1, k):
            ranked(logits, row_starts, row_ends, indices, values, num_rows, stride0, stride1, k)
    return module(rocm.AITER_TOPK[0], top_k_per_row_prefill=top_k_per_row_prefill)

@pytest.fixture
def rocm_platform(monkeypatch):
    """Look like a gfx950 ROCm machine; forget import results before and after."""
    monkeypatch.setattr(rocm, "_rocm_runtime", lambda: "7.0.0")
    monkeypatch.setattr(rocm, "_gpu_arch", lambda: "gfx950")
    monkeypatch.setattr(dispatch, "platform_of", lambda problem: Platform.named("gfx950"))  # explain's plan line
    rocm.reset()
    yield monkeypatch
    rocm.reset()

def install(monkeypatch, *mods: types.ModuleType) -> None:
    for m in mods:
        monkeypatch.setitem(sys.modules, m.__name__, m)

def flydsl_ready(monkeypatch, calls=None, **kw):
    monkeypatch.setenv("ROCM_QSA_FLYDSL", "1")
    install(monkeypatch, module(rocm.FLYDSL_PACKAGE), flydsl_scorer_standin([] if calls is None else calls, **kw))

# ---------------------------------------------------------------------------------------------------------------
# This machine: nothing serves, and nothing is imported
# ---------------------------------------------------------------------------------------------------------------

def test_without_rocm_both_say_why_and_import_nothing(monkeypatch):
    rocm.reset()
    monkeypatch.setattr(dispatch, "platform_of", lambda problem: Platform.named("sm_90"))  # explain, without a GPU
    monkeypatch.setenv("ROCM_QSA_FLYDSL", "1")
    for phase in ("prefill", "decode"):
        problem = dataclasses.replace(FLYDSL_PROBLEM, phase=phase)
        assert any("ROCm build of torch" in r for r in rocm.aiter_reasons(problem))
        assert any("ROCm build of torch" in r for r in rocm.flydsl_reasons(problem))
        assert registries.SCORING.select(problem).chosen in ("tiled", "rowwise")
    assert rocm._loaded == {}, "no library is imported where it could not serve"
    text = registries.SCORING.explain(FLYDSL_PROBLEM)
    assert "order flydsl > tiled > rowwise > aiter > torch" in text
    assert "- flydsl: needs a ROCm build of torch" in text and "* tiled: serves" in text

def test_cpu_tensors_are_not_served(rng):
    batch = make_batch([300, 200], 2, head_dim=32, generator=rng)
    text = qsa_aiter.explain(*batch.args(), phase="decode")
    assert "- aiter: needs ROCm GPU tensors (tensors are on cpu)" in text

# ---------------------------------------------------------------------------------------------------------------
# FlyDSL: every gate
# ---------------------------------------------------------------------------------------------------------------

def test_flydsl_serves_its_shape_and_leads_prefill(rocm_platform):
    flydsl_ready(rocm_platform)
    assert rocm.flydsl_reasons(FLYDSL_PROBLEM) == []
    decision = registries.SCORING.select(FLYDSL_PROBLEM)
    assert decision.chosen == "flydsl" and decision.order[0] == "flydsl"
    assert "* flydsl: serves (FlyDSL" in registries.SCORING.explain(FLYDSL_PROBLEM)

@pytest.mark.parametrize("change,why", [
    (dict(phase="verify"), "prefill phase only"),
    (dict(q_dtype=torch.float16, cache_dtype=torch.float16), "bf16 queries and caches only"),
    (dict(kv_dtype="fp8", cache_dtype=torch.float8_e4m3fn), "bf16 queries and caches only"),
    (dict(num_heads=8), "4 heads, head_dim 128, 16 groups per page, R 4 only (got 8, 128, 16, 4)"),
    (dict(head_dim=64), "(got 4, 64, 16, 4)"),
    (dict(block_size=64, num_columns=2560), "(got 4, 128, 64, 4)"),
    (dict(compress_ratio=8), "(got 4, 128, 16, 8)"),
    (dict(num_tokens=40000, num_columns=16384), "logits exceed its 2 GiB buffer addressing"),
    (dict(cache_bytes=2**31), "index cache exceeds its 2 GiB"),
    (dict(key_strides=(16 * 256, 256)), "reads a dense index cache only (this one is a strided view: page stride "
                                        "4096, slot stride 256)"),
    (dict(device_type="cpu"), "needs ROCm GPU tensors (tensors are on cpu)"),
])
def test_flydsl_shape_and_phase_gates(rocm_platform, change, why):
    flydsl_ready(rocm_platform)
    problem = dataclasses.replace(FLYDSL_PROBLEM, **change)
    assert any(why in r for r in rocm.flydsl_reasons(problem)), rocm.flydsl_reasons(problem)
    assert registries.SCORING.select(problem).chosen != "flydsl"

def test_flydsl_is_off_unless_asked_for_and_reads_the_vllm_alias(rocm_platform):
    install(rocm_platform, module(rocm.FLYDSL_PACKAGE), flydsl_scorer_standin([]))
    assert rocm.flydsl_reasons(FLYDSL_PROBLEM) == ["off (ROCM_QSA_FLYDSL=1 or VLLM_ROCM_QSA_FLYDSL=1 enables it)"]
    assert rocm._loaded == {}, "not imported while off"
    rocm_platform.setenv("VLLM_ROCM_QSA_FLYDSL", "yes")
    assert get_settings().rocm_qsa_flydsl is True
    assert rocm.flydsl_reasons(FLYDSL_PROBLEM) == []
    rocm_platform.setenv("ROCM_QSA_FLYDSL", "0")
    with pytest.raises(ValueError, match="ROCM_QSA_FLYDSL='0' and VLLM_ROCM_QSA_FLYDSL='yes' disagree"):
        get_settings()
    rocm_platform.setenv("ROCM_QSA_FLYDSL", "on")
    assert get_settings().rocm_qsa_flydsl is True

def test_a_bad_alias_value_names_the_alias(monkeypatch):
    monkeypatch.setenv("VLLM_ROCM_QSA_FLYDSL", "maybe")
    with pytest.raises(ValueError, match="VLLM_ROCM_QSA_FLYDSL='maybe' is invalid: allowed"):
        get_settings()
    monkeypatch.setenv("ROCM_QSA_FLYDSL", "1")
    with pytest.raises(ValueError, match="VLLM_ROCM_QSA_FLYDSL='maybe' is invalid"):
        get_settings()

@pytest.mark.parametrize("arch", ["gfx90a", "gfx1100"])
def test_flydsl_needs_gfx942_or_gfx950(rocm_platform, arch):
    flydsl_ready(rocm_platform)
    rocm_platform.setattr(rocm, "_gpu_arch", lambda: arch)
    assert f"needs gfx942 or gfx950 (this GPU is {arch})" in rocm.flydsl_reasons(FLYDSL_PROBLEM)
    rocm_platform.setattr(rocm, "_gpu_arch", lambda: "gfx942")
    assert rocm.flydsl_reasons(FLYDSL_PROBLEM) == []

def test_flydsl_needs_the_package_and_the_kernel_module(rocm_platform):
    rocm_platform.setenv("ROCM_QSA_FLYDSL", "1")
    rocm_platform.setitem(sys.modules, rocm.FLYDSL_PACKAGE, None)  # `import flydsl` fails
    assert rocm.flydsl_reasons(FLYDSL_PROBLEM) == ["the flydsl package is not importable"]
    install(rocm_platform, module(rocm.FLYDSL_PACKAGE))
    rocm_platform.setitem(sys.modules, rocm.FLYDSL_SCORER[0], None)
    reasons = rocm.flydsl_reasons(FLYDSL_PROBLEM)
    assert len(reasons) == 1 and "qsa_flydsl_layout.qsa_paged_mqa_logits_flydsl is not importable" in reasons[0]
    rocm.reset()
    install(rocm_platform, flydsl_scorer_standin([], page_size=64))  # a kernel built for another shape
    assert any("64 groups per page" in r for r in rocm.flydsl_reasons(FLYDSL_PROBLEM))

def test_flydsl_rejection_is_logged_once_as_a_warning(rocm_platform, caplog):
    flydsl_ready(rocm_platform)
    rocm_platform.setattr(rocm, "_gpu_arch", lambda: "gfx90a")
    with caplog.at_level(logging.WARNING, logger="qsa_aiter"):
        for _ in range(3):
            dispatch.clear_broken()  # drop the memoised decision: the reasons are asked for again
            registries.SCORING.select(FLYDSL_PROBLEM)
    lines = [r.getMessage() for r in caplog.records if "flydsl does not serve" in r.getMessage()]
    assert len(lines) == 1 and "gfx90a" in lines[0]

# ---------------------------------------------------------------------------------------------------------------
# AITER: gates, rank, forcing
# ---------------------------------------------------------------------------------------------------------------

def test_aiter_serves_bf16_but_ranks_after_the_rowwise_scorer(rocm_platform):
    install(rocm_platform, aiter_scorer_standin([]))
    problem = example_problem(phase="decode")
    assert rocm.aiter_reasons(problem) == []
    assert registries.SCORING.select(problem).chosen == "rowwise"
    assert "- aiter: serves, but an earlier candidate is preferred" in registries.SCORING.explain(problem)
    rocm_platform.setenv("QSA_AITER_BACKEND", "aiter")
    assert registries.SCORING.select(problem).chosen == "aiter"

def test_aiter_gates(rocm_platform):
    fp16 = example_problem(q_dtype=torch.float16, cache_dtype=torch.float16)
    assert any("bf16 queries and caches only (got q float16, cache float16)" in r for r in rocm.aiter_reasons(fp16))
    assert rocm._loaded == {}, "a shape it cannot serve imports nothing"
    rocm_platform.setitem(sys.modules, rocm.AITER_SCORER[0], None)
    reasons = rocm.aiter_reasons(example_problem())
    assert len(reasons) == 1 and "aiter.ops.triton.attention.qsa.qsa_paged_mqa_logits is not importable" in reasons[0]
    rocm.reset()
    install(rocm_platform, aiter_scorer_standin([], old=True))
    assert rocm.aiter_reasons(example_problem()) == [
        "aiter.ops.triton.attention.qsa.qsa_paged_mqa_logits has no num_columns, score_divisor argument (an older "
        "aiter)"]

def test_aiter_refuses_a_strided_cache_view_without_importing(rocm_platform):
    """A cache that is a view of a wider buffer (``buffer[..., :128]``) is left to the Triton scorers, with the
    reason, before AITER is imported; ``explain`` says why."""
    install(rocm_platform, aiter_scorer_standin([]))
    assert rocm.aiter_reasons(example_problem()) == []
    rocm.reset()
    strided = example_problem(key_strides=(64 * 256, 256))
    why = "reads a dense index cache only (this one is a strided view: page stride 16384, slot stride 256)"
    assert rocm.aiter_reasons(strided) == [why]
    assert rocm._loaded == {}
    assert registries.SCORING.select(strided).chosen != "aiter"
    assert f"- aiter: {why}" in registries.SCORING.explain(strided)

# ---------------------------------------------------------------------------------------------------------------
# Running them: argument mapping, results, fallback
# ---------------------------------------------------------------------------------------------------------------

def launch_for(batch, problem, **kwargs):
    """A GPU-marked problem for CPU tensors, and the launch arguments the op would build (logits poisoned)."""
    args = batch.args()
    problem = dataclasses.replace(problem, device_type="cuda")
    out = poisoned_out(args, problem.num_columns)
    visible = torch.full((args[0].shape[0],), -7, dtype=torch.int32)
    launch = ScoreArgs(*args[:6], out, visible, problem.num_columns, problem.compress_ratio, 1 / 11.5)
    return problem, launch

def test_forced_aiter_runs_the_library_op_with_the_calls_arguments(rocm_platform, rng):
    calls = []
    install(rocm_platform, aiter_scorer_standin(calls))
    rocm_platform.setenv("QSA_AITER_BACKEND", "aiter")
    batch = make_batch([900, 301, 1700], 1, head_dim=32, padded_rows=2, generator=rng)
    problem, launch = launch_for(batch, describe_call(*batch.args(), max_columns=400, phase="decode"))
    assert registries.SCORING.dispatch(problem, launch) == "aiter"
    assert calls == [dict(compress_ratio=4, num_columns=400, score_divisor=pytest.approx(11.5))]
    ref = reference_paged_mqa_logits(*batch.args()[:6], 4, 11.5, 400)
    assert_matches_reference(launch.logits, launch.visible, *ref, rtol=0, atol=0)

def test_flydsl_runs_in_place_with_the_calls_arguments(rocm_platform, rng):
    calls = []
    flydsl_ready(rocm_platform, calls)
    batch = make_batch([2100, 900], [30, 22], page_size=16, generator=rng)
    problem, launch = launch_for(batch, describe_call(*batch.args(), phase="prefill"))
    assert registries.SCORING.select(problem).chosen == "flydsl"
    assert registries.SCORING.dispatch(problem, launch) == "flydsl"
    assert calls == [dict(compress_ratio=4, divisor=pytest.approx(11.5), row_starts=None)]
    assert_matches_reference(launch.logits, launch.visible,
                             *reference_paged_mqa_logits(*batch.args()[:6], 4, 11.5), rtol=0, atol=0)

@pytest.mark.skipif(not interpreting(), reason="the fallback runs the tiled kernel on CPU tensors (interpreter)")
def test_a_failing_flydsl_kernel_is_marked_broken_and_the_triton_kernel_serves(rocm_platform, rng, caplog):
    flydsl_ready(rocm_platform, raises=True)
    batch = make_batch([2100, 900], [30, 22], page_size=16, generator=rng)
    problem, launch = launch_for(batch, describe_call(*batch.args(), phase="prefill"))
    with caplog.at_level(logging.WARNING, logger="qsa_aiter"):
        assert registries.SCORING.dispatch(problem, launch) == "tiled"
    assert any("kernel flydsl failed" in r.getMessage() and "marked broken" in r.getMessage()
               for r in caplog.records)
    assert "marked broken in this process: RuntimeError: stand-in FlyDSL launch failure" in registries.SCORING.explain(problem)
    assert_matches_reference(launch.logits, launch.visible,
                             *reference_paged_mqa_logits(*batch.args()[:6], 4, 11.5), rtol=1e-5, atol=1e-5)
    rocm_platform.setenv("QSA_AITER_STRICT", "1")
    dispatch.clear_broken()
    with pytest.raises(RuntimeError, match="stand-in FlyDSL launch failure"):
        registries.SCORING.dispatch(problem, launch)

# ---------------------------------------------------------------------------------------------------------------
# AITER's HIP top-k behind the qsa_block_topk contract
# ---------------------------------------------------------------------------------------------------------------

def test_aiter_block_topk_sorts_the_library_output_and_matches_the_oracle(rocm_platform, rng):
    calls = []
    install(rocm_platform, topk_standin(calls))
    logits = torch.randn(5, 300, generator=rng)
    visible = torch.tensor([300, 40, 16, 0, 299], dtype=torch.int32)
    # CPU tensors stand in for GPU ones here: only the device check is bypassed.
    rocm_platform.setattr(rocm, "aiter_topk_reasons", lambda device_type: [])
    out = torch.full((5, 16), -7, dtype=torch.int32)
    assert rocm.aiter_block_topk(logits, visible, 16, out=out) is out
    assert torch.equal(out, reference_block_topk(logits, visible, 16))
    assert calls == [dict(stable=True, num_rows=5, k=16, strides=(300, 1))]

def test_aiter_block_topk_gates(rocm_platform):
    logits, visible = torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32)
    assert rocm.aiter_topk_reasons("cpu") == ["needs ROCm GPU tensors (logits are on cpu)"]
    with pytest.raises(RuntimeError, match="does not serve: needs ROCm GPU tensors"):
        rocm.aiter_block_topk(logits, visible, 4)
    with pytest.raises(ValueError, match="`visible`"):
        rocm.aiter_block_topk(logits, visible[:1], 4)
    with pytest.raises(TypeError, match="`block_topk`"):
        rocm.aiter_block_topk(logits, visible, 4.0)
    install(rocm_platform, topk_standin([], stable=False))
    reasons = rocm.aiter_topk_reasons("cuda")
    assert len(reasons) == 1 and "no stable= argument" in reasons[0]
    rocm.reset()
    install(rocm_platform, topk_standin([]))
    assert rocm.aiter_topk_reasons("cuda") == []

def test_selection_uses_aiter_topk_only_when_the_aiter_path_is_forced(rocm_platform, rng):
    """``qsa_block_topk`` and the top-k step of ``qsa_select_paged_tokens`` rank with AITER's HIP top-k when
    ``QSA_AITER_BACKEND=aiter`` and it can run (the stand-in here); otherwise the library's own top-k ranks."""
    calls = []
    install(rocm_platform, topk_standin(calls))
    rocm_platform.setattr(rocm, "aiter_topk_reasons", lambda device_type: [])  # CPU tensors stand in for ROCm ones
    logits = torch.randn(3, 200, generator=rng)
    visible = torch.tensor([200, 150, 9], dtype=torch.int32)
    assert torch.equal(qsa_aiter.qsa_block_topk(logits, visible, 16), reference_block_topk(logits, visible, 16))
    assert calls == []
    rocm_platform.setenv("QSA_AITER_BACKEND", "aiter")
    assert torch.equal(qsa_aiter.qsa_block_topk(logits, visible, 16), reference_block_topk(logits, visible, 16))
    assert len(calls) == 1
    # Selection with the AITER path forced: AITER's scorer (its stand-in) and its top-k; the tokens equal those of
    # the library's own path.
    batch = make_batch([900, 700], [2, 1], page_size=16, dtype=torch.bfloat16, generator=rng)
    rocm_platform.delenv("QSA_AITER_BACKEND")
    expected = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 64, 4)
    assert len(calls) == 1
    scorer_calls = []
    install(rocm_platform, aiter_scorer_standin(scorer_calls))
    rocm_platform.setattr(rocm, "_rocm_gpu_reasons", lambda problem: [])  # CPU tensors stand in for ROCm ones
    rocm_platform.setenv("QSA_AITER_BACKEND", "aiter")
    assert torch.equal(qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 64, 4), expected)
    assert len(calls) == 2 and len(scorer_calls) == 1
    # QSA_AITER_TOPK_BACKEND=aiter asks for AITER's top-k alone (the scorer is the library's own).
    rocm_platform.delenv("QSA_AITER_BACKEND")
    rocm_platform.setenv("QSA_AITER_TOPK_BACKEND", "aiter")
    assert torch.equal(qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 64, 4), expected)
    assert len(calls) == 3 and len(scorer_calls) == 1

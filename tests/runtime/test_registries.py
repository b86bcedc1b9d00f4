"""The op families' registries (``runtime/registries.py``) through the one dispatch mechanism: the top-k, expansion
and writer candidates with their reasons (the native top-k's on this machine included), forcing by
``QSA_AITER_TOPK_BACKEND``, ``explain_selection``, and the fallback past a failing kernel (marked broken, or raised
with ``QSA_AITER_STRICT=1``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.cache import writer
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import expand, topk
from qsa_aiter.kernels.selection.reference import reference_block_topk, reference_expand_block_indices
from qsa_aiter.runtime import dispatch, registries, tuned
from qsa_aiter.runtime import native_topk as native_topk_runtime
from qsa_aiter.runtime.jit import cuda_driver, hiprtc, native
from qsa_aiter.runtime.settings import ConfigurationError
from qsa_aiter.tools.workloads import make_batch
from qsa_aiter.tools import topk_tuning


def _batch(rng):
    batch = make_batch([900, 700], [2, 1], page_size=16, head_dim=32, dtype=torch.bfloat16, generator=rng)
    return batch.args()[:6]


def _scores(rng):
    logits = torch.randn(3, 200, generator=rng)
    return logits, torch.tensor([200, 150, 9], dtype=torch.int32)


def test_every_family_has_a_universal_last_resort():
    for registry in (registries.SCORING, registries.TOPK, registries.EXPAND, registries.WRITER):
        assert registry.candidates["torch"].ranks and registry.candidates["torch"].spec is None
    assert registries.TOPK.order(registries.TopkProblem("cpu", 1, 8, 2))[0] == (
        "aiter", "native", "native_grid", "triton", "torch")


def test_explain_selection_reports_scoring_and_topk(rng):
    args = _batch(rng)
    report = qsa_aiter.explain_selection(*args, 64, 4)
    assert report.startswith("qsa_select_paged_tokens: 3 rows in 1 chunk(s)")
    assert "\nqsa_paged_mqa_logits: " in report and "  plan (arch " in report
    assert "\nblock top-k: rows=3 " in report and "expansion fused" in report
    assert "* triton: serves" in report  # the interpreter runs the Triton kernels on this CPU machine
    assert "- aiter: used only when the AITER path is asked for" in report
    assert "- native: needs CUDA GPU tensors (tensors are on cpu)" in report
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


# ---------------------------------------------------------------------------------------------------------------
# The native CUDA top-k
# ---------------------------------------------------------------------------------------------------------------

ON_CUDA_TORCH = torch.version.cuda is not None and torch.cuda.is_available()


@pytest.mark.skipif(ON_CUDA_TORCH, reason="the reasons of a machine without a CUDA build of torch")
def test_native_topk_reasons_on_this_machine():
    on_cpu = registries.TOPK.reasons("native", registries.TopkProblem("cpu", 3, 200, 16))
    assert on_cpu[0] == "needs CUDA GPU tensors (tensors are on cpu)"
    on_gpu = registries.TOPK.reasons("native", registries.TopkProblem("cuda", 36, 32768, 512, fused=True))
    assert "needs CUDA GPU tensors" not in " ".join(on_gpu)
    if torch.version.hip is None:
        assert f"needs a CUDA or ROCm build of torch (torch {torch.__version__} has neither)" in on_gpu
    for reason in native.unavailable_reasons("cuda"):
        assert reason in on_gpu
    if cuda_driver.driver_reason():
        assert any("libcuda.so.1" in r for r in on_gpu)


def test_native_topk_reasons_from_the_platform(monkeypatch, request):
    """On a CUDA build of torch: the compute capability and the shared memory of the device decide."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    problem = registries.TopkProblem("cuda", 36, 32768, 512)
    # This host's own facts (NVRTC and the driver library) follow the platform's; without NVRTC its reason names
    # where it looked (torch/lib among them), so the platform's reasons are compared whole, not searched for "torch".
    host = native.unavailable_reasons("cuda")
    volta = dataclasses.replace(Platform.named("sm_90"), arch="sm_70", capability=(7, 0))
    found = native_topk_runtime.native_topk_reasons(problem, volta, None)
    assert found == ["needs an NVIDIA GPU of compute capability 8.0 or newer (the device is sm_70)", *host]
    found = native_topk_runtime.native_topk_reasons(problem, Platform.named("sm_90"), None)
    assert found == host
    small = dataclasses.replace(Platform.named("sm_90"), shared_memory_per_block=4096)
    assert any("bytes of shared memory per block" in r for r in native_topk_runtime.native_topk_reasons(problem, small, None))
    # On a ROCm build: gfx942 / gfx950 serve (hipRTC and the HIP runtime are this host's facts), others do not.
    monkeypatch.setattr(torch.version, "hip", "7.0")
    hiprtc.forget()  # searched anew as on a ROCm build, and forgotten again after (the search is per process)
    request.addfinalizer(hiprtc.forget)
    hip_host = native.unavailable_reasons("hip")
    for arch in ("gfx942", "gfx950"):
        assert native_topk_runtime.native_topk_reasons(problem, Platform.named(arch), None) == hip_host
    gfx90a = dataclasses.replace(Platform.named("gfx942"), arch="gfx90a")
    assert native_topk_runtime.native_topk_reasons(problem, gfx90a, None)[0] == (
        "needs an NVIDIA GPU (sm_80+) or an AMD gfx942 or gfx950 (the device is gfx90a)")


@pytest.mark.skipif(ON_CUDA_TORCH, reason="forcing where the native top-k cannot run")
def test_forcing_the_native_topk_where_it_cannot_run_names_its_reasons(monkeypatch, rng):
    logits, visible = _scores(rng)
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "native")
    with pytest.raises(ValueError, match=r"native: needs CUDA GPU tensors \(tensors are on cpu\)") as info:
        qsa_aiter.qsa_block_topk(logits, visible, 16)
    assert "forced by QSA_AITER_TOPK_BACKEND" in str(info.value) and "no candidate serves this call" in str(info.value)
    with pytest.raises(ValueError, match="native: needs CUDA GPU tensors"):
        qsa_aiter.qsa_select_paged_tokens(*_batch(rng), 64, 4)


def test_the_native_topk_serves_where_its_host_facts_allow():
    """The native candidate's reasons are its host facts alone (no opt-in): ``auto`` takes it wherever it can run."""
    assert registries.TOPK.candidates["native"].reasons is native_topk_runtime.native_topk_reasons


def _native_serving(monkeypatch, launch=None):
    """The native candidate as if it served here (its reasons empty), with ``launch`` where given."""
    candidate = registries.TOPK.candidates["native"]
    changes = {"reasons": lambda problem, platform, settings: []}
    if launch is not None:
        changes["launch"] = launch
    monkeypatch.setitem(registries.TOPK.candidates, "native", dataclasses.replace(candidate, **changes))
    dispatch.clear_decisions()


def test_native_serving_is_ranked_before_triton(monkeypatch, rng):
    _native_serving(monkeypatch)
    report = qsa_aiter.explain_selection(*_batch(rng), 64, 4)
    assert "order aiter > native > native_grid > triton > torch" in report
    assert "* native: serves" in report and "- triton: serves, but an earlier candidate is preferred" in report


def test_a_failing_native_topk_falls_back_and_is_marked_broken(monkeypatch, rng, caplog):
    """With the Triton top-k broken, a native top-k that fails to compile is marked broken too and torch serves; when
    forced, its error is raised."""
    logits, visible = _scores(rng)
    monkeypatch.setattr(topk, "launch", _failing)
    _native_serving(monkeypatch, launch=lambda problem, args, settings: _failing())
    with caplog.at_level("WARNING", logger="qsa_aiter"):
        assert torch.equal(qsa_aiter.qsa_block_topk(logits, visible, 16), reference_block_topk(logits, visible, 16))
    assert "topk kernel native failed" in caplog.text
    report = registries.TOPK.explain(registries.TopkProblem("cpu", 3, 200, 16))
    assert "- native: marked broken in this process: RuntimeError: simulated launch failure" in report
    dispatch.clear_broken()
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "native")
    with pytest.raises(RuntimeError, match="simulated launch failure"):
        qsa_aiter.qsa_block_topk(logits, visible, 16)


def test_the_native_topk_fuses_the_expansion(monkeypatch, rng):
    """A fused step through the native candidate: one ``native_block_topk`` call given the expansion (stood in for
    by the torch paths here), equal to selection through the other candidates."""
    seen = []

    def stand_in(logits, visible, out, block_topk, settings=None, plan=None, expand_into=None):
        seen.append((tuple(out.shape), expand_into is not None))
        registries.torch_block_topk(logits, visible, block_topk, out)
        positions, context_lens, token_to_request, tokens_out, ratio, token_topk = expand_into
        registries.torch_expand_block_indices(out, positions, context_lens, token_to_request, ratio, token_topk,
                                              tokens_out)

    args = _batch(rng)
    want = qsa_aiter.qsa_select_paged_tokens(*args, 64, 4)
    _native_serving(monkeypatch)
    monkeypatch.setattr(native_topk_runtime, "native_block_topk", stand_in)
    monkeypatch.setattr(registries, "expand_tokens", _failing)  # no second launch
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "native")
    assert torch.equal(qsa_aiter.qsa_select_paged_tokens(*args, 64, 4), want) and seen == [((3, 16), True)]


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


def test_explain_prints_the_native_plan_and_that_rocm_has_no_clusters(monkeypatch, without_shipped_topk_rows):
    """A chosen native top-k's plan is in the report: on gfx942 one workgroup per row, with the reason no cluster is
    planned; on sm_90 a cluster of a long row."""
    _native_serving(monkeypatch)
    problem = registries.TopkProblem("cuda", 1, 65536, 512, fused=True)
    monkeypatch.setattr(dispatch, "platform_of", lambda problem: Platform.named("gfx942"))
    report = registries.TOPK.explain(problem)
    assert "* native: serves" in report
    assert "plan (arch gfx942): topk_rows_512 (uncached" in report  # 64 KB of LDS: the row does not fit
    assert report.endswith("clusters compiled out on ROCm (one workgroup per row)")
    monkeypatch.setattr(dispatch, "platform_of", lambda problem: Platform.named("sm_90"))
    assert "plan (arch sm_90): topk_cluster" in registries.TOPK.explain(problem)


# ---------------------------------------------------------------------------------------------------------------
# The measured top-k: the tuned top-k table chooses the candidate and the native plan
# ---------------------------------------------------------------------------------------------------------------

TOPK_HEADER = "arch,block_topk,rows,columns,candidate,plan,us,measured,source\n"
#: The shape of 16x4 @ 32K and 64x1 @ 32K: 64 rows of 8192 columns, 512 groups kept.
WIDE = registries.TopkProblem("cuda", 64, 8192, 512, fused=True)


def _topk_table(monkeypatch, tmp_path, *rows: str) -> None:
    path = tmp_path / "topk.csv"
    path.write_text(TOPK_HEADER + "".join(row + "\n" for row in rows))
    monkeypatch.setenv("QSA_AITER_TUNED_CONFIG", str(path))
    tuned.reload()  # the file may have been read before, with other rows
    dispatch.clear_decisions()


def _on(monkeypatch, platform: Platform) -> None:
    """Decisions made as on ``platform`` (a GPU this machine does not have), the native top-k serving."""
    _native_serving(monkeypatch)
    monkeypatch.setattr(dispatch, "platform_of", lambda problem: platform)


AMPERE = dataclasses.replace(Platform.named("sm_90"), arch="sm_80", capability=(8, 0))


def test_without_topk_rows_the_table_order_and_the_heuristic_plan(monkeypatch, without_shipped_topk_rows):
    _on(monkeypatch, Platform.named("sm_90"))
    decision = registries.TOPK.select(WIDE)
    assert decision.chosen == "native" and decision.rule == "table order"
    choice = native_topk_runtime.plan_choice(64, 8192, 512, Platform.named("sm_90"))
    assert choice.row is None and choice.plan == native_topk_runtime.kernels.choose_plan(64, 8192, 512,
                                                                                            Platform.named("sm_90"))
    assert "choose_plan's heuristic (no measured native row for arch sm_90, block_topk 512)" in \
        registries.TOPK.explain(WIDE)


def test_the_shipped_rows_choose_the_top_k_by_measurement(monkeypatch):
    """The shipped top-k table (configs/topk.csv, measured on an H100) holds sm_90 rows of every tuned candidate at
    64 rows of 8192 columns (16x4 and 64x1 @ 32K, where the table order once chose a slower top-k): the choice there
    is the fastest measured row's candidate."""
    _on(monkeypatch, Platform.named("sm_90"))
    table = tuned.load_tables(())
    fastest = {name: min(row.us for row in table.measured_topk("sm_90", name, WIDE))
               for name in topk_tuning.tuned_candidates()}
    decision = registries.TOPK.select(WIDE)
    assert decision.rule.startswith("measurement") and decision.chosen == min(fastest, key=fastest.get)


def test_the_triton_topk_measured_faster_runs_and_explain_says_why(monkeypatch, tmp_path, without_shipped_topk_rows):
    """The shape of 16x4 and 64x1 @ 32K: the Triton top-k measured faster than every native plan there."""
    _topk_table(monkeypatch, tmp_path, "sm_90,512,64,8192,triton,,11.2,1,t",
                "sm_90,512,64,8192,native,rows_256,16.7,1,t", "sm_90,512,64,8192,native,cluster4,17.4,1,t")
    _on(monkeypatch, Platform.named("sm_90"))
    assert registries.TOPK.select(WIDE).chosen == "triton"
    report = registries.TOPK.explain(WIDE)
    assert ("chosen by measurement: triton 11.20 us < native rows_256 16.70 us (tuned rows at 64 rows x 8192 columns, "
            "arch sm_90)") in report
    assert "- native: serves, but triton measured faster (native rows_256 16.70 us against triton 11.20 us)" in report
    assert "* triton: serves" in report


def test_the_native_topk_measured_faster_runs_its_measured_plan(monkeypatch, tmp_path, without_shipped_topk_rows):
    _topk_table(monkeypatch, tmp_path, "sm_90,512,64,8192,triton,,11.2,1,t",
                "sm_90,512,64,8192,native,rows_256,9.7,1,my sweep", "sm_90,512,64,8192,native,cluster4,17.4,1,t")
    _on(monkeypatch, Platform.named("sm_90"))
    assert registries.TOPK.select(WIDE).chosen == "native"
    report = registries.TOPK.explain(WIDE)
    assert "chosen by measurement: native rows_256 9.70 us < triton 11.20 us" in report
    assert "- triton: serves, but native measured faster (triton 11.20 us against native rows_256 9.70 us)" in report
    # The plan is the measured one, not the heuristic's cluster of four (which it would be here).
    assert native_topk_runtime.kernels.choose_plan(64, 8192, 512, Platform.named("sm_90")).variant.cluster == 4
    choice = native_topk_runtime.plan_choice(64, 8192, 512, Platform.named("sm_90"))
    assert choice.plan == native_topk_runtime.kernels.plans_for(64, 8192, 512, Platform.named("sm_90"))["rows_256"]
    assert ("plan (arch sm_90): topk_rows_256 (cached, " in report
            and "measured plan rows_256: 9.70 us at 64 rows x 8192 columns (my sweep)" in report)


def test_the_measured_plan_reaches_the_launch(monkeypatch, tmp_path, without_shipped_topk_rows):
    """``native_block_topk`` without a plan launches ``plan_choice``'s (the launch is stopped where it would build
    the call's arguments, on this machine without a GPU)."""
    _topk_table(monkeypatch, tmp_path, "sm_90,512,64,8192,native,rows_512,9.7,1,t")
    seen = []

    def stop(logits, visible, out, block_topk, plan, *rest):
        seen.append(plan)
        raise RuntimeError("stop")

    monkeypatch.setattr(native_topk_runtime, "native_topk_call", stop)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(Platform, "of", classmethod(lambda cls, device: Platform.named("sm_90")))
    logits = torch.zeros(64, 8192)
    with pytest.raises(RuntimeError, match="stop"):
        native_topk_runtime.native_block_topk(logits, torch.zeros(64, dtype=torch.int32),
                                              torch.empty(64, 512, dtype=torch.int32), 512)
    assert seen[0].variant.name == "topk_rows_512" and seen[0].cached


def test_a_forced_topk_beats_the_table(monkeypatch, tmp_path, without_shipped_topk_rows):
    _topk_table(monkeypatch, tmp_path, "sm_90,512,64,8192,triton,,11.2,1,t",
                "sm_90,512,64,8192,native,rows_256,16.7,1,t")
    _on(monkeypatch, Platform.named("sm_90"))
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "native")
    decision = registries.TOPK.select(WIDE)
    assert decision.chosen == "native" and decision.forced and not decision.rule
    report = registries.TOPK.explain(WIDE)
    assert "forced by QSA_AITER_TOPK_BACKEND" in report and "chosen by measurement" not in report
    assert "measured plan rows_256" in report  # forcing the candidate keeps its measured plan


@pytest.mark.parametrize("case", ["other-bucket", "not-measured", "other-arch", "other-block-topk", "triton-only"])
def test_topk_measurements_that_do_not_compare_leave_the_table_order(monkeypatch, tmp_path, case, without_shipped_topk_rows):
    rows = {"triton": "sm_90,512,64,8192,triton,,11.2,1,t", "native": "sm_90,512,64,8192,native,rows_256,16.7,1,t"}
    if case == "other-bucket":  # the native rows were measured at 16x the rows: not the bucket Triton was timed at
        rows["native"] = "sm_90,512,1024,8192,native,rows_256,16.7,1,t"
    elif case == "not-measured":
        rows["native"] = "sm_90,512,64,8192,native,rows_256,16.7,0,not measured: a report"
    elif case == "other-arch":
        rows = {name: row.replace("sm_90", "sm_80") for name, row in rows.items()}
    elif case == "other-block-topk":
        rows = {name: row.replace(",512,", ",256,") for name, row in rows.items()}
    elif case == "triton-only":
        del rows["native"]
    _topk_table(monkeypatch, tmp_path, *rows.values())
    _on(monkeypatch, Platform.named("sm_90"))
    decision = registries.TOPK.select(WIDE)
    assert decision.chosen == "native" and decision.rule == "table order", decision.rule


def test_a_measured_plan_that_does_not_serve_the_shape_is_passed_over(monkeypatch, tmp_path, without_shipped_topk_rows):
    """On compute capability 8.0 no cluster plan exists: the fastest measured plan that serves runs, and explain
    names the faster one passed over."""
    _topk_table(monkeypatch, tmp_path, "sm_80,512,64,8192,triton,,11.2,1,t",
                "sm_80,512,64,8192,native,cluster4,9.0,1,t", "sm_80,512,64,8192,native,rows_256,10.7,1,t")
    _on(monkeypatch, AMPERE)
    assert registries.TOPK.select(WIDE).chosen == "native"
    report = registries.TOPK.explain(WIDE)
    assert "chosen by measurement: native rows_256 10.70 us < triton 11.20 us" in report
    assert ("measured plan rows_256: 10.70 us at 64 rows x 8192 columns (t); faster but not serving 64 x 8192 on "
            "sm_80: cluster4 9.00 us") in report


def test_with_no_measured_plan_serving_the_heuristic_runs_and_explain_says_so(monkeypatch, tmp_path, without_shipped_topk_rows):
    """Only cluster plans measured, on a GPU without clusters: the native top-k runs choose_plan's plan, has no
    measurement to compare, and the table order stands."""
    _topk_table(monkeypatch, tmp_path, "sm_80,512,64,8192,triton,,11.2,1,t",
                "sm_80,512,64,8192,native,cluster4,9.0,1,t")
    _on(monkeypatch, AMPERE)
    decision = registries.TOPK.select(WIDE)
    assert decision.chosen == "native" and decision.rule == "table order"
    choice = native_topk_runtime.plan_choice(64, 8192, 512, AMPERE)
    assert choice.row is None and choice.plan == native_topk_runtime.kernels.choose_plan(64, 8192, 512, AMPERE)
    assert ("choose_plan's heuristic: none of the plans measured at 64 rows x 8192 columns (cluster4 9.00 us) serves "
            "64 x 8192 on sm_80 (those that do: rows_256, rows_512, rows_512_uncached)"
            ) in registries.TOPK.explain(WIDE)


def test_rows_no_wider_than_block_topk_take_the_trivial_plan(monkeypatch, tmp_path, without_shipped_topk_rows):
    _topk_table(monkeypatch, tmp_path, "sm_90,512,64,8192,native,rows_256,9.7,1,t")
    choice = native_topk_runtime.plan_choice(64, 512, 512, Platform.named("sm_90"))
    assert choice.row is None and choice.plan == native_topk_runtime.kernels.trivial_plan()
    assert choice.note == "the trivial plan (no row is wider than block_topk)"


def test_explain_selection_names_the_measured_topk(monkeypatch, tmp_path, rng, without_shipped_topk_rows):
    """``explain_selection`` at 16 requests x 4 rows @ 32K (a chunk of 64 rows x 8192 columns)."""
    batch = make_batch([32 * 1024] * 16, 4, page_size=64, head_dim=32, dtype=torch.bfloat16, generator=rng)
    _topk_table(monkeypatch, tmp_path, "sm_90,512,64,8192,triton,,11.2,1,t",
                "sm_90,512,64,8192,native,rows_256,16.7,1,t")
    _on(monkeypatch, Platform.named("sm_90"))
    report = qsa_aiter.explain_selection(*batch.args()[:6], 2048, 4)
    assert "\nblock top-k: rows=64 columns=8192 block_topk=512" in report
    assert "chosen by measurement: triton 11.20 us < native rows_256 16.70 us" in report


def test_qsa_block_topk_runs_the_candidate_measured_faster(monkeypatch, tmp_path, rng, without_shipped_topk_rows):
    """Dispatch itself (on CPU tensors, decisions as on an sm_90): the Triton top-k where it measured faster, the
    native one (stood in for) where it did."""
    logits = torch.randn(64, 1024, generator=rng)
    visible = torch.full((64,), 1000, dtype=torch.int32)
    ran = []
    _native_serving(monkeypatch, launch=lambda problem, args, settings: (
        ran.append("native"), registries.torch_block_topk(args.logits, args.visible, args.block_topk, args.groups)))
    monkeypatch.setattr(dispatch, "platform_of", lambda problem: Platform.named("sm_90"))
    want = reference_block_topk(logits, visible, 64)
    for native_us, expected in ((16.7, []), (9.7, ["native"])):
        _topk_table(monkeypatch, tmp_path, "sm_90,64,64,1024,triton,,11.2,1,t",
                    f"sm_90,64,64,1024,native,rows_256,{native_us},1,t")
        ran.clear()
        assert torch.equal(qsa_aiter.qsa_block_topk(logits, visible, 64), want)
        assert ran == expected


def test_a_rewritten_table_takes_effect_after_reload(monkeypatch, tmp_path, without_shipped_topk_rows):
    """``tuned.reload()`` (what the tuner calls after writing rows) forgets the decisions made from the old rows."""
    _topk_table(monkeypatch, tmp_path, "sm_90,512,64,8192,triton,,11.2,1,t",
                "sm_90,512,64,8192,native,rows_256,16.7,1,t")
    _on(monkeypatch, Platform.named("sm_90"))
    assert registries.TOPK.select(WIDE).chosen == "triton"
    (tmp_path / "topk.csv").write_text(TOPK_HEADER + "sm_90,512,64,8192,triton,,11.2,1,t\n"
                                       "sm_90,512,64,8192,native,rows_256,9.7,1,t\n")
    assert registries.TOPK.select(WIDE).chosen == "triton"  # read once per process
    tuned.reload()
    assert registries.TOPK.select(WIDE).chosen == "native"

"""Dispatch: the registry table, phase inference, the environment switches, fallback past failing kernels, logging."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels import platform as platform_module
from qsa_aiter.runtime import dispatch, registries
from qsa_aiter.runtime.dispatch import NO_PLAN_HINT
from qsa_aiter.runtime.log import reset_log_once
from qsa_aiter.runtime.settings import get_settings
from qsa_aiter.kernels.platform import interpreting
from qsa_aiter.kernels.scoring.problem import MAX_DECODE_ROWS, PHASES
from qsa_aiter.kernels.scoring.base import example_problem
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.tools.workloads import make_batch

from helpers import KERNELS, PREFERRED, check_call, force_backend, poisoned_out, reference_of

needs_interpreter = pytest.mark.skipif(
    not interpreting(), reason="Triton kernels serve CPU tensors only under TRITON_INTERPRET=1"
)


def batch_for(phase: str, gen, **kw):
    """Small batches (head_dim 32) of each phase's shape, with the hints the engine passes."""
    kw.setdefault("head_dim", 32)
    if phase == "prefill":
        return make_batch([400, 700], [6, 5], generator=gen, **kw), dict(phase="prefill")
    if phase == "verify":
        return make_batch([400, 700, 300], 4, generator=gen, **kw), dict(max_query_len=4)
    return make_batch([400, 700, 300], 1, generator=gen, **kw), dict(phase=phase, max_query_len=1)


# ---------------------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------------------


def test_candidates_and_table():
    assert set(registries.SCORING.candidates) == ({"tiled", "stacked", "keys_major", "rowwise", "native", "torch"}
                                        | set(registries.ROCM_CANDIDATES))
    for name, cand in registries.SCORING.candidates.items():
        assert cand.name == name and cand.description
    assert registries.KV_DTYPES == ("bf16", "fp8", "fp4")  # every cache dtype has its rows
    for kv in registries.KV_DTYPES:
        for block in (16, 64):
            for phase in PHASES:
                order = registries.SCORING_TABLE[(kv, block, phase)]
                assert [n for n in order if n not in registries.ROCM_CANDIDATES][0] == PREFERRED[phase]
                assert "rowwise" in order, "the row-wise scorer is the universal fallback"
                assert order[-1] == "torch"
                assert set(order) <= set(registries.SCORING.candidates)
    assert registries.SCORING_FALLBACK_ORDER[0] == "rowwise"


def test_page_size_outside_the_table_uses_the_fallback_order(rng):
    batch = make_batch([500, 300], 2, head_dim=32, page_size=32, generator=rng)
    problem = describe_call(*batch.args(), max_query_len=2)
    order, note = registries.SCORING.order(problem)
    assert order == registries.SCORING_FALLBACK_ORDER and "no registry row" in note
    text = qsa_aiter.explain(*batch.args(), max_query_len=2)
    assert "no registry row" in text
    if interpreting():
        assert qsa_aiter.selected_kernel(*batch.args(), max_query_len=2) == "rowwise"


# ---------------------------------------------------------------------------------------------------------------
# Phase inference (host facts only)
# ---------------------------------------------------------------------------------------------------------------

INFERENCE = [
    # (id, contexts, rows per request, padded rows, kwargs, stacked switch, expected phase)
    ("257-rows-prefill", [4000], 257, 0, {}, "1", "prefill"),
    ("mixed-prefill-and-decode", [4000, 500, 600], [255, 1, 1], 0, {}, "1", "prefill"),
    ("more-rows-than-limit-beats-max-query-len", [4000], 300, 0, dict(max_query_len=1), "1", "prefill"),
    ("256-rows-is-not-prefill", [900] * 64, 4, 0, {}, "1", "verify"),
    ("max-query-len-4", [400, 700, 300], 4, 0, dict(max_query_len=4), "1", "verify"),
    ("max-query-len-2-stacked-off", [400, 700, 300], 2, 0, dict(max_query_len=2), "0", "verify"),
    ("one-row-each-draft", [400, 700, 300], 1, 0, dict(max_query_len=1), "1", "draft"),
    ("one-row-each-decode", [400, 700, 300], 1, 0, dict(max_query_len=1), "0", "decode"),
    ("no-hint-rows-over-requests", [400, 700, 300], 3, 0, {}, "1", "verify"),
    ("no-hint-one-row-each", [400, 700, 300], 1, 0, {}, "1", "draft"),
    ("no-hint-one-row-each-stacked-off", [400, 700, 300], 1, 0, {}, "0", "decode"),
    ("max-query-len-1-wins-over-row-count", [400, 700], 1, 4, dict(max_query_len=1), "1", "draft"),
    ("padding-without-hint-counts-as-rows", [400, 700], 1, 4, {}, "1", "verify"),
    ("hint-wins", [4000], 300, 0, dict(phase="decode"), "1", "decode"),
    ("hint-verify-for-one-row", [400], 1, 0, dict(phase="verify"), "0", "verify"),
]


@pytest.mark.parametrize("contexts,rows,padded,kwargs,stacked,expected", [c[1:] for c in INFERENCE],
                         ids=[c[0] for c in INFERENCE])
def test_phase_inference(monkeypatch, rng, contexts, rows, padded, kwargs, stacked, expected):
    monkeypatch.setenv("ATOM_QSA_STACKED_DECODE_SCORER", stacked)
    batch = make_batch(contexts, rows, head_dim=16, page_size=64, padded_rows=padded, generator=rng)
    problem = describe_call(*batch.args(), **kwargs)
    assert problem.phase == expected, problem.phase_source
    if "phase" in kwargs:
        assert problem.phase_source == "hint"
    else:
        assert problem.phase_source.startswith("inferred: ")
    if expected == "prefill" and "phase" not in kwargs:
        assert f"> {MAX_DECODE_ROWS}" in problem.phase_source


def test_dispatch_reads_no_device_memory():
    """Validation and selection work on meta tensors, which hold no data at all."""
    meta = dict(device="meta")
    args = (torch.empty(36, 4, 128, dtype=torch.bfloat16, **meta),
            torch.empty(600, 64, 1, 128, dtype=torch.bfloat16, **meta),
            torch.empty(9, 64, dtype=torch.int32, **meta), torch.empty(36, dtype=torch.int32, **meta),
            torch.empty(36, dtype=torch.int32, **meta), torch.empty(9, dtype=torch.int32, **meta))
    problem = describe_call(*args, max_query_len=4)
    assert problem.phase == "verify" and problem.device_type == "meta"
    decision = registries.SCORING.select(problem)
    assert decision.order == ("stacked", "keys_major", "rowwise", "native", "aiter", "torch")
    for name in ("stacked", "keys_major", "rowwise"):
        assert "tensors are on meta" in " ".join(decision.rejected[name]), "Triton kernels do not serve meta tensors"
    assert decision.chosen == "torch"
    assert "meta" in qsa_aiter.explain(*args, max_query_len=4)
    # The hints' checks read shapes only.
    with pytest.raises(ValueError, match="phase"):
        describe_call(*args, phase="decode", max_query_len=4)


# ---------------------------------------------------------------------------------------------------------------
# The kernel chosen per phase, and the switches that change it
# ---------------------------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("phase", PHASES)
def test_preferred_kernel_per_phase(rng, phase):
    batch, hints = batch_for(phase, rng)
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == PREFERRED[phase]
    # The same batches without the phase hint (where the shape says it) pick the same kernel.
    if phase in ("verify", "draft"):
        assert qsa_aiter.selected_kernel(*batch.args()) == PREFERRED[phase]


@needs_interpreter
@pytest.mark.parametrize("phase", ["verify", "draft"])
def test_stacked_switch_off_sends_verify_and_draft_to_rowwise(monkeypatch, rng, phase):
    batch, hints = batch_for(phase, rng)
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "stacked"
    monkeypatch.setenv("ATOM_QSA_STACKED_DECODE_SCORER", "0")
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "rowwise"
    assert "disabled by ATOM_QSA_STACKED_DECODE_SCORER=0" in qsa_aiter.explain(*batch.args(), **hints)
    check_call(batch.args(), **hints)
    monkeypatch.setenv("ATOM_QSA_STACKED_DECODE_SCORER", "1")
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "stacked"


@pytest.mark.parametrize("name", KERNELS + ("torch",))
@pytest.mark.parametrize("phase", PHASES)
def test_backend_forces_one_kernel_for_every_phase(monkeypatch, rng, phase, name):
    batch, hints = batch_for(phase, rng)
    problem = describe_call(*batch.args(), **hints)
    if registries.SCORING.reasons(name, problem):
        pytest.skip(f"{name} does not serve {problem.summary()}")
    force_backend(monkeypatch, name)
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == name
    text = qsa_aiter.explain(*batch.args(), **hints)
    assert "forced by QSA_AITER_BACKEND" in text and f"* {name}: serves" in text
    monkeypatch.setenv("QSA_AITER_BACKEND", "auto")
    assert "forced" not in qsa_aiter.explain(*batch.args(), **hints)


@pytest.mark.parametrize(
    "name,shape,why",
    [("stacked", dict(heads=3), "head count"), ("stacked", dict(head_dim=96), "head_dim"),
     ("tiled", dict(head_dim=96), "head_dim")],
)
def test_forced_kernel_that_cannot_serve_raises_its_reason(monkeypatch, rng, name, shape, why):
    batch = make_batch([500, 300], 2, page_size=16, generator=rng, **{"head_dim": 32, **shape})
    args = batch.args()
    force_backend(monkeypatch, name)
    assert qsa_aiter.selected_kernel(*args) is None
    out = poisoned_out(args)
    before = out.clone()
    with pytest.raises(ValueError) as info:
        qsa_aiter.qsa_paged_mqa_logits(*args, out=out)
    message = str(info.value)
    assert f"- {name}:" in message and why in message and "no candidate serves" in message
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))


# ---------------------------------------------------------------------------------------------------------------
# Failing kernels: strict raises, otherwise marked broken, logged once, next candidate runs
# ---------------------------------------------------------------------------------------------------------------


class SimulatedFailure(RuntimeError):
    pass


@pytest.fixture
def failing(monkeypatch):
    """``failing(name)`` makes candidate ``name`` raise on launch; returns the list of its calls."""
    calls: list = []

    def install(name: str) -> list:
        def run(problem, args, settings):
            calls.append(problem)
            raise SimulatedFailure(f"simulated launch failure of {name}\nsecond line of the error")

        scoring = registries.SCORING.candidates
        monkeypatch.setitem(scoring, name, dataclasses.replace(scoring[name], launch=run))
        return calls

    yield install
    dispatch.clear_broken()


@needs_interpreter
def test_strict_raises_a_kernel_failure(monkeypatch, rng, failing):
    batch, hints = batch_for("verify", rng)
    calls = failing("stacked")
    monkeypatch.setenv("QSA_AITER_STRICT", "1")
    with pytest.raises(SimulatedFailure):
        qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)
    assert len(calls) == 1
    assert not dispatch._broken, "strict mode does not mark kernels broken"
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "stacked"


@needs_interpreter
def test_failure_marks_broken_logs_once_and_falls_back(monkeypatch, rng, failing, caplog):
    batch, hints = batch_for("verify", rng)
    calls = failing("stacked")
    check_call(batch.args(), **hints)  # served by the next candidate, correctly
    assert len(calls) == 1
    assert len(dispatch._broken) == 1
    (key, message), = dispatch._broken.items()
    assert key[:2] == ("scoring", "stacked") and "simulated launch failure of stacked" in message
    assert "second line" not in message, "the reason is the first line of the error"
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "keys_major"  # the next in the verify order
    assert "marked broken in this process" in qsa_aiter.explain(*batch.args(), **hints)
    # Again: the broken kernel is not tried again, and the warning is not repeated.
    check_call(batch.args(), **hints)
    assert len(calls) == 1
    warnings = [r for r in caplog.records if r.name == "qsa_aiter" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "stacked" in warnings[0].getMessage() and "marked broken" in warnings[0].getMessage()
    # Another specialisation (head count) is not affected.
    other = make_batch([400, 700], 4, heads=8, head_dim=32, generator=rng)
    assert qsa_aiter.selected_kernel(*other.args(), max_query_len=4) == "stacked"
    dispatch.clear_broken()
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "stacked"


@needs_interpreter
def test_failures_fall_through_every_candidate(monkeypatch, rng, failing):
    batch, hints = batch_for("verify", rng)
    failing("stacked")
    failing("keys_major")
    calls = failing("rowwise")
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)
    ref_logits, ref_visible = reference_of(batch.args())
    assert torch.equal(visible, ref_visible) and torch.equal(logits, ref_logits)  # the torch reference ran
    assert len(calls) == 3 and {k[1] for k in dispatch._broken} == {"stacked", "keys_major", "rowwise"}


@needs_interpreter
def test_forced_kernel_failure_is_raised_even_when_not_strict(monkeypatch, rng, failing):
    batch, hints = batch_for("decode", rng)
    failing("rowwise")
    force_backend(monkeypatch, "rowwise")
    with pytest.raises(SimulatedFailure):
        qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)


# ---------------------------------------------------------------------------------------------------------------
# Logging of dispatch decisions
# ---------------------------------------------------------------------------------------------------------------


def _dispatch_records(caplog):
    return [r for r in caplog.records if r.name == "qsa_aiter" and r.levelno == logging.INFO
            and "candidates" in r.getMessage()]


def test_info_level_logs_each_dispatch_decision_once(monkeypatch, rng, caplog):
    monkeypatch.setenv("QSA_AITER_LOG_LEVEL", "info")
    reset_log_once()
    batch, hints = batch_for("decode", rng, head_dim=16)
    chosen = qsa_aiter.selected_kernel(*batch.args(), **hints)
    for _ in range(3):
        qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)
    records = _dispatch_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert f"* {chosen}: serves" in records[0].getMessage()
    assert "phase decode (hint)" in records[0].getMessage()
    # A new decision (another phase) is logged too, once.
    other, other_hints = batch_for("draft", rng, head_dim=16)
    for _ in range(2):
        qsa_aiter.qsa_paged_mqa_logits(*other.args(), **other_hints)
    assert len(_dispatch_records(caplog)) == 2


def test_warning_level_does_not_log_dispatch(monkeypatch, rng, caplog):
    monkeypatch.setenv("QSA_AITER_LOG_LEVEL", "warning")
    batch, hints = batch_for("decode", rng, head_dim=16)
    qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)
    assert not _dispatch_records(caplog)


def test_switching_to_info_logs_a_decision_already_made(monkeypatch, rng, caplog):
    batch, hints = batch_for("decode", rng, head_dim=16)
    qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)  # default level: warning
    monkeypatch.setenv("QSA_AITER_LOG_LEVEL", "info")
    qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)
    assert len(_dispatch_records(caplog)) == 1


def test_reset_log_once_logs_the_decision_again(monkeypatch, rng, caplog):
    monkeypatch.setenv("QSA_AITER_LOG_LEVEL", "info")
    batch, hints = batch_for("decode", rng, head_dim=16)
    qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)
    reset_log_once()
    qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)
    assert len(_dispatch_records(caplog)) == 2


# ---------------------------------------------------------------------------------------------------------------
# explain()
# ---------------------------------------------------------------------------------------------------------------


@needs_interpreter
def test_explain_names_the_choice_and_the_others_reasons(rng):
    batch, hints = batch_for("verify", rng)
    text = qsa_aiter.explain(*batch.args(), **hints)
    assert "phase verify (inferred: max_query_len=4" in text
    assert "order stacked > keys_major > rowwise > native > aiter > torch" in text
    assert "* stacked: serves" in text
    assert "- rowwise: serves, but an earlier candidate is preferred" in text
    assert "- torch: serves, but an earlier candidate is preferred" in text

    odd = make_batch([500, 300], 4, heads=3, head_dim=32, generator=rng)
    text = qsa_aiter.explain(*odd.args(), max_query_len=4)
    assert "- stacked: needs a power-of-two head count >= 4 (got 3)" in text
    assert "* rowwise: serves" in text

    odd = make_batch([500, 300], 4, heads=4, head_dim=96, generator=rng)
    text = qsa_aiter.explain(*odd.args(), phase="prefill")
    assert "order flydsl > tiled > rowwise > aiter > torch" in text
    assert "- tiled: needs a power-of-two head_dim >= 16 (got 96)" in text
    assert "* rowwise: serves" in text


def test_explain_says_why_the_torch_path_has_no_plan(monkeypatch, rng):
    """Where the torch reference serves (CPU tensors without the interpreter, or forced) the report ends by saying
    that there is no launch plan and where the Triton kernels' plans are shown, rather than just stopping."""
    batch, hints = batch_for("verify", rng)
    force_backend(monkeypatch, "torch")
    text = qsa_aiter.explain(*batch.args(), **hints)
    assert text.splitlines()[-1] == f"  plan: none (torch is not one of this project's Triton kernels; {NO_PLAN_HINT})"
    assert "TRITON_INTERPRET=1" in NO_PLAN_HINT
    # The top-k family prints no plans for any candidate: no such line there.
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", "torch")
    assert "plan:" not in registries.TOPK.explain(registries.TopkProblem("cpu", 3, 200, 16))


# ---------------------------------------------------------------------------------------------------------------
# Measured dispatch: the tuned tables' timings choose among the serving kernels
# ---------------------------------------------------------------------------------------------------------------


def _timed_rows(path, problem, arch: str, times: dict, buckets: dict | None = None, measured: int = 1):
    """A tuned table with one row per kernel of ``times`` (µs) for ``problem``'s key, at ``problem``'s buckets or
    ``buckets[kernel]``; returns ``path`` as a string."""
    lines = ["arch,kernel,kv_dtype,page_size,heads,head_dim,rows,context,us,measured,source"]
    rows, context = problem.num_tokens, problem.num_columns * problem.compress_ratio
    for kernel, us in times.items():
        r, c = (buckets or {}).get(kernel, (rows, context))
        lines.append(f"{arch},{kernel},{problem.kv_dtype},{problem.block_size},{problem.num_heads},"
                     f"{problem.head_dim},{r},{c},{us},{measured},test")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@needs_interpreter
@pytest.mark.parametrize("times, expected", [
    (dict(rowwise=20.0, stacked=12.0), "stacked"),
    (dict(rowwise=10.0, stacked=12.0), "rowwise"),
    (dict(rowwise=12.0, stacked=12.0), "rowwise"),  # a tie keeps the table order
])
def test_decode_takes_the_kernel_measured_fastest_at_its_bucket(monkeypatch, rng, tmp_path, times, expected):
    batch, hints = batch_for("decode", rng)
    problem = describe_call(*batch.args(), **hints)
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "rowwise"  # no measurement: the table order
    monkeypatch.setenv("QSA_AITER_TUNED_CONFIG", _timed_rows(tmp_path / "t.csv", problem, "cpu", times))
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == expected
    text = qsa_aiter.explain(*batch.args(), **hints)
    ordered = sorted(times, key=lambda k: (times[k], k != "rowwise"))
    assert ("chosen by measurement: " + " < ".join(f"{k} {times[k]:.2f} us" for k in ordered)) in text
    other = ordered[1]
    assert (f"- {other}: serves, but {expected} measured faster ({other} {times[other]:.2f} us against {expected} "
            f"{times[expected]:.2f} us)") in text
    check_call(batch.args(), **hints)


@needs_interpreter
@pytest.mark.parametrize("case", ["other-bucket", "one-kernel", "not-measured", "other-arch", "switch-off", "forced"])
def test_measurements_that_do_not_compare_leave_the_table_order(monkeypatch, rng, tmp_path, case):
    batch, hints = batch_for("decode", rng)
    problem = describe_call(*batch.args(), **hints)
    times, kw = dict(rowwise=20.0, stacked=12.0), {}
    if case == "other-bucket":  # stacked's only row is at 16x the rows: not the bucket rowwise was timed at
        kw["buckets"] = dict(stacked=(problem.num_tokens * 16, problem.num_columns * problem.compress_ratio))
    elif case == "one-kernel":
        times = dict(stacked=12.0)
    elif case == "not-measured":
        kw["measured"] = 0
    path = _timed_rows(tmp_path / "t.csv", problem, "sm_90" if case == "other-arch" else "cpu", times, **kw)
    monkeypatch.setenv("QSA_AITER_TUNED_CONFIG", path)
    if case == "switch-off":
        monkeypatch.setenv("ATOM_QSA_STACKED_DECODE_SCORER", "0")
    if case == "forced":
        force_backend(monkeypatch, "rowwise")
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "rowwise"
    text = qsa_aiter.explain(*batch.args(), **hints)
    assert "chosen by measurement" not in text
    assert ("chosen by table order" in text) != (case == "forced")


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("page", [16, 64])
def test_shipped_h200_rows_send_decode_to_the_stacked_scorer(kv, page):
    """The shipped sm_90 rows time the row-wise and stacked scorers at the same decode buckets; the stacked one
    measured faster at each, so decode there runs it."""
    dtype = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp4": torch.float4_e2m1fn_x2}[kv]
    settings = get_settings()
    for rows, context in ((128, 100352), (64, 32768), (16, 100352), (1, 268288)):
        problem = example_problem(kv_dtype=kv, cache_dtype=dtype, block_size=page, num_tokens=rows,
                                  num_requests=rows, num_columns=context // 4, phase="decode", max_query_len=1)
        chosen = registries.SCORING.measured_choice(problem, ["rowwise", "stacked"], platform_module.Platform.named("sm_90"),
                                          settings)
        assert chosen is not None and chosen[0] == "stacked", (rows, context, chosen)
        assert f"tuned rows at {rows} rows x {context} tokens, arch sm_90" in chosen[1]


# ---------------------------------------------------------------------------------------------------------------
# Plain CPU without the interpreter: the torch candidate serves
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", PHASES)
def test_cpu_without_interpreter_uses_torch(monkeypatch, phase):
    monkeypatch.setattr(platform_module, "interpreting", lambda: False)  # as triton_runs_on sees it
    problem = dataclasses.replace(example_problem(), device_type="cpu", phase=phase)
    for name in KERNELS:
        reasons = registries.SCORING.reasons(name, problem)
        assert any("TRITON_INTERPRET" in r for r in reasons), (name, reasons)
    assert registries.SCORING.reasons("torch", problem) == []
    decision = registries.SCORING.select(problem)
    assert decision.chosen == "torch"
    assert "TRITON_INTERPRET" in registries.SCORING.explain(problem)


def test_cpu_without_interpreter_runs_the_reference(monkeypatch, rng):
    monkeypatch.setattr(platform_module, "interpreting", lambda: False)  # as triton_runs_on sees it
    batch, hints = batch_for("verify", rng)
    assert qsa_aiter.selected_kernel(*batch.args(), **hints) == "torch"
    out = poisoned_out(batch.args())
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*batch.args(), out=out, **hints)
    ref_logits, ref_visible = reference_of(batch.args())
    assert logits is out and torch.equal(visible, ref_visible) and torch.equal(logits, ref_logits)


def test_cuda_problem_is_served_by_the_triton_kernels():
    """Reasons are host facts: a CUDA problem of the model's shape is served by every kernel."""
    for phase in PHASES:
        problem = example_problem(phase=phase)
        for name in KERNELS:
            assert registries.SCORING.reasons(name, problem) == [], name
        assert registries.SCORING.select(problem).chosen == PREFERRED[phase]


# ---------------------------------------------------------------------------------------------------------------
# Bad environment values surface at the first call
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "var,value",
    [("ATOM_QSA_STACKED_DECODE_SCORER", "maybe"), ("QSA_AITER_BACKEND", "cutlass"), ("QSA_AITER_STRICT", "2"),
     ("QSA_AITER_LOG_LEVEL", "verbose")],
)
def test_bad_environment_value_fails_the_call(monkeypatch, rng, var, value):
    batch, hints = batch_for("decode", rng, head_dim=16)
    monkeypatch.setenv(var, value)
    out = poisoned_out(batch.args())
    before = out.clone()
    for fn in (qsa_aiter.selected_kernel, qsa_aiter.explain, qsa_aiter.qsa_paged_mqa_logits):
        kwargs = dict(hints, out=out) if fn is qsa_aiter.qsa_paged_mqa_logits else hints
        with pytest.raises(ValueError) as info:
            fn(*batch.args(), **kwargs)
        assert var in str(info.value) and repr(value) in str(info.value)
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))
    monkeypatch.delenv(var)
    qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **hints)


def test_decision_memo_is_bounded():
    base = example_problem()
    for tokens in range(1, 2001):
        registries.SCORING.select(dataclasses.replace(base, num_tokens=tokens, num_columns=64 * tokens, table_width=tokens))
    assert len(registries.SCORING._decisions) < 2000

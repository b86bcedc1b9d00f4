"""The Triton scoring kernels against the torch reference, on CPU tensors under the Triton interpreter.

Each kernel is forced with ``QSA_AITER_BACKEND`` and skipped through the candidate's own ``reasons()`` (the check the
registry makes) where it does not serve. Shapes are small: the interpreter runs every program in Python.
Tolerance is rtol = atol = 1e-5: under the interpreter the kernels upcast to fp32, like the reference.
"""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.runtime import registries
from qsa_aiter.kernels.platform import interpreting
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.tools.workloads import make_batch

from helpers import (
    BACKENDS, KERNELS, assert_matches_reference, check_call, check_forced, check_forced_call, force_backend,
    phase_batch, poisoned_out, reference_of, run_poisoned, skip_unless_serves, visible_bits,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PAGES = (16, 64)
PHASES = ("prefill", "verify", "draft", "decode")
#: Page sizes that divide no key tile (1, 5, 33, 100) besides the table's (16, 64): "any page size works".
ODD_PAGES = (1, 5, 33, 100)
#: (dtype, page size) pairs of the matrix: every page size in bf16, the table's in fp16 too. The default set keeps
#: both table pages and one odd page in bf16 and one page in fp16; the rest is marked slow (CI runs it).
DTYPE_PAGES = [("bf16", p) for p in sorted(PAGES + ODD_PAGES)] + [("fp16", p) for p in PAGES]
DEFAULT_DTYPE_PAGES = {("bf16", 16), ("bf16", 64), ("bf16", 5), ("fp16", 16)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("dtype,page_size", [
    pytest.param(d, p, id=f"{d}-page{p}", marks=() if (d, p) in DEFAULT_DTYPE_PAGES else pytest.mark.slow)
    for d, p in DTYPE_PAGES])
def test_kernel_matrix(monkeypatch, rng, dtype, page_size, phase, backend):
    batch, hints = phase_batch(phase, page_size, rng, dtype=DTYPES[dtype])
    # Page sizes outside the registry table take the universal fallback order (rowwise first) under `auto`.
    check_forced(monkeypatch, backend, batch, hints, label=f"{backend}/{phase}/{dtype}/page{page_size}",
                 auto_is_preferred=interpreting() and page_size in registries.BLOCK_SIZES)


@pytest.mark.parametrize("backend", KERNELS + ("auto",))
@pytest.mark.parametrize("phase", PHASES)
def test_repeated_calls_are_bitwise_identical(monkeypatch, rng, phase, backend):
    batch, hints = phase_batch(phase, 16, rng)
    args = batch.args()
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    first, vis1 = run_poisoned(args, **hints)
    second, vis2 = run_poisoned(args, **hints)
    assert torch.equal(vis1, vis2)
    assert torch.equal(visible_bits(first, vis1), visible_bits(second, vis2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", PAGES)
def test_model_shape_verify(monkeypatch, rng, page_size, backend):
    """The model's indexer shape (4 heads, head_dim 128, R 4) in an MTP verify batch."""
    batch = make_batch([600, 1000, 300], 4, heads=4, head_dim=128, page_size=page_size, generator=rng)
    args = batch.args()
    hints = dict(max_query_len=4)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_call(args, **hints)


# ---------------------------------------------------------------------------------------------------------------
# Edge cases, each for every kernel that serves it (and the automatic choice).
# ---------------------------------------------------------------------------------------------------------------

CHOICES = KERNELS + ("auto",)


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("page_size", PAGES)
def test_padded_rows_and_rows_that_see_nothing(monkeypatch, rng, page_size, backend):
    # Request 0 has a context shorter than R (sees nothing); request 1 is a prefill from position 0 (its first
    # R-1 rows see nothing); padded rows (-1, -1) are appended.
    batch = make_batch([3, 9, 700], [2, 9, 4], page_size=page_size, head_dim=64, padded_rows=3, generator=rng)
    args = batch.args()
    hints = dict(max_query_len=batch.max_query_len)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    _, visible = check_call(args, **hints)
    assert visible[:2].tolist() == [0, 0]  # context 3 < R
    assert visible[2:5].tolist() == [0, 0, 0]  # positions 0..2 < R - 1
    assert visible[5:11].tolist() == [1, 1, 1, 1, 2, 2]
    assert visible[-3:].tolist() == [0, 0, 0]  # padded rows


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("page_size", PAGES)
def test_uneven_contexts(monkeypatch, rng, page_size, backend):
    batch = make_batch([5, 37, 1999, 261, 1023], [1, 2, 3, 1, 2], page_size=page_size, head_dim=64, generator=rng)
    args = batch.args()
    hints = dict(max_query_len=batch.max_query_len)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_call(args, **hints)


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("page_size", PAGES)
def test_bad_page_ids_score_minus_inf(monkeypatch, rng, page_size, backend):
    batch = make_batch([600, 1000, 500], 3, page_size=page_size, head_dim=64, generator=rng)
    q, cache, table, *rest = batch.args()
    pages = cache.shape[0]
    table = table.clone()
    bad = [(0, 1, -3), (1, 0, pages), (1, 2, pages + 100), (2, 0, -(2**31)), (2, 1, 2**31 - 1)]
    for r, slot, value in bad:
        table[r, slot] = value
    args = (q, cache, table, *rest)
    hints = dict(max_query_len=3)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    logits, visible = check_call(args, **hints)
    for r, slot, _ in bad:
        for t in torch.nonzero(batch.token_to_request == r).flatten().tolist():
            lo, hi = slot * page_size, min((slot + 1) * page_size, int(visible[t]))
            if hi > lo:
                assert torch.isneginf(logits[t, lo:hi]).all(), f"row {t} page slot {slot} must be -inf"
    # A good page next to a bad one still scores.
    assert torch.isfinite(logits[0, :page_size]).all()


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("max_columns", [100, 1, 0])
def test_max_columns_below_capacity(monkeypatch, rng, max_columns, backend):
    batch = make_batch([900, 1500, 61], 4, page_size=16, head_dim=64, generator=rng)
    args = batch.args()
    capacity = batch.page_table.shape[1] * 16
    assert max_columns < capacity
    hints = dict(max_columns=max_columns, max_query_len=4)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    logits, visible = check_call(args, **hints)
    assert tuple(logits.shape) == (batch.q.shape[0], max_columns)
    assert int(visible.max()) <= max_columns


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("page_size,width", [(16, 21), (64, 7)])
def test_page_table_width_not_power_of_two(monkeypatch, rng, page_size, width, backend):
    batch = make_batch([500, 200, 900], [2, 1, 3], page_size=page_size, head_dim=64, table_width=width,
                       generator=rng)
    args = batch.args()
    hints = dict(max_query_len=3)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_call(args, **hints)
    # The same table as a column slice of a wider one: row stride != width.
    wide = torch.full((batch.page_table.shape[0], width + 6), 10**6, dtype=batch.page_table.dtype)
    wide[:, :width] = batch.page_table
    sliced = wide[:, :width]
    assert sliced.stride(0) != width
    args = (args[0], args[1], sliced, *args[3:])
    check_call(args, label="page table slice", **hints)


@pytest.mark.parametrize("backend", CHOICES)
def test_draft_rows_of_many_requests_share_a_tile(monkeypatch, rng, backend):
    ctx = [120, 1900, 333, 64, 1001, 777, 250, 1500, 17]
    batch = make_batch(ctx, 1, page_size=16, head_dim=64, generator=rng)
    args = batch.args()
    hints = dict(phase="draft", max_query_len=1)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_call(args, **hints)


@pytest.mark.parametrize("backend", CHOICES)
def test_prefill_chunk_of_short_requests_shares_a_tile(monkeypatch, rng, backend):
    batch = make_batch([40, 610, 130], [5, 7, 3], page_size=64, head_dim=64, generator=rng)
    args = batch.args()
    hints = dict(phase="prefill")
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_call(args, **hints)


@pytest.mark.parametrize("backend", CHOICES)
def test_rows_not_in_request_order(monkeypatch, rng, backend):
    batch = make_batch([500, 1200, 300, 900], [2, 3, 1, 2], page_size=16, head_dim=64, padded_rows=1,
                       generator=rng)
    perm = torch.randperm(batch.q.shape[0], generator=rng)
    args = (batch.q[perm].contiguous(), batch.compressed_k_cache, batch.page_table,
            batch.token_to_request[perm].contiguous(), batch.query_positions[perm].contiguous(), batch.context_lens)
    hints = dict(max_query_len=3)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_call(args, **hints)


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize(
    "heads,head_dim,page_size",
    [(8, 16, 16), (16, 32, 16), (1, 32, 16), (2, 32, 64), (4, 32, 32), (4, 32, 128), (4, 32, 1)],
    ids=lambda v: str(v),
)
def test_other_shapes(monkeypatch, rng, heads, head_dim, page_size, backend):
    """Head counts, head dims and page sizes besides the model's (page sizes outside the registry table too)."""
    ctx = [50, 90] if page_size == 1 else [500, 900]
    batch = make_batch(ctx, 2, heads=heads, head_dim=head_dim, page_size=page_size, generator=rng)
    args = batch.args()
    hints = dict(max_query_len=2)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_call(args, **hints)


@pytest.mark.parametrize("backend", ("tiled", "auto"))
def test_prefill_beyond_the_decode_row_limit(monkeypatch, rng, backend):
    """More than 256 rows without a hint is prefill; several row tiles, one of them spanning two requests."""
    batch = make_batch([1200, 400], [170, 130], head_dim=32, page_size=64, generator=rng)
    args = batch.args()
    force_backend(monkeypatch, backend)
    problem = skip_unless_serves(backend, args)
    assert problem.phase == "prefill"
    if interpreting():
        assert qsa_aiter.selected_kernel(*args) == "tiled"
    check_call(args)


@pytest.mark.parametrize("heads", [3, 6])
def test_heads_not_power_of_two(monkeypatch, rng, heads):
    batch = make_batch([640, 1300], 4, heads=heads, head_dim=64, page_size=16, generator=rng)
    args = batch.args()
    hints = dict(max_query_len=4)
    problem = describe_call(*args, **hints)
    assert problem.phase == "verify"
    reasons = registries.SCORING.reasons("stacked", problem)
    assert any("head count" in r and str(heads) in r for r in reasons), reasons
    # Automatic dispatch falls back to the row-wise scorer and stays correct.
    assert qsa_aiter.selected_kernel(*args, **hints) in ("rowwise", "torch")
    if interpreting():
        assert qsa_aiter.selected_kernel(*args, **hints) == "rowwise"
    check_call(args, label="auto", **hints)
    # The tiled kernel has no head-count restriction.
    force_backend(monkeypatch, "tiled")
    if not registries.SCORING.reasons("tiled", problem):
        check_call(args, label="tiled", **hints)
    # Forcing the stacked scorer is an error that gives its reason.
    force_backend(monkeypatch, "stacked")
    out = poisoned_out(args)
    before = out.clone()
    with pytest.raises(ValueError, match="head count"):
        qsa_aiter.qsa_paged_mqa_logits(*args, out=out, **hints)
    assert torch.equal(out.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("phase", ["prefill", "verify", "decode"])
@pytest.mark.parametrize("head_dim", [96, 80])
def test_head_dim_not_power_of_two(monkeypatch, rng, head_dim, phase):
    rows = 1 if phase == "decode" else 3  # decode has one row per request (a hint the shapes contradict is refused)
    batch = make_batch([530, 1000], rows, heads=4, head_dim=head_dim, page_size=64, generator=rng)
    args = batch.args()
    hints = dict(phase=phase, max_query_len=rows)
    problem = describe_call(*args, **hints)
    for name in ("tiled", "stacked"):
        reasons = registries.SCORING.reasons(name, problem)
        assert any("head_dim" in r and str(head_dim) in r for r in reasons), (name, reasons)
    if interpreting():
        # Automatic dispatch falls back to the row-wise scorer, whatever the phase.
        assert qsa_aiter.selected_kernel(*args, **hints) == "rowwise"
    else:
        force_backend(monkeypatch, "rowwise")
        skip_unless_serves("rowwise", args, **hints)
    check_call(args, **hints)


@pytest.mark.parametrize("backend", CHOICES)
def test_out_written_in_place_and_row_starts_zeroed(monkeypatch, rng, backend):
    batch = make_batch([500, 900], 3, page_size=16, head_dim=64, generator=rng)
    args = batch.args()
    hints = dict(max_query_len=3)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    tokens, columns = batch.q.shape[0], batch.page_table.shape[1] * 16
    # `out` is a view with a row stride larger than its width: the margin must stay untouched.
    storage = torch.full((tokens, columns + 24), float("nan"))
    out = storage[:, 3 : 3 + columns]
    margin_before = torch.cat([storage[:, :3], storage[:, 3 + columns :]], dim=1).clone()
    row_starts = torch.full((tokens,), 77, dtype=torch.int64)
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args, row_starts=row_starts, out=out, **hints)
    assert logits is out
    assert logits.data_ptr() == storage.data_ptr() + 3 * storage.element_size()
    assert row_starts.tolist() == [0] * tokens
    margin_after = torch.cat([storage[:, :3], storage[:, 3 + columns :]], dim=1)
    assert torch.equal(margin_after.view(torch.int32), margin_before.view(torch.int32))
    ref_logits, ref_visible = reference_of(args)
    assert_matches_reference(logits, visible, ref_logits, ref_visible)
    # Without `out` the op allocates fp32 [tokens, columns].
    fresh, vis = qsa_aiter.qsa_paged_mqa_logits(*args, row_starts=row_starts.to(torch.int32), **hints)
    assert fresh.dtype == torch.float32 and tuple(fresh.shape) == (tokens, columns)
    assert_matches_reference(fresh, vis, ref_logits, ref_visible)


@pytest.mark.parametrize("backend", CHOICES)
def test_int64_index_tensors(monkeypatch, rng, backend):
    batch = make_batch([700, 1300, 222], [1, 4, 2], page_size=64, head_dim=64, padded_rows=1, generator=rng)
    q, cache, *idx = batch.args()[:6]
    table, t2r, pos, ctx = [t.long() for t in idx]
    # Page ids that only an int64 table can hold: truncated to 32 bits they would look valid (0 and 1).
    table[1, 1] = 2**40
    table[1, 2] = -(2**40) + 1
    hints = dict(max_query_len=4)
    logits, visible = check_forced_call(monkeypatch, backend, (q, cache, table, t2r, pos, ctx), **hints)
    assert torch.isneginf(logits[1:5, 64:128]).all()
    # Mixed index dtypes in one call.
    check_call((q, cache, batch.page_table, t2r, pos.int(), ctx), label="mixed index dtypes", **hints)


@pytest.mark.parametrize("backend", CHOICES)
@pytest.mark.parametrize("ratio,divisor", [(1, None), (8, 3.0), (4, 0.5)])
def test_compress_ratio_and_score_divisor(monkeypatch, rng, ratio, divisor, backend):
    batch = make_batch([150, 170 * ratio + 3], 2, page_size=64, head_dim=64, compress_ratio=ratio, generator=rng)
    args = batch.args()
    hints = dict(score_divisor=divisor, max_query_len=2)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    check_call(args, **hints)


@pytest.mark.parametrize("backend", CHOICES)
def test_request_id_out_of_range_sees_nothing(monkeypatch, rng, backend):
    batch = make_batch([700, 400], 2, page_size=16, head_dim=64, generator=rng)
    t2r = batch.token_to_request.clone()
    t2r[1] = 2  # == requests: not a valid request, like a padded row
    args = (batch.q, batch.compressed_k_cache, batch.page_table, t2r, batch.query_positions, batch.context_lens)
    hints = dict(max_query_len=2)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    _, visible = check_call(args, **hints)
    assert int(visible[1]) == 0


@pytest.mark.parametrize("backend", CHOICES)
def test_no_rows(monkeypatch, rng, backend):
    batch = make_batch([700], 0, page_size=16, head_dim=64, generator=rng)
    args = batch.args()
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, phase="decode")
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args, phase="decode")
    assert tuple(logits.shape) == (0, batch.page_table.shape[1] * 16)
    assert tuple(visible.shape) == (0,)


@pytest.mark.parametrize("backend", CHOICES)
def test_no_requests_only_padded_rows(monkeypatch, rng, backend):
    q = torch.randn(3, 4, 32, generator=rng).to(torch.bfloat16)
    cache = torch.randn(4, 16, 1, 32, generator=rng).to(torch.bfloat16)
    none = torch.full((3,), -1, dtype=torch.int32)
    args = (q, cache, torch.zeros(0, 5, dtype=torch.int32), none, none.clone(), torch.zeros(0, dtype=torch.int32))
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, phase="decode")
    logits, visible = run_poisoned(args, phase="decode")
    assert visible.tolist() == [0, 0, 0] and tuple(logits.shape) == (3, 80)

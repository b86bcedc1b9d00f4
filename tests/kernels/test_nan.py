"""One NaN rule on every path (docs/kernels.md, "NaN"): a NaN in ``q[t]`` or in a key makes that (row, column) score
NaN (IEEE propagation through the per-head ReLU), the writer stores a key holding a NaN or an infinity so that it
dequantises to NaN (fp8: NaN scale and NaN codes; MXFP4: e8m0's NaN exponent 255 and zero codes), and selection
ranks a NaN score above ``+inf``, whatever its sign, NaNs among themselves by index, as ``torch.sort`` does."""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.cache.reference import write_reference
from qsa_aiter.kernels.quant.formats import dequantize_cache
from qsa_aiter.kernels.scoring.histogram import score_keys
from qsa_aiter.kernels.selection.reference import reference_block_topk, torch_block_topk
from qsa_aiter.ops.cache import qsa_write_index_cache
from qsa_aiter.tools.workloads import make_batch

from helpers import BACKENDS, force_backend, reference_of, run_poisoned, skip_unless_serves

NAN = float("nan")
CACHES = (None, "fp8", "fp4")


def _nan_batch(rng, cache, phase):
    """A small batch of ``phase`` with a NaN in head 2 of row 1's query and in column 5 of request 0 (written through
    the public writer, so quantised caches hold what the writer makes of it)."""
    if phase == "prefill":
        batch = make_batch([300, 200], [6, 5], heads=4, head_dim=64, page_size=16, cache=cache, generator=rng)
        hints = dict(phase="prefill")
    else:
        batch = make_batch([300, 200, 90], [2, 2, 2] if phase == "verify" else 1, heads=4, head_dim=64,
                           page_size=16, cache=cache, generator=rng)
        hints = dict(phase=phase, max_query_len=batch.max_query_len)
    q, kv, table = batch.args()[:3]
    q[1, 2, 7] = NAN
    keys = torch.randn(1, 64, generator=rng)
    keys[0, 11] = NAN
    slot = torch.tensor([int(table[0, 0]) * 16 + 5], dtype=torch.int32)
    qsa_write_index_cache(keys.to(torch.bfloat16), slot, kv, batch.k_scale)
    return batch.args(), dict(hints, **batch.kwargs())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", ("prefill", "verify", "decode"))
@pytest.mark.parametrize("cache", CACHES, ids=lambda c: c or "bf16")
def test_scores_propagate_nan_on_every_path(monkeypatch, rng, cache, phase, backend):
    args, hints = _nan_batch(rng, cache, phase)
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    logits, visible = run_poisoned(args, **hints)
    ref, ref_visible = reference_of(args, **hints)
    assert torch.equal(visible, ref_visible)
    cols = torch.arange(logits.shape[1])
    seen = cols[None, :] < visible[:, None].long()
    got_nan, want_nan = logits.isnan() & seen, ref.isnan() & seen
    assert int(want_nan[1].sum()) == int(visible[1]) > 0, "row 1 (NaN in q) must be NaN wherever it sees"
    rows_of_0 = (args[3] == 0) & (visible > 5)
    assert bool(want_nan[rows_of_0, 5].all()) and bool(rows_of_0.any()), "column 5 of request 0 must be NaN"
    assert torch.equal(got_nan, want_nan), f"{backend}: NaN at {got_nan.nonzero().tolist()} != " \
                                           f"{want_nan.nonzero().tolist()}"
    keep = seen & ~want_nan
    torch.testing.assert_close(logits[keep], ref[keep], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache,fp8_dtype", [("bf16", None), ("fp8", torch.float8_e4m3fn),
                                             ("fp8", torch.float8_e4m3fnuz), ("fp4", None)],
                         ids=["bf16", "fp8", "fp8_fnuz", "fp4"])
def test_writer_stores_nan_and_inf_keys_alike_on_both_paths(cache, fp8_dtype):
    keys = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
    keys[1, 40] = NAN
    keys[2, 99] = float("inf")
    keys[3, 0] = -NAN
    slots = torch.arange(4, dtype=torch.int32) * 3
    extra = {"fp8_dtype": fp8_dtype} if fp8_dtype else {}
    got, got_scale = qsa_aiter.allocate_index_cache(cache, 1, 16, 128, **extra)
    want, want_scale = qsa_aiter.allocate_index_cache(cache, 1, 16, 128, **extra)
    qsa_write_index_cache(keys.to(torch.bfloat16), slots, got, got_scale)  # the Triton writer (interpreted)
    write_reference(keys.to(torch.bfloat16), slots, want, want_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if cache == "bf16":
        return
    assert torch.equal(got_scale.view(torch.uint8), want_scale.view(torch.uint8))
    deq = dequantize_cache(got, got_scale)[0, slots.long(), 0]
    assert not deq[0].isnan().any()
    if cache == "fp8":
        assert got_scale.view(-1)[slots[1:].long()].isnan().all() and not got_scale.view(-1)[0].isnan()
        assert deq[1:].isnan().all(), "a key with a NaN or an infinity dequantises to NaN"
    else:
        exps = got_scale.view(torch.uint8).view(16, 4)
        assert exps[3, 1].item() == 255 and exps[6, 3].item() == 255 and exps[9, 0].item() == 255
        assert exps[3, 0].item() != 255, "only the block holding the NaN"
        assert deq[1, 32:64].isnan().all() and not deq[1, :32].isnan().any()


def _nan_logits(rng, tokens=5, columns=1400):
    logits = torch.randn(tokens, columns, generator=rng)
    logits[0, [7, 300, 1201]] = NAN
    logits[0, 900] = -NAN  # the sign of a NaN does not matter
    logits[0, 50] = float("inf")
    logits[1, ::3] = NAN  # more NaNs than the budget: the first by index
    logits[2, 600:] = NAN
    logits[3, 1000] = -NAN
    return logits


@pytest.mark.parametrize("backend", ("triton", "torch"))
def test_selection_ranks_nan_above_inf(monkeypatch, rng, backend):
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", backend)
    logits = _nan_logits(rng)
    visible = torch.tensor([1400, 1400, 1399, 1001, 64], dtype=torch.int32)
    want = reference_block_topk(logits, visible, 16)
    assert {7, 50, 300, 900, 1201} <= set(want[0].tolist())
    assert want[1].tolist() == list(range(0, 48, 3))
    assert 1000 in want[3].tolist()
    got = qsa_aiter.qsa_block_topk(logits, visible, 16)
    assert torch.equal(got, want)


def test_triton_topk_nan_through_both_candidate_paths(rng):
    """The lane-maxima floor and the column-block maxima (long rows) both keep NaN columns as candidates."""
    from qsa_aiter.kernels.selection import maxima, topk

    logits = _nan_logits(rng)
    visible = torch.tensor([1400, 1400, 1399, 1001, 64], dtype=torch.int32)
    want = reference_block_topk(logits, visible, 16)
    out = torch.full_like(want, -7)
    topk.launch(logits, visible, out, 16, topk.TopkConfig(capacity_factor=2, tile=128, chunk=64))
    assert torch.equal(out, want)
    block_max = torch.empty(maxima.maxima_shape(5, 1400, 16), dtype=torch.float32)
    maxima.launch(logits, visible, block_max, 16)
    out.fill_(-7)
    topk.launch(logits, visible, out, 16, block_maxima=block_max)
    assert torch.equal(out, want)
    torch_out = torch.empty_like(want)
    torch_block_topk(logits, visible, 16, torch_out)
    assert torch.equal(torch_out, want)


def test_histogram_keys_put_every_nan_above_inf():
    x = torch.tensor([float("inf"), NAN, -NAN, float("-inf"), -0.0, 0.0, -1.0, 1.0])
    k = score_keys(x).tolist()
    assert k[1] == k[2] > k[0] > k[7] > k[5] == k[4] > k[6] > k[3]


def _to_cuda(value):
    return value.cuda() if isinstance(value, torch.Tensor) else value


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", ("prefill", "verify", "decode"))
@pytest.mark.parametrize("cache", CACHES, ids=lambda c: c or "bf16")
def test_scores_propagate_nan_on_the_gpu(monkeypatch, rng, cache, phase, backend):
    """The GPU's ReLU (a max that keeps NaN) and MMAs give the NaN pattern of the reference, column for column."""
    args, hints = _nan_batch(rng, cache, phase)
    args = tuple(_to_cuda(a) for a in args)
    hints = {k: _to_cuda(v) for k, v in hints.items()}
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    logits, visible = run_poisoned(args, **hints)
    ref, _ = reference_of(args, **hints)
    seen = torch.arange(logits.shape[1], device="cuda")[None, :] < visible[:, None].long()
    assert int((ref.isnan() & seen).sum()) > 0
    assert torch.equal(logits.isnan() & seen, ref.isnan() & seen), backend


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ("native", "native_grid", "triton", "torch"))
@pytest.mark.parametrize("columns,budget", [(1400, 16), (40000, 512)])
def test_selection_ranks_nan_above_inf_on_the_gpu(monkeypatch, rng, backend, columns, budget):
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", backend)
    logits = _nan_logits(rng, columns=columns)
    visible = torch.tensor([columns, columns, columns - 1, 1001, 64], dtype=torch.int32)
    want = reference_block_topk(logits, visible, budget)
    got = qsa_aiter.qsa_block_topk(logits.cuda(), visible.cuda(), budget)
    assert torch.equal(got.cpu(), want), backend

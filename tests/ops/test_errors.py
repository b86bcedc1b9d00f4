"""Every public op (``qsa_aiter.__all__``) names itself and the argument at fault when it rejects a call: the error
starts with the name of the op the user called, whoever validates underneath (the selection ops and the explainers
validate through the scoring op's checks)."""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.selection.problem import MAX_BLOCK_TOPK, MAX_TOKEN_SLOTS
from qsa_aiter.tools.workloads import make_batch

R = 4


@pytest.fixture
def batch(rng):
    """2 requests x 2 rows, 4 heads, head_dim 32, page 16, bf16 cache (CPU)."""
    return make_batch([500, 300], 2, heads=4, head_dim=32, page_size=16, generator=rng)


def _scoring(b, **kw):
    return dict(q=b.q, compressed_k_cache=b.compressed_k_cache, page_table=b.page_table,
                token_to_request=b.token_to_request, query_positions=b.query_positions,
                context_lens=b.context_lens) | kw


def _select(b, token_topk=64, **kw):
    return _scoring(b, token_topk=token_topk, compress_ratio=R) | kw


def _logits(b):
    return torch.zeros(b.q.shape[0], 40), torch.full((b.q.shape[0],), 40, dtype=torch.int32)


def _groups(b):
    return torch.zeros(b.q.shape[0], 4, dtype=torch.int32)


def _expand(b, **kw):
    return dict(block_indices=_groups(b), query_positions=b.query_positions, context_lens=b.context_lens,
                token_to_request=b.token_to_request, compress_ratio=R, token_topk=16) | kw


def _write(b, keys=None, **kw):
    cache, scale = qsa_aiter.allocate_index_cache("fp8", 4, 16, 32)
    return dict(keys=torch.randn(3, 32) if keys is None else keys, slot_mapping=torch.arange(3), cache=cache,
                k_scale=scale) | kw


_SCORING_OPS = ("qsa_paged_mqa_logits", "explain", "selected_kernel")
_SELECTION_OPS = ("qsa_select_paged_tokens", "explain_selection")

# (op, fn(batch) -> keyword arguments, exception, the argument the message must name)
CASES = [
    *[(op, lambda b: _scoring(b, q=b.q.float()), TypeError, "q") for op in _SCORING_OPS],
    *[(op, lambda b: _scoring(b, max_query_len=99), ValueError, "max_query_len") for op in _SCORING_OPS],
    *[(op, lambda b: _scoring(b, phase="decode", max_query_len=2), ValueError, "phase") for op in _SCORING_OPS],
    *[(op, lambda b: _select(b, q=b.q[:, :, :16].contiguous()), ValueError, "compressed_k_cache")
      for op in _SELECTION_OPS],
    *[(op, lambda b: _select(b, page_table=b.page_table.float()), TypeError, "page_table") for op in _SELECTION_OPS],
    *[(op, lambda b: _select(b, token_topk=2**20), ValueError, "token_topk") for op in _SELECTION_OPS],
    *[(op, lambda b: _select(b, token_topk=10**6 * R), ValueError, "token_topk") for op in _SELECTION_OPS],
    *[(op, lambda b: _select(b, max_query_len=5), ValueError, "max_query_len") for op in _SELECTION_OPS],
    *[(op, lambda b: _select(b, phase="draft", max_query_len=2), ValueError, "phase") for op in _SELECTION_OPS],
    *[(op, lambda b: _select(b, max_seq_len=0), ValueError, "max_seq_len") for op in _SELECTION_OPS],
    *[(op, lambda b: _select(b, k_scale=torch.ones(1)), ValueError, "k_scale") for op in _SELECTION_OPS],
    ("qsa_block_topk", lambda b: dict(zip(("logits", "visible"), _logits(b)), block_topk=10**6), ValueError,
     "block_topk"),
    ("qsa_block_topk", lambda b: dict(zip(("logits", "visible"), _logits(b)), block_topk=MAX_BLOCK_TOPK + 1),
     ValueError, "block_topk"),
    ("qsa_block_topk", lambda b: dict(logits=_logits(b)[0].double(), visible=_logits(b)[1], block_topk=4),
     TypeError, "logits"),
    ("qsa_expand_block_indices", lambda b: _expand(b, token_topk=2**21), ValueError, "token_topk"),
    ("qsa_expand_block_indices", lambda b: _expand(b, compress_ratio=1, token_topk=MAX_TOKEN_SLOTS + 1), ValueError,
     "token_topk"),
    ("qsa_expand_block_indices", lambda b: _expand(b, block_indices=_groups(b).float()), TypeError,
     "block_indices"),
    ("qsa_write_index_cache", lambda b: _write(b, keys=torch.randn(3, 64)), ValueError, "keys"),
    ("qsa_write_index_cache", lambda b: _write(b, keys=torch.randn(3, 1, 16)), ValueError, "keys"),
    ("qsa_write_index_cache", lambda b: _write(b, slot_mapping=torch.arange(3.0)), TypeError, "slot_mapping"),
    ("qsa_write_index_cache", lambda b: _write(b, k_scale=None), TypeError, "k_scale"),
    ("allocate_index_cache", lambda b: dict(cache_format="int8", num_pages=2, page_size=16, head_dim=64), ValueError,
     "cache_format"),
    ("allocate_index_cache", lambda b: dict(cache_format=8, num_pages=2, page_size=16, head_dim=64), TypeError,
     "cache_format"),
    ("allocate_index_cache", lambda b: dict(cache_format="fp8", num_pages=2.0, page_size=16, head_dim=64), TypeError,
     "num_pages"),
    ("allocate_index_cache", lambda b: dict(cache_format="fp8", num_pages=2, page_size=0, head_dim=64), ValueError,
     "page_size"),
    ("allocate_index_cache", lambda b: dict(cache_format="fp4", num_pages=2, page_size=16, head_dim=48), ValueError,
     "head_dim"),
    ("allocate_index_cache", lambda b: dict(cache_format="fp8", num_pages=2, page_size=16, head_dim=64,
                                            device="gpu0"), ValueError, "device"),
    ("allocate_index_cache", lambda b: dict(cache_format="fp8", num_pages=2, page_size=16, head_dim=64,
                                            device="cuda:99"), ValueError, "device"),
    ("allocate_index_cache", lambda b: dict(cache_format="bf16", num_pages=2, page_size=16, head_dim=64,
                                            fp8_dtype=torch.float8_e4m3fn), ValueError, "fp8_dtype"),
    ("allocate_index_cache", lambda b: dict(cache_format="fp8", num_pages=2, page_size=16, head_dim=64,
                                            fp8_dtype=torch.bfloat16), TypeError, "fp8_dtype"),
    ("dequantize_cache", lambda b: dict(cache=[1.0]), TypeError, "cache"),
    ("dequantize_cache", lambda b: dict(cache=torch.zeros(2, 16, 1, 8)), TypeError, "cache"),
    ("dequantize_cache", lambda b: dict(cache=_write(b)["cache"]), TypeError, "scale"),
    ("dequantize_cache", lambda b: dict(cache=_write(b)["cache"], scale=torch.ones(4)), ValueError, "scale"),
    ("dequantize_cache", lambda b: dict(cache=b.compressed_k_cache, scale=torch.ones(4)), ValueError, "scale"),
    ("reference_paged_mqa_logits", lambda b: _scoring(b, compressed_k_cache=_write(b)["cache"]), ValueError,
     "k_scale"),
    ("reference_block_topk", lambda b: dict(zip(("logits", "visible"), _logits(b)), block_topk=0), ValueError,
     "block_topk"),
    ("reference_block_topk", lambda b: dict(logits=_logits(b)[0][0], visible=_logits(b)[1], block_topk=4),
     ValueError, "logits"),
    ("reference_expand_block_indices", lambda b: _expand(b, compress_ratio=0), ValueError, "compress_ratio"),
    ("reference_expand_block_indices", lambda b: _expand(b, token_topk=1.5), TypeError, "token_topk"),
]


@pytest.mark.parametrize("op,make,exc,name", CASES,
                         ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_an_error_names_the_op_called_and_the_argument(batch, op, make, exc, name):
    with pytest.raises(exc) as info:
        getattr(qsa_aiter, op)(**make(batch))
    message = str(info.value)
    assert message.startswith(f"{op}: "), f"the error must start with the op called ({op}): {message}"
    assert name in message, f"the error must name `{name}`: {message}"


def test_every_public_op_is_audited():
    """A public function added to ``qsa_aiter.__all__`` needs its cases here."""
    functions = {name for name in qsa_aiter.__all__ if callable(getattr(qsa_aiter, name)) and name != "jit"}
    assert functions == {case[0] for case in CASES}


def test_the_largest_budgets_run_and_a_larger_one_marks_no_kernel_broken(rng):
    """The bounds are what the kernels hold: a budget past them is refused before any kernel is chosen (under the
    interpreter a Triton top-k of 2**20 groups would fail and be marked broken for the process), and a budget at
    them runs on the path this process dispatches to, agreeing with the oracle."""
    from qsa_aiter.runtime import dispatch

    before = dict(dispatch._broken)
    logits = torch.randn(2, 2 * MAX_BLOCK_TOPK + 5, generator=rng)
    visible = torch.tensor([logits.shape[1], MAX_BLOCK_TOPK + 3], dtype=torch.int32)
    for block_topk in (2**20, MAX_BLOCK_TOPK + 1):
        with pytest.raises(ValueError, match="block_topk"):
            qsa_aiter.qsa_block_topk(logits, visible, block_topk)
    got = qsa_aiter.qsa_block_topk(logits, visible, MAX_BLOCK_TOPK)
    assert torch.equal(got, qsa_aiter.reference_block_topk(logits, visible, MAX_BLOCK_TOPK))
    groups = got[:, :16].contiguous()
    positions, contexts, requests = torch.tensor([9000, 70000]), torch.tensor([9001, 70001]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="token slots"):
        qsa_aiter.qsa_expand_block_indices(groups, positions, contexts, requests, 16, MAX_TOKEN_SLOTS)
    for ratio, budget in ((4, 4 * MAX_BLOCK_TOPK), (16, (MAX_TOKEN_SLOTS - 15) // 16 * 16)):
        tokens = qsa_aiter.qsa_expand_block_indices(groups, positions, contexts, requests, ratio, budget)
        assert torch.equal(tokens, qsa_aiter.reference_expand_block_indices(groups, positions, contexts, requests,
                                                                            ratio, budget))
    assert dispatch._broken == before


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ("auto", "triton", "native", "native_grid"))
def test_the_largest_budgets_compile_and_run_on_the_gpu(monkeypatch, rng, backend):
    """The bounds hold on the GPU's kernels too: the top-k at ``MAX_BLOCK_TOPK`` groups and the expansion at
    ``MAX_TOKEN_SLOTS`` slots compile, run (``QSA_AITER_STRICT=1``: no fallback hides a failure) and agree with the
    oracle."""
    monkeypatch.setenv("QSA_AITER_STRICT", "1")
    monkeypatch.setenv("QSA_AITER_TOPK_BACKEND", backend)
    logits = torch.randn(3, 2 * MAX_BLOCK_TOPK + 5, generator=rng)
    visible = torch.tensor([logits.shape[1], MAX_BLOCK_TOPK + 3, 700], dtype=torch.int32)
    got = qsa_aiter.qsa_block_topk(logits.cuda(), visible.cuda(), MAX_BLOCK_TOPK)
    assert torch.equal(got.cpu(), qsa_aiter.reference_block_topk(logits, visible, MAX_BLOCK_TOPK))
    groups = got[:, :16].contiguous()
    positions, contexts, requests = torch.tensor([9000, 70000, 20]), torch.tensor([9001, 70001, 21]), torch.arange(3)
    for ratio, budget in ((4, 4 * MAX_BLOCK_TOPK), (16, (MAX_TOKEN_SLOTS - 15) // 16 * 16)):
        tokens = qsa_aiter.qsa_expand_block_indices(groups, positions.cuda(), contexts.cuda(), requests.cuda(), ratio,
                                                    budget)
        assert torch.equal(tokens.cpu(), qsa_aiter.reference_expand_block_indices(
            groups.cpu(), positions, contexts, requests, ratio, budget))

"""Argument checks of ``qsa_paged_mqa_logits``: every bad argument is named in the error, and nothing is written."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
import torch

import qsa_aiter
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.tools.workloads import make_batch

from helpers import assert_matches_reference, reference_of

PAGE = 16


@pytest.fixture
def call(rng):
    """Keyword arguments of a valid call (CPU, bf16, 2 requests x 2 rows, 4 heads, head_dim 32, page 16)."""
    b = make_batch([500, 300], 2, heads=4, head_dim=32, page_size=PAGE, generator=rng)
    tokens, columns = b.q.shape[0], b.page_table.shape[1] * PAGE
    return dict(
        q=b.q, compressed_k_cache=b.compressed_k_cache, page_table=b.page_table,
        token_to_request=b.token_to_request, query_positions=b.query_positions, context_lens=b.context_lens,
        compress_ratio=4,
        out=torch.full((tokens, columns), float("nan")),
        row_starts=torch.full((tokens,), 123, dtype=torch.int32),
    )


def _noncontig_q(kw):
    q = kw["q"]
    return q.transpose(1, 2).contiguous().transpose(1, 2)


def _noncontig_cache(kw):
    """The cache with its last dim strided (every other element of a buffer twice as wide): a strided view is taken
    only with a dense last dim (tests/ops/test_strided_cache.py)."""
    c = kw["compressed_k_cache"]
    # Allocated as bytes: torch cannot create every cache dtype directly.
    wide = torch.zeros(c.shape[:3] + (2 * c.shape[3] * c.element_size(),), dtype=torch.uint8).view(c.dtype)
    return wide[..., ::2]


# (id, {argument: new value or fn(kwargs) -> value}, exception type, the argument the message must name)
BAD = [
    ("q-not-tensor", {"q": lambda kw: kw["q"].tolist()}, TypeError, "q"),
    ("q-2d", {"q": lambda kw: kw["q"][:, 0]}, ValueError, "q"),
    ("q-4d", {"q": lambda kw: kw["q"][None]}, ValueError, "q"),
    ("q-fp32", {"q": lambda kw: kw["q"].float()}, TypeError, "q"),
    ("q-fp8", {"q": lambda kw: kw["q"].to(torch.float8_e4m3fn)}, TypeError, "q"),
    ("q-noncontiguous", {"q": _noncontig_q}, ValueError, "q"),
    ("q-zero-heads", {"q": lambda kw: kw["q"][:, :0]}, ValueError, "q"),
    ("cache-not-tensor", {"compressed_k_cache": lambda kw: 3}, TypeError, "compressed_k_cache"),
    ("cache-fp32", {"compressed_k_cache": lambda kw: kw["compressed_k_cache"].float()}, TypeError,
     "compressed_k_cache"),
    ("cache-dtype-differs-from-q", {"compressed_k_cache": lambda kw: kw["compressed_k_cache"].half()}, TypeError,
     "compressed_k_cache"),
    ("cache-3d", {"compressed_k_cache": lambda kw: kw["compressed_k_cache"][:, :, 0]}, ValueError,
     "compressed_k_cache"),
    ("cache-2-kv-heads", {"compressed_k_cache": lambda kw: kw["compressed_k_cache"].repeat(1, 1, 2, 1)}, ValueError,
     "compressed_k_cache"),
    ("cache-head-dim", {"compressed_k_cache": lambda kw: kw["compressed_k_cache"][..., :16].contiguous()},
     ValueError, "compressed_k_cache"),
    ("cache-noncontiguous", {"compressed_k_cache": _noncontig_cache}, ValueError, "compressed_k_cache"),
    ("cache-no-pages", {"compressed_k_cache": lambda kw: kw["compressed_k_cache"][:0]}, ValueError,
     "compressed_k_cache"),
    ("k-scale-for-16-bit-cache", {"k_scale": lambda kw: torch.ones(kw["compressed_k_cache"].shape[:2])}, ValueError,
     "k_scale"),
    ("page-table-float", {"page_table": lambda kw: kw["page_table"].float()}, TypeError, "page_table"),
    ("page-table-int16", {"page_table": lambda kw: kw["page_table"].short()}, TypeError, "page_table"),
    ("page-table-1d", {"page_table": lambda kw: kw["page_table"][0]}, ValueError, "page_table"),
    ("page-table-column-major", {"page_table": lambda kw: kw["page_table"].t().contiguous().t()}, ValueError,
     "page_table"),
    ("token-to-request-length", {"token_to_request": lambda kw: kw["token_to_request"][:-1]}, ValueError,
     "token_to_request"),
    ("token-to-request-float", {"token_to_request": lambda kw: kw["token_to_request"].float()}, TypeError,
     "token_to_request"),
    ("token-to-request-2d", {"token_to_request": lambda kw: kw["token_to_request"][:, None]}, ValueError,
     "token_to_request"),
    ("token-to-request-strided", {"token_to_request": lambda kw: kw["token_to_request"].repeat(2)[::2]},
     ValueError, "token_to_request"),
    ("query-positions-length", {"query_positions": lambda kw: kw["query_positions"][:1]}, ValueError,
     "query_positions"),
    ("query-positions-uint8", {"query_positions": lambda kw: kw["query_positions"].to(torch.uint8)}, TypeError,
     "query_positions"),
    ("context-lens-length", {"context_lens": lambda kw: kw["context_lens"][:1]}, ValueError, "context_lens"),
    ("context-lens-float", {"context_lens": lambda kw: kw["context_lens"].double()}, TypeError, "context_lens"),
    ("context-lens-list", {"context_lens": lambda kw: kw["context_lens"].tolist()}, TypeError, "context_lens"),
    ("ratio-zero", {"compress_ratio": 0}, ValueError, "compress_ratio"),
    ("ratio-negative", {"compress_ratio": -4}, ValueError, "compress_ratio"),
    ("ratio-float", {"compress_ratio": 4.0}, TypeError, "compress_ratio"),
    ("ratio-bool", {"compress_ratio": True}, TypeError, "compress_ratio"),
    ("ratio-str", {"compress_ratio": "4"}, TypeError, "compress_ratio"),
    ("divisor-zero", {"score_divisor": 0.0}, ValueError, "score_divisor"),
    ("divisor-negative", {"score_divisor": -2}, ValueError, "score_divisor"),
    ("divisor-inf", {"score_divisor": math.inf}, ValueError, "score_divisor"),
    ("divisor-nan", {"score_divisor": math.nan}, ValueError, "score_divisor"),
    ("divisor-bool", {"score_divisor": True}, TypeError, "score_divisor"),
    ("divisor-str", {"score_divisor": "8"}, TypeError, "score_divisor"),
    ("max-columns-beyond-capacity", {"max_columns": lambda kw: kw["page_table"].shape[1] * PAGE + 1}, ValueError,
     "max_columns"),
    ("max-columns-negative", {"max_columns": -1}, ValueError, "max_columns"),
    ("max-columns-float", {"max_columns": 8.0}, TypeError, "max_columns"),
    ("max-columns-bool", {"max_columns": True}, TypeError, "max_columns"),
    ("row-starts-length", {"row_starts": lambda kw: kw["row_starts"][:-1].clone()}, ValueError, "row_starts"),
    ("row-starts-float", {"row_starts": lambda kw: kw["row_starts"].float()}, TypeError, "row_starts"),
    ("out-shape", {"out": lambda kw: kw["out"][:, :-1].clone()}, ValueError, "out"),
    ("out-rows", {"out": lambda kw: kw["out"][:-1].clone()}, ValueError, "out"),
    ("out-fp16", {"out": lambda kw: kw["out"].half()}, TypeError, "out"),
    ("out-bf16", {"out": lambda kw: kw["out"].bfloat16()}, TypeError, "out"),
    ("out-1d", {"out": lambda kw: kw["out"].flatten()}, ValueError, "out"),
    ("out-column-major", {"out": lambda kw: kw["out"].t().contiguous().t()}, ValueError, "out"),
    ("out-not-tensor", {"out": lambda kw: kw["out"].numpy()}, TypeError, "out"),
    ("out-shape-ignores-max-columns", {"max_columns": 10}, ValueError, "out"),
    ("phase-typo", {"phase": "prefil"}, ValueError, "phase"),
    ("phase-case", {"phase": "Decode"}, ValueError, "phase"),
    ("phase-not-str", {"phase": 1}, ValueError, "phase"),
    ("max-query-len-zero", {"max_query_len": 0}, ValueError, "max_query_len"),
    ("max-query-len-float", {"max_query_len": 1.5}, TypeError, "max_query_len"),
    ("max-query-len-bool", {"max_query_len": True}, TypeError, "max_query_len"),
]


def _apply(call: dict, changes: dict) -> dict:
    kw = dict(call)
    for name, value in changes.items():
        kw[name] = value(call) if callable(value) else value
    return kw


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of ``t`` (NaN poison compares equal to itself this way)."""
    return t.detach().contiguous().view(torch.uint8)


@pytest.mark.parametrize("changes,exc,name", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_argument_is_named_and_nothing_is_written(call, changes, exc, name):
    kw = _apply(call, changes)
    out, row_starts = kw["out"], kw["row_starts"]
    snapshots = {k: (v, v.clone()) for k, v in (("out", out), ("row_starts", row_starts))
                 if isinstance(v, torch.Tensor)}
    with pytest.raises(exc) as info:
        qsa_aiter.qsa_paged_mqa_logits(**kw)
    message = str(info.value)
    assert f"`{name}`" in message, f"the message must name `{name}`: {message}"
    assert "must be" in message, message
    for key, (tensor, before) in snapshots.items():
        assert torch.equal(_bits(tensor), _bits(before)), f"`{key}` was written by a rejected call"


@pytest.mark.parametrize("changes,exc,name", [c[1:] for c in BAD[:8]], ids=[c[0] for c in BAD[:8]])
def test_explain_and_selected_kernel_validate_the_same_way(call, changes, exc, name):
    kw = _apply(call, changes)
    for fn in (qsa_aiter.explain, qsa_aiter.selected_kernel, describe_call):
        with pytest.raises(exc, match=f"`{name}`"):
            fn(**kw)


@pytest.mark.parametrize("name, op", [("explain", "qsa_paged_mqa_logits"), ("selected_kernel", "qsa_paged_mqa_logits"),
                                      ("explain_selection", "qsa_select_paged_tokens")])
def test_the_explainers_take_the_signature_of_their_op(name, op):
    """``help()`` and ``inspect`` show the op's parameters, not ``*args, **kwargs``; a call without them names every
    argument it lacks."""
    explainer, public = getattr(qsa_aiter, name), getattr(qsa_aiter, op)
    assert inspect.signature(explainer).parameters == inspect.signature(public).parameters
    required = [p.name for p in inspect.signature(public).parameters.values() if p.default is p.empty]
    with pytest.raises(TypeError) as info:
        explainer()
    message = str(info.value)
    assert message.startswith(f"{name}() takes the arguments of {op}(q, compressed_k_cache, ")
    assert message.endswith("missing " + ", ".join(required)), message
    with pytest.raises(TypeError, match=f"{name}\\(\\) takes .*: got an unexpected keyword argument 'bogus'"):
        explainer(*([None] * len(required)), bogus=1)


def test_explain_takes_its_arguments_by_name(call):
    by_position = qsa_aiter.explain(*(call[k] for k in ("q", "compressed_k_cache", "page_table", "token_to_request",
                                                         "query_positions", "context_lens")), max_query_len=2)
    assert qsa_aiter.explain(**dict(call, max_query_len=2)) == by_position
    assert qsa_aiter.selected_kernel(**call) in by_position


def test_the_valid_call_passes(call):
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(**call)
    assert logits is call["out"]
    assert call["row_starts"].tolist() == [0] * call["q"].shape[0]
    ref = reference_of(tuple(call[k] for k in ("q", "compressed_k_cache", "page_table", "token_to_request",
                                               "query_positions", "context_lens")))
    assert_matches_reference(logits, visible, *ref)


@pytest.mark.parametrize(
    "changes",
    [
        {"compress_ratio": np.int64(4)},
        {"compress_ratio": torch.tensor(4).item()},
        {"score_divisor": 3},
        {"score_divisor": np.float32(2.5)},
        {"max_columns": np.int32(40), "out": None},
        {"max_columns": 0, "out": None},
        {"page_table": lambda kw: kw["page_table"].long(), "context_lens": lambda kw: kw["context_lens"].long()},
        {"row_starts": lambda kw: torch.full_like(kw["row_starts"], 5).long()},
        {"max_query_len": np.int64(2), "phase": "verify"},
        {"phase": None, "max_query_len": None},
    ],
    ids=["numpy-int-ratio", "python-int-ratio", "int-divisor", "numpy-float-divisor", "numpy-int-max-columns",
         "zero-columns", "int64-table-and-contexts", "int64-row-starts", "numpy-int-max-query-len", "no-hints"],
)
def test_accepted_argument_kinds(call, changes):
    kw = _apply(call, changes)
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(**kw)
    assert logits.dtype == torch.float32 and visible.dtype == torch.int32
    assert kw["row_starts"].tolist() == [0] * kw["q"].shape[0]


def test_fp16_q_and_cache_accepted(call):
    kw = dict(call, q=call["q"].half(), compressed_k_cache=call["compressed_k_cache"].half())
    problem = describe_call(**kw)
    assert problem.q_dtype == torch.float16 and problem.kv_dtype == "bf16"  # the 16-bit registry row


def test_problem_records_the_call(call):
    problem = describe_call(**dict(call, max_columns=50, out=None, phase="verify", max_query_len=2))
    assert (problem.num_tokens, problem.num_heads, problem.head_dim) == tuple(call["q"].shape)
    assert problem.block_size == PAGE
    assert problem.num_requests == 2 and problem.table_width == call["page_table"].shape[1]
    assert problem.num_pages == call["compressed_k_cache"].shape[0]
    assert problem.num_columns == 50 and problem.compress_ratio == 4
    assert problem.phase == "verify" and problem.phase_source == "hint" and problem.max_query_len == 2
    assert problem.cache_bytes == call["compressed_k_cache"].numel() * 2
    assert problem.device_type == "cpu"


def test_out_with_overlapping_rows_is_rejected(call):
    tokens, columns = call["out"].shape
    out = torch.full((1, columns), float("nan")).expand(tokens, columns)
    with pytest.raises(ValueError, match="`out`"):
        qsa_aiter.qsa_paged_mqa_logits(**dict(call, out=out))


@pytest.fixture(params=["fp8", "fp8_fnuz", "fp4"])
def quantised_call(request, rng):
    """A valid call on a quantised cache (CPU, 2 requests x 2 rows, 4 heads, head_dim 64, page 16)."""
    b = make_batch([500, 300], 2, heads=4, head_dim=64, page_size=PAGE, cache=request.param, generator=rng)
    tokens, columns = b.q.shape[0], b.page_table.shape[1] * PAGE
    return dict(
        q=b.q, compressed_k_cache=b.compressed_k_cache, page_table=b.page_table,
        token_to_request=b.token_to_request, query_positions=b.query_positions, context_lens=b.context_lens,
        compress_ratio=4, k_scale=b.k_scale, out=torch.full((tokens, columns), float("nan")),
        row_starts=torch.full((tokens,), 123, dtype=torch.int32),
    )


def _noncontig_scale(kw):
    s = kw["k_scale"]
    return torch.stack([s, s], dim=-1)[..., 0]


BAD_QUANTISED = [
    ("k-scale-missing", {"k_scale": None}, ValueError, "k_scale"),
    ("k-scale-not-tensor", {"k_scale": lambda kw: kw["k_scale"].float().tolist()}, TypeError, "k_scale"),
    ("k-scale-wrong-dtype", {"k_scale": lambda kw: kw["k_scale"].view(torch.uint8)
                             if kw["k_scale"].dtype != torch.float32 else kw["k_scale"].double()}, TypeError,
     "k_scale"),
    ("k-scale-missing-page", {"k_scale": lambda kw: kw["k_scale"][1:]}, ValueError, "k_scale"),
    ("k-scale-extra-dim", {"k_scale": lambda kw: kw["k_scale"][None]}, ValueError, "k_scale"),
    ("k-scale-noncontiguous", {"k_scale": _noncontig_scale}, ValueError, "k_scale"),
    ("k-scale-on-meta", {"k_scale": lambda kw: kw["k_scale"].to("meta")}, ValueError, "k_scale"),
    ("cache-head-dim-differs-from-q", {"q": lambda kw: kw["q"][:, :, :32].contiguous()}, ValueError,
     "compressed_k_cache"),
    ("cache-noncontiguous", {"compressed_k_cache": _noncontig_cache}, ValueError, "compressed_k_cache"),
]


@pytest.mark.parametrize("changes,exc,name", [c[1:] for c in BAD_QUANTISED], ids=[c[0] for c in BAD_QUANTISED])
def test_bad_quantised_argument_is_named_and_nothing_is_written(quantised_call, changes, exc, name):
    kw = _apply(quantised_call, changes)
    out, row_starts = kw["out"], kw["row_starts"]
    before = (out.clone(), row_starts.clone())
    with pytest.raises(exc, match=f"`{name}`"):
        qsa_aiter.qsa_paged_mqa_logits(**kw)
    assert torch.equal(out.isnan(), before[0].isnan()) and torch.equal(row_starts, before[1])


def test_fp4_cache_needs_head_dim_divisible_by_32(rng):
    b = make_batch([200], 2, heads=4, head_dim=64, page_size=PAGE, cache="fp4", generator=rng)
    q = torch.randn(2, 4, 48).to(torch.bfloat16)
    cache = b.compressed_k_cache.view(torch.uint8)[..., :24].contiguous().view(torch.float4_e2m1fn_x2)
    with pytest.raises(ValueError, match="`q`.*divisible by 32"):
        qsa_aiter.qsa_paged_mqa_logits(q, cache, *b.args()[2:], k_scale=b.k_scale[..., :1].contiguous())


def test_quantised_problem_records_kind_and_bytes(quantised_call):
    problem = describe_call(**quantised_call)
    cache, scale = quantised_call["compressed_k_cache"], quantised_call["k_scale"]
    assert problem.kv_dtype == ("fp4" if cache.dtype == torch.float4_e2m1fn_x2 else "fp8")
    assert problem.cache_dtype == cache.dtype and problem.head_dim == quantised_call["q"].shape[2]
    assert problem.cache_bytes == cache.numel() * cache.element_size() + scale.numel() * scale.element_size()


def test_columns_standing_for_2_to_31_tokens_are_refused(call):
    """The kernels clamp positions and context lengths to 32 bits, exact while ``columns x R < 2**31``: a table whose
    columns stand for more tokens is refused on the host (``problem.MAX_CONTEXT_TOKENS``), naming the argument."""
    wide = torch.zeros((2, 2**31 // (4 * PAGE)), dtype=torch.int32)  # exactly 2**31 tokens of columns at R 4
    with pytest.raises(ValueError, match="`page_table` must be at most 2147483647 tokens of columns"):
        describe_call(**dict(call, page_table=wide, out=None))
    with pytest.raises(ValueError, match="`max_columns` must be at most"):
        describe_call(**dict(call, page_table=wide, out=None, max_columns=2**29))
    assert describe_call(**dict(call, page_table=wide, out=None, max_columns=2**29 - 1)).num_columns == 2**29 - 1

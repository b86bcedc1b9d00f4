"""The host-side hints of a scoring call (``phase``, ``max_query_len``) are held to the call's shapes (SPEC section
4): a hint that contradicts them is refused naming it, by the scoring op and by the selection op, from shapes alone."""

from __future__ import annotations

import pytest

import qsa_aiter
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.tools.workloads import make_batch


HINT_RULES = [
    # (id, contexts, rows per request, hints, the error's text or None where the hints hold)
    ("verify-past-the-row-limit", [4000] * 75, 4, dict(phase="verify"), "verify and draft take at most 256"),
    ("draft-past-the-row-limit", [4000] * 257, 1, dict(phase="draft"), "verify and draft take at most 256"),
    ("decode-has-no-row-limit", [4000] * 257, 1, dict(phase="decode", max_query_len=1), None),
    ("decode-with-several-rows-per-request", [400, 700], 4, dict(phase="decode", max_query_len=4),
     "draft and decode have one row per request"),
    ("draft-with-several-rows-per-request", [400, 700], 2, dict(phase="draft", max_query_len=2),
     "draft and decode have one row per request"),
    ("draft-one-row-each", [400, 700], 1, dict(phase="draft", max_query_len=1), None),
    ("verify-at-the-row-limit", [900] * 64, 4, dict(phase="verify", max_query_len=4), None),
    ("prefill-any-shape", [400, 700], 1, dict(phase="prefill", max_query_len=1), None),
    ("max-query-len-past-the-rows", [400, 700], 2, dict(max_query_len=5), "in [1, 4]"),
    ("max-query-len-at-the-rows", [400], 4, dict(max_query_len=4), None),
]


@pytest.mark.parametrize("contexts,rows,hints,error", [c[1:] for c in HINT_RULES], ids=[c[0] for c in HINT_RULES])
def test_hints_are_held_to_the_shapes(rng, contexts, rows, hints, error):
    """A phase or max_query_len that contradicts the call's host-side shapes is refused, naming it (SPEC section 4);
    nothing about the tensors' contents is read."""
    batch = make_batch(contexts, rows, head_dim=16, page_size=64, generator=rng)
    if error is None:
        problem = describe_call(*batch.args(), **hints)
        assert problem.phase == hints.get("phase", problem.phase)
        return
    name = "phase" if "phase" in hints else "max_query_len"
    with pytest.raises(ValueError, match=f"^qsa_paged_mqa_logits: `{name}` must be .*" + error.replace("[", r"\[")):
        describe_call(*batch.args(), **hints)
    with pytest.raises(ValueError, match=f"^qsa_select_paged_tokens: `{name}`"):
        qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 64, 4, **hints)


def test_a_call_without_rows_takes_max_query_len_1(rng):
    batch = make_batch([400], 1, head_dim=16, page_size=64, generator=rng)
    args = (batch.q[:0], *batch.args()[1:3], batch.token_to_request[:0], batch.query_positions[:0], batch.context_lens)
    assert describe_call(*args, max_query_len=1).num_tokens == 0
    with pytest.raises(ValueError, match="max_query_len"):
        describe_call(*args, max_query_len=2)

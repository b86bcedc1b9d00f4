"""The torch reference, the oracle of every kernel test: checked by hand and against plain Python loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits, visible_groups
from qsa_aiter.tools.workloads import make_batch

NINF = float("-inf")


def loop_reference(q, cache, table, t2r, pos, ctx, ratio, divisor, num_columns):
    """The op's definition (README, what the op computes), written out with Python loops over floats."""
    q, cache = q.double().tolist(), cache.double().tolist()
    table, t2r, pos, ctx = table.tolist(), t2r.tolist(), pos.tolist(), ctx.tolist()
    pages, page_size = len(cache), (len(cache[0]) if cache else 0)
    out, vis_all = [], []
    for t in range(len(q)):
        r, p = t2r[t], pos[t]
        vis = 0 if not (0 <= r < len(ctx)) else max(0, min((p + 1) // ratio, ctx[r] // ratio, num_columns))
        row = [NINF] * num_columns
        for c in range(vis):
            logical = c // page_size
            page = table[r][logical] if logical < len(table[r]) else -1
            if not (0 <= page < pages):
                continue  # a bad page scores -inf
            key = cache[page][c % page_size][0]
            total = 0.0
            for head in q[t]:
                total += max(0.0, sum(a * b for a, b in zip(head, key, strict=True)))
            row[c] = total / divisor
        out.append(row)
        vis_all.append(vis)
    return out, vis_all


def tiny_case(dtype=torch.bfloat16):
    """R = 2, page size 2, 3 pages, head_dim 2, 2 heads, 2 requests; every value exact in bf16."""
    cache = torch.tensor(
        [[[1, 0], [0, 1]],  # page 0
         [[1, 1], [-1, 2]],  # page 1
         [[2, -1], [0.5, 0.5]]],  # page 2
        dtype=dtype,
    ).reshape(3, 2, 1, 2)
    table = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    ctx = torch.tensor([7, 3], dtype=torch.int32)
    t2r = torch.tensor([0, 0, 1, -1, 1, 0], dtype=torch.int32)
    pos = torch.tensor([6, 2, 2, -1, 0, 7], dtype=torch.int32)
    q = torch.tensor(
        [[[1, 2], [-1, 1]],
         [[0, 1], [1, 0]],
         [[1, -1], [0.5, 2]],
         [[3, 3], [3, 3]],
         [[1, 1], [1, 1]],
         [[1, 1], [2, 0]]],
        dtype=dtype,
    )
    return q, cache, table, t2r, pos, ctx


# Request 0 reads columns (page 2 slot 0, page 2 slot 1, page 0 slot 0, page 0 slot 1) = [2,-1], [.5,.5], [1,0],
# [0,1]; request 1 reads [1,1], [-1,2] (its second logical page is -1, past every row's visible range).
# Row 0 (p 6 -> 3 groups): c0 relu(0)+relu(-3) = 0; c1 1.5+0 = 1.5; c2 1+relu(-1) = 1     (/2)
# Row 1 (p 2 -> 1 group):  c0 relu(-1)+relu(2) = 2                                        (/2)
# Row 2 (request 1, p 2):  c0 relu(0)+relu(2.5) = 2.5                                     (/2)
# Row 3 padded, row 4 (p 0) sees nothing. Row 5 (p 7, context 7 -> 3 groups): 1+4, 1+1, 1+2 (/2)
TINY_EXPECTED = [
    [0.0, 0.75, 0.5, NINF],
    [1.0, NINF, NINF, NINF],
    [1.25, NINF, NINF, NINF],
    [NINF, NINF, NINF, NINF],
    [NINF, NINF, NINF, NINF],
    [2.5, 1.0, 1.5, NINF],
]
TINY_VISIBLE = [3, 1, 1, 0, 0, 3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_hand_computed_case(dtype):
    logits, visible = reference_paged_mqa_logits(*tiny_case(dtype), 2, 2.0)
    assert visible.dtype == torch.int32 and visible.tolist() == TINY_VISIBLE
    assert logits.dtype == torch.float32
    assert logits.tolist() == TINY_EXPECTED


def test_hand_computed_case_matches_the_loops():
    args = tiny_case()
    logits, visible = reference_paged_mqa_logits(*args, 2, 2.0)
    loop_logits, loop_visible = loop_reference(*args, 2, 2.0, 4)
    assert loop_visible == TINY_VISIBLE and loop_logits == TINY_EXPECTED
    assert logits.tolist() == loop_logits and visible.tolist() == loop_visible


def test_default_divisor_is_sqrt_head_dim():
    logits, _ = reference_paged_mqa_logits(*tiny_case(), 2)
    expected = torch.tensor(TINY_EXPECTED) * 2.0 / math.sqrt(2.0)
    assert torch.allclose(logits, expected, rtol=1e-6, atol=0)


def test_bad_page_ids_score_minus_inf():
    q, cache, table, t2r, pos, ctx = tiny_case()
    table = table.clone()
    table[0, 1] = -1  # row 0 col 2 and row 5 col 2
    table[1, 0] = 3  # == pages: row 2 col 0
    logits, visible = reference_paged_mqa_logits(q, cache, table, t2r, pos, ctx, 2, 2.0)
    expected = [row[:] for row in TINY_EXPECTED]
    expected[0][2] = expected[5][2] = expected[2][0] = NINF
    assert visible.tolist() == TINY_VISIBLE
    assert logits.tolist() == expected
    assert loop_reference(q, cache, table, t2r, pos, ctx, 2, 2.0, 4)[0] == expected


def test_max_columns_caps_visible_and_width():
    logits, visible = reference_paged_mqa_logits(*tiny_case(), 2, 2.0, 2)
    assert tuple(logits.shape) == (6, 2)
    assert visible.tolist() == [2, 1, 1, 0, 0, 2]
    assert logits.tolist() == [row[:2] for row in TINY_EXPECTED]
    logits, visible = reference_paged_mqa_logits(*tiny_case(), 2, 2.0, 0)
    assert tuple(logits.shape) == (6, 0) and visible.tolist() == [0] * 6


def test_no_rows():
    q, cache, table, _, _, ctx = tiny_case()
    empty = torch.empty(0, dtype=torch.int32)
    logits, visible = reference_paged_mqa_logits(q[:0], cache, table, empty, empty, ctx, 2)
    assert tuple(logits.shape) == (0, 4) and tuple(visible.shape) == (0,)


def test_chunking_does_not_change_the_result(rng):
    batch = make_batch([700, 1500, 90, 333], [3, 5, 2, 1], head_dim=32, page_size=16, padded_rows=2,
                       generator=rng)
    whole, vis = reference_paged_mqa_logits(*batch.args())
    chunked, vis_c = reference_paged_mqa_logits(*batch.args(), row_chunk=2, col_chunk=7)
    assert torch.equal(vis, vis_c)
    mask = torch.isfinite(whole)
    assert torch.equal(torch.isneginf(whole), torch.isneginf(chunked))
    assert torch.allclose(chunked[mask], whole[mask], rtol=1e-6, atol=1e-6)


def test_fp64_accumulation_agrees(rng):
    batch = make_batch([900, 400], 3, head_dim=64, page_size=64, generator=rng)
    f32, vis = reference_paged_mqa_logits(*batch.args())
    f64, vis64 = reference_paged_mqa_logits(*batch.args(), accum_dtype=torch.float64)
    assert torch.equal(vis, vis64)
    mask = torch.isfinite(f64)
    assert torch.equal(mask, torch.isfinite(f32))
    assert torch.allclose(f32[mask], f64[mask], rtol=1e-5, atol=1e-5)


def test_columns_past_visible_are_minus_inf(rng):
    batch = make_batch([300, 700], 4, head_dim=16, page_size=16, padded_rows=1, generator=rng)
    logits, visible = reference_paged_mqa_logits(*batch.args())
    cols = torch.arange(logits.shape[1])
    past = cols[None, :] >= visible.long()[:, None]
    assert torch.isneginf(logits[past]).all()
    assert torch.isfinite(logits[~past]).all()


def test_matches_the_loops_on_a_random_batch(rng):
    batch = make_batch([37, 130, 61], [2, 3, 1], heads=3, head_dim=8, page_size=4, padded_rows=1, generator=rng)
    args = batch.args()[:6]
    table = args[2].clone()
    table[1, 2] = 10**4  # one bad page
    args = (args[0], args[1], table, *args[3:])
    logits, visible = reference_paged_mqa_logits(*args, 4, 1.7)
    loop_logits, loop_visible = loop_reference(*args, 4, 1.7, table.shape[1] * 4)
    assert visible.tolist() == loop_visible
    assert torch.allclose(logits, torch.tensor(loop_logits, dtype=torch.float32), rtol=1e-5, atol=1e-5)
    assert torch.isneginf(logits[2:5, 8:12]).all()  # request 1 (rows 2..4), logical page 2


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 8),  # ratio
    st.integers(0, 400),  # num_columns
    st.lists(st.integers(0, 3000), min_size=1, max_size=5),  # contexts
    st.lists(st.tuples(st.integers(-2, 6), st.integers(-3, 3200)), min_size=0, max_size=12),  # (request, position)
)
def test_visible_groups_formula(ratio, num_columns, contexts, rows):
    t2r = torch.tensor([r for r, _ in rows], dtype=torch.int64)
    pos = torch.tensor([p for _, p in rows], dtype=torch.int64)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    got = visible_groups(t2r, pos, ctx, ratio, num_columns)
    expected = [0 if not (0 <= r < len(contexts)) else max(0, min((p + 1) // ratio, contexts[r] // ratio,
                                                                     num_columns))
                for r, p in rows]
    assert got.dtype == torch.int32 and got.tolist() == expected


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 3),  # heads
    st.integers(1, 6),  # head_dim
    st.integers(1, 4),  # page size
    st.integers(1, 4),  # ratio
    st.lists(st.integers(0, 40), min_size=1, max_size=3),  # contexts
    st.integers(0, 2**31 - 1),  # seed
)
def test_matches_the_loops_on_random_tiny_problems(heads, head_dim, page_size, ratio, contexts, seed):
    gen = torch.Generator().manual_seed(seed)
    groups = [c // ratio for c in contexts]
    width = max(1, max(-(-g // page_size) for g in groups)) + 1
    pages = 6
    table = torch.randint(-2, pages + 2, (len(contexts), width), generator=gen, dtype=torch.int32)
    cache = torch.randn(pages, page_size, 1, head_dim, generator=gen).to(torch.bfloat16)
    tokens = 5
    t2r = torch.randint(-1, len(contexts), (tokens,), generator=gen, dtype=torch.int32)
    pos = torch.randint(-1, 45, (tokens,), generator=gen, dtype=torch.int32)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(torch.bfloat16)
    logits, visible = reference_paged_mqa_logits(q, cache, table, t2r, pos, ctx, ratio, 1.5)
    loop_logits, loop_visible = loop_reference(q, cache, table, t2r, pos, ctx, ratio, 1.5, width * page_size)
    assert visible.tolist() == loop_visible
    assert torch.allclose(logits, torch.tensor(loop_logits, dtype=torch.float32), rtol=1e-5, atol=1e-5)

"""Selection: block top-k, expansion and ``qsa_select_paged_tokens`` against row-by-row oracles.

The oracles (``reference_block_topk``, ``reference_expand_block_indices``) rank with ``(-score, index)`` and build each
row with Python lists. ``qsa_select_paged_tokens`` is compared with the oracles applied to the op's own logits (the
scoring kernels are checked against the scoring reference elsewhere; near-equal scores would otherwise make the
comparison depend on summation order). On the CPU the Triton kernels run under the interpreter; the torch paths
are checked on every device.
"""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.ops import selection
from qsa_aiter.runtime import replay
from qsa_aiter.runtime.settings import ConfigurationError, get_settings
from qsa_aiter.kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from qsa_aiter.kernels.selection.reference import reference_block_topk, reference_expand_block_indices
from qsa_aiter.tools.timing import capture_graph
from qsa_aiter.tools.workloads import make_batch

from helpers import force_backend, random_logits, visible_counts, write_new_lengths

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
R = 4


@pytest.mark.parametrize("kind", ["random", "ties", "equal"])
@pytest.mark.parametrize("block_topk", [16, 100])
def test_block_topk_matches_the_oracle(rng, kind, block_topk):
    tokens, columns = 11, 1500
    logits = random_logits(rng, tokens, columns, kind)
    visible = visible_counts(tokens, columns, block_topk, rng)
    # Past each row's visible count the logits are garbage: the op must not read them.
    cols = torch.arange(columns, device=DEVICE)
    logits = torch.where(cols[None, :] < visible[:, None].long(), logits, torch.full_like(logits, float("nan")))
    expected = reference_block_topk(logits, visible, block_topk)
    out = torch.full((tokens, block_topk), -7, dtype=torch.int32, device=DEVICE)
    got = qsa_aiter.qsa_block_topk(logits, visible, block_topk, out=out)
    assert got is out
    assert torch.equal(got, expected)
    via_torch = torch.full_like(out, -7)
    torch_block_topk(logits, visible, block_topk, via_torch)
    assert torch.equal(via_torch, expected)


def test_block_topk_of_equal_scores_takes_the_lowest_groups():
    logits = torch.full((2, 700), 0.25, device=DEVICE)
    visible = torch.tensor([700, 300], dtype=torch.int32, device=DEVICE)
    got = qsa_aiter.qsa_block_topk(logits, visible, 128)
    assert torch.equal(got, torch.arange(128, dtype=torch.int32, device=DEVICE).expand(2, 128))


def random_block_indices(gen, tokens: int, groups: int, contexts: torch.Tensor, t2r: torch.Tensor):
    """Ascending selected groups then -1, some rows short, some groups reaching past the context."""
    rows = []
    for t in range(tokens):
        r = int(t2r[t])
        limit = int(contexts[r]) // R + 2 if r >= 0 else 10
        n = int(torch.randint(0, groups + 1, (), generator=gen))
        chosen = torch.randperm(max(limit, 1), generator=gen)[:n].sort().values
        row = torch.full((groups,), -1, dtype=torch.int64)
        row[: chosen.numel()] = chosen
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("token_topk", [64, 68])
def test_expansion_matches_the_oracle(rng, index_dtype, token_topk):
    contexts = torch.tensor([37, 400, 5, 1000])
    t2r = torch.tensor([0, 1, 1, 2, 3, 3, -1, 3, 0])
    positions = torch.tensor([36, 399, 201, 4, 999, 997, -1, 3, 30])
    groups = token_topk // R
    block = random_block_indices(rng, t2r.numel(), groups, contexts, t2r)
    block[2, 3] = -1  # a hole: skipped
    args = [x.to(index_dtype).to(DEVICE) for x in (block, positions, contexts, t2r)]
    expected = reference_expand_block_indices(*args, R, token_topk)
    out = torch.full((t2r.numel(), token_topk + R - 1), -7, dtype=torch.int32, device=DEVICE)
    got = qsa_aiter.qsa_expand_block_indices(*args, R, token_topk, out=out)
    assert got is out
    assert torch.equal(got, expected)
    assert bool((got[6] == -1).all())  # the padded row
    via_torch = torch.full_like(out, -7)
    torch_expand_block_indices(*args, R, token_topk, via_torch)
    assert torch.equal(via_torch, expected)


def oracle_selection(batch, token_topk: int, **kwargs) -> torch.Tensor:
    """The oracles applied to the op's own logits."""
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*batch.args(), **batch.kwargs(), **kwargs)
    groups = reference_block_topk(logits, visible, token_topk // R)
    return reference_expand_block_indices(groups, batch.query_positions, batch.context_lens, batch.token_to_request,
                                          R, token_topk)


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("cache", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("rows", [1, 4])
def test_select_matches_the_oracles(rng, cache, page_size, rows):
    batch = make_batch([3000, 1100, 237, 61], rows, page_size=page_size, cache=cache, head_dim=64, padded_rows=2,
                       device=DEVICE, generator=rng)
    token_topk = 256
    expected = oracle_selection(batch, token_topk, max_query_len=rows)
    got = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], token_topk, R, **batch.kwargs(), max_query_len=rows)
    assert got.dtype == torch.int32 and tuple(got.shape) == (batch.q.shape[0], token_topk + R - 1)
    assert torch.equal(got, expected)


def test_select_in_chunks_equals_one_chunk(rng):
    batch = make_batch([2000, 900], 4, page_size=16, head_dim=64, device=DEVICE, generator=rng)
    whole = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, max_query_len=4)
    columns = batch.page_table.shape[1] * 16
    chunked = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, logits_workspace_bytes=3 * columns * 4,
                                                max_query_len=4)
    one_row = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, logits_workspace_bytes=1,
                                                max_query_len=4)
    assert torch.equal(chunked, whole) and torch.equal(one_row, whole)


class FakeProperties:
    def __init__(self, total_memory: int):
        self.total_memory = total_memory


def fake_gpus(monkeypatch, totals: dict[int, int]) -> list:
    """``torch.cuda.get_device_properties`` of GPUs with these total memories (by index), current device 1, no bound
    sized yet; returns the list of the devices whose properties were read, in order."""
    reads = []

    def properties(device):
        index = torch.device(device).index
        reads.append(index)
        return FakeProperties(totals[index])

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(selection, "_device_bounds", {})
    return reads


def test_the_default_bound_follows_the_device_memory(monkeypatch):
    gib = 1 << 30
    reads = fake_gpus(monkeypatch, {0: 150_121_322_496, 1: 24 * gib, 2: 8 * gib})
    h200 = selection.device_workspace_bound(torch.device("cuda", 0))
    assert h200.nbytes == 2 * gib == selection.WORKSPACE_CAP_BYTES  # 140 GiB / 16 is past the cap
    assert "sized from cuda:0" in h200.source and "150121322496 bytes total" in h200.source
    assert "/ 16 = 9382582656" in h200.source and "cap 2147483648" in h200.source
    # 24 GiB / 16 = 1.5 GiB: the logits of 16K prefill rows x 24576 columns (96K tokens at R = 4), one chunk.
    assert selection.device_workspace_bound("cuda:1").nbytes == 16384 * 24576 * 4
    assert selection.device_workspace_bound(torch.device("cuda", 2)).nbytes == 512 << 20
    assert selection.device_workspace_bound(torch.device("cpu")).nbytes == selection.HOST_WORKSPACE_BYTES == 128 << 20
    # Read once per device: later calls, and "cuda" (the current device, 1), reuse the bound.
    assert selection.device_workspace_bound("cuda") is selection.device_workspace_bound("cuda:1")
    for index in (0, 1, 2):
        selection.device_workspace_bound(torch.device("cuda", index))
    assert reads == [0, 1, 2]


def test_the_argument_then_the_variable_then_the_device_bound(monkeypatch):
    reads = fake_gpus(monkeypatch, {0: 16 << 30})
    gpu = torch.device("cuda", 0)
    assert selection.logits_workspace_bound(None, gpu, get_settings()).nbytes == 1 << 30 and reads == [0]
    monkeypatch.setenv("QSA_AITER_LOGITS_WORKSPACE_MB", "300")
    bound = selection.logits_workspace_bound(None, gpu, get_settings())
    assert (bound.nbytes, bound.source) == (300 << 20, "from QSA_AITER_LOGITS_WORKSPACE_MB=300")
    bound = selection.logits_workspace_bound(4096, gpu, get_settings())
    assert (bound.nbytes, bound.source) == (4096, "from the argument logits_workspace_bytes")
    monkeypatch.setenv("QSA_AITER_LOGITS_WORKSPACE_MB", "0")
    assert selection.logits_workspace_bound(None, gpu, get_settings()).nbytes == 1 << 30
    assert reads == [0]
    with pytest.raises(TypeError, match="`logits_workspace_bytes`"):
        selection.logits_workspace_bound(2.5, gpu, get_settings())
    with pytest.raises(ValueError, match="`logits_workspace_bytes`"):
        selection.logits_workspace_bound(-1, gpu, get_settings())


def test_the_bound_chunks_the_call_and_explain_says_where_it_came_from(monkeypatch, rng):
    batch = make_batch([2000, 900], 4, page_size=16, head_dim=64, device=DEVICE, generator=rng)
    args = batch.args()[:6]
    columns = batch.page_table.shape[1] * 16
    whole = qsa_aiter.qsa_select_paged_tokens(*args, 128, R, logits_workspace_bytes=1 << 30, max_query_len=4)
    # The default bound of this device, made 3 rows of logits: the op scores 3 chunks of at most 3 rows.
    monkeypatch.setattr(selection, "_device_bounds", {})
    monkeypatch.setattr(selection, "HOST_WORKSPACE_BYTES", 3 * columns * 4)
    monkeypatch.setattr(selection, "WORKSPACE_CAP_BYTES", 3 * columns * 4)  # on a GPU too
    report = qsa_aiter.explain_selection(*args, 128, R, max_query_len=4)
    assert report.startswith(f"qsa_select_paged_tokens: 8 rows in 3 chunk(s) of at most 3 rows (logits workspace "
                             f"{3 * columns * 4} bytes, ")
    assert f"a chunk's logits 3 x {columns} x 4 = {3 * columns * 4} bytes)" in report.splitlines()[0]
    assert ("the fixed bound for cpu tensors" if DEVICE == "cpu" else "sized from cuda:") in report
    chunks = []
    score = selection.score_validated
    monkeypatch.setattr(selection, "score_validated", lambda *a: chunks.append(a[0].num_tokens) or score(*a))
    replay.clear()  # no call replayed: each one validates and chunks
    assert torch.equal(qsa_aiter.qsa_select_paged_tokens(*args, 128, R, max_query_len=4), whole)
    assert chunks == [3, 3, 2]
    # The variable beats the device, the argument beats both.
    monkeypatch.setenv("QSA_AITER_LOGITS_WORKSPACE_MB", "1")
    report = qsa_aiter.explain_selection(*args, 128, R, max_query_len=4)
    assert "8 rows in 1 chunk(s) of at most 8 rows (logits workspace 1048576 bytes, from " \
           "QSA_AITER_LOGITS_WORKSPACE_MB=1;" in report
    chunks.clear()
    assert torch.equal(qsa_aiter.qsa_select_paged_tokens(*args, 128, R, max_query_len=4), whole)
    assert chunks == [8]
    report = qsa_aiter.explain_selection(*args, 128, R, logits_workspace_bytes=4 * columns * 4, max_query_len=4)
    assert "8 rows in 2 chunk(s) of at most 4 rows" in report and "from the argument logits_workspace_bytes" in report
    chunks.clear()
    assert torch.equal(qsa_aiter.qsa_select_paged_tokens(*args, 128, R, logits_workspace_bytes=4 * columns * 4,
                                                         max_query_len=4), whole)
    assert chunks == [4, 4]


@pytest.mark.parametrize("value", ["-1", "1.5", "64MB", "", "lots"])
def test_a_bad_workspace_variable_is_named(monkeypatch, rng, value):
    batch = make_batch([300], 1, page_size=16, head_dim=64, device=DEVICE, generator=rng)
    monkeypatch.setenv("QSA_AITER_LOGITS_WORKSPACE_MB", value)
    for call in (qsa_aiter.qsa_select_paged_tokens, qsa_aiter.explain_selection):
        with pytest.raises(ConfigurationError, match=f"QSA_AITER_LOGITS_WORKSPACE_MB={value!r} is invalid"):
            call(*batch.args()[:6], 128, R)


def test_a_row_alone_and_in_a_verify_batch_select_the_same_tokens(rng):
    batch = make_batch([5000, 3100], 4, page_size=64, head_dim=64, device=DEVICE, generator=rng)
    verify = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 512, R, max_query_len=4)
    q, cache, table, t2r, pos, ctx = batch.args()[:6]
    for t in range(q.shape[0]):
        alone = qsa_aiter.qsa_select_paged_tokens(q[t : t + 1], cache, table, t2r[t : t + 1], pos[t : t + 1], ctx,
                                                  512, R, max_query_len=1)
        assert torch.equal(alone[0], verify[t]), f"row {t}"


def test_max_seq_len_fixes_the_width(rng):
    batch = make_batch([1500, 700], 1, page_size=16, head_dim=64, device=DEVICE, generator=rng,
                       table_width=200)
    capped = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, max_seq_len=2048, max_query_len=1)
    full = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, max_query_len=1)
    assert torch.equal(capped, full)


def test_max_seq_len_past_the_table_is_clamped_to_its_capacity(rng):
    """An engine passes its longest context plus a slack (vLLM: 1792 tokens): the width stops at the table's capacity,
    past which nothing can be selected, and the call equals one with max_seq_len at that capacity."""
    batch = make_batch([1500, 700], 1, page_size=16, head_dim=64, device=DEVICE, generator=rng, table_width=40)
    capacity = 40 * 16 * R
    at_capacity = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, max_seq_len=capacity, max_query_len=1)
    for max_seq_len in (capacity + R, capacity + 1792, 10**9):
        got = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, max_seq_len=max_seq_len, max_query_len=1)
        assert torch.equal(got, at_capacity), max_seq_len
        text = qsa_aiter.explain_selection(*batch.args()[:6], 128, R, max_seq_len=max_seq_len, max_query_len=1)
        assert f"columns={capacity // R}" in text and f"x {capacity // R} x 4" in text
    assert torch.equal(at_capacity, qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, max_query_len=1))


def test_bad_pages_and_short_rows(monkeypatch, rng):
    batch = make_batch([900, 40, 3000], 2, page_size=16, head_dim=64, device=DEVICE, generator=rng)
    batch.page_table[0, 2] = batch.compressed_k_cache.shape[0] + 9
    batch.page_table[2, 0] = -5
    got = qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, max_query_len=2)
    assert torch.equal(got, oracle_selection(batch, 128, max_query_len=2))
    # Request 1 (40 tokens) sees fewer groups than the budget: its last row (position 39) takes all 40 tokens, the
    # one before (position 38) 9 groups and the tail 36..38.
    assert got[3].tolist() == list(range(40)) + [-1] * 91
    assert got[2].tolist() == list(range(39)) + [-1] * 92
    force_backend(monkeypatch, "torch")
    assert torch.equal(qsa_aiter.qsa_select_paged_tokens(*batch.args()[:6], 128, R, max_query_len=2), got)


def test_bad_arguments_are_named(rng):
    batch = make_batch([300], 1, page_size=16, head_dim=64, device=DEVICE, generator=rng)
    args = batch.args()[:6]
    with pytest.raises(ValueError, match="token_topk"):
        qsa_aiter.qsa_select_paged_tokens(*args, 130, R)
    with pytest.raises(TypeError, match="token_topk"):
        qsa_aiter.qsa_select_paged_tokens(*args, 128.0, R)
    with pytest.raises(ValueError, match="`out`"):
        qsa_aiter.qsa_select_paged_tokens(*args, 128, R, out=torch.empty(1, 128, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="`out`"):
        qsa_aiter.qsa_select_paged_tokens(*args, 128, R, out=torch.empty(1, 131, device=DEVICE))
    with pytest.raises(ValueError, match="logits_workspace_bytes"):
        qsa_aiter.qsa_select_paged_tokens(*args, 128, R, logits_workspace_bytes=0)
    with pytest.raises(TypeError, match="logits_workspace_bytes"):
        qsa_aiter.qsa_select_paged_tokens(*args, 128, R, logits_workspace_bytes=float(1 << 20))
    with pytest.raises(ValueError, match="block_indices"):
        qsa_aiter.qsa_expand_block_indices(torch.zeros(1, 40, dtype=torch.int32, device=DEVICE), args[4], args[5],
                                           args[3], R, 128)
    with pytest.raises(ValueError, match="visible"):
        qsa_aiter.qsa_block_topk(torch.zeros(2, 10, device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE),
                                 4)
    # A rejected call writes nothing.
    out = torch.full((1, 131), -7, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):
        qsa_aiter.qsa_select_paged_tokens(*args, 128, R, out=out, max_query_len=2)
    assert bool((out == -7).all())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_select_is_captured_once_and_replayed_with_new_inputs():
    """One CUDA graph, new queries, positions and lengths written in place before each replay: equal to eager."""
    gen = torch.Generator().manual_seed(3)
    batch = make_batch([40000] * 8, 4, page_size=64, device="cuda", generator=gen, cache="fp8")
    q, cache, table, t2r, pos, ctx = batch.args()[:6]
    out = torch.empty((q.shape[0], 2048 + R - 1), dtype=torch.int32, device="cuda")
    call = lambda: qsa_aiter.qsa_select_paged_tokens(q, cache, table, t2r, pos, ctx, 2048, R, out=out,  # noqa: E731
                                                     max_seq_len=40000, k_scale=batch.k_scale, phase="verify",
                                                     max_query_len=4)
    graph, _ = capture_graph(call)
    for step in range(3):
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        write_new_lengths(gen, ctx, pos, 2000, 40000, 4)
        graph.replay()
        replayed = out.clone()
        eager = qsa_aiter.qsa_select_paged_tokens(q, cache, table, t2r, pos, ctx, 2048, R, max_seq_len=40000,
                                                  k_scale=batch.k_scale, phase="verify", max_query_len=4)
        assert torch.equal(replayed, eager), f"replay {step}"

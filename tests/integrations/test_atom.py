"""ATOM drop-in (``qsa_aiter.integrations.atom``): the engine's calling conventions, and ``install()`` on a stand-in.

ATOM is not installable here, so ``standin_engine`` builds a stand-in for ``atom.model_ops.qwen4_exp.ops.qsa`` whose
three ops have the engine's signatures (as in ROCm/ATOM's source) and fail if called, plus a stand-in for the engine's
attention module, which binds the ops at import time. Expected results come from the row-by-row oracles applied to
the op's own logits (as in test_selection.py).
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

import qsa_aiter
from qsa_aiter.integrations import atom
from qsa_aiter.ops import selection
from qsa_aiter.runtime import replay
from qsa_aiter.kernels.selection.reference import reference_block_topk, reference_expand_block_indices
from qsa_aiter.tools.timing import capture_graph
from qsa_aiter.tools.workloads import make_batch

from helpers import assert_matches_reference, write_new_lengths

R = 4


def _engine_op(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"the engine stand-in's own {name} ran")
    return fail


def standin_engine(extra_param: bool = False):
    """``(ops module, attention module)`` stand-ins with the engine's op names and signatures."""
    module = types.ModuleType("standin_atom_ops_qsa")
    fail = _engine_op

    def qsa_paged_mqa_logits(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                             compress_ratio=4, score_divisor=None, max_columns=None, row_starts=None):
        return fail("qsa_paged_mqa_logits")()

    def qsa_select_paged_tokens(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                                token_topk, compress_ratio=4, out=None, logits_workspace_bytes=128 * 1024 * 1024,
                                max_seq_len=None):
        return fail("qsa_select_paged_tokens")()

    def qsa_expand_block_indices(block_indices, query_positions, context_lens, token_to_request, compress_ratio,
                                 token_topk, out=None, output_width=None):
        return fail("qsa_expand_block_indices")()

    def qsa_select_paged_tokens_newer(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                      context_lens, token_topk, compress_ratio=4, out=None,
                                      logits_workspace_bytes=128 * 1024 * 1024, max_seq_len=None, backend="auto"):
        return fail("qsa_select_paged_tokens")()

    module.qsa_paged_mqa_logits = qsa_paged_mqa_logits
    module.qsa_select_paged_tokens = qsa_select_paged_tokens_newer if extra_param else qsa_select_paged_tokens
    module.qsa_expand_block_indices = qsa_expand_block_indices
    module.qsa_store_rows = fail("qsa_store_rows")  # an engine op the drop-in does not replace
    consumer = types.ModuleType("standin_atom_qsa_attention")
    # `from atom.model_ops.qwen4_exp.ops.qsa import qsa_select_paged_tokens, qsa_store_rows`
    consumer.qsa_select_paged_tokens = module.qsa_select_paged_tokens
    consumer.qsa_store_rows = module.qsa_store_rows
    return module, consumer


@pytest.fixture
def installed():
    module, consumer = standin_engine()
    handle = atom.install(module, consumers=(consumer,))
    yield module, consumer
    handle.uninstall()


def batch_of(rng, contexts=(700, 1500, 90), rows=(4, 1, 2), padded=2, **kw):
    kw.setdefault("head_dim", 32)
    return make_batch(list(contexts), list(rows), padded_rows=padded, generator=rng, **kw)


def expected_selection(args, token_topk, columns=None):
    """The oracles applied to the op's own logits: ``[tokens, token_topk + R - 1]``."""
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args[:6], R, max_columns=columns)
    groups = reference_block_topk(logits, visible, token_topk // R)
    return reference_expand_block_indices(groups, args[4], args[5], args[3], R, token_topk)


# ---------------------------------------------------------------------------------------------------------------
# install / uninstall
# ---------------------------------------------------------------------------------------------------------------


def test_install_replaces_the_ops_in_the_engine_and_its_importers():
    module, consumer = standin_engine()
    originals = {n: getattr(module, n) for n in atom.OPS}
    store_rows = module.qsa_store_rows
    handle = atom.install(module, consumers=(consumer, "a_module_that_is_not_imported"))
    try:
        for name in atom.OPS:
            assert getattr(module, name) is getattr(atom, name)
        assert consumer.qsa_select_paged_tokens is atom.qsa_select_paged_tokens
        assert module.qsa_store_rows is store_rows and consumer.qsa_store_rows is store_rows, "others untouched"
        assert atom.install(module, consumers=(consumer,)) is handle, "installing twice is a no-op"
        with pytest.raises(RuntimeError, match="uninstall"):
            atom.install(standin_engine()[0])
    finally:
        handle.uninstall()
    for name in atom.OPS:
        assert getattr(module, name) is originals[name]
    assert consumer.qsa_select_paged_tokens is originals["qsa_select_paged_tokens"]
    assert not hasattr(consumer, "qsa_paged_mqa_logits"), "uninstall adds nothing"


def test_install_refuses_an_engine_with_other_signatures_and_changes_nothing():
    module, consumer = standin_engine(extra_param=True)
    before = {n: getattr(module, n) for n in atom.OPS}
    with pytest.raises(TypeError, match="keyword `backend`|parameter 11 is `backend`"):
        atom.install(module, consumers=(consumer,))
    assert {n: getattr(module, n) for n in atom.OPS} == before
    bare = types.ModuleType("bare")
    with pytest.raises(TypeError, match="has no `qsa_paged_mqa_logits`"):
        atom.install(bare)


def test_the_drop_ins_keep_the_engines_parameters_and_defaults():
    module, _ = standin_engine()
    for name in atom.OPS:
        atom.check_signature(name, getattr(module, name))  # raises on any difference

    def reordered(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                  compress_ratio=4, max_columns=None, score_divisor=None, row_starts=None):
        pass

    with pytest.raises(TypeError, match="parameter 7 is `max_columns`"):
        atom.check_signature("qsa_paged_mqa_logits", reordered)

    def other_default(block_indices, query_positions, context_lens, token_to_request, compress_ratio, token_topk,
                      out=None, output_width=16):
        pass

    with pytest.raises(TypeError, match="`output_width` defaults to 16"):
        atom.check_signature("qsa_expand_block_indices", other_default)


def test_the_workspace_default_is_the_public_ops_and_the_engines_is_accepted():
    """The drop-in's ``logits_workspace_bytes`` defaults to None (the bound sized at run time), the engine's to
    128 MiB; ``install()`` accepts that difference, and not another default of the op."""
    module, _ = standin_engine()
    engine = inspect.signature(module.qsa_select_paged_tokens).parameters["logits_workspace_bytes"].default
    assert engine == 128 << 20
    assert inspect.signature(atom.qsa_select_paged_tokens).parameters["logits_workspace_bytes"].default is None
    atom.check_signature("qsa_select_paged_tokens", module.qsa_select_paged_tokens)

    def other_ratio(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, token_topk,
                    compress_ratio=8, out=None, logits_workspace_bytes=1 << 20, max_seq_len=None):
        pass

    with pytest.raises(TypeError, match="`compress_ratio` defaults to 8"):
        atom.check_signature("qsa_select_paged_tokens", other_ratio)


def test_the_workspace_argument_is_passed_through(installed, monkeypatch, rng):
    """What the engine passes (positionally, by keyword, or nothing) reaches the op's bound unchanged; a bad value
    is named by the op."""
    module, _ = installed
    args = batch_of(rng).args()
    seen = []
    bound = selection.logits_workspace_bound
    monkeypatch.setattr(selection, "logits_workspace_bound", lambda value, *a: seen.append(value) or bound(value, *a))
    replay.clear()  # every call below validates (none is replayed)
    whole = module.qsa_select_paged_tokens(*args[:6], 64, R)
    columns = args[2].shape[1] * args[1].shape[1]
    assert torch.equal(module.qsa_select_paged_tokens(*args[:6], 64, R, None, 2 * columns * 4), whole)
    assert torch.equal(module.qsa_select_paged_tokens(*args[:6], 64, R, logits_workspace_bytes=1), whole)
    assert seen == [None, 2 * columns * 4, 1]
    with pytest.raises(ValueError, match="`logits_workspace_bytes` must be >= 1"):
        module.qsa_select_paged_tokens(*args[:6], 64, R, logits_workspace_bytes=0)


def test_the_drop_ins_signatures_derive_from_the_public_ops():
    """The engine's positional parameters are the public op's (the expansion's ``output_width`` after them); the
    keyword-only extras are the public op's but ``out``, then the drop-in's own ``block_size`` where a cache is
    read."""
    for name in atom.OPS:
        public = inspect.signature(getattr(qsa_aiter, name)).parameters.values()
        ours = inspect.signature(getattr(atom, name)).parameters.values()
        positional = [p for p in public if p.kind == p.POSITIONAL_OR_KEYWORD]
        extras = [p for p in public if p.kind == p.KEYWORD_ONLY and p.name != "out"]
        engine_only = ["output_width"] if name == "qsa_expand_block_indices" else []
        own = [] if name == "qsa_expand_block_indices" else ["block_size"]
        assert [p.name for p in ours] == ([p.name for p in positional] + engine_only + [p.name for p in extras]
                                          + own)
        assert [p for p in ours if p.name not in engine_only + own] == positional + extras
        assert all(p.kind == p.KEYWORD_ONLY and p.default is None for p in ours if p.name in own)


def test_the_drop_ins_reject_what_their_signatures_do_not_take(installed, rng):
    module, _ = installed
    args = batch_of(rng).args()
    with pytest.raises(TypeError, match="`out`|'out'"):
        module.qsa_paged_mqa_logits(*args[:6], R, out=torch.empty(0))  # the engine's scoring op has no `out`
    with pytest.raises(TypeError, match="'backend'"):
        module.qsa_select_paged_tokens(*args[:6], 64, R, backend="auto")
    with pytest.raises(TypeError, match="multiple values for argument 'output_width'"):
        module.qsa_expand_block_indices(args[3][:, None], *args[4:6], args[3], R, 64, None, 67, output_width=67)


def test_engine_selection_compiles_with_fullgraph(installed, rng):
    """The engine compiles its model: dynamo traces the drop-in (argument binding included) without a graph break,
    recording the custom op."""
    _, consumer = installed
    args = batch_of(rng).args()[:6]
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: consumer.qsa_select_paged_tokens(*a, 64, R, max_seq_len=1024, phase="verify"),
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(*args), consumer.qsa_select_paged_tokens(*args, 64, R, max_seq_len=1024))


# ---------------------------------------------------------------------------------------------------------------
# The engine's calls, through the installed names
# ---------------------------------------------------------------------------------------------------------------


def test_engine_scoring_call_positional_with_row_starts_and_padding(installed, rng):
    module, _ = installed
    batch = batch_of(rng)
    args = batch.args()
    tokens = args[0].shape[0]
    row_starts = torch.full((tokens,), 11, dtype=torch.int32)
    logits, visible = module.qsa_paged_mqa_logits(*args[:6], R, None, 300, row_starts)
    assert logits.shape == (tokens, 300) and not bool(row_starts.any())
    assert bool((visible[-2:] == 0).all()), "padded rows see nothing"
    assert_matches_reference(logits, visible, *qsa_aiter.reference_paged_mqa_logits(*args[:6], R, max_columns=300))


@pytest.mark.parametrize("max_columns,expected", [(10**6, "capacity"), (0, 1)])
def test_engine_scoring_clamps_max_columns_like_the_engine(installed, rng, max_columns, expected):
    module, _ = installed
    args = batch_of(rng).args()
    capacity = args[2].shape[1] * args[1].shape[1]
    logits, visible = module.qsa_paged_mqa_logits(*args[:6], R, max_columns=max_columns)
    columns = capacity if expected == "capacity" else expected
    assert logits.shape[1] == columns
    assert_matches_reference(logits, visible, *qsa_aiter.reference_paged_mqa_logits(*args[:6], R,
                                                                                    max_columns=columns))
    with pytest.raises(TypeError, match="`max_columns`"):
        module.qsa_paged_mqa_logits(*args[:6], R, max_columns=2.5)


def test_engine_selection_call_as_the_attention_layer_makes_it(installed, rng):
    """``qsa_select_paged_tokens(index_q, cache, block_tables, token_to_req, positions, seq_lens, topk, R,
    max_seq_len=...)``, called through the name the attention module bound at import."""
    _, consumer = installed
    batch = batch_of(rng, table_width=12)  # 768 groups of capacity
    args = batch.args()
    got = consumer.qsa_select_paged_tokens(*args[:6], 128, R, max_seq_len=1500)
    assert got.shape == (args[0].shape[0], 128 + R - 1)
    assert torch.equal(got, expected_selection(args, 128, columns=512))  # bucket of ceil(1500 / 4) = 512 groups
    assert bool((got[-2:] == -1).all()), "padded rows select nothing"


def test_max_seq_len_gives_a_constant_narrower_width(installed, rng):
    """A decode graph pins ``max_seq_len``: the width (here bounded by the bucket, 128 groups) is the same for every
    context up to it, and the dropped columns would have been ``-1``."""
    module, _ = installed
    for contexts in ((300, 200), (500, 12), (511, 400)):
        batch = batch_of(rng, contexts, (1, 1), padded=1, table_width=40)
        args = batch.args()
        got = module.qsa_select_paged_tokens(*args[:6], 2048, R, max_seq_len=512)
        assert got.shape == (3, 128 * R + R - 1)
        full = expected_selection(args, 2048, columns=128)
        assert torch.equal(got, full[:, :got.shape[1]]) and bool((full[:, got.shape[1]:] == -1).all())


def test_selection_out_wider_narrower_and_too_narrow(installed, rng):
    module, _ = installed
    args = batch_of(rng).args()
    tokens, full = args[0].shape[0], 64 + R - 1
    want = expected_selection(args, 64)
    wide = torch.full((tokens, full + 5), -7, dtype=torch.int32)
    got = module.qsa_select_paged_tokens(*args[:6], 64, R, wide)
    assert got.data_ptr() == wide.data_ptr() and torch.equal(got, want)
    assert bool((wide[:, full:] == -7).all()), "nothing written past the width"
    # Narrower than the full width but as wide as the engine's bound (max_seq_len 64 tokens: 16 groups).
    narrow = torch.full((tokens, 16 * R + R - 1), -7, dtype=torch.int32)
    got = module.qsa_select_paged_tokens(*args[:6], 2048, R, narrow, max_seq_len=64)
    assert got.data_ptr() == narrow.data_ptr()
    assert torch.equal(got, expected_selection(args, 2048, columns=16)[:, :narrow.shape[1]])
    short = torch.full((tokens, full - 1), -7, dtype=torch.int32)
    with pytest.raises(ValueError, match="`out`"):
        module.qsa_select_paged_tokens(*args[:6], 64, R, short)
    assert bool((short == -7).all()), "a rejected call writes nothing"


def test_selection_returns_the_callers_out_and_no_extra_view(installed, rng):
    """Where the width is the full ``token_topk + R - 1``, the result is ``out`` itself (or the op's own tensor):
    no view is made per call."""
    module, _ = installed
    args = batch_of(rng).args()
    tokens, full = args[0].shape[0], 64 + R - 1
    out = torch.full((tokens, full), -7, dtype=torch.int32)
    assert module.qsa_select_paged_tokens(*args[:6], 64, R, out) is out
    assert torch.equal(out, expected_selection(args, 64))
    fresh = module.qsa_select_paged_tokens(*args[:6], 64, R)
    assert fresh._base is None and fresh.shape == (tokens, full) and torch.equal(fresh, out)


# ---------------------------------------------------------------------------------------------------------------
# The engine's block size (tokens) beside the cache's page size (compressed key groups)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size, ratio, page_size", [(64, 4, 16), (256, 4, 64), (64, 1, 64), (24, 8, 3)])
def test_a_block_in_tokens_is_a_page_of_compressed_groups(block_size, ratio, page_size):
    assert atom.page_size_of_block(block_size, ratio) == page_size


@pytest.mark.parametrize("block_size, ratio, exc, message", [
    (66, 4, ValueError, r"`block_size` must be a multiple of compress_ratio \(4\).*got 66"),
    (0, 4, ValueError, r"`block_size` must be >= 1; got 0"),
    (64.0, 4, TypeError, r"`block_size` must be an int"),
    (64, 0, ValueError, r"`compress_ratio` must be >= 1"),
])
def test_a_block_size_that_is_no_page_is_refused(block_size, ratio, exc, message):
    with pytest.raises(exc, match=message):
        atom.page_size_of_block(block_size, ratio)


def test_the_drop_ins_take_the_engines_block_size(installed, rng):
    """``block_size`` (tokens per KV block, the engines' term) is checked against the cache's page (``page_size``
    compressed groups x R) and changes nothing else; a block that disagrees, or splits a group, is named."""
    module, consumer = installed
    batch = batch_of(rng, page_size=16)
    args = batch.args()
    logits, visible = module.qsa_paged_mqa_logits(*args[:6], R, block_size=64)
    assert_matches_reference(logits, visible, *qsa_aiter.reference_paged_mqa_logits(*args[:6], R))
    picked = consumer.qsa_select_paged_tokens(*args[:6], 64, R, block_size=64)
    assert torch.equal(picked, expected_selection(args, 64))
    for call in (lambda b: module.qsa_paged_mqa_logits(*args[:6], R, block_size=b),
                 lambda b: consumer.qsa_select_paged_tokens(*args[:6], 64, R, block_size=b)):
        with pytest.raises(ValueError, match=r"`block_size` must be 64 tokens, the page of compressed_k_cache "
                                             r"\(16 compressed key groups x compress_ratio 4\); got 16 \(4 groups"):
            call(16)  # the page size in groups given as the block size: the engines' usual mix-up
        with pytest.raises(ValueError, match=r"`block_size` must be a multiple of compress_ratio \(4\)"):
            call(62)


@pytest.mark.parametrize("output_width", [None, 20, 80])
def test_engine_expansion_with_output_width(installed, rng, output_width):
    module, _ = installed
    args = batch_of(rng).args()
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args[:6], R)
    groups = qsa_aiter.qsa_block_topk(logits, visible, 16)
    full = reference_expand_block_indices(groups, args[4], args[5], args[3], R, 64)
    width = output_width or full.shape[1]
    out = torch.full((groups.shape[0], width), -7, dtype=torch.int32)
    got = module.qsa_expand_block_indices(groups, args[4], args[5], args[3], R, 64, out, output_width)
    assert got is out
    keep = min(width, full.shape[1])
    assert torch.equal(got[:, :keep], full[:, :keep]) and bool((got[:, keep:] == -1).all())
    assert torch.equal(module.qsa_expand_block_indices(groups, args[4], args[5], args[3], R, 64,
                                                       output_width=output_width), got)
    with pytest.raises(ValueError, match="`out`"):
        module.qsa_expand_block_indices(groups, args[4], args[5], args[3], R, 64, out[:, :-1], output_width)


def test_engine_selection_with_a_quantised_cache_and_hints(installed, rng):
    """The keyword-only extras reach the op: an fp8 cache with its scales, and the phase hints."""
    module, _ = installed
    batch = batch_of(rng, cache="fp8")
    args = batch.args()
    got = module.qsa_select_paged_tokens(*args[:6], 64, R, k_scale=batch.k_scale, phase="verify", max_query_len=4)
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args[:6], R, k_scale=batch.k_scale)
    groups = reference_block_topk(logits, visible, 16)
    assert torch.equal(got, reference_expand_block_indices(groups, args[4], args[5], args[3], R, 64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
def test_engine_decode_graph_is_captured_once_and_replayed(installed):
    """The engine's decode step with ``max_seq_len`` pinned: one CUDA graph, new lengths and queries per replay."""
    _, consumer = installed
    gen = torch.Generator().manual_seed(4)
    batch = make_batch([20000] * 6, 1, padded_rows=2, page_size=16, device="cuda", generator=gen)
    q, cache, table, t2r, pos, ctx = batch.args()[:6]
    call = lambda: consumer.qsa_select_paged_tokens(q, cache, table, t2r, pos, ctx, 2048, R,  # noqa: E731
                                                    max_seq_len=20000)
    graph, captured = capture_graph(call)
    for step in range(3):
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        write_new_lengths(gen, ctx, pos, 100, 20000, 1)
        graph.replay()
        eager = qsa_aiter.qsa_select_paged_tokens(q, cache, table, t2r, pos, ctx, 2048, R, max_seq_len=20000)
        assert torch.equal(captured, eager[:, :captured.shape[1]]), f"replay {step}"
        assert bool((eager[:, captured.shape[1]:] == -1).all())

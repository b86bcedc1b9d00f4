"""The ``torch.ops.qsa_aiter`` custom ops: schemas with declared mutations, fake implementations, ``opcheck``,
equality with the eager ops, ``torch.compile(fullgraph=True)`` of a small indexer module, and (GPU) CUDA-graph
capture and compilation through them.

On the CPU the op bodies run the Triton kernels under the interpreter (``TRITON_INTERPRET=1``, set by conftest).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import qsa_aiter
from qsa_aiter.ops import custom_ops, traced
from qsa_aiter.kernels.quant.formats import allocate_index_cache
from qsa_aiter.tools.timing import capture_graph
from qsa_aiter.tools.workloads import make_batch

from helpers import assert_matches_reference, visible_mask, write_new_lengths

ON_GPU = torch.cuda.is_available()
R = 4
TOPK = 64  # tokens: 16 groups


def small_batch(gen, device="cpu", **kw):
    """A verify-shaped batch with uneven contexts, a request shorter than the budget and padded rows."""
    kw.setdefault("head_dim", 32)
    kw.setdefault("page_size", 16)
    return make_batch([300, 520, 90], [4, 3, 1], padded_rows=2, device=device, generator=gen, **kw)


def schema(name: str) -> str:
    return str(getattr(torch.ops.qsa_aiter, name).default._schema)


# ---------------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------------

#: op -> the arguments it declares as written in place.
MUTATIONS = {
    "paged_mqa_logits": {"row_starts"}, "paged_mqa_logits_out": {"row_starts", "out"},
    "block_topk": set(), "block_topk_out": {"out"},
    "expand_block_indices": set(), "expand_block_indices_out": {"out"},
    "select_paged_tokens": set(), "select_paged_tokens_out": {"out"},
    "write_index_cache": {"cache", "k_scale"},
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_schema_declares_exactly_the_written_arguments(name):
    op = getattr(torch.ops.qsa_aiter, name).default
    written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == MUTATIONS[name], schema(name)
    assert not any(r.alias_info for r in op._schema.returns), "no op returns one of its inputs"


_SCORING_ARGS = ("Tensor q, Tensor compressed_k_cache, Tensor page_table, Tensor token_to_request, "
                 "Tensor query_positions, Tensor context_lens")
_HINTS = "Tensor? k_scale, str? phase, SymInt? max_query_len"
_EXPAND_ARGS = ("Tensor block_indices, Tensor query_positions, Tensor context_lens, Tensor token_to_request, "
                "SymInt compress_ratio, SymInt token_topk")
#: The registered schemas, generated from the public signatures (the contract with compiled graphs and engines).
SCHEMAS = {
    "paged_mqa_logits": f"({_SCORING_ARGS}, SymInt compress_ratio, float? score_divisor, SymInt? max_columns, "
                        f"Tensor(a9!)? row_starts, {_HINTS}) -> (Tensor, Tensor)",
    "paged_mqa_logits_out": f"({_SCORING_ARGS}, SymInt compress_ratio, float? score_divisor, SymInt? max_columns, "
                            f"Tensor(a9!)? row_starts, {_HINTS}, Tensor(a13!) out) -> Tensor",
    "block_topk": "(Tensor logits, Tensor visible, SymInt block_topk) -> Tensor",
    "block_topk_out": "(Tensor logits, Tensor visible, SymInt block_topk, Tensor(a3!) out) -> ()",
    "expand_block_indices": f"({_EXPAND_ARGS}) -> Tensor",
    "expand_block_indices_out": f"({_EXPAND_ARGS}, Tensor(a6!) out) -> ()",
    "select_paged_tokens": f"({_SCORING_ARGS}, SymInt token_topk, SymInt compress_ratio, "
                           f"SymInt? logits_workspace_bytes, SymInt? max_seq_len, {_HINTS}) -> Tensor",
    "select_paged_tokens_out": f"({_SCORING_ARGS}, SymInt token_topk, SymInt compress_ratio, "
                               f"SymInt? logits_workspace_bytes, SymInt? max_seq_len, {_HINTS}, Tensor(a13!) out) -> ()",
    "write_index_cache": "(Tensor keys, Tensor slot_mapping, Tensor(a2!) cache, Tensor(a3!)? k_scale) -> ()",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schemas_are_the_documented_ones(name):
    """Generated from the public signatures, equal to the hand-written ones they replaced, and listed (wrapped) in
    ``custom_ops``' docstring."""
    assert sorted(SCHEMAS) == sorted(MUTATIONS)
    assert schema(name) == f"qsa_aiter::{name}{SCHEMAS[name]}"
    assert schema(name) in " ".join(custom_ops.__doc__.split()), "the module docstring lists every schema"


@pytest.mark.parametrize("declaration", custom_ops.DECLARATIONS, ids=lambda d: d.name)
def test_ops_take_the_public_parameters_in_order(declaration):
    """The op: the public parameters but ``out``, positional; the ``_out`` variant: the same, then ``out``."""
    public = [name for name in inspect.signature(declaration.public).parameters if name != "out"]
    names = [a.name for a in getattr(torch.ops.qsa_aiter, declaration.name).default._schema.arguments]
    assert names == public
    if "out" in inspect.signature(declaration.public).parameters:
        variant = getattr(torch.ops.qsa_aiter, f"{declaration.name}_out").default._schema
        assert [a.name for a in variant.arguments] == public + ["out"]


@pytest.mark.parametrize("name", sorted(traced.TRACED))
def test_wrappers_keep_the_public_signatures(name):
    """Every public function that becomes its custom op when traced has a declaration, and its wrapper here takes
    the same parameters (names, order, kinds, defaults, annotations) and has the same return annotation."""
    assert name in {d.public.__name__ for d in custom_ops.DECLARATIONS}
    wrapper = getattr(custom_ops, name)
    assert inspect.signature(wrapper) == inspect.signature(getattr(qsa_aiter, name))
    assert (wrapper.__name__, wrapper.__module__) == (name, "qsa_aiter.ops.custom_ops")


def test_every_declared_op_is_traced_through_its_wrapper():
    assert {d.public.__name__ for d in custom_ops.DECLARATIONS} == set(traced.TRACED)
    assert all(d.public is traced.TRACED[d.public.__name__] for d in custom_ops.DECLARATIONS)
    assert set(traced.TRACED) <= set(custom_ops.__all__)


def test_wrappers_reject_the_calls_the_public_functions_reject(rng):
    b = small_batch(rng)
    a = b.args()
    for call in (lambda api: api.qsa_paged_mqa_logits(*a[:6], 4, None, None, None, None),  # k_scale is keyword-only
                 lambda api: api.qsa_select_paged_tokens(*a[:6], token_topk=TOPK, bogus=1),
                 lambda api: api.qsa_block_topk(a[0], a[3], 4, block_topk=4),
                 lambda api: api.qsa_write_index_cache(a[0])):
        for api in (qsa_aiter, custom_ops):
            with pytest.raises(TypeError, match="argument"):
                call(api)


# ---------------------------------------------------------------------------------------------------------------
# opcheck: schema, fake tensors, and AOT dispatch with dynamic shapes
# ---------------------------------------------------------------------------------------------------------------


def opcheck_case(gen, name: str):
    """``(args, test_utils)`` for ``opcheck`` of op ``name`` (``test_utils`` None: every check)."""
    b = small_batch(gen)
    a = b.args()
    tokens = a[0].shape[0]
    columns = a[2].shape[1] * a[1].shape[1]
    rows = torch.full((tokens,), 7, dtype=torch.int32)
    if name == "paged_mqa_logits":
        # The functional scoring op leaves columns past `visible` unwritten (torch.empty): its outputs are not
        # comparable run to run there, so it skips the eager-vs-AOT comparison; the `_out` variant covers it.
        return (*a, None, None, rows, None, "verify", 4), ("test_schema", "test_autograd_registration",
                                                             "test_faketensor")
    if name == "paged_mqa_logits_out":
        return (*a, None, 40, rows, None, None, None, torch.zeros(tokens, 40)), None
    if name == "select_paged_tokens":
        return (*a[:6], TOPK, R, None, None, None, None, None), None  # the bound chosen when it runs
    if name == "select_paged_tokens_out":  # rows chunked (3 per chunk), a fixed width, phase hints
        return (*a[:6], TOPK, R, 4 * columns * 3, columns * R - 8, None, "verify", 4,
                torch.zeros(tokens, TOPK + R - 1, dtype=torch.int32)), None
    if name == "write_index_cache":
        # A 16-bit cache: opcheck clones and compares the written tensors, which CPU torch cannot do for fp8.
        keys = torch.randn(5, a[0].shape[2], generator=gen).to(torch.bfloat16)
        cache, scale = allocate_index_cache("bf16", 3, 16, a[0].shape[2])
        return (keys, torch.tensor([0, 17, -1, 40, 5]), cache, scale), None
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*a)
    # Columns past `visible` are never written: zero them so runs compare equal there.
    logits = torch.where(visible_mask(visible, columns), logits, torch.zeros_like(logits))
    if name == "block_topk_out":
        return (logits, visible, TOPK // R, torch.zeros(tokens, TOPK // R, dtype=torch.int32)), None
    groups = qsa_aiter.qsa_block_topk(logits, visible, TOPK // R)
    return (groups, a[4], a[5], a[3], R, TOPK), None


@pytest.mark.parametrize("name", ["paged_mqa_logits", "paged_mqa_logits_out", "block_topk_out",
                                  "expand_block_indices", "select_paged_tokens", "select_paged_tokens_out",
                                  "write_index_cache"])
def test_opcheck(rng, name):
    args, utils = opcheck_case(rng, name)
    kwargs = {} if utils is None else {"test_utils": utils}
    result = torch.library.opcheck(getattr(torch.ops.qsa_aiter, name).default, args, **kwargs)
    assert set(result.values()) == {"SUCCESS"}, result


# ---------------------------------------------------------------------------------------------------------------
# Fake implementations: shapes and dtypes without data; validation at trace time
# ---------------------------------------------------------------------------------------------------------------


def test_fake_implementations_give_shapes_and_dtypes(rng):
    b = small_batch(rng)
    with FakeTensorMode() as mode:
        a = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in b.args())
        tokens, columns = a[0].shape[0], a[2].shape[1] * a[1].shape[1]
        logits, visible = custom_ops.qsa_paged_mqa_logits(*a)
        assert (logits.shape, logits.dtype, visible.shape, visible.dtype) == \
            ((tokens, columns), torch.float32, (tokens,), torch.int32)
        logits, _ = custom_ops.qsa_paged_mqa_logits(*a, max_columns=33)
        assert logits.shape == (tokens, 33)
        groups = custom_ops.qsa_block_topk(logits, visible, 9)
        assert (groups.shape, groups.dtype) == ((tokens, 9), torch.int32)
        tokens_out = custom_ops.qsa_expand_block_indices(groups, a[4], a[5], a[3], R, 36)
        assert tokens_out.shape == (tokens, 36 + R - 1) and tokens_out.dtype == torch.int32
        selected = custom_ops.qsa_select_paged_tokens(*a[:6], TOPK, R)
        assert selected.shape == (tokens, TOPK + R - 1) and selected.dtype == torch.int32


@pytest.mark.parametrize("call,name", [
    (lambda a: custom_ops.qsa_paged_mqa_logits(*a, max_columns=10**6), "max_columns"),
    (lambda a: custom_ops.qsa_paged_mqa_logits(*a[:6], 0), "compress_ratio"),
    (lambda a: custom_ops.qsa_paged_mqa_logits(a[0][:, :, :16].contiguous(), *a[1:]), "compressed_k_cache"),
    (lambda a: custom_ops.qsa_select_paged_tokens(*a[:6], 66, R), "token_topk"),
    (lambda a: custom_ops.qsa_select_paged_tokens(*a[:6], TOPK, R, max_seq_len=0), "max_seq_len"),
    (lambda a: custom_ops.qsa_expand_block_indices(a[3][:, None], a[4], a[5], a[3], R, 6), "token_topk"),
])
def test_fake_implementations_reject_bad_arguments_by_name(rng, call, name):
    """Under fake tensors (tracing) a bad argument fails with the eager op's error, which names it."""
    b = small_batch(rng)
    with FakeTensorMode() as mode:
        a = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in b.args())
        with pytest.raises((ValueError, TypeError), match=f"`{name}`"):
            call(a)


# ---------------------------------------------------------------------------------------------------------------
# The wrappers equal the eager ops
# ---------------------------------------------------------------------------------------------------------------


def test_wrappers_equal_the_eager_ops_and_write_in_place(rng):
    b = small_batch(rng)
    a = b.args()
    tokens = a[0].shape[0]
    ref_logits, ref_visible = qsa_aiter.qsa_paged_mqa_logits(*a, max_columns=48)
    rows = torch.full((tokens,), 9, dtype=torch.int32)
    out = torch.full((tokens, 48), float("nan"))
    logits, visible = custom_ops.qsa_paged_mqa_logits(*a, None, 48, rows, out=out)
    assert logits is out and not bool(rows.any())
    assert_matches_reference(logits, visible, ref_logits, ref_visible, rtol=0, atol=0)
    expected = qsa_aiter.qsa_select_paged_tokens(*a[:6], TOPK, R)
    sel_out = torch.full((tokens, TOPK + R - 1), -7, dtype=torch.int32)
    assert custom_ops.qsa_select_paged_tokens(*a[:6], TOPK, R, out=sel_out) is sel_out
    assert torch.equal(sel_out, expected)
    assert torch.equal(custom_ops.qsa_select_paged_tokens(*a[:6], TOPK, R), expected)
    assert bool((expected[-2:] == -1).all()), "padded rows select nothing"


def test_writer_op_writes_the_cache_and_scales_in_place(rng):
    keys = torch.randn(6, 64, generator=rng).to(torch.bfloat16)
    slots = torch.tensor([0, 5, -1, 31, 12, 2])
    expected = allocate_index_cache("fp4", 2, 16, 64)
    qsa_aiter.qsa_write_index_cache(keys, slots, *expected)
    cache, scale = allocate_index_cache("fp4", 2, 16, 64)
    custom_ops.qsa_write_index_cache(keys, slots, cache, scale)
    assert torch.equal(cache.view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8), expected[1].view(torch.uint8))


# ---------------------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ---------------------------------------------------------------------------------------------------------------


class Indexer(torch.nn.Module):
    """Score -> block top-k -> expansion, beside the fused selection written into a caller's buffer, through ``api``:
    ``custom_ops``, or the plain public functions (``qsa_aiter``), which become the custom ops when traced."""

    def __init__(self, api=custom_ops):
        super().__init__()
        self.api = api

    def forward(self, q, cache, page_table, token_to_request, positions, context_lens, selected, row_starts):
        api = self.api
        q = q.view(q.shape[0], -1).view(q.shape)  # glue the graph must carry around the ops
        logits, visible = api.qsa_paged_mqa_logits(q, cache, page_table, token_to_request, positions, context_lens,
                                                   R, None, None, row_starts)
        groups = api.qsa_block_topk(logits, visible, TOPK // R)
        tokens = api.qsa_expand_block_indices(groups, positions, context_lens, token_to_request, R, TOPK)
        api.qsa_select_paged_tokens(q, cache, page_table, token_to_request, positions, context_lens, TOPK, R,
                                    out=selected, phase="verify", max_query_len=4)
        return visible, tokens


def indexer_inputs(batch):
    tokens = batch.q.shape[0]
    return (*batch.args()[:6], torch.full((tokens, TOPK + R - 1), -7, dtype=torch.int32, device=batch.q.device),
            torch.full((tokens,), 3, dtype=torch.int32, device=batch.q.device))


def check_compiled_indexer(batch, api=custom_ops, **compile_kwargs):
    torch._dynamo.reset()
    eager_inputs, compiled_inputs = indexer_inputs(batch), indexer_inputs(batch)
    eager = Indexer(api)(*eager_inputs)
    compiled = torch.compile(Indexer(api), fullgraph=True, **compile_kwargs)(*compiled_inputs)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
    assert torch.equal(compiled_inputs[6], eager_inputs[6]), "the selection is written into `selected`"
    assert torch.equal(compiled[1], compiled_inputs[6]), "fused selection == score, top-k, expand"
    assert not bool(compiled_inputs[7].any()), "row_starts is zeroed"
    return compiled


def test_compiled_indexer_has_no_graph_breaks_and_matches_eager(rng):
    # Views only around the ops: inductor then needs no C++ kernel build, which would add ~40 s on a CI CPU.
    check_compiled_indexer(small_batch(rng))


def test_the_plain_public_functions_compile_with_fullgraph(rng):
    """Engines compile model code that calls ``qsa_aiter.qsa_*`` by name: traced, each becomes its custom op."""
    batch = small_batch(rng)
    check_compiled_indexer(batch, api=qsa_aiter)
    args = batch.args()[:6]
    torch._dynamo.reset()
    score = torch.compile(lambda *a: qsa_aiter.qsa_paged_mqa_logits(*a, 4), fullgraph=True)
    (logits, visible), (want_logits, want_visible) = score(*args), qsa_aiter.qsa_paged_mqa_logits(*args, 4)
    region = visible_mask(want_visible, want_logits.shape[1])  # columns past visible are not written
    assert torch.equal(visible, want_visible) and torch.equal(logits[region], want_logits[region])
    keys = torch.randn(6, 64, generator=rng).to(torch.bfloat16)
    slots = torch.tensor([0, 5, -1, 31, 12, 5])
    expected, cache = allocate_index_cache("fp8", 2, 16, 64), allocate_index_cache("fp8", 2, 16, 64)
    qsa_aiter.qsa_write_index_cache(keys, slots, *expected)
    torch.compile(lambda *a: qsa_aiter.qsa_write_index_cache(*a), fullgraph=True)(keys, slots, *cache)
    for got, want in zip(cache, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


# ---------------------------------------------------------------------------------------------------------------
# GPU: CUDA-graph capture and torch.compile through the custom ops
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA/HIP GPU")
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_custom_ops_are_captured_in_a_cuda_graph_and_replayed(cache):
    """One graph holding the writer, scoring and selection ops; new queries, keys and lengths before each replay."""
    gen = torch.Generator().manual_seed(5)
    batch = make_batch([30000] * 8, 4, page_size=64, device="cuda", generator=gen, cache=cache)
    q, kc, table, t2r, pos, ctx = batch.args()[:6]
    tokens, head_dim = q.shape[0], q.shape[2]
    keys = torch.randn(tokens, head_dim, device="cuda").to(torch.bfloat16)
    slots = torch.arange(tokens, device="cuda") * 7
    logits = torch.empty((tokens, 30000 // R), device="cuda")
    selected = torch.empty((tokens, 2048 + R - 1), dtype=torch.int32, device="cuda")
    row_starts = torch.empty(tokens, dtype=torch.int32, device="cuda")
    extra = dict(k_scale=batch.k_scale, phase="verify", max_query_len=4)

    def step():
        custom_ops.qsa_write_index_cache(keys, slots, kc, batch.k_scale)
        _, vis = custom_ops.qsa_paged_mqa_logits(q, kc, table, t2r, pos, ctx, R, None, 30000 // R, row_starts,
                                                 out=logits, **extra)
        custom_ops.qsa_select_paged_tokens(q, kc, table, t2r, pos, ctx, 2048, R, out=selected, max_seq_len=30000,
                                           **extra)
        return vis

    graph, visible = capture_graph(step)
    for replay in range(3):
        q.copy_(torch.randn(q.shape, generator=gen).to(q.dtype))
        keys.copy_(torch.randn(keys.shape, generator=gen).to(keys.dtype))
        write_new_lengths(gen, ctx, pos, 2000, 30000, 4)
        row_starts.fill_(5)
        want_cache = kc.clone()
        want_scale = None if batch.k_scale is None else batch.k_scale.clone()
        qsa_aiter.qsa_write_index_cache(keys, slots, want_cache, want_scale)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(kc.view(torch.uint8), want_cache.view(torch.uint8)), f"replay {replay}: cache"
        if want_scale is not None:
            assert torch.equal(batch.k_scale, want_scale), f"replay {replay}: scales"
        ref_logits, ref_visible = qsa_aiter.qsa_paged_mqa_logits(q, kc, table, t2r, pos, ctx, R,
                                                                 max_columns=30000 // R, **extra)
        assert torch.equal(visible, ref_visible), f"replay {replay}"
        assert_matches_reference(logits, visible, ref_logits, ref_visible, rtol=0, atol=0, label=f"replay {replay}")
        eager = qsa_aiter.qsa_select_paged_tokens(q, kc, table, t2r, pos, ctx, 2048, R, max_seq_len=30000, **extra)
        assert torch.equal(selected, eager), f"replay {replay}"
        assert not bool(row_starts.any())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA/HIP GPU")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_indexer_on_gpu(mode):
    """fullgraph compile with inductor on the GPU; ``reduce-overhead`` also records CUDA graphs around the ops."""
    batch = make_batch([9000, 15000, 500], 4, page_size=64, device="cuda", generator=torch.Generator().manual_seed(2))
    compiled = check_compiled_indexer(batch, mode=mode)
    assert compiled[1].device.type == "cuda"

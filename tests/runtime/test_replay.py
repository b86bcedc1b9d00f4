"""The host path's plan cache (``qsa_aiter.runtime.replay``): a repeated call replays its first call's launches, and
every change that could make a plan stale misses it.

On the CPU the interpreter compiles nothing, so the ``replaying`` fixture stands a recorder in for the compiled
kernels: the first call's launches are recorded as usual, and a replay runs the interpreted kernel on the arguments
the cached plan built (with the recorded grid and constexprs), each pointer argument (an integer address) rebuilt as a
tensor over that memory with the layout of the recorded call's tensor. That checks what the cache adds: the
signature, the addresses (a wrong scratch offset reads the wrong memory), the recorded scalars and the invalidation.
The GPU test at the end runs the real compiled kernels.
"""

from __future__ import annotations

import ctypes
import inspect

import pytest

import torch

import qsa_aiter
from qsa_aiter.runtime import replay, dispatch
from qsa_aiter.kernels import spec
from qsa_aiter.kernels.cache import writer
from qsa_aiter.kernels.cache.reference import write_reference
from qsa_aiter.runtime.jit import triton_compat
from qsa_aiter.kernels.quant.formats import allocate_index_cache
from qsa_aiter.ops import selection_plans as plans
from qsa_aiter.kernels.selection.reference import reference_block_topk, reference_expand_block_indices
from qsa_aiter.tools.testing import poisoned_logits
from qsa_aiter.tools.workloads import make_batch
from qsa_aiter.runtime import tuned

from helpers import check_call, reference_of

TOKEN_TOPK = 60  # 15 groups of R = 4 (an odd count: the replay's scratch parts stay aligned)


class _Recorded:
    """Stands in for a compiled kernel: its replays run the plan's (interpreted) function; ``args`` are the recorded
    call's positional arguments."""

    def __init__(self, plan, args):
        self.plan, self.args, self.replays = plan, args, 0


def _over(address: int, like: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the memory at ``address`` laid out as ``like`` (same dtype, shape and strides)."""
    span = 1 + sum((n - 1) * s for n, s in zip(like.shape, like.stride())) if like.numel() else 0
    nbytes = span * like.element_size()
    raw = torch.frombuffer((ctypes.c_char * max(nbytes, 1)).from_address(address), dtype=torch.uint8)
    return raw[:nbytes].view(like.dtype).as_strided(like.shape, like.stride())


class _Launches(list):
    failing: set


@pytest.fixture
def replaying(monkeypatch):
    """Record each launch with a stand-in kernel, and count the replays; yields the list of stand-ins."""
    recorded = _Launches()
    recorded.failing = set()  # kernels whose launch raises, as a kernel that fails to compile would

    def launch(self, *args):
        if self.kernel in recorded.failing:
            raise RuntimeError(f"{self.kernel} does not compile here")
        self.fn[self.grid](*args, **self.constexprs, **self.options)
        launches = spec._recording.get()
        if launches is not None:
            recorded.append(_Recorded(self, args))
            launches.append(spec.RecordedLaunch(self, recorded[-1], args))

    def launcher(kernel, grid, device):
        def run(params):
            assert all(isinstance(p, int) for p, a in zip(params, kernel.args) if isinstance(a, torch.Tensor))
            kernel.replays += 1
            tensors = [_over(p, a) if isinstance(a, torch.Tensor) else p for p, a in zip(params, kernel.args)]
            kernel.plan.fn[grid](*tensors, *params[len(tensors):], **kernel.plan.options)
        return run

    monkeypatch.setattr(spec.LaunchPlan, "launch", launch)
    monkeypatch.setattr(triton_compat, "compiled_launcher", launcher)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    replay.clear()
    yield recorded
    replay.clear()


def _verify_batch(gen):
    batch = make_batch([700, 1201, 403], [4, 3, 4], padded_rows=2, page_size=16, head_dim=64, generator=gen)
    return batch.args(), dict(phase="verify", max_query_len=batch.max_query_len)


def _replays(recorded) -> int:
    return sum(r.replays for r in recorded)


def test_a_repeated_scoring_call_replays_its_plan_and_matches_the_reference(replaying, rng):
    args, hints = _verify_batch(rng)
    check_call(args, **hints)
    assert replay.size() == 1 and _replays(replaying) == 0
    args[0].copy_(torch.randn(args[0].shape, generator=rng).to(args[0].dtype))  # new queries, same signature
    logits, visible = check_call(args, **hints)
    assert replay.size() == 1 and _replays(replaying) == 1
    # Without `out`: the plan allocates the logits (a new signature, recorded once, then replayed).
    for expected in (1, 2):
        logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args, **hints)
        assert _replays(replaying) == expected
    ref_logits, ref_visible = reference_of(args)
    assert torch.equal(visible, ref_visible)
    mask = torch.arange(logits.shape[1])[None, :] < visible[:, None]
    torch.testing.assert_close(logits[mask], ref_logits[mask], rtol=1e-5, atol=1e-5)


def test_row_starts_are_zeroed_on_replay(replaying, rng):
    args, hints = _verify_batch(rng)
    row_starts = torch.full((args[0].shape[0],), 7, dtype=torch.int32)
    for _ in range(2):
        row_starts.fill_(7)
        qsa_aiter.qsa_paged_mqa_logits(*args, row_starts=row_starts, out=poisoned_logits(args), **hints)
        assert torch.equal(row_starts, torch.zeros_like(row_starts))
    assert _replays(replaying) == 1


def _reference_selection(args, token_topk):
    """The selection of the torch reference's scores (its oracles; for inputs without near-ties at the cut)."""
    q, cache, page_table, t2r, pos, ctx, ratio = args
    logits, visible = reference_of(args)
    groups = reference_block_topk(logits, visible, token_topk // ratio)
    return reference_expand_block_indices(groups, pos, ctx, t2r, ratio, token_topk)


def _validated_selection(args, hints, token_topk):
    """The selection through the validating path (the plan cache emptied first)."""
    replay.clear()
    return qsa_aiter.qsa_select_paged_tokens(*args[:6], token_topk, args[6], **hints)


def test_a_repeated_selection_call_replays_its_plan_and_matches_the_validating_path(replaying, rng):
    args, hints = _verify_batch(rng)
    out = torch.full((args[0].shape[0], TOKEN_TOPK + 3), -7, dtype=torch.int32)
    qsa_aiter.qsa_select_paged_tokens(*args[:6], TOKEN_TOPK, args[6], out=out, **hints)
    assert replay.size() == 1 and _replays(replaying) == 0
    args[0].copy_(torch.randn(args[0].shape, generator=rng).to(args[0].dtype))
    out.fill_(-7)
    again = qsa_aiter.qsa_select_paged_tokens(*args[:6], TOKEN_TOPK, args[6], out=out, **hints)
    assert _replays(replaying) == 2  # the scorer and the top-k
    assert again is out and torch.equal(again, _validated_selection(args, hints, TOKEN_TOPK))


def test_repeated_top_k_and_expansion_calls_replay_their_plans(replaying, rng):
    tokens, columns, block_topk = 6, 300, 15
    logits = torch.randn((tokens, columns), generator=rng)
    visible = torch.tensor([300, 0, 15, 16, 299, 120], dtype=torch.int32)
    groups = [qsa_aiter.qsa_block_topk(logits, visible, block_topk) for _ in range(2)]
    assert _replays(replaying) == 1 and torch.equal(groups[0], groups[1])
    assert torch.equal(groups[1], reference_block_topk(logits, visible, block_topk))
    positions = torch.tensor([1199, -1, 63, 64, 1197, 480])
    context_lens = torch.tensor([1200, 1198, 481])
    t2r = torch.tensor([0, -1, 2, 2, 1, 2])
    tokens_out = [qsa_aiter.qsa_expand_block_indices(groups[0], positions, context_lens, t2r, 4, TOKEN_TOPK)
                  for _ in range(2)]
    assert _replays(replaying) == 2
    assert torch.equal(tokens_out[1], reference_expand_block_indices(groups[0], positions, context_lens, t2r, 4,
                                                                     TOKEN_TOPK))


def test_a_repeated_top_k_of_long_rows_replays_its_block_maxima(replaying, rng):
    """Rows of at least ``MAXIMA_MIN_COLUMNS`` take the block maxima first: the replay puts them in its scratch
    after the candidates."""
    from qsa_aiter.kernels.selection.topk import MAXIMA_MIN_COLUMNS

    logits = torch.randn((2, MAXIMA_MIN_COLUMNS + 37), generator=rng)
    visible = torch.tensor([MAXIMA_MIN_COLUMNS + 37, 40000], dtype=torch.int32)
    groups = [qsa_aiter.qsa_block_topk(logits, visible, 15) for _ in range(2)]
    assert [r.plan.kernel for r in replaying] == ["block_maxima", "topk"] and _replays(replaying) == 2
    assert torch.equal(groups[1], reference_block_topk(logits, visible, 15))


@pytest.mark.parametrize("kind,fp8_dtype", [("bf16", None), ("fp8", torch.float8_e4m3fn), ("fp4", None)],
                         ids=["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_a_repeated_cache_write_replays_its_plan_and_matches_the_reference(replaying, rng, monkeypatch, kind,
                                                                           fp8_dtype, index_dtype):
    extra = {"fp8_dtype": fp8_dtype} if fp8_dtype else {}
    cache, scale = allocate_index_cache(kind, 4, 16, 64, **extra)
    want, want_scale = allocate_index_cache(kind, 4, 16, 64, **extra)

    def write(tokens: int) -> None:
        keys = torch.randn((tokens, 1, 64), generator=rng).to(torch.bfloat16)
        slots = torch.randperm(64, generator=rng)[:tokens].to(index_dtype)
        slots[3], slots[7] = -1, slots[2]  # a skipped key, a slot named twice
        qsa_aiter.qsa_write_index_cache(keys, slots, cache, scale)
        write_reference(keys[:, 0], slots, want, want_scale)
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
        if scale is not None:
            assert torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))

    for _ in range(3):
        write(10)
    assert (replay.size(), _replays(replaying)) == (1, 2)
    # A call longer than SCAN_MAX_TOKENS writes a deduplicated copy of its slots: no plan is kept for it.
    monkeypatch.setattr(writer, "SCAN_MAX_TOKENS", 8)
    for _ in range(2):
        write(12)
    assert (replay.size(), _replays(replaying)) == (1, 2)


def test_a_chunked_selection_is_not_cached(replaying, rng):
    args, hints = _verify_batch(rng)
    small = 4 * 8 * args[2].shape[1] * 16  # a workspace of 8 rows: several chunks
    for _ in range(2):
        got = qsa_aiter.qsa_select_paged_tokens(*args[:6], TOKEN_TOPK, args[6], logits_workspace_bytes=small,
                                                **hints)
        assert torch.equal(got, qsa_aiter.qsa_select_paged_tokens(*args[:6], TOKEN_TOPK, args[6], **hints))
        replay.clear()
    assert replay.size() == 0 and _replays(replaying) == 0


def _call(args, hints, **changes):
    kwargs = {**hints, **changes}
    return qsa_aiter.qsa_paged_mqa_logits(*args, **kwargs)


@pytest.mark.parametrize("change", ["settings", "reload", "broken", "index_dtype", "shape", "alignment", "ratio",
                                    "hint", "divisor"])
def test_every_change_of_what_a_plan_depends_on_misses_it(replaying, rng, monkeypatch, change):
    args, hints = _verify_batch(rng)
    _call(args, hints)
    _call(args, hints)
    assert (replay.size(), _replays(replaying)) == (1, 1)
    if change == "settings":
        monkeypatch.setenv("QSA_AITER_LOG_LEVEL", "error")  # any variable: a new settings object
    elif change == "reload":
        tuned.reload()
    elif change == "broken":
        dispatch.clear_broken()
    elif change == "index_dtype":
        args = args[:3] + tuple(t.long() for t in args[3:6]) + args[6:]
    elif change == "shape":
        args = (args[0][:-1], *args[1:3], args[3][:-1], args[4][:-1], *args[5:])
    extra = {}
    if change == "alignment":  # out 4 bytes past a 16-byte boundary: Triton specialises on the alignment
        out = poisoned_logits(args)
        extra["out"] = torch.empty(out.numel() + 1)[1:].view(out.shape)
    elif change == "ratio":
        args = args[:6] + (2,)
    elif change == "hint":
        extra["phase"] = "prefill"
    elif change == "divisor":
        extra["score_divisor"] = 3.0
    before = _replays(replaying)
    logits, visible = _call(args, hints, **extra)
    assert _replays(replaying) == before, f"a call after a change of {change} replayed a plan"
    ref_logits, ref_visible = reference_of(args, **{k: v for k, v in extra.items() if k == "score_divisor"})
    assert torch.equal(visible, ref_visible)


def test_a_kernel_that_failed_leaves_the_plan_of_the_kernel_that_served(replaying, rng):
    """The stacked scorer fails, is marked broken, the next in the order serves: the plan kept is that one's, and
    its replay matches the reference."""
    args, hints = _verify_batch(rng)
    replaying.failing.add("stacked")
    check_call(args, **hints)
    assert [r.plan.kernel for r in replaying] == ["keys_major"] and replay.size() == 1
    check_call(args, **hints)
    assert _replays(replaying) == 1


def test_the_cache_is_bounded_least_recently_used_first(replaying, rng, monkeypatch):
    monkeypatch.setattr(replay, "MAX_PLANS", 2)
    args, hints = _verify_batch(rng)
    for divisor in (2.0, 3.0, 2.0, 5.0):  # 2.0 is used again before 5.0 arrives: 3.0 is dropped
        _call(args, hints, score_divisor=divisor)
    assert replay.size() == 2
    before = _replays(replaying)
    _call(args, hints, score_divisor=2.0)
    assert _replays(replaying) == before + 1
    _call(args, hints, score_divisor=3.0)
    assert _replays(replaying) == before + 1


def test_bad_input_is_rejected_after_a_plan_exists(replaying, rng):
    args, hints = _verify_batch(rng)
    _call(args, hints)
    with pytest.raises(TypeError, match="page_table"):
        qsa_aiter.qsa_paged_mqa_logits(args[0], args[1], args[2].float(), *args[3:], **hints)
    with pytest.raises(TypeError, match="token_to_request"):
        qsa_aiter.qsa_paged_mqa_logits(*args[:3], [0, 1], *args[4:], **hints)
    with pytest.raises((TypeError, ValueError), match="max_query_len"):
        qsa_aiter.qsa_paged_mqa_logits(*args, phase="verify", max_query_len=[4])


def test_the_interpreter_caches_nothing(rng):
    """Without the stand-ins the interpreter's launches return no compiled kernel: nothing is kept."""
    replay.clear()
    args, hints = _verify_batch(rng)
    check_call(args, **hints)
    check_call(args, **hints)
    assert replay.size() == 0


class _Fn:
    """A ``@triton.jit`` kernel's stand-in: its parameter names and, as ``fn``'s signature, their defaults."""

    def __init__(self, *names, **defaults):
        self.arg_names = list(names)
        self.fn = lambda: None
        self.fn.__signature__ = inspect.Signature([
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=defaults.get(n, inspect.Parameter.empty))
            for n in names])


def _plan(kernel, fn, constexprs):
    return spec.LaunchPlan(kernel, fn, (1,), constexprs, {})


def test_direct_launches_take_only_the_expected_kernels_with_leading_pointers_and_trailing_constexprs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_compat, "compiled_launcher", lambda kernel, grid, device: None)
    fn = _Fn("x", "N", "BLOCK")
    x = torch.zeros(4)
    good = (_plan("a", fn, {"BLOCK": 4}), object(), (x, 3))
    other = (_plan("b", fn, {"BLOCK": 8}), object(), (x, 3))
    direct = replay.direct_launches([good, other], ("a", "b"))
    assert (len(direct[1].pointer_names), direct[1].tail) == (1, (3, 8))  # the recorded scalar, then the constexpr
    two = _Fn("x", "y", "N", "BLOCK")
    pair = replay.direct_launches([(_plan("a", two, {"BLOCK": 4}), object(), (x, x, 3))], ("a",))[0]
    assert pair.pointer_names == ("x", "y")
    # A replay names the pointers it passes: each of the kernel's once, in any order; anything else keeps no plan.
    assert pair.taking("x", "y") == pair.__call__ and pair.taking("y", "x") is not None
    assert pair.taking("x") is None and pair.taking("x", "z") is None and pair.taking("x", "x") is None
    # A tensor after a scalar: its address could not lead the replayed arguments.
    assert replay.direct_launches([(_plan("a", two, {"BLOCK": 4}), object(), (x, 3, x))], ("a",)) is None
    assert len(replay.direct_launches([good], ("a", "m?"))) == 1  # an optional kernel may be absent
    assert replay.direct_launches([other, good], ("a", "b")) is None  # the wrong order
    assert replay.direct_launches([good], ("a", "b")) is None  # one missing
    assert replay.direct_launches([(good[0], None, good[2])], ("a",)) is None  # nothing compiled
    interleaved = _Fn("x", "BLOCK", "N")
    assert replay.direct_launches([(_plan("a", interleaved, {"BLOCK": 4}), object(), ("x",))], ("a",)) is None
    assert replay.direct_launches([(_plan("a", interleaved, {"BLOCK": 4}), object(), ("x", 1, 3))],
                                      ("a",)) is None  # BLOCK given positionally and as a constexpr
    assert replay.direct_launches([(_plan("a", fn, {}), object(), ("x", 3))], ("a",)) is None  # BLOCK unknown
    # A constexpr the launch leaves out takes the kernel's default (a dense cache's key strides).
    strided = _Fn("x", "N", "BLOCK", "STRIDE", STRIDE=0)
    assert replay.direct_launches([(_plan("a", strided, {"BLOCK": 4}), object(), (x, 3))], ("a",))[0].tail == (3, 4, 0)


def test_a_launch_taking_its_pointers_by_name_passes_them_in_the_kernel_order(monkeypatch):
    sent = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_compat, "compiled_launcher", lambda kernel, grid, device: sent.append)
    x = torch.zeros(4)
    launch = replay.direct_launches([(_plan("a", _Fn("x", "y", "N", "BLOCK"), {"BLOCK": 4}), object(), (x, x, 3))],
                                    ("a",))[0]
    launch.taking("y", "x")(20, 10)
    launch.taking("x", "y")(10, 20)
    assert sent == [(10, 20, 3, 4), (10, 20, 3, 4)]


def test_the_replay_scratch_parts_start_aligned_and_apart():
    for sizes in ((13 * 301, 13 * 32, 13 * 15, 13, 0), (37 * 7, 37 * 1024, 37 * 511, 37, 37 * 16), (1, 1, 1, 1, 1)):
        offsets, elements = plans._scratch_parts(*sizes)
        assert all(offset % 64 == 0 for offset in offsets), offsets
        ends = [offset + 4 * size for offset, size in zip(offsets, sizes)]
        assert all(end <= start for end, start in zip(ends, offsets[1:])) and ends[-1] <= 4 * elements


@pytest.mark.parametrize("guards", ["compiled", "python"])
def test_a_plan_is_found_only_for_calls_alike_in_what_validation_reads(monkeypatch, guards):
    if guards == "python":
        monkeypatch.setattr(replay, "_build_guards", replay._PythonGuards)
    else:
        assert replay._compiled_guards() is not None  # PyTorch's C++ guard serves on this release
    t = torch.zeros(8, 4)
    sig = lambda *tensors, hosts=(): replay.signature(("op", 0), tensors, hosts)[0]  # noqa: E731
    found = lambda *tensors, hosts=(): replay.lookup(sig(*tensors, hosts=hosts))  # noqa: E731
    replay.store(sig(t, None, hosts=(1,)), "plan", None)
    assert found(torch.ones(8, 4), None, hosts=(1,)) == "plan"
    others = [((t.double(), None), (1,)), ((t[:4], None), (1,)), ((t.t(), None), (1,)),
              ((torch.zeros(33)[1:].view(8, 4), None), (1,)),  # the same shape 4 bytes off a 16-byte boundary
              ((torch.zeros(8, 4, requires_grad=True), None), (1,)), ((t, t), (1,)), ((t, None), (True,)),
              ((t, None), (2,)), ((t, None), ()), ((torch.zeros(8, 4, device="meta"), None), (1,))]
    assert [found(*tensors, hosts=hosts) for tensors, hosts in others] == [None] * len(others)
    assert sig(t, [1]) is None and sig([1], t) is None  # not a tensor: the validating path names it
    assert replay.lookup(sig(t, hosts=([1],))) is None  # unhashable: no plan, no error
    assert replay.signature(("op", 0), (t, None), ())[1] == [t.data_ptr(), 0]  # what a replay passes
    replay.store(sig(torch.nn.Parameter(t), None, hosts=(1,)), "parameter", None)  # a subclass: not kept
    assert replay.size() == 1


def test_a_compiled_guard_that_tells_nothing_apart_is_not_used(monkeypatch):
    """The C++ guard is a private PyTorch API: a release where it accepts what it should reject, or fails, leaves the
    Python check in its place."""
    from torch._C._dynamo import guards

    class AcceptsAll:
        def __init__(self, *tensors, **sizes):
            pass

        def check(self, *tensors):
            return True

    class Fails(AcceptsAll):
        def check(self, *tensors):
            raise RuntimeError("changed")

    for stand_in in (AcceptsAll, Fails):
        monkeypatch.setattr(guards, "TensorGuards", stand_in)
        assert replay._compiled_guards() is None


def test_a_change_of_the_current_device_misses_the_plan(monkeypatch):
    """A plan's launches go to the stream of the device that was current when it was recorded: another current
    device is another key (tensors on another device are told apart by the guard, above)."""
    t = torch.zeros(8, 4)
    current = [0]
    monkeypatch.setattr(replay, "_current_device", lambda first: current[0])
    sig = lambda: replay.signature(("op", 0), (t,), ())[0]  # noqa: E731
    replay.store(sig(), "on 0", None)
    assert replay.lookup(sig()) == "on 0"
    current[0] = 1
    assert replay.lookup(sig()) is None


def test_plans_under_one_key_are_told_apart_by_their_guards_and_bounded(monkeypatch):
    monkeypatch.setattr(replay, "MAX_PLANS", 3)
    sig = lambda t: replay.signature(("op", 0), (t,), ())[0]  # noqa: E731
    shapes = [(4, 4), (5, 4), (6, 4), (7, 4)]
    for i, shape in enumerate(shapes[:3]):
        replay.store(sig(torch.zeros(shape)), i, None)
    assert [replay.lookup(sig(torch.zeros(shape))) for shape in shapes] == [0, 1, 2, None]
    replay.store(sig(torch.zeros(shapes[3])), 3, None)  # (4, 4) is the least recently used: dropped
    assert replay.size() == 3
    assert [replay.lookup(sig(torch.zeros(shape))) for shape in shapes] == [None, 1, 2, 3]


@pytest.mark.gpu
def test_cached_calls_on_the_gpu_run_the_compiled_kernels_eagerly_and_in_a_graph():
    """Real compiled kernels: the replay equals the first call bit for bit, and a graph captured from a cached call
    replays with new lengths written in place."""
    from qsa_aiter.tools.timing import capture_graph

    from helpers import write_new_lengths

    replay.clear()
    gen = torch.Generator().manual_seed(3)
    batch = make_batch([5000, 12000, 800], 4, page_size=64, head_dim=128, device="cuda", generator=gen)
    args, hints = batch.args(), dict(phase="verify", max_query_len=4)
    token_topk = 2044  # 511 groups: the int32 scratch's parts need padding to stay aligned
    out = torch.empty((batch.q.shape[0], token_topk + 3), dtype=torch.int32, device="cuda")
    first = qsa_aiter.qsa_select_paged_tokens(*args[:6], token_topk, args[6], **hints).clone()
    scored = [t.clone() for t in qsa_aiter.qsa_paged_mqa_logits(*args, **hints)]
    assert replay.size() == 2
    again = qsa_aiter.qsa_select_paged_tokens(*args[:6], token_topk, args[6], **hints)
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args, **hints)
    assert torch.equal(again, first) and torch.equal(visible, scored[1])
    mask = torch.arange(logits.shape[1], device="cuda")[None, :] < visible[:, None]
    assert torch.equal(logits[mask], scored[0][mask])
    assert torch.equal(first.cpu(), _reference_selection(tuple(a.cpu() if torch.is_tensor(a) else a for a in args),
                                                         token_topk))
    # One long request (more columns than MAXIMA_MIN_COLUMNS): the replay's scratch holds the block maxima too.
    long = make_batch([300_000], 4, page_size=64, head_dim=128, device="cuda", generator=gen)
    long_args = long.args()
    picked = [qsa_aiter.qsa_select_paged_tokens(*long_args[:6], token_topk, long_args[6], **hints).clone()
              for _ in range(2)]
    assert torch.equal(picked[0], picked[1])
    graph, _ = capture_graph(
        lambda: qsa_aiter.qsa_select_paged_tokens(*args[:6], token_topk, args[6], out=out, **hints))
    for step in range(2):
        write_new_lengths(gen, batch.context_lens, batch.query_positions, 2000, 12000, 4)
        graph.replay()
        replay.clear()  # the validating path, for comparison
        want = qsa_aiter.qsa_select_paged_tokens(*args[:6], token_topk, args[6], **hints)
        assert torch.equal(out, want), f"replay {step}"

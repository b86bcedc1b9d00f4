"""An index cache that is a strided view of a larger buffer, as engines keep it (vLLM's FlyDSL test scores
``padded[..., :128]`` of a ``[pages, page_size, 1, 256]`` buffer in place): every scorer, selection and the writer
take it and give the bytes they give on its ``.contiguous()`` copy; the rest of the buffer is never read (it holds
garbage here) nor written. A view whose last dim is not dense, or whose keys overlap, is refused by name.

CPU tensors under the interpreter, small shapes; ``test_strided_view_on_gpu`` repeats the scoring and writer checks
at a model shape on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.cache.reference import write_reference
from qsa_aiter.kernels.quant.formats import allocate_index_cache, dequantize_cache, view_strides
from qsa_aiter.kernels.scoring import SPECS
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.tools.workloads import make_batch

from helpers import KERNELS, force_backend, skip_unless_serves

FORMATS = ("bf16", "fp16", "fp8", "fp4")
PAGES = (16, 64)
#: How the view sits in its buffer: slots twice as wide as a key (``big[..., :width]`` of ``[pages, P, 1, 2 *
#: width]``), or pages padded by 3 slots (``big[:, :P]`` of ``[pages, P + 3, 1, width]``): the two page-stride cases
#: of ``dequant.key_rows``.
LAYOUTS = ("wide_slots", "padded_pages")
#: (page size, layout) of the scorer matrix: the padded pages at page 64 in the long (``slow``) set only.
PAGE_LAYOUTS = [pytest.param(p, layout, marks=[pytest.mark.slow] if (p, layout) == (64, "padded_pages") else [],
                             id=f"page{p}-{layout}") for p in PAGES for layout in LAYOUTS]


def strided_copy(cache: torch.Tensor, layout: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: a strided view holding ``cache``'s bytes inside a larger ``buffer`` of random bytes."""
    pages, page_size, _, width = cache.shape
    shape = (pages, page_size, 1, 2 * width) if layout == "wide_slots" else (pages, page_size + 3, 1, width)
    raw = torch.randint(0, 256, shape[:3] + (shape[3] * cache.element_size(),), dtype=torch.uint8, generator=gen)
    # Random 16-bit words include NaNs and infinities: a kernel that read past the view would show them.
    buffer = raw.view(cache.dtype)
    view = buffer[:, :page_size, :, :width]
    view.view(torch.uint8).copy_(cache.view(torch.uint8))
    assert not view.is_contiguous() and view_strides(view) is not None
    return view, buffer


def scoring_batch(fmt: str, page_size: int, gen):
    batch = make_batch([300, 700], [3, 2], heads=4, head_dim=64, page_size=page_size, cache=fmt, generator=gen)
    return batch, dict(phase="verify", max_query_len=3, **batch.kwargs())


def visible_logits(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """The written part of each row (``[0, visible)``), as raw bits (NaN-safe bitwise comparison)."""
    keep = torch.arange(logits.shape[1])[None, :] < visible.long()[:, None]
    return logits.view(torch.int32)[keep]


@pytest.mark.parametrize("backend", KERNELS + ("torch",))
@pytest.mark.parametrize("page_size,layout", PAGE_LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_scorer_reads_a_strided_view_bitwise_as_its_copy(monkeypatch, rng, fmt, page_size, backend, layout):
    batch, hints = scoring_batch(fmt, page_size, rng)
    args = batch.args()
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    view, _ = strided_copy(args[1], layout, rng)
    strided_args = (args[0], view) + args[2:]
    problem = describe_call(*strided_args, **hints)
    assert problem.key_strides == view_strides(view)
    dense_logits, dense_vis = qsa_aiter.qsa_paged_mqa_logits(*args, **hints)
    logits, vis = qsa_aiter.qsa_paged_mqa_logits(*strided_args, **hints)
    assert torch.equal(vis, dense_vis)
    assert torch.equal(visible_logits(logits, vis), visible_logits(dense_logits, dense_vis))


def test_kernels_specialise_on_a_view_and_a_dense_cache_builds_as_before(rng):
    """A view's strides reach every Triton scorer as the ``KEY_PAGE_STRIDE`` / ``KEY_SLOT_STRIDE`` constexprs; a
    dense cache passes neither (its variant, warm-up and ahead-of-time builds are the ones it always had), and so does
    a view that is dense but for the stride of a dim of size 1."""
    batch, hints = scoring_batch("bf16", 16, rng)
    args = batch.args()
    platform = Platform.of(args[0].device)
    dense = describe_call(*args, **hints)
    view, _ = strided_copy(args[1], "padded_pages", rng)
    strided = describe_call(args[0], view, *args[2:], **hints)
    assert dense.key_strides is None and strided.key_strides == (19 * 64, 64)
    for spec in SPECS:
        assert not {"KEY_PAGE_STRIDE", "KEY_SLOT_STRIDE"} & set(spec.plan(dense, platform).constexprs), spec.name
        constexprs = spec.plan(strided, platform).constexprs
        assert (constexprs["KEY_PAGE_STRIDE"], constexprs["KEY_SLOT_STRIDE"]) == (19 * 64, 64), spec.name
    # One page: its page stride means nothing, nor does the head dim's.
    assert view_strides(args[1][:1].as_strided((1, 16, 1, 64), (5, 64, 7, 1))) is None


@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_selection_takes_a_strided_view(rng, fmt, page_size):
    batch, hints = scoring_batch(fmt, page_size, rng)
    args = batch.args()
    view, _ = strided_copy(args[1], "wide_slots", rng)
    want = qsa_aiter.qsa_select_paged_tokens(*args[:6], 64, args[6], **hints)
    got = qsa_aiter.qsa_select_paged_tokens(args[0], view, *args[2:6], 64, args[6], **hints)
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("page_size", PAGES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_writer_writes_into_a_strided_view_in_place(rng, fmt, page_size, layout):
    """The op (the Triton writer under the interpreter) and the torch reference writer write a view's keys where a
    dense cache has them, and nothing else of its buffer; the scales as on a dense cache."""
    pages, head_dim = 5, 64
    dense, scale = allocate_index_cache(fmt, pages, page_size, head_dim)
    view, buffer = strided_copy(dense, layout, rng)
    reference_buffer = buffer.clone()
    by_reference = reference_buffer[:, :page_size, :, :view.shape[3]]
    before = buffer.view(torch.uint8).clone()
    keys = torch.randn(9, head_dim, generator=rng).to(torch.float16 if fmt == "fp16" else torch.bfloat16)
    # Both ends of the cache, a skipped slot, one named twice (the last key wins), one past the end (not written).
    slots = torch.tensor([0, page_size + 1, 3 * page_size - 1, -1, pages * page_size - 1, 5, page_size + 1,
                          2 * page_size, pages * page_size])
    scales = [None if scale is None else scale.clone() for _ in range(3)]
    qsa_aiter.qsa_write_index_cache(keys, slots, dense, scales[0])
    qsa_aiter.qsa_write_index_cache(keys, slots, view, scales[1])
    write_reference(keys, slots, by_reference, scales[2])
    assert torch.equal(view.view(torch.uint8), dense.view(torch.uint8))
    assert torch.equal(by_reference.view(torch.uint8), dense.view(torch.uint8))
    if scale is not None:
        assert torch.equal(scales[1].view(torch.uint8), scales[0].view(torch.uint8))
        assert torch.equal(scales[2].view(torch.uint8), scales[0].view(torch.uint8))
    outside = torch.ones(before.shape, dtype=torch.bool)
    outside[:, :page_size, :, :view.shape[3] * view.element_size()] = False
    assert torch.equal(buffer.view(torch.uint8)[outside], before[outside])
    assert torch.equal(reference_buffer.view(torch.uint8)[outside], before[outside])
    assert not torch.equal(view.view(torch.uint8), before[:, :page_size, :, :view.shape[3] * view.element_size()])
    # What the writer put there reads back the same through the view.
    got = dequantize_cache(view, scales[1])
    assert torch.equal(got.nan_to_num(), dequantize_cache(dense, scales[0]).nan_to_num())


def refused_views(cache: torch.Tensor) -> dict:
    """Views the ops refuse: last dim not dense, and keys that overlap (a page repeated by ``expand``)."""
    pages, page_size, _, width = cache.shape
    wide = torch.zeros((pages, page_size, 1, 2 * width), dtype=torch.uint8).view(cache.dtype)
    return {"a last dim that is not dense": (wide[..., ::2], "dense along its last dim"),
            "overlapping keys": (cache[:1].expand(cache.shape), "a view whose keys do not overlap")}


@pytest.mark.parametrize("case", ["a last dim that is not dense", "overlapping keys"])
def test_views_the_ops_cannot_take_are_refused_by_name(rng, case):
    batch, hints = scoring_batch("fp8", 16, rng)
    args = batch.args()
    view, why = refused_views(args[1])[case]
    strided_args = (args[0], view) + args[2:]
    with pytest.raises(ValueError, match=f"qsa_paged_mqa_logits: `compressed_k_cache` must be {why}"):
        qsa_aiter.qsa_paged_mqa_logits(*strided_args, **hints)
    with pytest.raises(ValueError, match=f"`compressed_k_cache` must be {why}"):
        qsa_aiter.qsa_select_paged_tokens(*strided_args[:6], 64, args[6], **hints)
    keys = torch.randn(2, 64, generator=rng).bfloat16()
    with pytest.raises(ValueError, match=f"qsa_write_index_cache: `cache` must be {why}"):
        qsa_aiter.qsa_write_index_cache(keys, torch.tensor([0, 1]), view, batch.k_scale.clone())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
@pytest.mark.parametrize("backend", KERNELS + ("auto",))
@pytest.mark.parametrize("fmt", FORMATS)
def test_strided_view_on_gpu(monkeypatch, fmt, backend):
    """The model's shape (4 heads, head_dim 128, page 64) over long contexts, the cache a view
    ``padded[..., :width]`` of a buffer twice as wide: every scorer gives the dense cache's bits, and the writer
    fills the view in place."""
    gen = torch.Generator(device="cuda").manual_seed(7)  # the new keys' (drawn on the GPU)
    batch = make_batch([20000, 9000, 31000], 4, heads=4, head_dim=128, page_size=64, cache=fmt, device="cuda",
                       generator=torch.Generator().manual_seed(7))  # make_batch draws on the CPU
    hints = dict(phase="verify", max_query_len=4, **batch.kwargs())
    args = batch.args()
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    view, buffer = strided_copy(args[1].cpu(), "wide_slots", torch.Generator().manual_seed(3))
    view = buffer.cuda()[..., :view.shape[3]]
    strided_args = (args[0], view) + args[2:]
    dense_logits, dense_vis = qsa_aiter.qsa_paged_mqa_logits(*args, **hints)
    logits, vis = qsa_aiter.qsa_paged_mqa_logits(*strided_args, **hints)
    assert torch.equal(vis, dense_vis)
    keep = torch.arange(logits.shape[1], device="cuda")[None, :] < vis.long()[:, None]
    assert torch.equal(logits.view(torch.int32)[keep], dense_logits.view(torch.int32)[keep])
    keys = torch.randn(512, 128, device="cuda", generator=gen).bfloat16()
    slots = torch.randperm(args[1].shape[0] * 64, device="cuda", generator=gen)[:512]
    dense_scale = None if batch.k_scale is None else batch.k_scale.clone()
    view_scale = None if batch.k_scale is None else batch.k_scale.clone()
    before = buffer.cuda()
    before_bytes = before.view(torch.uint8).clone()
    qsa_aiter.qsa_write_index_cache(keys, slots, args[1], dense_scale)
    target = before[..., :view.shape[3]]
    qsa_aiter.qsa_write_index_cache(keys, slots, target, view_scale)
    assert torch.equal(target.view(torch.uint8), args[1].view(torch.uint8))
    width = view.shape[3] * view.element_size()
    assert torch.equal(before.view(torch.uint8)[..., width:], before_bytes[..., width:])


def test_the_custom_ops_take_a_strided_view(rng):
    """The ``torch.library`` ops (what ``torch.compile`` and the engines' graphs call): the writer's op writes into
    a view in place, and the scoring op reads it, as the eager ops do."""
    dense, scale = allocate_index_cache("fp8", 4, 16, 64)
    view, buffer = strided_copy(dense, "wide_slots", rng)
    before = buffer.view(torch.uint8).clone()
    view_scale = scale.clone()
    keys = torch.randn(5, 64, generator=rng).bfloat16()
    slots = torch.tensor([0, 3, 17, 40, 63])
    torch.ops.qsa_aiter.write_index_cache(keys, slots, dense, scale)
    torch.ops.qsa_aiter.write_index_cache(keys, slots, view, view_scale)
    assert torch.equal(view.view(torch.uint8), dense.view(torch.uint8))
    assert torch.equal(view_scale, scale)
    assert torch.equal(buffer.view(torch.uint8)[..., 64:], before[..., 64:])
    batch, hints = scoring_batch("bf16", 16, rng)
    args = batch.args()
    wide_view, _ = strided_copy(args[1], "wide_slots", rng)
    want, want_vis = torch.ops.qsa_aiter.paged_mqa_logits(*args, None, None, None, None, "verify", 3)
    got, vis = torch.ops.qsa_aiter.paged_mqa_logits(args[0], wide_view, *args[2:], None, None, None, None, "verify",
                                                    3)
    assert torch.equal(vis, want_vis)
    assert torch.equal(visible_logits(got, vis), visible_logits(want, want_vis))

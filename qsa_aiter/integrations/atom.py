"""Drop-in replacements for the ATOM engine's in-tree QSA ops, and ``install()`` to put them in the engine's place.

ATOM (ROCm/ATOM) defines its QSA indexer ops in ``atom.model_ops.qwen4_exp.ops.qsa`` and its attention layer
(``atom.model_ops.qwen4_exp.qsa_attention``) binds them with ``from ... import`` at import time. The three functions
here take the engine's arguments, in the engine's order, with the engine's defaults (one aside, below) and return
shapes. The engine's positional parameters are those of ``qsa_aiter``'s public op of the same name (the expansion's
``output_width`` aside), so each drop-in's signature is derived from the public one (``drop_in``) rather than written
out again:

    qsa_paged_mqa_logits(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                         compress_ratio=4, score_divisor=None, max_columns=None, row_starts=None)
    qsa_select_paged_tokens(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                            token_topk, compress_ratio=4, out=None, logits_workspace_bytes=None,
                            max_seq_len=None)
    qsa_expand_block_indices(block_indices, query_positions, context_lens, token_to_request, compress_ratio,
                             token_topk, out=None, output_width=None)

Where the engine's semantics differ from ``qsa_aiter``'s public ops, these follow the engine:

- ``max_columns`` is clamped to ``[1, page-table capacity]`` (``qsa_aiter`` rejects a value past the capacity).
- ``max_seq_len`` (the longest sequence the call can hold; a decode graph pins it to the engine's context) bounds
  the scored width to the power-of-two bucket of ``ceil(max_seq_len / R)`` groups, and the returned width to
  ``min(token_topk // R, capacity, bucket) * R + R - 1``: the columns dropped would all be ``-1``. For one
  ``max_seq_len`` the width is constant, so a captured graph serves every context up to it.
- ``out`` of ``qsa_select_paged_tokens`` may be wider than that width; the result is ``out[:, :width]``.
- ``output_width`` of ``qsa_expand_block_indices`` narrows (or widens, with ``-1``) the expansion.

One default differs from the engine's: ``logits_workspace_bytes`` of ``qsa_select_paged_tokens`` is None (the public
op's), not 128 MiB, so a call that leaves it out chunks its rows by ``QSA_AITER_LOGITS_WORKSPACE_MB`` or by the bound
sized from the GPU (docs/selection.md). The bound changes no result, only how many chunks the rows are scored in, so
``install()`` accepts that default (``WORKSPACE_DEFAULTS``); a value the engine passes is passed on unchanged.

Padded rows (``token_to_request == -1``) see nothing and select nothing (all ``-1``). Each function also accepts
the public op's keyword-only extras but ``out`` (``k_scale`` for quantised caches, ``phase`` / ``max_query_len``
hints) and passes them on. Calls
go through the ``torch.ops.qsa_aiter`` custom ops, so the engine's ``torch.compile`` and CUDA graphs see opaque ops.

Page size: ``compressed_k_cache`` is ``[pages, page_size, 1, D]`` with ``page_size`` compressed key groups per page,
that is ``page_size * compress_ratio`` tokens (ATOM's 64-token KV block is a page of 16 groups at R 4). The engines
count a block in tokens (``block_size``), so the scoring and selection drop-ins also take a keyword-only
``block_size`` (tokens): it must be a multiple of ``compress_ratio`` and equal the cache's ``page_size *
compress_ratio``, else ``ValueError`` naming ``block_size``; it changes nothing else. ``page_size_of_block`` converts
a block size for allocating the cache (``qsa_aiter.allocate_index_cache``).

The engine's signatures were read from ROCm/ATOM's ``atom/model_ops/qwen4_exp/ops/qsa.py``; ATOM is not installable
in this project's CI, so the tests patch a stand-in module with those signatures. ``install()`` checks the real
module's signatures against these before patching and refuses (``TypeError``) if they differ.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..ops import custom_ops
from ..ops.declarations import Call, argument_binder
from ..runtime.arguments import check_int, check_tensor, check_topk_budget, fail_argument

ENGINE_MODULE = "atom.model_ops.qwen4_exp.ops.qsa"
#: Engine modules that bind the ops at import time (``from ...ops.qsa import ...``).
ENGINE_CONSUMERS = ("atom.model_ops.qwen4_exp.qsa_attention",)
OPS = ("qsa_paged_mqa_logits", "qsa_select_paged_tokens", "qsa_expand_block_indices")


def _capacity(op: str, compressed_k_cache, page_table) -> int:
    """Columns the page table can address: ``width * page_size``."""
    if not isinstance(compressed_k_cache, torch.Tensor):
        fail_argument(TypeError, "compressed_k_cache", "a torch.Tensor", type(compressed_k_cache).__name__, op)
    if compressed_k_cache.dim() != 4:
        fail_argument(ValueError, "compressed_k_cache", "4-D [pages, page_size, 1, width]",
                      f"shape {tuple(compressed_k_cache.shape)}", op)
    check_tensor("page_table", page_table, ndim=2, dtypes=(torch.int32, torch.int64), op=op)
    return page_table.shape[1] * compressed_k_cache.shape[1]


def page_size_of_block(block_size: int, compress_ratio: int = 4, op: str = "page_size_of_block") -> int:
    """The index cache's ``page_size`` (compressed key groups per page) of an engine KV block of ``block_size``
    tokens: ``block_size // compress_ratio``. ``ValueError`` naming ``block_size`` unless it is a positive multiple
    of ``compress_ratio`` (a block that splits a compressed group has no page size)."""
    ratio = check_int("compress_ratio", compress_ratio, minimum=1, op=op)
    tokens = check_int("block_size", block_size, minimum=1, op=op)
    if tokens % ratio:
        fail_argument(ValueError, "block_size", f"a multiple of compress_ratio ({ratio}): tokens per KV block, "
                      f"{ratio} to a compressed key group", tokens, op)
    return tokens // ratio


def _check_block_size(op: str, block_size: int | None, compress_ratio, compressed_k_cache) -> None:
    """A given ``block_size`` (tokens) must be the cache's page in tokens: ``page_size * compress_ratio``."""
    if block_size is None:
        return
    ratio = check_int("compress_ratio", compress_ratio, minimum=1, op=op)
    page_size = page_size_of_block(block_size, ratio, op)
    if not isinstance(compressed_k_cache, torch.Tensor) or compressed_k_cache.dim() != 4:
        return  # the op names the malformed cache
    cache_groups = compressed_k_cache.shape[1]
    if page_size != cache_groups:
        fail_argument(ValueError, "block_size",
                      f"{cache_groups * ratio} tokens, the page of compressed_k_cache ({cache_groups} compressed "
                      f"key groups x compress_ratio {ratio})", f"{block_size} ({page_size} groups per page)", op)


def _bucket(groups: int) -> int:
    return 1 << (max(groups, 1) - 1).bit_length()


def engine_widths(capacity: int, token_topk: int, compress_ratio: int, max_seq_len: int | None) -> tuple[int, int]:
    """``(scored columns, returned width)`` of the engine's ``qsa_select_paged_tokens`` for these host values."""
    columns = capacity
    block_topk = min(token_topk // compress_ratio, capacity)
    if max_seq_len is not None:
        bucket = _bucket(-(-max_seq_len // compress_ratio))
        columns = max(1, min(capacity, bucket))
        block_topk = max(1, min(block_topk, bucket))
    return columns, block_topk * compress_ratio + compress_ratio - 1


def drop_in(public: Callable) -> Callable[[Callable], Callable]:
    """Make the engine op of ``public``'s name from ``body(call, **engine_only)``.

    The drop-in's signature is derived, not written: ``public``'s positional parameters (the engine's, in its order
    and with its defaults), then ``body``'s own positional parameters after ``call`` (those only the engine has,
    such as ``output_width``; positional, after the others), then ``public``'s keyword-only parameters but ``out``
    (qsa_aiter's extras: ``k_scale``, ``phase``, ``max_query_len``; ``out`` only where the engine takes it
    positionally), then ``body``'s keyword-only parameters (the drop-in's own extras, such as ``block_size``).
    ``body`` gets the public op's arguments by name in ``call`` (defaults filled in; it may change them and pass
    them on with ``**call``) and its own ones as its parameters.
    """

    def make(body: Callable) -> Callable:
        public_parameters = inspect.signature(public).parameters.values()
        body_signature = inspect.signature(body)
        own = list(body_signature.parameters.values())[1:]
        engine_only = [p.replace(kind=p.POSITIONAL_OR_KEYWORD) for p in own if p.kind != p.KEYWORD_ONLY]
        extras = [p for p in own if p.kind == p.KEYWORD_ONLY]
        signature = inspect.Signature(
            [p for p in public_parameters if p.kind == p.POSITIONAL_OR_KEYWORD] + engine_only
            + [p for p in public_parameters if p.kind == p.KEYWORD_ONLY and p.name != "out"] + extras,
            return_annotation=body_signature.return_annotation)
        bind = argument_binder(signature)
        engine_names = tuple(p.name for p in own)

        def engine_op(*args, **kwargs):
            call = bind(args, kwargs)
            return body(call, **{name: call.pop(name) for name in engine_names})

        functools.update_wrapper(engine_op, body)
        engine_op.__signature__ = signature
        return engine_op

    return make


@drop_in(custom_ops.qsa_paged_mqa_logits)
def qsa_paged_mqa_logits(call: Call, *, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's scoring op: fp32 logits ``[tokens, columns]`` (columns ``[0, visible)`` written) and int32
    ``visible_groups`` ``[tokens]``; ``row_starts`` (int ``[tokens]``), when given, is filled with zeros.

    Shapes and dtypes as ``qsa_aiter.qsa_paged_mqa_logits`` (``page_size`` of ``compressed_k_cache`` counts
    compressed key groups); ``max_columns`` is clamped to ``[1, width * page_size]`` as the engine does.
    ``block_size``: optional, the engine's KV block in tokens, checked against the cache's ``page_size *
    compress_ratio`` (``ValueError`` naming it otherwise).
    """
    op = "qsa_paged_mqa_logits"
    _check_block_size(op, block_size, call["compress_ratio"], call["compressed_k_cache"])
    if call["max_columns"] is not None:
        capacity = _capacity(op, call["compressed_k_cache"], call["page_table"])
        call["max_columns"] = max(1, min(capacity, check_int("max_columns", call["max_columns"], minimum=0, op=op)))
    return custom_ops.qsa_paged_mqa_logits(**call)


@drop_in(custom_ops.qsa_select_paged_tokens)
def qsa_select_paged_tokens(call: Call, *, block_size: int | None = None) -> torch.Tensor:
    """The engine's selection op: int32 ``[tokens, width]`` token indices (``-1`` padded), ``width`` from
    ``engine_widths`` (``token_topk + R - 1`` unless the capacity or ``max_seq_len`` bounds it).

    ``out``: optional int32 ``[tokens, >= width]`` (last dim contiguous); the result is then ``out`` itself when it
    is ``width`` wide, else ``out[:, :width]``. ``block_size``: optional, the engine's KV block in tokens, checked
    against the cache's ``page_size * compress_ratio``. Other arguments as ``qsa_aiter.qsa_select_paged_tokens``.
    """
    op = "qsa_select_paged_tokens"
    q, out, max_seq_len = call["q"], call["out"], call["max_seq_len"]
    ratio, topk = check_topk_budget(op, call["compress_ratio"], call["token_topk"])
    _check_block_size(op, block_size, ratio, call["compressed_k_cache"])
    if max_seq_len is not None:
        max_seq_len = check_int("max_seq_len", max_seq_len, minimum=1, op=op)
    check_tensor("q", q, ndim=3, dtypes=(torch.bfloat16, torch.float16), op=op)
    capacity = _capacity(op, call["compressed_k_cache"], call["page_table"])
    columns, width = engine_widths(capacity, topk, ratio, max_seq_len)
    full = topk + ratio - 1
    tokens = q.shape[0]
    target = None
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(torch.int32,), device=q.device, op=op)
        if out.shape[0] != tokens or out.shape[1] < width or out.stride(-1) != 1:
            fail_argument(ValueError, "out", f"int32 [{tokens}, >= {width}] with a contiguous last dim",
                          f"shape {tuple(out.shape)}, strides {out.stride()}", op)
        if out.shape[1] >= full:
            # No view is made where `out` is exactly as wide: the common call costs no extra tensor.
            target = out if out.shape[1] == full else out[:, :full]
    # Our op scores `max_seq_len // R` columns: pass the engine's column count exactly.
    call.update(token_topk=topk, compress_ratio=ratio, out=target,
                max_seq_len=None if max_seq_len is None else columns * ratio)
    result = custom_ops.qsa_select_paged_tokens(**call)
    if out is None:
        return result if width == full else result[:, :width]
    if target is None:  # `out` narrower than the full width: the dropped columns are all -1
        out[:, :width].copy_(result[:, :width])
    return out if out.shape[1] == width else out[:, :width]


@drop_in(custom_ops.qsa_expand_block_indices)
def qsa_expand_block_indices(call: Call, output_width: int | None = None) -> torch.Tensor:
    """The engine's expansion op: int32 ``[tokens, output_width]`` (default ``token_topk + R - 1``).

    The selected groups' tokens and the causal tail, packed to the front, ``-1`` after them (as
    ``qsa_aiter.qsa_expand_block_indices``), cut to or padded with ``-1`` up to ``output_width``. ``out``: optional
    int32 ``[tokens, output_width]``.
    """
    op = "qsa_expand_block_indices"
    block_indices, out = call["block_indices"], call["out"]
    ratio = check_int("compress_ratio", call["compress_ratio"], minimum=1, op=op)
    topk = check_int("token_topk", call["token_topk"], minimum=1, op=op)
    full = topk + ratio - 1
    width = full if output_width is None else check_int("output_width", output_width, minimum=1, op=op)
    check_tensor("block_indices", block_indices, ndim=2, dtypes=(torch.int32, torch.int64), op=op)
    tokens = block_indices.shape[0]
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(torch.int32,), device=block_indices.device, op=op,
                     like="block_indices")
        if tuple(out.shape) != (tokens, width):
            fail_argument(ValueError, "out", f"shape ({tokens}, {width})", tuple(out.shape), op)
    call.update(compress_ratio=ratio, token_topk=topk)
    if width == full:
        return custom_ops.qsa_expand_block_indices(**call)
    call["out"] = None
    result = custom_ops.qsa_expand_block_indices(**call)
    if out is None:
        out = torch.full((tokens, width), -1, dtype=torch.int32, device=block_indices.device)
    elif width > full:
        out[:, full:].fill_(-1)
    keep = min(width, full)
    out[:, :keep].copy_(result[:, :keep])
    return out


# ---------------------------------------------------------------------------------------------------------------
# Installing into the engine
# ---------------------------------------------------------------------------------------------------------------

_DROP_INS = {"qsa_paged_mqa_logits": qsa_paged_mqa_logits, "qsa_select_paged_tokens": qsa_select_paged_tokens,
             "qsa_expand_block_indices": qsa_expand_block_indices}


#: Parameters whose default may differ from the engine's, by op: each bounds memory and changes no result. The
#: drop-in's None sizes the logits workspace automatically where the engine's default is a fixed 128 MiB.
WORKSPACE_DEFAULTS = {"qsa_select_paged_tokens": ("logits_workspace_bytes",)}


def check_signature(name: str, engine_fn) -> None:
    """``TypeError`` unless the drop-in for ``name`` accepts every way the engine's ``engine_fn`` can be called:
    the same positional parameters in the same order with the same defaults (but those of ``WORKSPACE_DEFAULTS``),
    and every keyword-only one."""
    ours = inspect.signature(_DROP_INS[name]).parameters
    theirs = inspect.signature(engine_fn).parameters
    positional = [p for p in ours.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    for i, p in enumerate(theirs.values()):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{ENGINE_MODULE}.{name} takes *{p.name}/**{p.name}; the drop-in cannot mirror it")
        if p.kind == p.POSITIONAL_OR_KEYWORD or p.kind == p.POSITIONAL_ONLY:
            mine = positional[i] if i < len(positional) else None
            if mine is None or mine.name != p.name:
                raise TypeError(f"{ENGINE_MODULE}.{name}: the engine's parameter {i} is `{p.name}`, the drop-in's is "
                                f"`{mine.name if mine else 'missing'}`; this engine version is not supported")
        elif p.name not in ours:
            raise TypeError(f"{ENGINE_MODULE}.{name} takes keyword `{p.name}`, which the drop-in does not")
        else:
            mine = ours[p.name]
        if p.default is not p.empty and mine.default != p.default and p.name not in WORKSPACE_DEFAULTS.get(name, ()):
            raise TypeError(f"{ENGINE_MODULE}.{name}: `{p.name}` defaults to {p.default!r} in the engine, "
                            f"{mine.default!r} in the drop-in")


@dataclass
class Installation:
    """What ``install()`` replaced in the engine: ``(module, attribute, original)``, restored by ``uninstall()``."""

    module: types.ModuleType  # the engine's ops module
    patched: list[tuple[types.ModuleType, str, object]] = field(default_factory=list)

    def uninstall(self) -> None:
        """Put the engine's own ops back where ``install()`` replaced them."""
        global _active
        for module, name, original in reversed(self.patched):
            setattr(module, name, original)
        self.patched.clear()
        if _active is self:
            _active = None


_active: Installation | None = None


def install(engine_module: str | types.ModuleType = ENGINE_MODULE,
            consumers: tuple[str | types.ModuleType, ...] = ENGINE_CONSUMERS) -> Installation:
    """Make the engine call qsa_aiter's ops: replace ``OPS`` in ``engine_module`` and, in each already imported
    ``consumers`` module, every attribute that still is the engine's original function.

    Call it before the engine builds its model (consumer modules imported later bind the replaced names anyway).
    It also opens the JIT cache on the current GPU (``qsa_aiter.runtime.jit.load``), so that the first call pays no
    set-up.
    Raises ``TypeError`` when an engine op's signature differs from the drop-in's (another ATOM version), before
    anything is replaced. Installing into the same module again returns the active installation; into another one
    while one is active raises ``RuntimeError`` (uninstall first).
    """
    global _active
    module = importlib.import_module(engine_module) if isinstance(engine_module, str) else engine_module
    if _active is not None:
        if _active.module is module:
            return _active
        raise RuntimeError(f"qsa_aiter is installed into {_active.module.__name__}; uninstall() it first")
    originals = {}
    for name in OPS:
        if not hasattr(module, name):
            raise TypeError(f"{module.__name__} has no `{name}`; this engine version is not supported")
        originals[name] = getattr(module, name)
        check_signature(name, originals[name])
    installation = Installation(module)
    targets = [module] + [sys.modules.get(c) if isinstance(c, str) else c for c in consumers]
    for target in targets:
        if target is None:  # not imported yet: it will bind the replaced names when it is
            continue
        for name in OPS:
            if target is module or getattr(target, name, None) is originals[name]:
                installation.patched.append((target, name, getattr(target, name, None)))
                setattr(target, name, _DROP_INS[name])
    _active = installation
    from ..runtime.jit import load as load_jit_cache

    load_jit_cache()  # at start-up, not at the first call: the JIT cache's entries placed, Triton's set-up done
    return installation

"""A user's program, typed, against ``qsa_aiter``'s public API: what a type checker must see of every public name.

Not collected by pytest: tests/test_typing.py runs mypy over it (with the ``[tool.mypy]`` settings of pyproject.toml,
``disallow_any_expr`` for this module) and fails on any error. So every public op must keep its own signature and
return type: ``assert_type`` checks each result's type, ``disallow_any_expr`` rejects a name or result seen as
``Any``, and each call in ``rejected_calls`` must be a type error, which its ``# type: ignore[code]`` expects
(``warn_unused_ignores``: were the signature lost, as ``(*Any, **Any) -> Any``, the ignore would go unused and fail).
``main()`` runs the calls on small CPU tensors: ``python tests/typing/public_api.py``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from typing_extensions import assert_type  # typing.assert_type from Python 3.11 on; requires-python is 3.10

import qsa_aiter
from qsa_aiter import (
    allocate_index_cache, dequantize_cache, explain, explain_selection, jit, qsa_block_topk,
    qsa_expand_block_indices, qsa_paged_mqa_logits, qsa_select_paged_tokens, qsa_write_index_cache,
    reference_block_topk, reference_expand_block_indices, reference_paged_mqa_logits, selected_kernel,
)

PAGES, PAGE_SIZE, HEAD_DIM, HEADS, RATIO, TOKEN_TOPK = 4, 16, 64, 2, 4, 32


def write_keys(cache: torch.Tensor, scale: torch.Tensor | None) -> None:
    """The cache writer, then the cache read back."""
    keys = torch.randn(PAGES * PAGE_SIZE, HEAD_DIM)
    slots = torch.arange(PAGES * PAGE_SIZE, dtype=torch.int32)
    assert_type(qsa_write_index_cache(keys, slots, cache, scale), None)
    assert_type(qsa_write_index_cache(keys, slots, cache, k_scale=scale), None)
    assert_type(dequantize_cache(cache, scale), torch.Tensor)


def select(q: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None, table: torch.Tensor,
           requests: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Scoring, top-k and expansion, each public op called as documented; returns the selected tokens."""
    logits, visible = qsa_paged_mqa_logits(q, cache, table, requests, positions, lengths, RATIO, k_scale=scale)
    assert_type(logits, torch.Tensor)
    assert_type(visible, torch.Tensor)
    assert_type(qsa_paged_mqa_logits(q, cache, table, requests, positions, lengths, compress_ratio=RATIO,
                                     score_divisor=8.0, max_columns=None, row_starts=None, k_scale=scale,
                                     out=torch.empty_like(logits), phase="prefill", max_query_len=3),
                tuple[torch.Tensor, torch.Tensor])
    assert_type(reference_paged_mqa_logits(q, cache, table, requests, positions, lengths, RATIO, k_scale=scale,
                                           accum_dtype=torch.float64),
                tuple[torch.Tensor, torch.Tensor])
    assert_type(explain(q, cache, table, requests, positions, lengths, RATIO, k_scale=scale), str)
    assert_type(selected_kernel(q, cache, table, requests, positions, lengths, k_scale=scale, phase="decode"),
                str | None)

    groups = qsa_block_topk(logits, visible, TOKEN_TOPK // RATIO)
    assert_type(groups, torch.Tensor)
    assert_type(qsa_block_topk(logits, visible, block_topk=TOKEN_TOPK // RATIO, out=torch.empty_like(groups)),
                torch.Tensor)
    assert_type(reference_block_topk(logits, visible, TOKEN_TOPK // RATIO), torch.Tensor)
    tokens = qsa_expand_block_indices(groups, positions, lengths, requests, RATIO, TOKEN_TOPK)
    assert_type(tokens, torch.Tensor)
    assert_type(reference_expand_block_indices(groups, positions, lengths, requests, RATIO, TOKEN_TOPK),
                torch.Tensor)

    selected = qsa_select_paged_tokens(q, cache, table, requests, positions, lengths, TOKEN_TOPK, RATIO,
                                       logits_workspace_bytes=1 << 20, max_seq_len=2 * PAGE_SIZE * RATIO,
                                       k_scale=scale, phase="prefill", max_query_len=3)
    assert_type(selected, torch.Tensor)
    assert_type(explain_selection(q, cache, table, requests, positions, lengths, TOKEN_TOPK, k_scale=scale), str)
    return selected


def rejected_calls(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, requests: torch.Tensor,
                   positions: torch.Tensor, lengths: torch.Tensor) -> None:
    """Calls a type checker must reject (never run): a wrong keyword, a missing argument, a wrong type, and a
    keyword-only argument passed by position, each marked with the error it must give."""
    qsa_paged_mqa_logits(q, cache, table, requests, positions, lengths, kscale=None)  # type: ignore[call-arg]
    qsa_paged_mqa_logits(q, cache, table, requests, positions)  # type: ignore[call-arg]
    qsa_paged_mqa_logits(q, cache, table, requests, positions, lengths, "4")  # type: ignore[arg-type]
    qsa_paged_mqa_logits(q, cache, table, requests, positions, lengths, 4, None, None, None,  # type: ignore[call-arg]
                         None)
    explain(q, cache, table, requests, positions, lengths, block_size=64)  # type: ignore[call-arg]
    selected_kernel(q, cache)  # type: ignore[call-arg]
    explain_selection(q, cache, table, requests, positions, lengths)  # type: ignore[call-arg]
    qsa_select_paged_tokens(q, cache, table, requests, positions, lengths)  # type: ignore[call-arg]
    qsa_select_paged_tokens(q, cache, table, requests, positions, lengths, 32, topk=8)  # type: ignore[call-arg]
    qsa_block_topk(q, lengths)  # type: ignore[call-arg]
    qsa_block_topk(q, lengths, 8.0)  # type: ignore[arg-type]
    qsa_expand_block_indices(table, positions, lengths, requests, 4, 32, outs=None)  # type: ignore[call-arg]
    qsa_write_index_cache(q, positions)  # type: ignore[call-arg]
    qsa_write_index_cache(q, positions, cache, scale=None)  # type: ignore[call-arg]
    allocate_index_cache("bf16", 4, 16)  # type: ignore[call-arg]
    allocate_index_cache("bf16", 4, 16, 64, "cpu")  # type: ignore[call-arg]
    dequantize_cache(cache, scales=None)  # type: ignore[call-arg]
    reference_paged_mqa_logits(q, cache, table, requests, positions, lengths, out=None)  # type: ignore[call-arg]
    reference_block_topk(q, lengths)  # type: ignore[call-arg]
    reference_expand_block_indices(table, positions, lengths, requests, 4)  # type: ignore[call-arg]
    jit.load(torch.device("cpu"), cache_dir=None)  # type: ignore[call-arg]


def ints(*values: int) -> torch.Tensor:
    """An int32 tensor of ``values`` (typed: a list literal passed to ``torch.tensor`` is ``list[Any]``)."""
    return torch.tensor(values, dtype=torch.int32)


def main() -> None:
    """Every op once on a bf16 cache and once on an fp8 one: two requests of 3 and 2 query rows."""
    assert_type(jit.load(torch.device("cpu")), jit.Store | None)
    assert_type(jit.jit_root(), Path)
    assert_type(qsa_aiter.__version__, str)
    for cache_format in ("bf16", "fp8"):
        cache, scale = allocate_index_cache(cache_format, PAGES, PAGE_SIZE, HEAD_DIM, device="cpu")
        assert_type(cache, torch.Tensor)
        assert_type(scale, torch.Tensor | None)
        write_keys(cache, scale)
        q = torch.randn(5, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        table = ints(0, 1, 2, 3).view(2, 2)
        requests, positions, lengths = ints(0, 0, 0, 1, 1), ints(100, 101, 102, 60, 61), ints(103, 62)
        selected = select(q, cache, scale, table, requests, positions, lengths)
        print(cache_format, tuple(selected.shape))


if __name__ == "__main__":
    main()

"""Torch reference of QSA index scoring: the oracle of every kernel test.

Runs on CPU or GPU tensors, groups rows by request and chunks rows and columns so that memory stays bounded at 262K
context (about ``row_chunk * heads * col_chunk * 4`` bytes of scores plus ``col_chunk * head_dim`` keys at a time).
"""

from __future__ import annotations

import math

import torch

from ..quant.formats import FP8_DTYPES, dequantize_cache


def visible_groups(token_to_request, query_positions, context_lens, compress_ratio: int, num_columns: int):
    """Visible compressed groups per row, int32 ``[tokens]``.

    ``max(0, min((p + 1) // R, context_len // R, num_columns))``; rows whose request id is outside
    ``[0, requests)`` (the padded ``-1``) see nothing.
    """
    req = token_to_request.long()
    pos = query_positions.long()
    valid = (req >= 0) & (req < context_lens.numel())
    ctx = context_lens.long()[req.clamp(0, max(context_lens.numel() - 1, 0))] if context_lens.numel() else req * 0
    vis = torch.minimum(torch.div(pos + 1, compress_ratio, rounding_mode="floor"),
                        torch.div(ctx, compress_ratio, rounding_mode="floor"))
    vis = vis.clamp(min=0, max=num_columns)
    return torch.where(valid, vis, torch.zeros_like(vis)).to(torch.int32)


def head_summed_scores(q: torch.Tensor, k: torch.Tensor, divisor: float) -> torch.Tensor:
    """``sum_h relu(q[n, h] . k[c]) / divisor``: ``[n, C]`` from ``q`` ``[n, H, D]`` and keys ``k`` ``[C, D]`` (one
    float dtype, the accumulation's).

    Every (row, column) value is computed by the same operations in the same order, whatever the shapes: products
    elementwise, summed over head_dim by a fixed pairwise tree (zero-padded to a power of two), heads added in order.
    A matmul's summation order changes with the shapes and the library's kernel choice, so identical keys could
    score differently by column or by how many rows share the call, and exact ties would not break to the lower
    group (docs/kernels.md).
    """
    n, heads, dim = q.shape
    width = 1 << max(0, (dim - 1).bit_length())
    terms = q[:, :, None, :] * k[None, None, :, :]  # [n, H, C, D]
    if width != dim:
        terms = torch.nn.functional.pad(terms, (0, width - dim))
    while terms.shape[-1] > 1:
        half = terms.shape[-1] // 2
        terms = terms[..., :half] + terms[..., half:]
    dots = terms[..., 0]  # [n, H, C]
    total = dots[:, 0].clamp_min(0)
    for h in range(1, heads):
        total = total + dots[:, h].clamp_min(0)
    return total / divisor


#: Bound on the ``[rows, heads, columns, head_dim]`` products ``head_summed_scores`` holds at a time (elements).
TERMS_PER_STEP = 1 << 23


def reference_paged_mqa_logits(
    q: torch.Tensor,
    compressed_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_to_request: torch.Tensor,
    query_positions: torch.Tensor,
    context_lens: torch.Tensor,
    compress_ratio: int = 4,
    score_divisor: float | None = None,
    max_columns: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    accum_dtype: torch.dtype = torch.float32,
    row_chunk: int = 256,
    col_chunk: int = 16384,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference logits fp32 ``[tokens, num_columns]`` and visible groups int32 ``[tokens]``.

    q: ``[tokens, heads, head_dim]``; compressed_k_cache: ``[pages, page_size, 1, head_dim]`` of any float dtype (read
    as is), or a quantised cache (fp8, MXFP4) with its ``k_scale``, whose gathered keys are dequantised exactly
    (``qsa_aiter.cache_formats``). Columns in ``[0, visible)`` hold scores or ``-inf``
    where the page id is outside ``[0, pages)``; every other column is ``-inf``. Accumulates in ``accum_dtype``, in
    a fixed order per (row, column) (``head_summed_scores``): the result does not depend on ``row_chunk``,
    ``col_chunk`` (keys gathered at a time) or on which other rows share the call.
    """
    tokens, heads, head_dim = q.shape
    num_pages, page_size = compressed_k_cache.shape[:2]
    quantised = compressed_k_cache.dtype in FP8_DTYPES + (torch.float4_e2m1fn_x2,)
    if quantised and k_scale is None:
        raise ValueError("reference_paged_mqa_logits: a quantised cache needs its k_scale")
    width = page_table.shape[1]
    num_columns = width * page_size if max_columns is None else int(max_columns)
    divisor = math.sqrt(head_dim) if score_divisor is None else float(score_divisor)
    device = q.device
    logits = torch.full((tokens, num_columns), float("-inf"), dtype=torch.float32, device=device)
    vis = visible_groups(token_to_request, query_positions, context_lens, compress_ratio, num_columns)
    if tokens == 0 or num_columns == 0:
        return logits, vis
    # Quantised caches are gathered as raw bytes (torch has no indexing kernels for fp4/e8m0 on every device).
    keys = compressed_k_cache.view(torch.uint8) if quantised else compressed_k_cache.reshape(num_pages, page_size, -1)
    # k_scale is not None where quantised (checked above), which a type checker cannot follow.
    scales = (k_scale.view(torch.uint8)  # type: ignore[union-attr]
              if quantised and k_scale.dtype.itemsize == 1 else k_scale)  # type: ignore[union-attr]
    req_of_row = token_to_request.long()
    vis_host = vis.long().cpu()
    for r in torch.unique(req_of_row).tolist():
        if r < 0 or r >= page_table.shape[0]:
            continue
        rows = torch.nonzero(req_of_row == r).flatten()
        rows = rows[vis_host[rows.cpu()].to(device) > 0] if rows.numel() else rows
        if rows.numel() == 0:
            continue
        req_cols = int(vis_host[rows.cpu()].max())
        for c0 in range(0, req_cols, col_chunk):
            cols = torch.arange(c0, min(c0 + col_chunk, req_cols), device=device)
            pages = page_table[r].long()[cols // page_size]
            page_ok = (pages >= 0) & (pages < num_pages)
            slot = (pages.clamp(0, num_pages - 1), cols % page_size)
            # [C, D]; quantised caches are dequantised here, gathered keys only, so memory stays bounded.
            if quantised:
                gathered = (keys[slot].view(compressed_k_cache.dtype),
                            scales[slot].view(k_scale.dtype))  # type: ignore[index, union-attr]
                k = dequantize_cache(*gathered).reshape(cols.numel(), head_dim).to(accum_dtype)
            else:
                k = keys[slot].to(accum_dtype)
            k = torch.where(page_ok[:, None], k, torch.zeros_like(k))
            for r0 in range(0, rows.numel(), row_chunk):
                sub = rows[r0 : r0 + row_chunk]
                qs = q[sub].to(accum_dtype)  # [n, H, D]
                step = max(1, TERMS_PER_STEP // (sub.numel() * heads * head_dim))
                for s0 in range(0, cols.numel(), step):
                    part = slice(s0, min(s0 + step, cols.numel()))
                    scores = head_summed_scores(qs, k[part], divisor)
                    scores = torch.where(page_ok[None, part], scores, torch.full_like(scores, float("-inf")))
                    in_view = cols[None, part] < vis[sub].long()[:, None]
                    span = slice(c0 + part.start, c0 + part.stop)
                    logits[sub, span] = torch.where(in_view, scores.float(), logits[sub, span])
    return logits, vis

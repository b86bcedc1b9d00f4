"""Synthetic but realistic scoring batches: paged caches with shuffled pages, request-major rows.

Used by the demo, the benchmark and the tests, so that all three score the same kind of input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.cache import qsa_write_index_cache
from ..kernels.cache.reference import write_reference
from ..kernels.quant.formats import CACHE_FORMATS, allocate_index_cache, canonical_format


@dataclass
class ScoringBatch:
    """Arguments of one ``qsa_paged_mqa_logits`` call (positional order of the op) plus host facts about it."""

    q: torch.Tensor
    compressed_k_cache: torch.Tensor
    page_table: torch.Tensor
    token_to_request: torch.Tensor
    query_positions: torch.Tensor
    context_lens: torch.Tensor
    compress_ratio: int
    max_query_len: int
    visible_groups_total: int  # sum over requests of the groups the longest row of the request sees
    k_scale: torch.Tensor | None = None  # the cache's scales (fp8, fp4); None for 16-bit caches
    cache_format: str = "bf16"  # the index cache's format (``CACHE_FORMATS``)

    def args(self) -> tuple:
        return (self.q, self.compressed_k_cache, self.page_table, self.token_to_request, self.query_positions,
                self.context_lens, self.compress_ratio)

    def kwargs(self) -> dict:
        """Keyword arguments the op needs besides ``args()``: the scale tensor of a quantised cache."""
        return {} if self.k_scale is None else {"k_scale": self.k_scale}


def make_batch(
    context_lens: list[int],
    rows_per_request: int | list[int],
    *,
    heads: int = 4,
    head_dim: int = 128,
    page_size: int = 64,
    compress_ratio: int = 4,
    dtype: torch.dtype | None = None,
    cache: str | None = None,
    device: str | torch.device = "cpu",
    spare_pages: int = 3,
    padded_rows: int = 0,
    table_width: int | None = None,
    generator: torch.Generator | None = None,
) -> ScoringBatch:
    """A batch whose request ``r`` has ``context_lens[r]`` tokens and its last ``rows_per_request`` positions queried.

    Pages are allocated in a random order (so page ids are not contiguous per request); ``spare_pages`` unused pages
    are added; ``padded_rows`` rows with request ``-1`` are appended; ``table_width`` widens the page table
    (entries past a request's pages are ``-1``). ``cache`` names the index-cache format (docs/cache_formats.md):
    ``bf16``, ``fp16``, ``fp8`` (e4m3fn), ``fp8_fnuz`` (e4m3fnuz) or ``fp4`` (MXFP4); by default a 16-bit cache of
    q's dtype. ``dtype`` is q's: by default the 16-bit cache's dtype, else bf16; a 16-bit cache must have q's dtype.
    Quantised caches hold the quantised keys (written with ``qsa_write_index_cache`` on a GPU, its torch reference
    elsewhere: the same bytes) and come with their ``k_scale``.
    """
    cache_format, dtype = cache_format_and_query_dtype(cache, dtype)
    gen = generator
    n_req = len(context_lens)
    rows = [rows_per_request] * n_req if isinstance(rows_per_request, int) else list(rows_per_request)
    groups = [c // compress_ratio for c in context_lens]
    pages_needed = [max(1, -(-g // page_size)) for g in groups]
    width = max(pages_needed) if table_width is None else table_width
    if width < max(pages_needed):
        raise ValueError(f"table_width {width} is smaller than the {max(pages_needed)} pages a request needs")
    total_pages = sum(pages_needed) + spare_pages
    perm = torch.randperm(total_pages, generator=gen)
    table = torch.full((n_req, width), -1, dtype=torch.int32)
    at = 0
    for r, n in enumerate(pages_needed):
        table[r, :n] = perm[at : at + n].to(torch.int32)
        at += n
    # Keys and queries are drawn on the target device from a seed taken from ``gen`` (fast for GB-sized caches).
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    keys = torch.randn(total_pages, page_size, 1, head_dim, generator=dev_gen, device=device).to(dtype)
    k_cache, k_scale = keys, None
    if CACHE_FORMATS[cache_format].kind != "bf16":
        k_cache, k_scale = allocate_index_cache(cache_format, total_pages, page_size, head_dim, device=device)
        flat = keys.reshape(-1, head_dim)
        slots = torch.arange(flat.shape[0], dtype=torch.int64, device=device)
        if k_cache.device.type == "cuda":
            qsa_write_index_cache(flat, slots, k_cache, k_scale)
        else:  # the torch writer: the same bytes, and no interpreted kernel per token
            write_reference(flat, slots, k_cache, k_scale)
        del keys, flat
    t2r, pos = [], []
    for r, (ctx, n) in enumerate(zip(context_lens, rows)):
        for i in range(n):
            t2r.append(r)
            pos.append(ctx - n + i)
    t2r += [-1] * padded_rows
    pos += [-1] * padded_rows
    tokens = len(t2r)
    q = torch.randn(tokens, heads, head_dim, generator=dev_gen, device=device).to(dtype)
    return ScoringBatch(
        q=q,
        compressed_k_cache=k_cache,
        page_table=table.to(device),
        token_to_request=torch.tensor(t2r, dtype=torch.int32).to(device),
        query_positions=torch.tensor(pos, dtype=torch.int32).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32).to(device),
        compress_ratio=compress_ratio,
        max_query_len=max(rows) if rows else 1,
        visible_groups_total=sum(groups),
        k_scale=k_scale,
        cache_format=cache_format,
    )


def cache_format_and_query_dtype(cache: str | None, dtype: torch.dtype | None) -> tuple[str, torch.dtype]:
    """``(cache format name, q dtype)`` of ``make_batch``'s ``cache`` and ``dtype`` (see there); a former spelling
    of the format is accepted with a ``DeprecationWarning`` (``16bit``: the 16-bit format of ``dtype``), and a
    16-bit format that is not ``dtype`` raises ``ValueError``."""
    if cache is None:
        cache = "fp16" if dtype == torch.float16 else "bf16"
    fmt = CACHE_FORMATS[canonical_format(cache, q_dtype=dtype or torch.bfloat16, stacklevel=3)]
    if dtype is not None and fmt.kind == "bf16" and dtype != fmt.dtype:
        raise ValueError(f"dtype {dtype} with cache {fmt.name!r}: a 16-bit cache has q's dtype (give cache=None or "
                         f"the format of {dtype})")
    return fmt.name, dtype or fmt.query_dtype

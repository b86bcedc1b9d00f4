"""Quantisation quality: how much of the bf16 cache's top-k selection an fp8 or MXFP4 cache keeps, and what the
low-precision MMA paths add.

Keys get a realistic spread: per-channel scales drawn log-normally (some channels carry far more energy than
others) and a few outlier channels, as normalised-then-rotated index keys show. Selection is the block top-k of the
scores of ``reference_paged_mqa_logits``; overlap is ``|top_k(quantised) & top_k(bf16)| / k`` per row.

Two numerics per quantised cache (``numerics``): ``decoded`` (keys decoded exactly, q as it is, fp32 sums: the
reference, and what the kernels compute with ``QSA_AITER_E4M3_MMA=0`` or without low-precision MMAs) and ``e4m3_mma``
(q split into two e4m3 terms by the kernels' rule, ``split_query_terms``, against the same exact keys: what the e4m3
tensor cores and the f8f6f4 / block-scaled MFMAs multiply; their products are exact, and the rounding inside their
sums is not modelled here).
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..kernels.cache.reference import write_reference
from ..kernels.scoring.reference import reference_paged_mqa_logits
from ..kernels.quant.formats import allocate_index_cache, dequantize_cache
from .cli_args import cache_formats, comma_subset, positive_int, run_command


def realistic_keys(n: int, head_dim: int, generator: torch.Generator, outlier_channels: int = 4) -> torch.Tensor:
    """bf16 keys ``[n, head_dim]`` with log-normal channel scales and a few 8x outlier channels."""
    channel_scale = torch.exp(0.75 * torch.randn(head_dim, generator=generator))
    outliers = torch.randperm(head_dim, generator=generator)[:outlier_channels]
    channel_scale[outliers] *= 8.0
    return (torch.randn(n, head_dim, generator=generator) * channel_scale).to(torch.bfloat16)


#: The numerics ``selection_overlap`` models (module docstring).
NUMERICS = ("decoded", "e4m3_mma")


def split_query_terms(q: torch.Tensor) -> torch.Tensor:
    """fp32 ``q`` ``[..., D]`` as the e4m3 MMA paths see it: ``(hi + lo) * row_scale`` with each row scaled into
    ``[128, 256)`` by a power of two, ``hi`` rounded to e4m3 and ``lo`` the remainder rounded to e4m3 (the rule of
    ``kernels.quant.dequant.split_query_e4m3``, whose split the tests compare with torch's e4m3 rounding)."""
    amax = q.abs().amax(dim=-1, keepdim=True)
    exponent = torch.clamp((amax.view(torch.int32) >> 23) & 0xFF, min=8)
    inverse = torch.exp2((134 - exponent).float())
    x = q * inverse
    hi = x.to(torch.float8_e4m3fn).float()
    lo = (x - hi).to(torch.float8_e4m3fn).float()
    return (hi + lo) / inverse


def selection_overlap(cache_format: str, *, rows: int = 16, groups: int = 8192, topk: int = 512, heads: int = 4,
                      head_dim: int = 128, page_size: int = 64, seed: int = 0, numerics: str = "decoded",
                      **alloc) -> torch.Tensor:
    """Per-row top-``topk`` overlap (fraction in [0, 1]) of a ``cache_format`` cache (a format name,
    docs/cache_formats.md) scored with ``numerics`` (``NUMERICS``) against the bf16 cache of the same keys scored
    exactly.

    One request of ``groups`` compressed keys; ``rows`` query rows that all see every group. Runs on the CPU.
    """
    base, other = _scores(cache_format, rows, groups, heads, head_dim, page_size, seed, numerics, alloc)
    base, other = base.topk(topk, dim=1).indices, other.topk(topk, dim=1).indices
    hits = (base[:, :, None] == other[:, None, :]).any(dim=2).sum(dim=1)
    return hits.float() / topk


def score_error(cache_format: str, *, rows: int = 16, groups: int = 8192, heads: int = 4, head_dim: int = 128,
                page_size: int = 64, seed: int = 0, numerics: str = "e4m3_mma", **alloc) -> float:
    """The largest error of ``cache_format``'s scores under ``numerics`` against the fp32 reference on the same
    cache (decoded keys, q in fp32), relative to the row's largest score magnitude."""
    exact, got = (_scores(cache_format, rows, groups, heads, head_dim, page_size, seed, n, alloc, base_format=None)[1]
                  for n in ("decoded", numerics))
    scale = exact.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    return float(((got - exact).abs() / scale).max())


def _scores(cache_format, rows, groups, heads, head_dim, page_size, seed, numerics, alloc, base_format="bf16"):
    """``(bf16 cache's exact scores or None, cache_format's scores under numerics)``, each fp32 ``[rows, groups]``."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(NUMERICS)}; got {numerics!r}")
    gen = torch.Generator().manual_seed(seed)
    pages = -(-groups // page_size)
    keys = realistic_keys(pages * page_size, head_dim, gen)
    q = realistic_keys(rows * heads, head_dim, gen).reshape(rows, heads, head_dim)
    slots = torch.arange(pages * page_size, dtype=torch.int32)
    table = torch.arange(pages, dtype=torch.int32)[None]
    t2r = torch.zeros(rows, dtype=torch.int32)
    pos = torch.full((rows,), groups * 4 - 1, dtype=torch.int32)
    ctx = torch.tensor([groups * 4], dtype=torch.int32)

    def scores(name: str, terms: str) -> torch.Tensor:
        cache, scale = allocate_index_cache(name, pages, page_size, head_dim, **alloc)
        write_reference(keys, slots, cache, scale)  # the quantisation itself; the writer kernel is tested apart
        dequant = dequantize_cache(cache, scale).to(torch.float32)
        query = split_query_terms(q.float()) if terms == "e4m3_mma" else q.float()
        logits, _ = reference_paged_mqa_logits(query, dequant, table, t2r, pos, ctx, 4, max_columns=groups)
        return logits

    return (scores(base_format, "decoded") if base_format else None), scores(cache_format, numerics)


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m qsa_aiter quality`` (also ``python -m qsa_aiter.tools.quality``)."""
    parser = argparse.ArgumentParser(
        prog="python -m qsa_aiter quality",
        description="Measure on the CPU how much of the bf16 cache's top-k selection each quantised cache keeps "
                    "(selection_overlap over --seeds seeds) and its largest score error against the fp32 reference "
                    "(score_error), and print them as a Markdown table (docs/cache_formats.md, 'Selection quality').")
    parser.add_argument("--caches", type=cache_formats, default=("fp8", "fp8_fnuz", "fp4"),
                        help="index-cache formats, comma-separated (default fp8,fp8_fnuz,fp4)")
    parser.add_argument("--numerics", type=comma_subset(NUMERICS), default=NUMERICS,
                        help=f"comma-separated subset of {','.join(NUMERICS)} (default: both)")
    parser.add_argument("--seeds", type=positive_int, default=10, help="seeds 0..N-1 per cache (default 10)")
    parser.add_argument("--rows", type=positive_int, default=16, help="query rows per seed (default 16)")
    parser.add_argument("--groups", type=positive_int, default=8192, help="compressed keys of the request (default "
                                                                           "8192)")
    parser.add_argument("--topk", type=positive_int, default=512, help="selection size (default 512)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Print the quality table; exit 2 on bad options (a ``--topk`` above ``--groups`` included)."""
    opts = build_parser().parse_args(argv)
    if opts.topk > opts.groups:
        print(f"error: --topk {opts.topk} is more than --groups {opts.groups}", file=sys.stderr)
        return 2
    print("| cache | numerics | mean overlap | worst row | 10th percentile | max score error / row's largest score |")
    print("|---|---|---|---|---|---|")
    shape = dict(rows=opts.rows, groups=opts.groups)
    for name in opts.caches:
        for numerics in opts.numerics:
            overlap = torch.cat([selection_overlap(name, topk=opts.topk, seed=seed, numerics=numerics, **shape)
                                 for seed in range(opts.seeds)])
            error = max(score_error(name, seed=seed, numerics=numerics, **shape) for seed in range(opts.seeds))
            print(f"| {name} | {numerics} | {overlap.mean():.2%} | {overlap.min():.2%} | "
                  f"{overlap.quantile(0.1):.2%} | {error:.2g} |", flush=True)
    return 0


if __name__ == "__main__":  # as ``python -m qsa_aiter quality`` runs it (environment check, closed pipes)
    raise SystemExit(run_command(main, sys.argv[1:]))

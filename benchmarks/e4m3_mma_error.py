"""How far the e4m3 tensor-core path (``QSA_AITER_E4M3_MMA=1``) lands from the exact scores, on a GPU.

Scores verify batches on e4m3fn (``--cache fp8``, the default) or MXFP4 (``--cache fp4``) caches (written from realistic
keys, and filled with random codes) with the stacked scorer and reports, per batch, the largest error as a fraction of
the magnitude bound ``sum_h sum_d |q| |k| / divisor`` (the scale of any summation's rounding; the GPU tests allow
``E4M3_MMA_TOL`` of it) and the median error relative to the score. Run from the repository root:
``python benchmarks/e4m3_mma_error.py [--cache fp4]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "kernels", "scoring"))

from test_quantised import fill_random_codes  # noqa: E402

from qsa_aiter.ops.scoring import qsa_paged_mqa_logits  # noqa: E402
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits  # noqa: E402
from qsa_aiter.tools.cli_args import RenamedOption, cache_format  # noqa: E402
from qsa_aiter.tools.workloads import make_batch  # noqa: E402

from helpers import E4M3_MMA_TOL, magnitude_bound, uses_e4m3_mma  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/e4m3_mma_error.py``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", type=cache_format, default="fp8", choices=("fp8", "fp4"),
                    help="index-cache format (docs/cache_formats.md): those e4m3 tensor cores read")
    ap.add_argument("--kv", dest="cache", type=cache_format, choices=("fp8", "fp4"), action=RenamedOption,
                    renamed_to="--cache")
    return ap


def main() -> None:
    cache = build_parser().parse_args().cache
    worst = 0.0
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        batch = make_batch([8192, 5000, 777, 12000, 30000], 4, cache=cache, device="cuda", generator=gen)
        random_codes = seed % 2 == 1
        if random_codes:
            fill_random_codes(batch, cache, gen)
        args, hints = batch.args(), dict(batch.kwargs(), max_query_len=4)
        if not uses_e4m3_mma(args, **hints):
            raise SystemExit("this GPU or setting does not use the e4m3 MMA path")
        logits, visible = qsa_paged_mqa_logits(*args, **hints)
        ref = reference_paged_mqa_logits(*args, **batch.kwargs())[0].cuda()
        bound = magnitude_bound(args, **batch.kwargs()).cuda()
        mask = (torch.arange(logits.shape[1], device="cuda")[None, :] < visible[:, None]) & torch.isfinite(ref)
        err = (logits[mask] - ref[mask]).abs()
        ratio = (err / bound[mask].clamp_min(1e-30)).max().item()
        rel = (err / ref[mask].abs().clamp_min(1e-3)).median().item()
        print(f"seed {seed} ({'random codes' if random_codes else 'written keys'}): max error {ratio:.3g} of the "
              f"magnitude bound; median error {rel:.3g} of the score")
        worst = max(worst, ratio)
    print(f"worst {worst:.3g} of the magnitude bound (tests allow {E4M3_MMA_TOL:g})")


if __name__ == "__main__":
    main()

"""Quick GPU correctness pass of every kernel against the reference (page 16 and 64), before timing."""

import os

import torch

import qsa_aiter
from qsa_aiter.reference import reference_paged_mqa_logits
from qsa_aiter.workloads import make_batch

bad = 0
for kernel in ("rowwise", "stacked", "tiled"):
    for ps in (16, 64):
        for ctxs, rows in (([3000, 70000, 64, 517, 20001], [4, 4, 1, 3, 4]), ([9000] * 3, [700, 5, 1])):
            os.environ["QSA_AITER_BACKEND"] = kernel
            b = make_batch(ctxs, rows, page_size=ps, padded_rows=3, device="cuda",
                           generator=torch.Generator().manual_seed(ps + len(rows)))
            b.page_table[1, 2] = 1 << 20
            b.page_table[0, 0] = -5
            out = torch.full((b.q.shape[0], b.page_table.shape[1] * ps), float("nan"), device="cuda")
            logits, vis = qsa_aiter.qsa_paged_mqa_logits(*b.args(), out=out)
            ref, rvis = reference_paged_mqa_logits(*b.args())
            m = torch.arange(out.shape[1], device="cuda")[None, :] < vis[:, None]
            ok = torch.equal(vis, rvis) and torch.allclose(logits[m], ref[m], rtol=1e-4, atol=1e-4)
            err = (logits[m] - ref[m]).abs().nan_to_num(0).max().item()
            bad += not ok
            print(f"{kernel:8s} page {ps:2d} rows {b.q.shape[0]:4d}: {'ok' if ok else 'MISMATCH'} max err {err:.2e}")
os.environ.pop("QSA_AITER_BACKEND")
print("GPU smoke:", "all ok" if not bad else f"{bad} failures")

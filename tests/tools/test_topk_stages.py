"""``benchmarks/topk_stages.py``'s staged kernels compute what each stage of the top-k kernel computes: the row
length, the lane maxima, the floor (the top 16 bits of the K-th largest lane maximum, reached by at least K columns)
and the number of columns at or above it. Checked against torch on random, tied and ``-inf``-holding rows, rows
longer than the capacity and rows that fit it. On a GPU where there is one, else under the Triton interpreter."""

import sys

import numpy as np
import pytest
import torch

from qsa_aiter.kernels.selection import topk

import benchmark_scripts

topk_stages = benchmark_scripts.load("topk_stages")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_TOPK = 64
CONFIG = topk.TopkConfig(tile=512, scan=256)  # capacity 128: rows of 1400 columns take several steps per pass
CAPACITY = topk.capacity(BLOCK_TOPK, CONFIG)
VISIBLE = [1400, 1399, 700, 257, 65, 3]


def _order_keys(x: np.ndarray) -> np.ndarray:
    """The kernel's order-preserving uint32 keys of fp32 scores (``-0.0`` keyed as ``+0.0``)."""
    bits = x.astype(np.float32).view(np.int32).astype(np.int64)
    bits = np.where(bits == -(2**31), 0, bits)
    flipped = np.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (flipped & 0xFFFFFFFF) ^ 0x80000000


def _logits(rng, kind: str) -> torch.Tensor:
    shape = (len(VISIBLE), max(VISIBLE))
    if kind == "ties":
        logits = torch.randint(0, 6, shape, generator=rng).float()
    else:
        logits = torch.randn(shape, generator=rng)
    logits[0, 3:300] = float("-inf")
    logits[1, ::5] = -0.0
    return logits


def _run(stage: int, logits: torch.Tensor) -> np.ndarray:
    out = torch.full((logits.shape[0], CAPACITY), float("nan"), device=DEVICE)
    visible = torch.tensor(VISIBLE, dtype=torch.int32, device=DEVICE)
    topk_stages.launch_stage(stage, logits.to(DEVICE), visible, out, BLOCK_TOPK, CONFIG)
    return out.cpu().numpy()


@pytest.mark.parametrize("kind", ["random", "ties"])
def test_staged_kernels_compute_the_top_k_stages(rng, kind):
    logits = _logits(rng, kind)
    lengths = _run(0, logits)
    assert lengths[:, 0].tolist() == VISIBLE
    maxima, floors, counts = _run(1, logits), _run(2, logits), _run(3, logits)
    for row, n in enumerate(VISIBLE):
        if n <= CAPACITY:  # these rows skip the floor: the kernel writes their length
            for out in (maxima, floors, counts):
                assert out[row, 0] == n
            continue
        x = logits[row, :n].numpy()
        lanes = np.full(CAPACITY, -np.inf, dtype=np.float32)
        np.maximum.at(lanes, np.arange(n) % CAPACITY, x)
        np.testing.assert_array_equal(maxima[row], lanes)
        kth_key = np.sort(_order_keys(lanes))[::-1][BLOCK_TOPK - 1]
        floor = floors[row, 0]
        assert _order_keys(np.array([floor]))[0] == kth_key & 0xFFFF0000 or (
            floor == -np.inf and kth_key & 0xFFFF0000 <= _order_keys(np.array([-np.inf]))[0])
        assert (x >= floor).sum() >= BLOCK_TOPK
        assert counts[row, 0] == (x >= floor).sum()



def test_unknown_points_are_rejected_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["topk_stages.py", "--points", "9x4@64K-128K,3x3@1K"])
    with pytest.raises(SystemExit) as info:
        topk_stages.main()
    assert info.value.code == 2
    assert "3x3@1K" in capsys.readouterr().err

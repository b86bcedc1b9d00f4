"""The Triton block top-k kernel and its column-block maxima (``kernels/selection/topk.py``, ``maxima.py``) launched
directly, against the oracle: the lane-maxima floor and the block-maxima floor on rows built to defeat them, which
path a launch takes, and the long-row path on the GPU inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

import qsa_aiter
from qsa_aiter.kernels.selection.reference import reference_block_topk, torch_block_topk
from qsa_aiter.tools.timing import capture_graph

from helpers import SELECTION_DEVICE as DEVICE, random_logits

ON_GPU = torch.cuda.is_available()


@pytest.mark.parametrize("config", [dict(capacity_factor=4, tile=512, chunk=128),
                                    dict(capacity_factor=2, tile=128, chunk=64)])
@pytest.mark.parametrize("kind", ["random", "ties", "equal", "ascending", "descending"])
def test_triton_topk_through_lane_maxima(rng, kind, config):
    """Rows longer than the candidate capacity (256 or 128 here): lane-maxima floor, candidate pass, and the
    whole-row fallback when more columns than the capacity reach the floor (ties, constant rows)."""
    from qsa_aiter.kernels.selection import topk

    tokens, columns, block_topk = 6, 1400, 64
    if kind in ("ascending", "descending"):
        logits = torch.arange(columns, dtype=torch.float32).repeat(tokens, 1) / 7
        logits = (logits if kind == "ascending" else -logits).to(DEVICE)
    else:
        logits = random_logits(rng, tokens, columns, kind)
    visible = torch.tensor([1400, 1399, 700, 257, 65, 3], dtype=torch.int32, device=DEVICE)
    out = torch.full((tokens, block_topk), -7, dtype=torch.int32, device=DEVICE)
    topk.launch(logits, visible, out, block_topk, topk.TopkConfig(**config))
    assert torch.equal(out, reference_block_topk(logits, visible, block_topk))


@pytest.mark.parametrize("kind", ["random", "ties", "equal", "ascending", "descending", "spikes"])
@pytest.mark.parametrize("columns, block_topk", [(1400, 16), (4000, 64), (333, 5)])
def test_triton_topk_through_block_maxima(rng, kind, columns, block_topk):
    """The long-row path: column-block maxima from several programs per row (``maxima.launch``, checked against
    torch with the columns past ``visible`` poisoned), then the top-k reading only the blocks that reach the
    floor; rows too short for it, ties at the threshold and the whole-row fallback (more reaching blocks than the
    capacity) in the same launch. The result equals the oracle and the lane-maxima path."""
    from qsa_aiter.kernels.selection import maxima, topk

    tokens = 6
    if kind in ("ascending", "descending"):
        logits = torch.arange(columns, dtype=torch.float32).repeat(tokens, 1) / 7
        logits = (logits if kind == "ascending" else -logits).to(DEVICE)
    elif kind == "spikes":  # the top groups all in a few blocks
        logits = torch.randn(tokens, columns, generator=rng).abs().neg().to(DEVICE)
        logits[:, columns // 3: columns // 3 + 2 * block_topk] = 5.0
    else:
        logits = random_logits(rng, tokens, columns, kind)
    visible = torch.tensor([columns, columns - 3, columns // 2, 2 * block_topk + 1, block_topk, 0],
                           dtype=torch.int32, device=DEVICE)
    cols = torch.arange(columns, device=DEVICE)
    poisoned = torch.where(cols[None, :] < visible[:, None].long(), logits, float("inf"))  # never read
    width = maxima.maxima_block(columns, block_topk)
    block_max = torch.full(maxima.maxima_shape(tokens, columns, block_topk), float("nan"), device=DEVICE)
    maxima.launch(poisoned, visible, block_max, block_topk)
    for r in range(tokens):
        n = int(visible[r])
        blocks = (n + width - 1) // width
        want = torch.stack([logits[r, b * width:min((b + 1) * width, n)].max() for b in range(blocks)]) \
            if blocks else torch.zeros(0, device=DEVICE)
        assert torch.equal(block_max[r, :blocks], want), f"row {r} maxima"
    out = torch.full((tokens, block_topk), -7, dtype=torch.int32, device=DEVICE)
    topk.launch(poisoned, visible, out, block_topk, block_maxima=block_max)
    assert torch.equal(out, reference_block_topk(logits, visible, block_topk))
    lanes = torch.full_like(out, -7)
    topk.launch(poisoned, visible, lanes, block_topk)
    assert torch.equal(out, lanes), "the two paths select different groups"


def test_long_rows_take_the_block_maxima_where_rows_leave_multiprocessors_idle():
    from qsa_aiter.kernels.platform import Platform
    from qsa_aiter.kernels.selection import topk

    h200 = Platform.named("sm_90")
    assert topk.maxima_reason(16, 67072, h200) is None  # 4x4 verify at 262K tokens
    assert topk.maxima_reason(1, 65536, h200) is None
    assert "read by their own program" in topk.maxima_reason(36, 32768, h200)  # 9x4 at 128K tokens
    assert "already give each of the 132" in topk.maxima_reason(256, 67072, h200)


def test_prefill_batches_take_programs_of_four_warps():
    from qsa_aiter.kernels.platform import Platform
    from qsa_aiter.kernels.selection import topk
    from qsa_aiter.kernels.selection.problem import SelectionProblem

    h200 = Platform.named("sm_90")
    assert topk.warps_for(256, h200) == 8  # 64x4 verify
    assert topk.warps_for(4 * 132 - 1, h200) == 8
    assert topk.warps_for(4 * 132, h200) == 4
    assert topk.warps_for(4096, h200) == 4  # a 4096-row prefill chunk
    assert topk.warps_for(4096, Platform.named("gfx942")) == 4  # 304 CUs: 1216 rows and more
    plan = topk.SPEC.plan(SelectionProblem(4096, 8192, 512), h200)
    assert plan.options["num_warps"] == 4 and plan.config.num_warps == 4


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["random", "ties", "equal"])
def test_long_rows_through_block_maxima_on_the_gpu_and_in_a_graph(kind):
    """``qsa_block_topk`` on 16 rows of 70000 columns (the block-maxima path) equals the torch path, eagerly and
    in a CUDA graph replayed with new lengths written in place."""
    gen = torch.Generator().manual_seed(5)
    tokens, columns, block_topk = 16, 70000, 512
    logits = random_logits(gen, tokens, columns, kind)
    visible = torch.randint(columns // 2, columns + 1, (tokens,), generator=gen, dtype=torch.int32).cuda()
    visible[3] = 600
    out = torch.empty((tokens, block_topk), dtype=torch.int32, device="cuda")
    want = torch.empty_like(out)
    graph, _ = capture_graph(lambda: qsa_aiter.qsa_block_topk(logits, visible, block_topk, out=out))
    for step in range(3):
        visible.copy_(torch.randint(1000, columns + 1, (tokens,), generator=gen, dtype=torch.int32))
        graph.replay()
        torch_block_topk(logits, visible, block_topk, want)
        assert torch.equal(out, want), f"replay {step}"
        assert torch.equal(qsa_aiter.qsa_block_topk(logits, visible, block_topk), want), f"eager {step}"

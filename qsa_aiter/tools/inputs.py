"""Inputs at a work point, for timing: the scoring kernels' rotated input sets (``point_inputs``: the benchmark and
the tuner), one scored batch with the selection ops' buffers (``selection_inputs``: the selection and host-path
benchmarks), a batch's selection call as a selection candidate takes it (``selection_call``: the fused selection's
tests and ``benchmarks/fused_phases.py``), and the physical floor of a batch's memory traffic (``floor_bytes``)."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from ..kernels.scoring.base import ScoreArgs
from ..ops.scoring import describe_call, qsa_paged_mqa_logits
from ..ops.selection import qsa_select_paged_tokens, validate_selection_call
from ..runtime.registries import SelectionArgs, SelectionProblem
from .work_points import TOKEN_TOPK, WorkPoint
from .workloads import ScoringBatch, make_batch

#: Bytes the rotated input sets of one point exceed together, so that each call reads its keys from HBM, not L2.
L2_ROTATE_BYTES = 256 << 20


def key_bytes_per_group(batch: ScoringBatch) -> int:
    """Bytes one compressed key group occupies in the cache, scales included: 2 D for 16-bit caches, D + 4 for fp8
    (one fp32 scale per token), D / 2 + D / 32 for MXFP4 (one e8m0 exponent per 32 elements)."""
    cache, scale = batch.compressed_k_cache, batch.k_scale
    key_bytes = cache.shape[-1] * cache.element_size()
    return key_bytes if scale is None else key_bytes + scale[0, 0].numel() * scale.element_size()


def floor_bytes(batch: ScoringBatch) -> tuple[int, int]:
    """(bytes, flops): visible keys read once per request (in the cache's own format) + fp32 logits written; dot
    FLOPs of the visible region."""
    t2r = batch.token_to_request.cpu().tolist()
    pos = batch.query_positions.cpu().tolist()
    ctx = batch.context_lens.cpu().tolist()
    r_ = batch.compress_ratio
    heads, head_dim = batch.q.shape[1:]
    per_req: dict[int, int] = {}
    logits = flops = 0
    for r, p in zip(t2r, pos):
        if r < 0:
            continue
        vis = max(0, min((p + 1) // r_, ctx[r] // r_))
        per_req[r] = max(per_req.get(r, 0), vis)
        logits += 4 * vis
        flops += 2 * heads * head_dim * vis
    return sum(per_req.values()) * key_bytes_per_group(batch) + logits, flops


@dataclass
class PointInputs:
    """Rotated input sets of one work point: one validated problem and one launch-argument bundle per set."""

    problems: list
    launches: list[ScoreArgs]
    rows: int
    nbytes: int
    flops: int


def point_inputs(point: WorkPoint, page_size: int, device, cache: str = "bf16", max_sets: int = 8) -> PointInputs:
    """Enough input sets of ``point`` that cycling through them exceeds L2 (2 to ``max_sets`` sets), on a ``cache``
    index cache (a format name, docs/cache_formats.md). Every set has the same shapes, so one Triton variant serves
    them all."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{point.name}/{page_size}".encode()))

    def batch():
        return make_batch(list(point.context_lens), point.rows_per_request, page_size=page_size, device=device,
                          cache=cache, generator=gen)

    probe = batch()
    nbytes, flops = floor_bytes(probe)
    pages = probe.compressed_k_cache.shape[0] * page_size
    set_bytes = pages * key_bytes_per_group(probe) + probe.q.shape[0] * 4 * (probe.page_table.shape[1] * page_size)
    n_sets = min(max_sets, max(2, min(8, math.ceil(L2_ROTATE_BYTES / max(set_bytes, 1)))))
    sets = [probe] + [batch() for _ in range(n_sets - 1)]
    problems, launches = [], []
    for b in sets:
        problem = describe_call(*b.args(), **b.kwargs(), phase=point.phase, max_query_len=b.max_query_len)
        logits = torch.empty(b.q.shape[0], problem.num_columns, dtype=torch.float32, device=device)
        visible = torch.empty(b.q.shape[0], dtype=torch.int32, device=device)
        problems.append(problem)
        launches.append(ScoreArgs(b.q, b.compressed_k_cache, b.page_table, b.token_to_request, b.query_positions,
                                  b.context_lens, logits, visible, problem.num_columns, b.compress_ratio,
                                  1.0 / math.sqrt(b.q.shape[2]), b.k_scale))
    return PointInputs(problems, launches, probe.q.shape[0], nbytes, flops)


@dataclass
class SelectionInputs:
    """One batch of a work point with the selection op's output buffers, for the selection benchmarks; ``logits``
    and ``visible`` hold the batch's scores (``selection_inputs`` scores it once)."""

    args: tuple  # qsa_paged_mqa_logits' positional arguments up to context_lens
    hints: dict  # k_scale, phase, max_query_len
    batch: ScoringBatch
    logits: torch.Tensor  # fp32 [tokens, columns]
    visible: torch.Tensor  # int32 [tokens]
    groups: torch.Tensor  # int32 [tokens, TOKEN_TOPK // R]
    picked: torch.Tensor  # int32 [tokens, TOKEN_TOPK + R - 1]

    def score(self):
        """Scoring alone into ``logits`` (``qsa_paged_mqa_logits``)."""
        return qsa_paged_mqa_logits(*self.args, out=self.logits, **self.hints)

    def select(self):
        """The whole selection into ``picked`` (``qsa_select_paged_tokens``)."""
        return qsa_select_paged_tokens(*self.args, TOKEN_TOPK, self.batch.compress_ratio, out=self.picked,
                                       **self.hints)


def selection_inputs(point: WorkPoint, page_size: int, cache: str = "bf16", device="cuda") -> SelectionInputs:
    """A batch of ``point`` (seed 0) at ``page_size`` on a ``cache`` index cache (a format name), scored once, with
    the selection buffers."""
    batch = make_batch(list(point.context_lens), point.rows_per_request, page_size=page_size, cache=cache,
                       device=device, generator=torch.Generator().manual_seed(0))
    tokens, ratio = batch.q.shape[0], batch.compress_ratio
    args, hints = batch.args()[:6], dict(batch.kwargs(), phase=point.phase, max_query_len=batch.max_query_len)
    logits = torch.empty((tokens, batch.page_table.shape[1] * page_size), dtype=torch.float32, device=device)
    _, visible = qsa_paged_mqa_logits(*args, out=logits, **hints)
    return SelectionInputs(args, hints, batch, logits, visible,
                           torch.empty((tokens, TOKEN_TOPK // ratio), dtype=torch.int32, device=device),
                           torch.empty((tokens, TOKEN_TOPK + ratio - 1), dtype=torch.int32, device=device))


def selection_call(batch: ScoringBatch, token_topk: int, hints: dict, out: torch.Tensor | None = None):
    """``(problem, args)`` of a ``qsa_select_paged_tokens`` call on ``batch`` (validated as the op validates it: a
    ``registries.SelectionProblem`` and ``SelectionArgs``), as a selection candidate (``runtime.fused_select``) takes
    it; ``hints``: ``phase``, ``max_query_len``; ``out``: the tokens' output, else a fresh one filled with -5 on the
    batch's device."""
    b = batch
    call = validate_selection_call(b.q, b.compressed_k_cache, b.page_table, b.token_to_request, b.query_positions,
                                   b.context_lens, token_topk, b.compress_ratio, out, None, None, b.k_scale,
                                   hints.get("phase"), hints.get("max_query_len"))
    problem = SelectionProblem(call.problem, call.token_topk, call.chunk_rows)
    result = call.out if out is not None else torch.full(call.out.shape, -5, dtype=torch.int32, device=b.q.device)
    args = SelectionArgs(b.q, b.compressed_k_cache, b.page_table, b.token_to_request, b.query_positions,
                         b.context_lens, b.k_scale, result, None)
    return problem, args

"""Replays of the selection ops' recorded launches: the host path of a call whose signature was seen before
(``qsa_aiter.runtime.replay``). Each plan holds what its op's validation and dispatch decided for the signature and the
compiled kernels its first call launched; a replay allocates its outputs and one scratch buffer for its internal
arrays (logits, visible counts, top-k candidates, block maxima: parts laid out as the first call's own buffers) and
passes the kernels their addresses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime import replay, dispatch
from ..kernels.scoring.problem import ScoreProblem
from ..kernels.scoring.base import SCORE_POINTERS
from ..kernels.selection import expand, maxima, topk


def _scratch_parts(*sizes: int) -> tuple[tuple[int, ...], int]:
    """Byte offsets of 4-byte-element parts of ``sizes`` elements in one scratch allocation, each 64-byte aligned (as a
    buffer of its own would be to the kernels, which Triton specialises on 16-byte alignment), and the scratch's
    element count."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(4 * total)
        total += -(-size // 16) * 16
    return tuple(offsets), max(total, 1)


def _laid_out(tensor: torch.Tensor, shape: tuple[int, int]) -> bool:
    """Whether a recorded launch's internal buffer is a contiguous ``shape`` array (the layout a replay gives its
    part of the scratch, so the recorded strides hold for it)."""
    return tuple(tensor.shape) == shape and tensor.is_contiguous()


def _topk_parts(launches: list, block_topk: int, tokens: int, columns: int):
    """``(maxima launch or None, top-k launch, candidate width, maxima elements)`` of the direct launches of a
    top-k's recorded ``launches`` (the block maxima, when recorded, then the top-k), or None where a recorded
    buffer is not laid out as a replay lays it out."""
    direct = replay.direct_launches(launches, ("block_maxima?", "topk"))
    if direct is None or direct[-1].pointers != topk.TOPK_POINTERS:
        return None
    with_maxima = len(direct) == 2
    width = topk.buffer_width(block_topk, launches[-1][0].config, with_maxima)
    shape = maxima.maxima_shape(tokens, columns, block_topk)
    if not _laid_out(launches[-1][2][3], (tokens, width)) or (with_maxima and not _laid_out(launches[0][2][2], shape)):
        return None
    return (direct[0] if with_maxima else None), direct[-1], width, (shape[0] * shape[1] if with_maxima else 0)


def selection_signature(settings, q, compressed_k_cache, page_table, token_to_request, query_positions,
                        context_lens, token_topk, compress_ratio, out, logits_workspace_bytes, max_seq_len, k_scale,
                        phase, max_query_len):
    """The call's ``call_plans`` signature ``(key, addresses)`` (a None key: not a cacheable call; the validating
    path names the problem)."""
    return replay.signature(
        ("qsa_select_paged_tokens", id(settings)),
        (q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, k_scale, out),
        (token_topk, compress_ratio, logits_workspace_bytes, max_seq_len, phase, max_query_len))


@dataclass(frozen=True)
class SelectionPlan:
    """A validated one-chunk ``qsa_select_paged_tokens`` signature and its recorded launches: the scorer, the
    block maxima (or None) and the top-k with its expansion; ``offsets`` are the byte offsets in the scratch of the
    logits, the top-k's candidates, the groups, the visible counts and the block maxima."""

    problem: ScoreProblem
    token_topk: int
    score: replay.DirectLaunch
    maxima: replay.DirectLaunch | None
    topk: replay.DirectLaunch
    offsets: tuple[int, int, int, int, int]
    scratch_elements: int

    @classmethod
    def of(cls, problem: ScoreProblem, block_topk: int, token_topk: int, launches: list) -> "SelectionPlan | None":
        """The plan of a call that made ``launches`` (None unless they were a scorer's, then the Triton top-k's)."""
        if not launches or launches[0][0].kernel not in dispatch.SCORER_KERNELS:
            return None
        tokens, columns = problem.num_tokens, problem.num_columns
        score = replay.direct_launches(launches[:1], (launches[0][0].kernel,))
        parts = _topk_parts(launches[1:], block_topk, tokens, columns)
        if score is None or score[0].pointers != SCORE_POINTERS or parts is None:
            return None
        if not _laid_out(launches[0][2][7], (tokens, columns)):
            return None
        maxima_launch, topk_launch, width, maxima_elements = parts
        offsets, elements = _scratch_parts(tokens * columns, tokens * width, tokens * block_topk, tokens,
                                           maxima_elements)
        return cls(problem, token_topk, score[0], maxima_launch, topk_launch, offsets, elements)

    def run(self, addresses, q, out, has_scale: bool) -> torch.Tensor:
        """The call, for arguments of this plan's signature: ``addresses`` of its tensors in
        ``selection_signature``'s order."""
        q_at, cache_at, table_at, request_at, position_at, lens_at, scale_at, _ = addresses
        tokens, ratio = self.problem.num_tokens, self.problem.compress_ratio
        if out is None:
            out = q.new_empty((tokens, self.token_topk + ratio - 1), dtype=torch.int32)
        scratch = q.new_empty((self.scratch_elements,), dtype=torch.int32)
        base = scratch.data_ptr()
        logits_at, candidates_at, groups_at, visible_at, maxima_at = [base + offset for offset in self.offsets]
        self.score(q_at, cache_at, scale_at if has_scale else cache_at, table_at, request_at, position_at, lens_at,
                   logits_at, visible_at)
        if self.maxima is not None:
            self.maxima(logits_at, visible_at, maxima_at)
        else:
            maxima_at = logits_at  # unread without maxima
        self.topk(logits_at, visible_at, groups_at, candidates_at, maxima_at, position_at, lens_at, request_at,
                  out.data_ptr())
        return out


def topk_signature(settings, logits, visible, block_topk, out) -> tuple:
    """A ``qsa_block_topk`` call's ``call_plans`` signature ``(key, addresses)``."""
    return replay.signature(("qsa_block_topk", id(settings)), (logits, visible, out), (block_topk,))


@dataclass(frozen=True)
class TopkPlan:
    """A validated ``qsa_block_topk`` signature and its recorded launches: the block maxima (or None), the top-k;
    ``maxima_offset``: the byte offset of the block maxima in the scratch, after the candidates."""

    block_topk: int
    maxima: replay.DirectLaunch | None
    topk: replay.DirectLaunch
    maxima_offset: int
    scratch_elements: int

    @classmethod
    def of(cls, logits: torch.Tensor, block_topk: int, launches: list) -> "TopkPlan | None":
        """The plan of a call on ``logits`` that made ``launches`` (None unless they were the Triton top-k's)."""
        tokens, columns = logits.shape
        parts = _topk_parts(launches, block_topk, tokens, columns)
        if parts is None:
            return None
        maxima_launch, topk_launch, width, maxima_elements = parts
        (_, maxima_offset), elements = _scratch_parts(tokens * width, maxima_elements)
        return cls(block_topk, maxima_launch, topk_launch, maxima_offset, elements)

    def run(self, addresses, logits: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The call: ``addresses`` of ``topk_signature``'s tensors."""
        logits_at, visible_at, _ = addresses
        if out is None:
            out = logits.new_empty((logits.shape[0], self.block_topk), dtype=torch.int32)
        scratch = logits.new_empty((self.scratch_elements,), dtype=torch.int32)
        candidates_at = scratch.data_ptr()
        maxima_at = candidates_at + self.maxima_offset
        if self.maxima is not None:
            self.maxima(logits_at, visible_at, maxima_at)
        else:
            maxima_at = logits_at  # unread without maxima
        # Without expansion the top-k's expansion pointers are unread: the visible counts stand in, as when recorded.
        self.topk(logits_at, visible_at, out.data_ptr(), candidates_at, maxima_at, visible_at, visible_at, visible_at,
                  visible_at)
        return out


def expand_signature(settings, block_indices, query_positions, context_lens, token_to_request, compress_ratio,
                     token_topk, out) -> tuple:
    """A ``qsa_expand_block_indices`` call's ``call_plans`` signature ``(key, addresses)``."""
    return replay.signature(("qsa_expand_block_indices", id(settings)),
                                (block_indices, query_positions, context_lens, token_to_request, out),
                                (compress_ratio, token_topk))


@dataclass(frozen=True)
class ExpandPlan:
    """A validated ``qsa_expand_block_indices`` signature and its recorded launch."""

    width: int  # token_topk + R - 1
    expand: replay.DirectLaunch

    @classmethod
    def of(cls, width: int, launches: list) -> "ExpandPlan | None":
        """The plan of a call that made ``launches`` (None unless it was the Triton expansion's)."""
        direct = replay.direct_launches(launches, ("expand",))
        return None if direct is None or direct[0].pointers != expand.EXPAND_POINTERS else cls(width, direct[0])

    def run(self, addresses, block_indices, out) -> torch.Tensor:
        """The call: ``addresses`` of ``expand_signature``'s tensors."""
        indices_at, position_at, lens_at, request_at, _ = addresses
        if out is None:
            out = block_indices.new_empty((block_indices.shape[0], self.width), dtype=torch.int32)
        self.expand(indices_at, position_at, lens_at, request_at, out.data_ptr())
        return out

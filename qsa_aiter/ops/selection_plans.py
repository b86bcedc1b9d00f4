"""Replays of the selection ops' recorded launches: the host path of a call whose signature was seen before
(``qsa_aiter.runtime.replay``). Each plan holds what its op's validation and dispatch decided for the signature and the
compiled kernels its first call launched; a replay allocates its outputs and one scratch buffer for its internal
arrays (logits, visible counts, top-k candidates, block maxima: parts laid out as the first call's own buffers) and
passes the kernels their addresses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime import native_topk, registries, replay
from ..kernels.scoring.problem import ScoreProblem
from ..kernels.selection import maxima, topk
from .scoring import SCORER_POINTERS

#: The pointer parameters of the kernels, in the order the replays below pass their addresses.
TOPK_POINTERS = ("logits_ptr", "vis_ptr", "out_ptr", "buf_ptr", "max_ptr", "pos_ptr", "ctx_ptr", "t2r_ptr", "tok_ptr")
MAXIMA_POINTERS = ("logits_ptr", "vis_ptr", "max_ptr")
EXPAND_POINTERS = ("blk_ptr", "pos_ptr", "ctx_ptr", "t2r_ptr", "out_ptr")
NATIVE_TOPK_POINTERS = ("logits", "visible", "out", "positions", "contexts", "requests", "tokens", "histogram")


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


def _native_topk_parts(launches: list, expands: bool):
    """``(None, top-k, 0, 0)`` as ``_topk_parts`` gives them, for the native top-k's recorded launch (with its fused
    expansion where the call ``expands``): the top-k as one function of the Triton top-k's nine addresses (it reads
    the logits, the visible counts and the groups, and the expansion's four; not the candidates or the maxima), or
    None where the launches are not that one."""
    name = native_topk.NATIVE_TOPK_EXPAND_LAUNCH if expands else native_topk.NATIVE_TOPK_LAUNCH
    direct = replay.direct_launches(launches, (name,))
    launch = direct[0].taking(*NATIVE_TOPK_POINTERS) if direct else None
    if launch is None:
        return None
    if not expands:
        def topk_alone(logits_at, visible_at, out_at, *unread):
            launch(logits_at, visible_at, out_at, 0, 0, 0, 0, 0)  # the expansion's pointers null: no expansion

        return None, topk_alone, 0, 0

    def topk_and_expand(logits_at, visible_at, groups_at, candidates_at, maxima_at, position_at, lens_at, request_at,
                        out_at):
        launch(logits_at, visible_at, groups_at, position_at, lens_at, request_at, out_at, 0)

    return None, topk_and_expand, 0, 0


def _topk_parts(launches: list, block_topk: int, tokens: int, columns: int, expands: bool = False):
    """``(maxima launch or None, top-k launch, candidate width, maxima elements)`` of the direct launches of a
    top-k's recorded ``launches`` (the block maxima, when recorded, then the top-k; or the native top-k, with its
    expansion where the call ``expands``), or None where a recorded buffer is not laid out as a replay lays it
    out. The top-k launch takes the Triton top-k's pointer addresses (``TOPK_POINTERS``)."""
    if launches and not replay.is_recorded(launches[0]):
        return _native_topk_parts(launches, expands)
    direct = replay.direct_launches(launches, ("block_maxima?", "topk"))
    if direct is None:
        return None
    with_maxima = len(direct) == 2
    topk_launch = direct[-1].taking(*TOPK_POINTERS)
    maxima_launch = direct[0].taking(*MAXIMA_POINTERS) if with_maxima else None
    if topk_launch is None or (with_maxima and maxima_launch is None):
        return None
    width = topk.buffer_width(block_topk, launches[-1].plan.config, with_maxima)
    shape = maxima.maxima_shape(tokens, columns, block_topk)
    if not _laid_out(launches[-1].arg("buf_ptr"), (tokens, width)) or (
            with_maxima and not _laid_out(launches[0].arg("max_ptr"), shape)):
        return None
    return maxima_launch, topk_launch, width, (shape[0] * shape[1] if with_maxima else 0)


@dataclass(frozen=True)
class SelectionPlan:
    """A validated one-chunk ``qsa_select_paged_tokens`` signature and its recorded launches: the scorer, the
    block maxima (or None) and the top-k with its expansion; ``offsets`` are the byte offsets in the scratch of the
    logits, the top-k's candidates, the groups, the visible counts and the block maxima."""

    problem: ScoreProblem
    token_topk: int
    score: Callable  # the recorded launches, taking their pointer arguments' addresses (DirectLaunch.taking)
    maxima: Callable | None
    topk: Callable
    offsets: tuple[int, ...]  # five byte offsets (_scratch_parts)
    scratch_elements: int

    @classmethod
    def of(cls, problem: ScoreProblem, block_topk: int, token_topk: int, launches: list) -> "SelectionPlan | None":
        """The plan of a call that made ``launches`` (None unless they were a scorer's, then the Triton or the native
        top-k's)."""
        first = launches[0] if launches else None
        if first is None or not replay.is_recorded(first) or first.plan.kernel not in registries.SCORER_KERNELS:
            return None
        tokens, columns = problem.num_tokens, problem.num_columns
        score = replay.direct_launches(launches[:1], (launches[0].plan.kernel,))
        score = score[0].taking(*SCORER_POINTERS) if score else None
        parts = _topk_parts(launches[1:], block_topk, tokens, columns, expands=True)
        if score is None or parts is None:
            return None
        if not _laid_out(launches[0].arg("out_ptr"), (tokens, columns)):
            return None
        maxima_launch, topk_launch, width, maxima_elements = parts
        offsets, elements = _scratch_parts(tokens * columns, tokens * width, tokens * block_topk, tokens,
                                           maxima_elements)
        return cls(problem, token_topk, score, maxima_launch, topk_launch, offsets, elements)

    def replay(self, addresses, tensors) -> torch.Tensor:
        """The call, for arguments of this plan's signature: ``tensors`` and their ``addresses`` in the order
        ``qsa_select_paged_tokens`` gives them to ``replay.cached_call``."""
        q_at, cache_at, table_at, request_at, position_at, lens_at, scale_at, _ = addresses
        q, k_scale, out = tensors[0], tensors[6], tensors[7]
        has_scale = k_scale is not None
        tokens, ratio = self.problem.num_tokens, self.problem.compress_ratio
        if out is None:
            out = q.new_empty((tokens, self.token_topk + ratio - 1), dtype=torch.int32)
        scratch = q.new_empty((self.scratch_elements,), dtype=torch.int32)
        base = scratch.data_ptr()
        logits_at, candidates_at, groups_at, visible_at, maxima_at = [base + offset for offset in self.offsets]
        self.score(q_at, cache_at, scale_at if has_scale else cache_at, table_at, request_at, position_at, lens_at,
                   logits_at, visible_at, visible_at)  # no histogram: the visible counts stand in for it
        if self.maxima is not None:
            self.maxima(logits_at, visible_at, maxima_at)
        else:
            maxima_at = logits_at  # unread without maxima
        self.topk(logits_at, visible_at, groups_at, candidates_at, maxima_at, position_at, lens_at, request_at,
                  out.data_ptr())
        return out


@dataclass(frozen=True)
class TopkPlan:
    """A validated ``qsa_block_topk`` signature and its recorded launches: the block maxima (or None), the top-k;
    ``maxima_offset``: the byte offset of the block maxima in the scratch, after the candidates."""

    block_topk: int
    maxima: Callable | None
    topk: Callable
    maxima_offset: int
    scratch_elements: int

    @classmethod
    def of(cls, logits: torch.Tensor, block_topk: int, launches: list) -> "TopkPlan | None":
        """The plan of a call on ``logits`` that made ``launches`` (None unless they were the Triton or the native
        top-k's)."""
        tokens, columns = logits.shape
        parts = _topk_parts(launches, block_topk, tokens, columns)
        if parts is None:
            return None
        maxima_launch, topk_launch, width, maxima_elements = parts
        (_, maxima_offset), elements = _scratch_parts(tokens * width, maxima_elements)
        return cls(block_topk, maxima_launch, topk_launch, maxima_offset, elements)

    def replay(self, addresses, tensors) -> torch.Tensor:
        """The call: ``qsa_block_topk``'s tensors (logits, visible, out) and their ``addresses``."""
        logits_at, visible_at, _ = addresses
        logits, out = tensors[0], tensors[2]
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


@dataclass(frozen=True)
class ExpandPlan:
    """A validated ``qsa_expand_block_indices`` signature and its recorded launch."""

    width: int  # token_topk + R - 1
    expand: Callable

    @classmethod
    def of(cls, width: int, launches: list) -> "ExpandPlan | None":
        """The plan of a call that made ``launches`` (None unless it was the Triton expansion's)."""
        direct = replay.direct_launches(launches, ("expand",))
        launch = direct[0].taking(*EXPAND_POINTERS) if direct else None
        return None if launch is None else cls(width, launch)

    def replay(self, addresses, tensors) -> torch.Tensor:
        """The call: ``qsa_expand_block_indices``'s tensors (block_indices, query_positions, context_lens,
        token_to_request, out) and their ``addresses``."""
        indices_at, position_at, lens_at, request_at, _ = addresses
        block_indices, out = tensors[0], tensors[4]
        if out is None:
            out = block_indices.new_empty((block_indices.shape[0], self.width), dtype=torch.int32)
        self.expand(indices_at, position_at, lens_at, request_at, out.data_ptr())
        return out

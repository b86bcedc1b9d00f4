"""Replays of the selection ops' recorded launches: the host path of a call whose signature was seen before
(``qsa_aiter.call_plans``). Each plan holds what its op's validation and dispatch decided for the signature and the
compiled kernels its first call launched, and rebuilds the kernels' arguments with the functions that call used
(``scoring.base.score_kernel_args``, ``topk.run``, ``expand.kernel_args``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import call_plans, registry
from ..problem import ScoreProblem
from ..scoring.base import score_kernel_args
from . import expand, topk


def _topk_launches(direct: tuple, launches: list, block_topk: int) -> tuple:
    """``(maxima launch or None, top-k launch, candidate width)`` of the direct launches of a top-k's recorded
    ``launches`` (the block maxima, when recorded, then the top-k)."""
    with_maxima = len(direct) == 2
    width = topk.buffer_width(block_topk, launches[-1][0].config, with_maxima)
    return (direct[0] if with_maxima else None), direct[-1], width


def selection_signature(settings, q, compressed_k_cache, page_table, token_to_request, query_positions,
                         context_lens, token_topk, compress_ratio, out, logits_workspace_bytes, max_seq_len, k_scale,
                         phase, max_query_len):
    """The call's ``call_plans`` signature (None: not a cacheable call; the validating path names the problem)."""
    return call_plans.signature(
        ("qsa_select_paged_tokens", id(settings)),
        (q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, k_scale, out),
        (token_topk, compress_ratio, logits_workspace_bytes, max_seq_len, phase, max_query_len))


@dataclass(frozen=True)
class SelectionPlan:
    """A validated one-chunk ``qsa_select_paged_tokens`` signature and its recorded launches: the scorer, the
    block maxima (or None) and the top-k with its expansion."""

    problem: ScoreProblem
    block_topk: int
    token_topk: int
    score: call_plans.DirectLaunch
    maxima: call_plans.DirectLaunch | None
    topk: call_plans.DirectLaunch
    candidate_width: int

    @property
    def scratch_sizes(self) -> tuple[int, int, int, int]:
        """Elements of the int32 scratch: the top-k's candidates, the groups, padding, the visible counts. Each
        part starts 64-byte aligned (the candidate width is a power of two >= 16), as a buffer of its own would be
        to the kernels, which Triton specialises on 16-byte alignment."""
        tokens = self.problem.num_tokens
        groups = tokens * self.block_topk
        return tokens * self.candidate_width, groups, -groups % 16, tokens

    @classmethod
    def of(cls, problem: ScoreProblem, block_topk: int, token_topk: int, launches: list) -> "SelectionPlan | None":
        """The plan of a call that made ``launches`` (None unless they were a scorer's, then the Triton top-k's)."""
        if not launches:
            return None
        direct = call_plans.direct_launches(launches, (launches[0][0].kernel, "block_maxima?", "topk"))
        if direct is None or launches[0][0].kernel not in registry.SCORER_KERNELS:
            return None
        return cls(problem, block_topk, token_topk, direct[0], *_topk_launches(direct[1:], launches, block_topk))

    def run(self, q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, k_scale,
            out) -> torch.Tensor:
        """The call, for arguments of this plan's signature."""
        tokens, columns, ratio = self.problem.num_tokens, self.problem.num_columns, self.problem.compress_ratio
        if out is None:
            out = q.new_empty((tokens, self.token_topk + ratio - 1), dtype=torch.int32)
        logits = q.new_empty((tokens, columns), dtype=torch.float32)
        # The int32 scratch in one allocation (an allocation costs more host time than a view).
        sizes = self.scratch_sizes
        candidates, groups, _, visible = q.new_empty((sum(sizes),), dtype=torch.int32).split_with_sizes(sizes)
        groups = groups.view(tokens, self.block_topk)
        self.score(*score_kernel_args(q, compressed_k_cache, k_scale, page_table, token_to_request, query_positions,
                                      context_lens, logits, visible, columns, 1.0 / math.sqrt(self.problem.head_dim)))
        topk.run(logits, visible, groups, self.block_topk,
                 (query_positions, context_lens, token_to_request, out, ratio, self.token_topk), None, self.maxima,
                 self.topk, candidates.view(tokens, self.candidate_width))
        return out


def topk_signature(settings, logits, visible, block_topk, out) -> tuple | None:
    """A ``qsa_block_topk`` call's ``call_plans`` signature."""
    return call_plans.signature(("qsa_block_topk", id(settings)), (logits, visible, out), (block_topk,))


@dataclass(frozen=True)
class TopkPlan:
    """A validated ``qsa_block_topk`` signature and its recorded launches: the block maxima (or None), the top-k."""

    block_topk: int
    maxima: call_plans.DirectLaunch | None
    topk: call_plans.DirectLaunch
    candidate_width: int

    @classmethod
    def of(cls, block_topk: int, launches: list) -> "TopkPlan | None":
        """The plan of a call that made ``launches`` (None unless they were the Triton top-k's)."""
        direct = call_plans.direct_launches(launches, ("block_maxima?", "topk"))
        return None if direct is None else cls(block_topk, *_topk_launches(direct, launches, block_topk))

    def run(self, logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        tokens = logits.shape[0]
        if out is None:
            out = logits.new_empty((tokens, self.block_topk), dtype=torch.int32)
        candidates = logits.new_empty((tokens, self.candidate_width), dtype=torch.int32)
        topk.run(logits, visible, out, self.block_topk, None, None, self.maxima, self.topk, candidates)
        return out


def expand_signature(settings, block_indices, query_positions, context_lens, token_to_request, compress_ratio,
                     token_topk, out) -> tuple | None:
    """A ``qsa_expand_block_indices`` call's ``call_plans`` signature."""
    return call_plans.signature(("qsa_expand_block_indices", id(settings)),
                                (block_indices, query_positions, context_lens, token_to_request, out),
                                (compress_ratio, token_topk))


@dataclass(frozen=True)
class ExpandPlan:
    """A validated ``qsa_expand_block_indices`` signature and its recorded launch."""

    width: int  # token_topk + R - 1
    expand: call_plans.DirectLaunch

    @classmethod
    def of(cls, width: int, launches: list) -> "ExpandPlan | None":
        """The plan of a call that made ``launches`` (None unless it was the Triton expansion's)."""
        direct = call_plans.direct_launches(launches, ("expand",))
        return None if direct is None else cls(width, direct[0])

    def run(self, block_indices, query_positions, context_lens, token_to_request, out) -> torch.Tensor:
        if out is None:
            out = block_indices.new_empty((block_indices.shape[0], self.width), dtype=torch.int32)
        self.expand(*expand.kernel_args(block_indices, query_positions, context_lens, token_to_request, out))
        return out

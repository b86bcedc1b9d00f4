"""Public scoring op: ``qsa_paged_mqa_logits``, a drop-in for the engine's op of the same name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels.scoring.base import ScoreArgs
from ..kernels.scoring.problem import ScoreProblem
from ..runtime import native_scorer, registries, replay
from ..runtime.arguments import validate_scoring_call
from ..runtime.settings import get_settings
from .declarations import Call, taking_arguments_of
from .traced import through_custom_op


def _prepare(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, compress_ratio,
             score_divisor, max_columns, row_starts, k_scale, out, phase, max_query_len, settings=None,
             op="qsa_paged_mqa_logits"):
    settings = settings or get_settings()
    return validate_scoring_call(
        q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, compress_ratio,
        score_divisor, max_columns, row_starts, k_scale, out, phase, max_query_len,
        stacked_enabled=settings.stacked_decode_scorer, e4m3_mma=settings.e4m3_mma, op=op,
    )


@through_custom_op
def qsa_paged_mqa_logits(
    q: torch.Tensor,
    compressed_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_to_request: torch.Tensor,
    query_positions: torch.Tensor,
    context_lens: torch.Tensor,
    compress_ratio: int = 4,
    score_divisor: float | None = None,
    max_columns: int | None = None,
    row_starts: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    phase: str | None = None,
    max_query_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every visible compressed key group for every query row.

    Args:
        q: ``[tokens, heads, head_dim]`` bf16/fp16, contiguous.
        compressed_k_cache: the paged index cache (docs/cache_formats.md): ``[pages, page_size, 1,
            head_dim]`` bf16/fp16 (same dtype as ``q``) or ``float8_e4m3fn``/``float8_e4m3fnuz``; or MXFP4
            ``[pages, page_size, 1, head_dim // 2]`` ``float4_e2m1fn_x2``. A page holds ``page_size`` compressed key
            groups, ``page_size * compress_ratio`` tokens (an engine's ``block_size`` counts tokens). Its last dim
            dense (stride 1), its page and slot strides any that keep keys apart: a view of a wider buffer
            (``buffer[..., :head_dim]``) is read in place.
        page_table: ``[requests, width]`` int32/int64; logical page ``c // page_size`` of request ``r`` is
            physical page ``page_table[r, c // page_size]``.
        token_to_request, query_positions: ``[tokens]`` int32/int64; ``-1`` marks a padded row.
        context_lens: ``[requests]`` int32/int64, in tokens.
        compress_ratio: tokens per compressed group (R).
        score_divisor: scores are divided by it; default ``sqrt(head_dim)``.
        max_columns: caps ``num_columns`` (default ``width * page_size``).
        row_starts: optional ``[tokens]`` int tensor, filled with zeros (the engine's top-k convention).
        k_scale: the cache's scales: fp32 ``[pages, page_size]`` (one per token) for fp8; ``float8_e8m0fnu``
            ``[pages, page_size, 1, head_dim // 32]`` (one exponent per 32 elements) for MXFP4; None for 16-bit.
        out: optional fp32 ``[tokens, num_columns]`` (last dim contiguous) to write the logits into.
        phase: optional host-side hint: ``prefill``, ``verify``, ``draft`` or ``decode``.
        max_query_len: optional host int: the most query rows any request has in this call.

    Traced by ``torch.compile`` the call goes through the custom op (``qsa_aiter.ops.traced``).

    Returns:
        ``(logits, visible_groups)``: fp32 ``[tokens, num_columns]`` whose columns ``[0, visible)`` hold
        ``sum_h relu(q[t, h] . K[c]) / score_divisor`` (``-inf`` for a bad page id) and whose other columns are not
        written; int32 ``[tokens]`` visible group counts ``max(0, min((p+1)//R, ctx//R, num_columns))``.
    """
    settings = get_settings()  # read once per call

    def first_call():
        problem, divisor = _prepare(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                    context_lens, compress_ratio, score_divisor, max_columns, row_starts, k_scale,
                                    out, phase, max_query_len, settings)
        logits = out if out is not None else torch.empty((problem.num_tokens, problem.num_columns),
                                                         dtype=torch.float32, device=q.device)
        if row_starts is not None:
            row_starts.zero_()
        visible = score_validated(problem, divisor, q, compressed_k_cache, page_table, token_to_request,
                                  query_positions, context_lens, k_scale, logits, settings)
        return (logits, visible), lambda launches: ScoringPlan.of(problem, launches)

    # The tensors in the order ScoringPlan.replay reads them; the host arguments are everything validation reads.
    return replay.cached_call(
        "qsa_paged_mqa_logits", settings,
        (q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, row_starts, k_scale, out),
        (compress_ratio, score_divisor, max_columns, phase, max_query_len), first_call)


#: The pointer parameters of every scoring kernel, in the order a replay passes their addresses.
SCORER_POINTERS = ("q_ptr", "k_ptr", "ks_ptr", "pt_ptr", "t2r_ptr", "pos_ptr", "ctx_ptr", "out_ptr", "vis_ptr",
                   "hist_ptr")
#: The native scorer's pointer parameters (``kernels.scoring.native_scorer.PARAMS``), in the order its replay passes
#: them.
NATIVE_SCORER_POINTERS = ("q", "keys", "k_scale", "page_table", "token_to_request", "query_positions", "context_lens",
                          "logits", "visible")


@dataclass(frozen=True)
class ScoringPlan:
    """A validated ``qsa_paged_mqa_logits`` signature: its problem and recorded kernel launch."""

    problem: ScoreProblem
    launch: Callable  # the recorded launch, taking SCORER_POINTERS' addresses (DirectLaunch.taking)

    @classmethod
    def of(cls, problem: ScoreProblem, launches: list) -> "ScoringPlan | None":
        """The plan of a call that made ``launches`` (None unless it was one scoring kernel's launch: a Triton
        scorer's, or the native scorer's)."""
        if problem.num_tokens == 0 or len(launches) != 1:
            return None
        if not replay.is_recorded(launches[0]):
            launch = _native_scoring_launch(launches)
            return None if launch is None else cls(problem, launch)
        if launches[0].plan.kernel not in registries.SCORER_KERNELS:
            return None
        direct = replay.direct_launches(launches, (launches[0].plan.kernel,))
        launch = direct[0].taking(*SCORER_POINTERS) if direct else None
        return None if launch is None else cls(problem, launch)

    def replay(self, addresses, tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """The call, for arguments of this plan's signature: ``tensors`` and their ``addresses`` in the order
        ``qsa_paged_mqa_logits`` gives them to ``replay.cached_call``."""
        q_at, cache_at, table_at, request_at, position_at, lens_at, _, scale_at, _ = addresses
        q, row_starts, k_scale, out = tensors[0], tensors[6], tensors[7], tensors[8]
        has_scale = k_scale is not None
        tokens, columns = self.problem.num_tokens, self.problem.num_columns
        logits = out if out is not None else q.new_empty((tokens, columns), dtype=torch.float32)
        if row_starts is not None:
            row_starts.zero_()
        visible = q.new_empty((tokens,), dtype=torch.int32)
        self.launch(q_at, cache_at, scale_at if has_scale else cache_at, table_at, request_at, position_at, lens_at,
                    logits.data_ptr(), visible.data_ptr(), visible.data_ptr())
        return logits, visible


def _native_scoring_launch(launches: list) -> Callable | None:
    """The native scorer's recorded launch (``runtime.native_scorer.native_score``) as a function of the
    ``SCORER_POINTERS`` addresses (it counts no histogram; a 16-bit cache's scale address is the cache's), or None
    where ``launches`` are not that one launch."""
    direct = replay.direct_launches(launches, (native_scorer.NATIVE_SCORER_LAUNCH,))
    if not direct:
        return None
    launch = direct[0].taking(*NATIVE_SCORER_POINTERS)
    if launch is None:
        return None

    def scoring(q_at, cache_at, scale_at, table_at, request_at, position_at, lens_at, logits_at, visible_at,
                _histogram_at):
        launch(q_at, cache_at, scale_at, table_at, request_at, position_at, lens_at, logits_at, visible_at)

    return scoring


def score_validated(problem: ScoreProblem, divisor: float, q, compressed_k_cache, page_table, token_to_request,
                    query_positions, context_lens, k_scale, logits: torch.Tensor, settings) -> torch.Tensor:
    """Score a call that ``problem`` describes and whose arguments were validated into it (``describe_call``, with
    ``q``, ``token_to_request`` and ``query_positions`` possibly narrowed to the first ``problem.num_tokens`` rows of
    the validated ones): the logits go into ``logits`` (fp32 ``[problem.num_tokens, problem.num_columns]``, last dim
    contiguous); returns the int32 visible counts ``[problem.num_tokens]``. The selection op scores its row chunks
    through it, so a call is validated once."""
    visible = torch.empty((problem.num_tokens,), dtype=torch.int32, device=q.device)
    if problem.num_tokens == 0:
        return visible
    args = ScoreArgs(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, logits,
                     visible, problem.num_columns, problem.compress_ratio, 1.0 / divisor, k_scale)
    registries.SCORING.dispatch(problem, args, settings)
    return visible


def describe_call(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                  compress_ratio=4, score_divisor=None, max_columns=None, row_starts=None, *, k_scale=None,
                  out=None, phase=None, max_query_len=None, op="qsa_paged_mqa_logits") -> ScoreProblem:
    """The validated ``ScoreProblem`` a ``qsa_paged_mqa_logits`` call with these arguments would dispatch on; an
    argument error names ``op``, the public op called."""
    return _prepare(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                    compress_ratio, score_divisor, max_columns, row_starts, k_scale, out, phase, max_query_len,
                    op=op)[0]


# Typed like the op they explain, whose signature is the one declaration of its arguments and defaults.
@taking_arguments_of(qsa_paged_mqa_logits)
def explain(call: Call) -> str:
    """Which kernel a ``qsa_paged_mqa_logits`` call with these arguments would run, and why each other candidate
    does not: the problem, where its phase came from, the registry row, the rule that chose, every candidate with
    its reasons, and for a Triton kernel its launch plan (or why there is none). The arguments are validated as the
    op validates them; nothing is launched or written."""
    return registries.SCORING.explain(describe_call(**call, op="explain"))


@taking_arguments_of(qsa_paged_mqa_logits)
def selected_kernel(call: Call) -> str | None:
    """Name of the candidate a ``qsa_paged_mqa_logits`` call with these arguments would run (``None`` if none
    serves); the arguments are validated as the op validates them."""
    return registries.SCORING.select(describe_call(**call, op="selected_kernel")).chosen

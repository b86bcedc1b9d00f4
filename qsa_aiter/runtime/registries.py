"""The registries of the op families (the mechanism is ``runtime/dispatch.py``): what each family's candidates are,
how they are ordered, and the host-side problem each decides from.

- ``SCORING`` (``qsa_paged_mqa_logits``): every scoring kernel (``kernels.scoring.SPECS``, ranked per phase by their
  specs), the native tensor-core scorer (``native``: CUDA C++ compiled by NVRTC, ``runtime/native_scorer.py``;
  ranked after the Triton scorers), ATOM's FlyDSL and AITER's scorers on ROCm, the torch reference. The table
  ``(kv_dtype, page_size, phase) -> order``; page sizes outside it get the universal candidates. Forced by
  ``QSA_AITER_BACKEND``.
- ``TOPK`` (the block top-k step of ``qsa_block_topk`` and ``qsa_select_paged_tokens``): AITER's HIP top-k on ROCm
  (where the AITER path is asked for), the Triton top-k, the native top-k (compiled by NVRTC or hipRTC, cached in the
  JIT cache: ``runtime/native_topk.py``), the grid select (``native_grid``: a row split across the CTAs of one
  cooperative grid, ``runtime/grid_topk.py``), the torch path. The Triton, native and grid ones have tuned rows (the
  top-k table, ``configs/topk.csv``): the one measured fastest at the shape's bucket runs, the native one with its
  measured plan. Forced by ``QSA_AITER_TOPK_BACKEND``.
- ``EXPAND`` (``qsa_expand_block_indices``, and selection's expansion after a top-k that does not fuse it): the
  Triton expansion, the torch path.
- ``WRITER`` (``qsa_write_index_cache``): the Triton writer, the torch reference writer.
- ``SELECTION`` (``qsa_select_paged_tokens`` as a whole): AITER's FlyDSL fused selection (``flydsl_k1``, where
  ``ROCM_QSA_FLYDSL=1``), the composite path (scoring, then ``TOPK`` with the expansion), the native fused
  selection (``native_fused``: one launch, ``runtime/fused_select.py``; ranked after the composite path).
  Forced by ``QSA_AITER_SELECT_BACKEND``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels.cache import reference as cache_reference
from ..kernels.cache import writer
from ..kernels.platform import Platform
from ..kernels.scoring import SPECS as SCORING_SPECS
from ..kernels.scoring.base import KV_DTYPES
from ..kernels.scoring.problem import PHASES, ScoreProblem
from ..kernels.scoring.reference import reference_paged_mqa_logits
from ..kernels.selection import expand, topk
from ..kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from . import fused_select, grid_topk, native_scorer, native_topk, rocm, tuned
from .dispatch import (ANY_PHASE, Candidate, Measurement, Registry, plan_for, register, spec_candidate,
                       table_measurement)
from .settings import QsaSettings, get_settings

BLOCK_SIZES = (16, 64)

def _serves_all(problem, platform, settings) -> list[str]:
    return []


# ---------------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------------


def _launch_scorer(spec):
    def launch(problem: ScoreProblem, args, settings) -> None:
        plan_for(spec, problem, Platform.of(args.device), settings).launch(*args.kernel_args())

    return launch


def _launch_torch_scorer(problem: ScoreProblem, args, settings) -> None:
    logits, visible = reference_paged_mqa_logits(
        args.q, args.k_cache, args.page_table, args.token_to_request, args.query_positions, args.context_lens,
        args.compress_ratio, 1.0 / args.scale, args.num_columns, k_scale=args.k_scale,
    )
    args.logits.copy_(logits)
    args.visible.copy_(visible)


def _launch_native_scorer(problem: ScoreProblem, args, settings) -> None:
    native_scorer.native_score(problem, args, settings)


#: The native scorer's ranks: after every Triton scorer of the phase, before the ROCm libraries and the torch
#: reference. It runs where forced, where the others do not serve, or where tuned rows of ``native_scorer`` time it
#: faster than the order's first kernel at the call's bucket (measured dispatch).
NATIVE_SCORER_RANKS = {"verify": 36, "draft": 36, "decode": 36}

_SCORING_CANDIDATES = tuple(spec_candidate(spec, _launch_scorer(spec)) for spec in SCORING_SPECS) + (
    Candidate("native", native_scorer.kernels.SPEC.description, native_scorer.native_scorer_reasons,
              _launch_native_scorer, NATIVE_SCORER_RANKS, describe_plan=native_scorer.describe_plan,
              measurement=table_measurement(native_scorer.kernels.SPEC.name)),
    Candidate("torch", "torch reference (CPU, or last resort)", _serves_all, _launch_torch_scorer,
              dict.fromkeys(PHASES, 90), universal=True),
    rocm.AITER_SCORING,
    rocm.FLYDSL_SCORING,
)


def _scoring_broken_key(problem: ScoreProblem) -> tuple:
    return (problem.device_type, str(problem.cache_dtype), problem.block_size, problem.num_heads, problem.head_dim,
            problem.compress_ratio)


def _scoring_order(problem: ScoreProblem) -> tuple[tuple[str, ...], str]:
    key = (problem.kv_dtype, problem.block_size, problem.phase)
    if key in SCORING_TABLE:
        return SCORING_TABLE[key], f"registry row {key}"
    return SCORING_FALLBACK_ORDER, f"no registry row for {key}: universal fallback order"


SCORING = register(Registry("scoring", "qsa_paged_mqa_logits", _SCORING_CANDIDATES,
                            broken_key=_scoring_broken_key, forced_setting="backend", order_of=_scoring_order))
#: The scoring table. Every kv dtype and block size the project ships has a row per phase.
SCORING_TABLE: dict[tuple[str, int, str], tuple[str, ...]] = {
    (kv, bs, phase): SCORING.ranked(phase) for kv in KV_DTYPES for bs in BLOCK_SIZES for phase in PHASES
}
#: For page sizes outside the table: the universal candidates.
SCORING_FALLBACK_ORDER = SCORING.ranked(None)
#: The scoring candidates that are this project's kernels.
SCORER_KERNELS = frozenset(c.name for c in _SCORING_CANDIDATES if c.spec is not None)
#: The scoring candidates that wrap ROCm libraries rather than this project's kernels.
ROCM_CANDIDATES = ("aiter", "flydsl")


def scoring_rank_table() -> str:
    """Markdown rows of the scoring candidates' ranks per phase (lower runs first; empty: not a candidate in that
    phase) and whether each is in the universal order of page sizes outside the table, from the candidates'
    declarations, candidates by their mean rank: docs/architecture.md shows it (tests/test_readme.py checks that it
    is there, as generated)."""
    candidates = sorted(SCORING.candidates.values(), key=lambda c: (sum(c.ranks.values()) / len(c.ranks), c.name))
    rows = ["| candidate | " + " | ".join(PHASES) + " | other page sizes |",
            "|---|" + "---:|" * len(PHASES) + "---|"]
    for c in candidates:
        ranks = " | ".join(str(c.ranks[phase]) if phase in c.ranks else "" for phase in PHASES)
        rows.append(f"| `{c.name}` | {ranks} | {'yes' if c.universal else ''} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------------------------
# Block top-k
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopkProblem:
    """A block top-k step, from host facts: ``rows`` rows of fp32 logits ``columns`` wide on ``device_type``,
    ``block_topk`` groups kept per row; ``fused``: the step also expands its groups to tokens (selection)."""

    device_type: str
    rows: int
    columns: int
    block_topk: int
    fused: bool = False

    def summary(self) -> str:
        fused = ", expansion fused" if self.fused else ""
        return f"rows={self.rows} columns={self.columns} block_topk={self.block_topk} device={self.device_type}{fused}"


@dataclass(frozen=True)
class TopkArgs:
    """The tensors of a top-k step: fp32 ``logits [rows, columns]`` (last dim contiguous), int32 ``visible [rows]``,
    int32 ``groups [rows, block_topk]`` (the output); ``expand_into`` = (query_positions, context_lens,
    token_to_request, tokens_out, compress_ratio, token_topk) where the expansion follows (``fused``); ``plan``: one
    of the candidate's ``plans`` instead of the one it chooses (the tuner)."""

    logits: torch.Tensor
    visible: torch.Tensor
    groups: torch.Tensor
    block_topk: int
    expand_into: tuple | None = None
    plan: object = None

    @property
    def device(self) -> torch.device:
        return self.logits.device


def _launch_triton_topk(problem: TopkProblem, args: TopkArgs, settings) -> None:
    topk.launch(args.logits, args.visible, args.groups, args.block_topk, expand_into=args.expand_into)


def _launch_torch_topk(problem: TopkProblem, args: TopkArgs, settings) -> None:
    torch_block_topk(args.logits, args.visible, args.block_topk, args.groups)
    if args.expand_into is not None:
        positions, context_lens, token_to_request, tokens_out, ratio, token_topk = args.expand_into
        torch_expand_block_indices(args.groups, positions, context_lens, token_to_request, ratio, token_topk,
                                   tokens_out)


def _expand_after(args: TopkArgs, settings) -> None:
    """The expansion of a fused step whose top-k does not expand (a second launch, through ``EXPAND``)."""
    if args.expand_into is not None:
        positions, context_lens, token_to_request, tokens_out, ratio, token_topk = args.expand_into
        expand_tokens(args.groups, positions, context_lens, token_to_request, ratio, token_topk, tokens_out, settings)


def _launch_aiter_topk(problem: TopkProblem, args: TopkArgs, settings) -> None:
    rocm.aiter_block_topk(args.logits, args.visible, args.block_topk, args.groups)
    _expand_after(args, settings)


def _launch_native_topk(problem: TopkProblem, args: TopkArgs, settings) -> None:
    # Without a plan given, native_block_topk takes the measured plan of the tuned top-k table, else choose_plan's.
    native_topk.native_block_topk(args.logits, args.visible, args.groups, args.block_topk, settings, plan=args.plan,
                                  expand_into=args.expand_into)


#: The Triton top-k's name among the top-k candidates and in the tuned top-k table.
TRITON_TOPK = "triton"


def _topk_measurement(row: tuned.TopkRow | None, problem: TopkProblem) -> Measurement | None:
    """The ``Measurement`` of a top-k candidate's measured row (None: no row)."""
    if row is None:
        return None
    return Measurement(row.us, (row.rows, row.columns), tuned.topk_bucket_distance(row.rows, row.columns, problem),
                       f"{row.rows} rows x {row.columns} columns", row.plan)


def _one_plan_measurement(candidate: str):
    """The ``measurement`` of a top-k candidate with one plan: its measured row at the bucket nearest a problem."""

    def measurement(problem: TopkProblem, platform: Platform, settings) -> Measurement | None:
        rows = tuned.load_tables(tuple(settings.tuned_config)).measured_topk(platform.arch, candidate, problem)
        return _topk_measurement(rows[0] if rows else None, problem)

    return measurement


def _native_topk_measurement(problem: TopkProblem, platform: Platform, settings) -> Measurement | None:
    """The measured row of the plan the native top-k runs for ``problem`` (``native_topk.measured_plan``; None where
    it runs ``choose_plan``'s: that plan's time is not in the table)."""
    _, row, _ = native_topk.measured_plan(problem.rows, problem.columns, problem.block_topk, platform,
                                          tuned.load_tables(tuple(settings.tuned_config)))
    return _topk_measurement(row, problem)


def _native_topk_plans(problem: TopkProblem, platform: Platform) -> dict:
    return native_topk.kernels.plans_for(problem.rows, problem.columns, problem.block_topk, platform)


def _launch_grid_topk(problem: TopkProblem, args: TopkArgs, settings) -> None:
    grid_topk.grid_block_topk(args.logits, args.visible, args.groups, args.block_topk, settings,
                              expand_into=args.expand_into)


TOPK = register(Registry("topk", "block top-k", (
    Candidate("aiter", "AITER's HIP top-k (aiter.ops.topk, stable), its groups sorted",
              rocm.aiter_topk_candidate_reasons, _launch_aiter_topk, {ANY_PHASE: 10}),
    spec_candidate(topk.SPEC, _launch_triton_topk, name=TRITON_TOPK, ranks={ANY_PHASE: 20},
                   measurement=_one_plan_measurement(TRITON_TOPK)),
    # Ranked before Triton wherever it serves (faster at most work points of docs/selection.md): the order where the
    # tuned top-k table has no measurement; a failed compile or launch marks it broken and the Triton top-k serves.
    Candidate(native_topk.CANDIDATE, native_topk.kernels.SPEC.description, native_topk.native_topk_reasons,
              _launch_native_topk, {ANY_PHASE: 15}, describe_plan=native_topk.describe_plan,
              measurement=_native_topk_measurement, plan_names=native_topk.kernels.PLAN_NAMES,
              plans=_native_topk_plans),
    # The grid select (a row split across the CTAs of one cooperative grid): ranked right after the native top-k,
    # which serves wherever it does, so it runs where the tuned top-k table measured it fastest.
    Candidate(grid_topk.CANDIDATE, grid_topk.kernels.SPEC.description, grid_topk.grid_topk_reasons,
              _launch_grid_topk, {ANY_PHASE: 16}, describe_plan=grid_topk.describe_plan,
              measurement=_one_plan_measurement(grid_topk.CANDIDATE)),
    Candidate("torch", "torch path (a stable sort; any device, graph-safe)", _serves_all, _launch_torch_topk,
              {ANY_PHASE: 90}),
), broken_key=lambda problem: (problem.device_type, problem.fused), forced_setting="topk_backend"))


def topk_problem(logits: torch.Tensor, block_topk: int, fused: bool) -> TopkProblem:
    """The ``TopkProblem`` of a top-k step over ``logits`` (no device access)."""
    return TopkProblem(logits.device.type, logits.shape[0], logits.shape[1], block_topk, fused)


# ---------------------------------------------------------------------------------------------------------------
# Expansion
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpandProblem:
    """An expansion of ``rows`` rows of ``groups`` selected groups each to tokens, on ``device_type``."""

    device_type: str
    rows: int
    groups: int
    compress_ratio: int
    token_topk: int

    def summary(self) -> str:
        return (f"rows={self.rows} groups={self.groups} compress_ratio={self.compress_ratio} "
                f"token_topk={self.token_topk} device={self.device_type}")


@dataclass(frozen=True)
class ExpandArgs:
    """The tensors of an expansion: ``block_indices [rows, groups]`` int32/int64, ``query_positions`` and
    ``token_to_request [rows]``, ``context_lens [requests]``, int32 ``out [rows, token_topk + R - 1]``."""

    block_indices: torch.Tensor
    query_positions: torch.Tensor
    context_lens: torch.Tensor
    token_to_request: torch.Tensor
    out: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.block_indices.device


EXPAND = register(Registry("expand", "expansion", (
    spec_candidate(expand.SPEC, lambda problem, args, settings: expand.launch(
        args.block_indices, args.query_positions, args.context_lens, args.token_to_request, args.out,
        problem.compress_ratio, problem.token_topk), name="triton", ranks={ANY_PHASE: 20}),
    Candidate("torch", "torch path (a vectorised scatter; any device, graph-safe)", _serves_all,
              lambda problem, args, settings: torch_expand_block_indices(
                  args.block_indices, args.query_positions, args.context_lens, args.token_to_request,
                  problem.compress_ratio, problem.token_topk, args.out), {ANY_PHASE: 90}),
), broken_key=lambda problem: (problem.device_type,)))


def expand_tokens(block_indices, query_positions, context_lens, token_to_request, ratio: int, token_topk: int,
                  out: torch.Tensor, settings=None) -> str:
    """Expand validated ``block_indices`` into ``out`` through the ``EXPAND`` registry; returns who ran."""
    problem = ExpandProblem(block_indices.device.type, block_indices.shape[0], block_indices.shape[1], ratio,
                            token_topk)
    args = ExpandArgs(block_indices, query_positions, context_lens, token_to_request, out)
    return EXPAND.dispatch(problem, args, settings)


# ---------------------------------------------------------------------------------------------------------------
# Cache writer
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteProblem:
    """A cache write of ``tokens`` keys of ``head_dim`` into an index cache of format ``kind`` on ``device_type``."""

    device_type: str
    tokens: int
    kind: str
    head_dim: int

    def summary(self) -> str:
        return f"tokens={self.tokens} kv={self.kind} head_dim={self.head_dim} device={self.device_type}"


@dataclass(frozen=True)
class WriteArgs:
    """The tensors of a cache write: ``keys [tokens, D]``, ``slot_mapping [tokens]``, the ``cache`` and its
    ``k_scale`` (or None), as validated by ``qsa_write_index_cache``."""

    keys: torch.Tensor
    slot_mapping: torch.Tensor
    cache: torch.Tensor
    k_scale: torch.Tensor | None

    @property
    def device(self) -> torch.device:
        return self.keys.device


def _launch_triton_writer(problem: WriteProblem, args: WriteArgs, settings) -> None:
    from ..kernels.quant.dequant import kernel_view

    pages, page_size = args.cache.shape[:2]
    writer.launch(args.keys, args.slot_mapping, kernel_view(args.cache), kernel_view(args.k_scale),
                  writer.kind_of(args.cache, problem.kind), problem.head_dim, pages * page_size)


WRITER = register(Registry("writer", "qsa_write_index_cache", (
    spec_candidate(writer.SPEC, _launch_triton_writer, name="triton", ranks={ANY_PHASE: 20}),
    Candidate("torch", "torch reference writer (the same bytes; any device)", _serves_all,
              lambda problem, args, settings: cache_reference.write_reference(args.keys, args.slot_mapping,
                                                                              args.cache, args.k_scale),
              {ANY_PHASE: 90}),
), broken_key=lambda problem: (problem.device_type, problem.kind)))



# ---------------------------------------------------------------------------------------------------------------
# Selection (scoring, top-k and expansion of qsa_select_paged_tokens)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectionProblem:
    """A ``qsa_select_paged_tokens`` call, from host facts: ``score``, its scoring problem (every row of the call,
    columns fixed by ``max_seq_len``), ``token_topk`` tokens kept per row, ``chunk_rows``: the rows of one chunk of
    logits within the call's workspace bound."""

    score: ScoreProblem
    token_topk: int
    chunk_rows: int

    @property
    def device_type(self) -> str:
        return self.score.device_type

    @property
    def block_topk(self) -> int:
        return self.token_topk // self.score.compress_ratio

    def summary(self) -> str:
        return (f"{self.score.summary()} token_topk={self.token_topk} R={self.score.compress_ratio} "
                f"chunk_rows={self.chunk_rows}")


@dataclass(frozen=True)
class SelectionArgs:
    """The tensors of a validated ``qsa_select_paged_tokens`` call as the op was given them (``q [tokens, H, D]``,
    ``k_cache``, ``page_table``, ``token_to_request`` and ``query_positions [tokens]``, ``context_lens [requests]``,
    ``k_scale`` or None), its int32 ``out [tokens, token_topk + R - 1]``, and ``composite``: the op's own path
    (scoring, then the top-k with the expansion, chunk by chunk), called with these args and the settings."""

    q: torch.Tensor
    k_cache: torch.Tensor
    page_table: torch.Tensor
    token_to_request: torch.Tensor
    query_positions: torch.Tensor
    context_lens: torch.Tensor
    k_scale: torch.Tensor | None
    out: torch.Tensor
    composite: Callable[["SelectionArgs", QsaSettings], None]

    @property
    def device(self) -> torch.device:
        return self.q.device


def _launch_flydsl_k1(problem: SelectionProblem, args: SelectionArgs, settings) -> None:
    ratio, token_topk = problem.score.compress_ratio, problem.token_topk

    def expand(block_ids: torch.Tensor, rows: slice) -> None:
        expand_tokens(block_ids, args.query_positions[rows], args.context_lens, args.token_to_request[rows], ratio,
                      token_topk, args.out[rows], settings)

    rocm.run_flydsl_k1(problem, args, expand)


def _launch_native_fused(problem: SelectionProblem, args: SelectionArgs, settings) -> None:
    fused_select.fused_select(problem, args, settings)


def _fastest_measured(registry: Registry, problem, platform: Platform, settings) -> Measurement | None:
    """The measured time ``registry``'s measured dispatch would run for ``problem``: among its candidates with
    tuned rows (host facts only: their reasons are not asked), the fastest at the nearest bucket; None without any."""
    found = [m for m in (registry.candidates[name].measurement(problem, platform, settings)
                         for name in registry.order(problem)[0] if registry.candidates[name].measurement)
             if m is not None]
    if not found:
        return None
    nearest = min(found, key=lambda m: m.distance).bucket
    return min((m for m in found if m.bucket == nearest), key=lambda m: m.us)


def _composite_measurement(problem: SelectionProblem, platform: Platform, settings) -> Measurement | None:
    """The composite path's measured time: its scoring's (the scoring table's fastest measured kernel at the call's
    (rows, context) bucket) plus its top-k's with the expansion (the top-k table's at the rows x columns bucket),
    where both are measured; at the scoring row's bucket, where ``native_fused``'s rows are compared with it."""
    score = problem.score
    scoring = _fastest_measured(SCORING, score, platform, settings)
    selecting = _fastest_measured(TOPK, TopkProblem(score.device_type, score.num_tokens, score.num_columns,
                                                    problem.block_topk, fused=True), platform, settings)
    if scoring is None or selecting is None:
        return None
    return Measurement(scoring.us + selecting.us, scoring.bucket, scoring.distance,
                       f"{scoring.bucket_text} (scoring {scoring.us:.2f} us + top-k {selecting.us:.2f} us at "
                       f"{selecting.bucket_text})")


def _native_fused_measurement(problem: SelectionProblem, platform: Platform, settings) -> Measurement | None:
    """The fused selection's measured row (``kernel`` = ``fused_select`` in the scoring table) nearest the call."""
    return table_measurement(fused_select.kernels.SPEC.name)(problem.score, platform, settings)


# One candidate per way of turning a call into its tokens: the composite path (which always serves), AITER's FlyDSL
# K1 (opt-in: ranked first where asked for) and the native fused selection (scoring, top-k and expansion in one
# launch: ranked after the composite path, so it runs where forced or where tuned rows time it faster
# than the composite path's scoring plus top-k at the call's bucket).
SELECTION = register(Registry("selection", "selection", (
    Candidate("flydsl_k1", rocm.FLYDSL_K1_DESCRIPTION,
              lambda problem, platform, settings: rocm.flydsl_k1_reasons(problem, settings), _launch_flydsl_k1,
              {ANY_PHASE: 10}),
    Candidate("composite", "scoring (qsa_paged_mqa_logits' registry), then the block top-k with the expansion "
              "(block top-k's registry), chunk by chunk; any device", _serves_all,
              lambda problem, args, settings: args.composite(args, settings), {ANY_PHASE: 50}, final=True,
              measurement=_composite_measurement),
    Candidate(fused_select.CANDIDATE, fused_select.kernels.SPEC.description, fused_select.fused_select_reasons,
              _launch_native_fused, {ANY_PHASE: 60}, describe_plan=fused_select.describe_plan,
              measurement=_native_fused_measurement),
), broken_key=lambda problem: (_scoring_broken_key(problem.score), problem.token_topk),
    forced_setting="select_backend"))

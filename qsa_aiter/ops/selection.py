"""Selection half of the indexer (docs/selection.md): block top-k, expansion, and ``qsa_select_paged_tokens``.

- ``qsa_block_topk``: the ``block_topk`` best visible groups of each row, by ``(-score, index)``, listed in ascending
  order with ``-1`` after them; rows with ``visible <= block_topk`` take every visible group without reading a score.
  The top-k registry (``runtime/registries.TOPK``) chooses who ranks: the Triton radix select where Triton runs, the
  torch path (a stable sort) elsewhere, AITER's HIP top-k when the AITER path is asked for on a ROCm GPU.
- ``qsa_expand_block_indices``: groups back to tokens, plus each row's causal tail (``registries.EXPAND``).
- ``qsa_select_paged_tokens``: the selection registry (``registries.SELECTION``) chooses how: the composite path
  (scoring, then top-k and expansion in one launch) or, where asked for and served, AITER's FlyDSL fused selection
  (``flydsl_k1``: block ids in one pass, then the expansion). Rows are chunked so the fp32 logits stay within the
  logits workspace bound: ``logits_workspace_bytes``, else ``QSA_AITER_LOGITS_WORKSPACE_MB``, else one sized from
  the device once per device (``device_workspace_bound``). ``explain_selection`` reports every decision and the
  chunking, with where its bound came from.

Every decision is made from shapes, host-side arguments and (for the workspace bound) the device's total memory, a
host-side property read once per device; nothing of this project reads device memory, so the ops can be captured in
a CUDA graph (K1's own wrapper reads one int back for a decode batch over a wide table, except while capturing).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from ..kernels.scoring.problem import ScoreProblem
from ..runtime import registries, replay
from ..runtime.arguments import (
    check_index_out, check_int, check_tensor, check_topk_args, check_topk_budget, fail_argument,
)
from ..runtime.registries import (
    SELECTION, TOPK, SelectionArgs, SelectionProblem, TopkArgs, expand_tokens, topk_problem,
)
from ..runtime.settings import QsaSettings, get_settings
from . import selection_plans as plans
from .declarations import Call, taking_arguments_of
from .scoring import describe_call, score_validated
from .traced import through_custom_op

_INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# Block top-k
# ---------------------------------------------------------------------------------------------------------------


@through_custom_op
def qsa_block_topk(logits: torch.Tensor, visible: torch.Tensor, block_topk: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Block top-k of scored rows: int32 ``[tokens, block_topk]``.

    Args:
        logits: fp32 ``[tokens, columns]`` (last dim contiguous); only ``[0, visible)`` of each row is read.
        visible: int32 ``[tokens]`` (as ``qsa_paged_mqa_logits`` returns it); read clamped to ``[0, columns]``, so no
            value makes a kernel read past its row.
        block_topk: groups to keep per row (``token_topk // R``), in ``[1, MAX_BLOCK_TOPK]`` (8192: what the kernels
            hold; ``kernels/selection/problem.py``).
        out: optional int32 ``[tokens, block_topk]`` (last dim contiguous).

    Returns:
        Per row the kept groups in ascending order, then ``-1``: the ``block_topk`` first columns by
        ``(-score, index)``, or every visible column when ``visible <= block_topk``.
    """
    settings = get_settings()

    def first_call():
        op = "qsa_block_topk"
        k = check_topk_args(op, logits, visible, block_topk)
        result = check_index_out(op, out, (logits.shape[0], k), logits.device, "logits")
        if logits.shape[0]:
            TOPK.dispatch(topk_problem(logits, k, fused=False), TopkArgs(logits, visible, result, k), settings)
        return result, lambda launches: plans.TopkPlan.of(logits, k, launches)

    return replay.cached_call("qsa_block_topk", settings, (logits, visible, out), (block_topk,), first_call)


# ---------------------------------------------------------------------------------------------------------------
# Expansion
# ---------------------------------------------------------------------------------------------------------------


@through_custom_op
def qsa_expand_block_indices(block_indices: torch.Tensor, query_positions: torch.Tensor, context_lens: torch.Tensor,
                             token_to_request: torch.Tensor, compress_ratio: int, token_topk: int,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """Token indices of the selected groups: int32 ``[tokens, token_topk + R - 1]``.

    Args:
        block_indices: ``[tokens, groups]`` int32/int64 (``groups * R <= token_topk``), ascending groups then ``-1``
            (as ``qsa_block_topk`` writes them); ``-1`` entries are skipped wherever they are.
        query_positions, token_to_request: ``[tokens]`` int32/int64; ``-1`` request marks a padded row.
        context_lens: ``[requests]`` int32/int64, in tokens.
        compress_ratio: tokens per group (R). token_topk: token budget (a multiple of R; ``token_topk // R`` at
            most ``MAX_BLOCK_TOPK`` and ``token_topk + R - 1`` at most ``MAX_TOKEN_SLOTS``, what the kernels hold).
        out: optional int32 ``[tokens, token_topk + R - 1]`` (last dim contiguous).

    Returns:
        Per row the tokens ``g*R .. g*R+R-1`` of each selected group, then the causal tail ``((p+1)//R)*R .. p``,
        only tokens ``< context_len``, packed to the front, ``-1`` after them; padded rows all ``-1``.
    """
    settings = get_settings()

    def first_call():
        op = "qsa_expand_block_indices"
        check_tensor("block_indices", block_indices, ndim=2, dtypes=_INDEX_DTYPES, op=op)
        device = block_indices.device
        tokens = block_indices.shape[0]
        for name, t in (("query_positions", query_positions), ("token_to_request", token_to_request)):
            check_tensor(name, t, ndim=1, dtypes=_INDEX_DTYPES, device=device, op=op, like="block_indices")
            if t.shape[0] != tokens:
                fail_argument(ValueError, name, f"length {tokens} like block_indices' rows", t.shape[0], op)
        check_tensor("context_lens", context_lens, ndim=1, dtypes=_INDEX_DTYPES, device=device, op=op,
                     like="block_indices")
        ratio, budget = check_topk_budget(op, compress_ratio, token_topk)
        if block_indices.shape[1] * ratio > budget:
            fail_argument(ValueError, "block_indices", f"at most token_topk // R = {budget // ratio} groups per row",
                          block_indices.shape[1], op)
        if block_indices.stride(-1) != 1 and block_indices.shape[1] > 1:
            fail_argument(ValueError, "block_indices", "contiguous in its last dimension",
                          f"strides {block_indices.stride()}", op)
        result = check_index_out(op, out, (tokens, budget + ratio - 1), device, "block_indices")
        if tokens:
            expand_tokens(block_indices, query_positions, context_lens, token_to_request, ratio, budget, result,
                          settings)
        return result, lambda launches: plans.ExpandPlan.of(budget + ratio - 1, launches)

    return replay.cached_call(
        "qsa_expand_block_indices", settings, (block_indices, query_positions, context_lens, token_to_request, out),
        (compress_ratio, token_topk), first_call)


# ---------------------------------------------------------------------------------------------------------------
# Scoring + top-k + expansion
# ---------------------------------------------------------------------------------------------------------------


# The logits workspace bound: the argument, else QSA_AITER_LOGITS_WORKSPACE_MB, else sized from the device
# (docs/selection.md, "Chunks of rows", says why these numbers).

#: On a CUDA (or ROCm) GPU, the bound sized from the device is its total memory divided by this ...
WORKSPACE_MEMORY_DIVISOR = 16
#: ... and at most this: 2 GiB holds the fp32 logits of 16384 rows x 32768 columns (16K prefill rows at 128K tokens,
#: R = 4) in one chunk.
WORKSPACE_CAP_BYTES = 2 << 30
#: The bound on the CPU (the interpreter) and any other device whose memory is not read.
HOST_WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True)
class WorkspaceBound:
    """A bound on one chunk's fp32 logits: ``nbytes``, and ``source``, where it came from (as ``explain_selection``
    reports it)."""

    nbytes: int
    source: str


_GIB = 1 << 30
#: device -> its bound, sized on the first call that needs it (``device_workspace_bound``).
_device_bounds: dict[torch.device, WorkspaceBound] = {}


def device_workspace_bound(device: torch.device | str) -> WorkspaceBound:
    """The logits workspace bound sized from ``device``, computed on its first use and kept for the process.

    A CUDA (or ROCm) GPU: ``min(total_memory // WORKSPACE_MEMORY_DIVISOR, WORKSPACE_CAP_BYTES)``, its total memory
    read from ``torch.cuda.get_device_properties`` (host data: no device work, no synchronisation). Not its free
    memory: that depends on what the process allocated before the first call (a KV cache, the caching allocator's
    reserve) and reading it costs a driver call, so the chunking would depend on call order. Any other device:
    ``HOST_WORKSPACE_BYTES``."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bound = _device_bounds.get(device)
    if bound is None:
        bound = _device_bounds[device] = _sized_from(device)
    return bound


def _sized_from(device: torch.device) -> WorkspaceBound:
    if device.type != "cuda":
        return WorkspaceBound(HOST_WORKSPACE_BYTES, f"the fixed bound for {device.type} tensors "
                                                    f"({HOST_WORKSPACE_BYTES >> 20} MiB)")
    total = int(torch.cuda.get_device_properties(device).total_memory)
    share = total // WORKSPACE_MEMORY_DIVISOR
    nbytes = max(1, min(share, WORKSPACE_CAP_BYTES))
    return WorkspaceBound(nbytes, f"sized from {device}: min({total} bytes total ({total / _GIB:.1f} GiB) / "
                                  f"{WORKSPACE_MEMORY_DIVISOR} = {share}, cap {WORKSPACE_CAP_BYTES} "
                                  f"({WORKSPACE_CAP_BYTES // _GIB} GiB))")


def logits_workspace_bound(logits_workspace_bytes: int | None, device: torch.device, settings: QsaSettings,
                           op: str = "qsa_select_paged_tokens") -> WorkspaceBound:
    """The bound of a call on ``device``: ``logits_workspace_bytes`` when given (an int >= 1, else ``ValueError`` /
    ``TypeError`` naming it), else ``QSA_AITER_LOGITS_WORKSPACE_MB`` when set to more than 0, else
    ``device_workspace_bound(device)``."""
    if logits_workspace_bytes is not None:
        nbytes = check_int("logits_workspace_bytes", logits_workspace_bytes, minimum=1, op=op)
        return WorkspaceBound(nbytes, "from the argument logits_workspace_bytes")
    mebibytes = settings.logits_workspace_mb
    if mebibytes:
        return WorkspaceBound(mebibytes << 20, f"from QSA_AITER_LOGITS_WORKSPACE_MB={mebibytes}")
    return device_workspace_bound(device)


def selection_problem(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, ratio: int,
                      max_seq_len: int | None, *, k_scale=None, phase=None, max_query_len=None,
                      op: str = "qsa_select_paged_tokens"):
    """The scoring problem of a ``qsa_select_paged_tokens`` call (its scoring arguments validated; an error names
    ``op``): its columns are the page table's capacity, or ``max_seq_len // R`` clamped to that capacity (an engine
    passes its longest context plus a slack, and nothing past the table can be selected)."""
    problem = describe_call(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, ratio,
                            k_scale=k_scale, phase=phase, max_query_len=max_query_len, op=op)
    if max_seq_len is None:
        return problem
    max_columns = check_int("max_seq_len", max_seq_len, minimum=1, op=op) // ratio
    # Nothing else in the problem depends on the columns.
    return dataclasses.replace(problem, num_columns=min(max_columns, problem.num_columns))


@dataclass(frozen=True)
class ValidatedSelection:
    """A validated ``qsa_select_paged_tokens`` call: its scoring ``problem`` (columns fixed by ``max_seq_len``),
    ``ratio`` (R), ``token_topk``, ``out`` (the caller's or a new int32 ``[tokens, token_topk + R - 1]``), the
    logits ``workspace`` bound in bytes with ``workspace_source`` (where it came from: ``WorkspaceBound.source``)
    and the rows of one chunk of logits within it."""

    problem: ScoreProblem
    ratio: int
    token_topk: int
    out: torch.Tensor
    workspace: int
    workspace_source: str
    chunk_rows: int


def validate_selection_call(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                            token_topk, compress_ratio, out, logits_workspace_bytes, max_seq_len, k_scale, phase,
                            max_query_len, settings: QsaSettings | None = None,
                            op: str = "qsa_select_paged_tokens") -> ValidatedSelection:
    """Check every argument of a ``qsa_select_paged_tokens`` call, given by name as the op declares them (the op and
    ``explain_selection`` share it; ``op`` is the one called, which an error names), and bound its chunks
    (``logits_workspace_bound``, with ``settings`` or the current ones); raises before anything is written."""
    ratio, budget = check_topk_budget(op, compress_ratio, token_topk)
    if logits_workspace_bytes is not None:  # named before any tensor is checked
        check_int("logits_workspace_bytes", logits_workspace_bytes, minimum=1, op=op)
    problem = selection_problem(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                                ratio, max_seq_len, k_scale=k_scale, phase=phase, max_query_len=max_query_len,
                                op=op)
    result = check_index_out(op, out, (problem.num_tokens, budget + ratio - 1), q.device, "q")
    bound = logits_workspace_bound(logits_workspace_bytes, q.device, settings or get_settings(), op)
    rows = max(1, min(problem.num_tokens, bound.nbytes // (4 * max(problem.num_columns, 1))))
    return ValidatedSelection(problem, ratio, budget, result, bound.nbytes, bound.source, rows)


@through_custom_op
def qsa_select_paged_tokens(
    q: torch.Tensor,
    compressed_k_cache: torch.Tensor,
    page_table: torch.Tensor,
    token_to_request: torch.Tensor,
    query_positions: torch.Tensor,
    context_lens: torch.Tensor,
    token_topk: int,
    compress_ratio: int = 4,
    out: torch.Tensor | None = None,
    logits_workspace_bytes: int | None = None,
    max_seq_len: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    phase: str | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """The tokens each query row's sparse attention reads: int32 ``[tokens, token_topk + R - 1]``.

    Scores every visible group (``qsa_paged_mqa_logits``), keeps the ``token_topk // R`` best per row
    (``qsa_block_topk``) and expands them to tokens plus the causal tail (``qsa_expand_block_indices``). Rows are
    scored in chunks whose fp32 logits fit ``logits_workspace_bytes`` (at least one row per chunk); None (the
    default): ``QSA_AITER_LOGITS_WORKSPACE_MB`` MiB where that is set, else a bound sized from the device once per
    process (on a GPU ``min(total memory / 16, 2 GiB)``, else 128 MiB: ``device_workspace_bound``). ``max_seq_len``
    (tokens) fixes the logits width at ``max_seq_len // R`` columns whatever the page table's width, so a decode CUDA
    graph captured once serves every context up to it; a ``max_seq_len`` past the table's capacity (``width *
    page_size * R`` tokens: an engine's longest context plus a slack) is clamped to it, as nothing past the table can
    be selected. ``token_topk // R`` is at most ``MAX_BLOCK_TOPK`` groups and ``token_topk + R - 1`` at most
    ``MAX_TOKEN_SLOTS`` (``kernels/selection/problem.py``: what the kernels hold). Other arguments as ``qsa_paged_mqa_logits``; ``out`` is
    validated (int32, that shape, q's device, last dim contiguous) before anything is written.
    """
    settings = get_settings()

    def first_call():
        call = validate_selection_call(q, compressed_k_cache, page_table, token_to_request, query_positions,
                                       context_lens, token_topk, compress_ratio, out, logits_workspace_bytes,
                                       max_seq_len, k_scale, phase, max_query_len, settings)
        problem, budget, result, rows = call.problem, call.token_topk, call.out, call.chunk_rows
        if problem.num_tokens == 0:
            return result, None
        args = SelectionArgs(q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens,
                             k_scale, result, functools.partial(_composite, call))
        ran = SELECTION.dispatch(SelectionProblem(problem, budget, rows), args, settings)
        # Replayed: one chunk of the composite path (a library's launches, and several chunks, are not recorded).
        if ran != "composite" or rows < problem.num_tokens:
            return result, None
        return result, lambda launches: plans.SelectionPlan.of(problem, budget // call.ratio, budget, launches)

    return replay.cached_call(
        "qsa_select_paged_tokens", settings,
        (q, compressed_k_cache, page_table, token_to_request, query_positions, context_lens, k_scale, out),
        (token_topk, compress_ratio, logits_workspace_bytes, max_seq_len, phase, max_query_len), first_call)


def _composite(call: ValidatedSelection, args: SelectionArgs, settings: QsaSettings) -> None:
    """The ``composite`` selection candidate: per chunk of ``call.chunk_rows`` rows, scoring (``SCORING``), then
    the block top-k with the expansion into ``args.out`` (``TOPK``; one launch for the Triton and native top-k)."""
    problem, ratio, budget, rows = call.problem, call.ratio, call.token_topk, call.chunk_rows
    tokens, columns, block_topk = problem.num_tokens, problem.num_columns, call.token_topk // call.ratio
    logits = torch.empty((rows, columns), dtype=torch.float32, device=args.device)
    groups = torch.empty((rows, block_topk), dtype=torch.int32, device=args.device)
    for r0 in range(0, tokens, rows):
        r1 = min(tokens, r0 + rows)
        # A chunk is the validated call narrowed to its rows: it keeps the whole call's dispatch (its phase).
        chunk = dataclasses.replace(problem, num_tokens=r1 - r0)
        chunk_logits = logits[: r1 - r0]
        visible = score_validated(chunk, math.sqrt(problem.head_dim), args.q[r0:r1], args.k_cache, args.page_table,
                                  args.token_to_request[r0:r1], args.query_positions[r0:r1], args.context_lens,
                                  args.k_scale, chunk_logits, settings)
        expansion = (args.query_positions[r0:r1], args.context_lens, args.token_to_request[r0:r1], args.out[r0:r1],
                     ratio, budget)
        TOPK.dispatch(topk_problem(chunk_logits, block_topk, fused=True),
                      TopkArgs(chunk_logits, visible, groups[: r1 - r0], block_topk, expansion), settings)


# Typed like the op it explains, whose signature is the one declaration of its arguments and defaults.
@taking_arguments_of(qsa_select_paged_tokens)
def explain_selection(call: Call) -> str:
    """Which kernels a ``qsa_select_paged_tokens`` call with these arguments would run, and why: the chunks of rows
    (their count, rows and logits bytes, and the workspace bound with where it came from: the argument,
    ``QSA_AITER_LOGITS_WORKSPACE_MB``, or the device with its numbers), the selection decision (the composite path
    or a fused candidate, with every candidate's reasons), then for the composite path the scoring decision (with
    its launch plan) and the top-k decision, for a fused candidate the expansion decision, each with every
    candidate's reasons. The arguments are validated as the op validates them; nothing is launched or written."""
    selection = validate_selection_call(**call, op="explain_selection")
    problem, rows = selection.problem, selection.chunk_rows
    chunks = -(-problem.num_tokens // rows) if problem.num_tokens else 0
    block_topk = selection.token_topk // selection.ratio
    whole = SelectionProblem(problem, selection.token_topk, rows)
    lines = [
        f"qsa_select_paged_tokens: {problem.num_tokens} rows in {chunks} chunk(s) of at most {rows} rows (logits "
        f"workspace {selection.workspace} bytes, {selection.workspace_source}; a chunk's logits {rows} x "
        f"{problem.num_columns} x 4 = {4 * rows * problem.num_columns} bytes)",
        SELECTION.explain(whole),
    ]
    chosen = SELECTION.select(whole).chosen
    if chosen == "composite":
        lines += [registries.SCORING.explain(dataclasses.replace(problem, num_tokens=min(rows, problem.num_tokens))),
                  TOPK.explain(registries.TopkProblem(problem.device_type, rows, problem.num_columns, block_topk,
                                                      fused=True))]
    elif chosen == "native_fused":
        lines.append("native_fused: scoring, the block top-k and the expansion in one launch (every row at once, "
                     "no logits chunks; the last CTA of each row group selects its candidates)")
    else:
        lines.append(registries.EXPAND.explain(registries.ExpandProblem(
            problem.device_type, min(rows, problem.num_tokens), block_topk, selection.ratio, selection.token_topk)))
    return "\n".join(lines)


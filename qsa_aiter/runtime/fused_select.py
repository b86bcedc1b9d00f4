"""The fused selection at launch time: its reasons (``fused_select_reasons``, the ``native_fused`` candidate's of the
``SELECTION`` registry), the marshalling of a ``qsa_select_paged_tokens`` call (``SelectionArgs``) into its kernel's
arguments (``fused_select_call``), the launch on a GPU (``fused_select``: compiled through NVRTC into the JIT cache,
loaded and launched by ``runtime/jit/native.py``) and the run on the CPU through the CUDA emulator
(``emulated_fused_select``). What the kernels are is declared once in ``kernels/selection/fused_select.py``
(``SPEC``).

Two buffers come from ``grid_topk.workspace_for``, each the stream's own (a fresh zeroed one inside a CUDA-graph
capture, its memset captured with the launch): the workspace (``Plan.workspace_words``: the rows' arrival counters,
gates and histograms at fixed places, zeroed once and left clean by every launch) and the candidates
(``Plan.candidate_words``: the rows' counts and candidates, written before they are read). The block indices
``[rows, block_topk]`` int32 are allocated per call: no ``[rows, columns]`` fp32 logits anywhere.
"""

from __future__ import annotations

import math

import torch

from ..kernels.platform import Platform
from ..kernels.scoring import native_scorer as scorer
from ..kernels.selection import fused_select as kernels
from . import grid_topk
from .jit import emulated, native
from .native_scorer import cache_layout, scales_of, wide_bits

#: The fused selection's name among the selection candidates (``QSA_AITER_SELECT_BACKEND=native_fused``).
CANDIDATE = "native_fused"
FUSED_SELECT_LAUNCH = "fused_select"
#: The owners of the fused selection's buffers in ``grid_topk.workspace_for``.
WORKSPACE, CANDIDATES = "native_fused", "native_fused.candidates"


def fused_select_reasons(problem, platform: Platform, settings) -> list[str]:
    """Why the fused selection does not serve ``problem`` (a ``registries.SelectionProblem``; empty: it serves), from
    host facts only: CUDA GPU tensors of a CUDA build of torch, the kernels' own limits (``kernels.SPEC.reasons``: the
    scorer's cache formats (bf16, fp16, fp8 e4m3fn, MXFP4 with bf16 queries), heads, head_dim, page size, prefill,
    strides and compute capability, then a group's scores held in shared memory, the workspace's size), and NVRTC
    and the CUDA driver library loadable."""
    found = native.cuda_only_reasons(
        problem.device_type, "no AMD version yet (a ROCm build of torch; the scorer's matrix primitives are NVIDIA's)")
    if problem.device_type == "cuda" and torch.version.cuda is not None:
        found += kernels.SPEC.reasons(problem, platform)
    else:
        found += scorer.shape_reasons(problem.score)
    return found + (native.unavailable_reasons("cuda") if torch.version.hip is None else [])


def describe_plan(problem, platform: Platform) -> str:
    return kernels.SPEC.describe_plan(problem, platform)


def fused_select_call(problem, args, plan: kernels.Plan, blocks: torch.Tensor, workspace: torch.Tensor,
                      candidates: torch.Tensor, scores: torch.Tensor | None = None,
                      stamps: torch.Tensor | None = None):
    """The launch of ``plan`` for the call ``args`` (a ``SelectionArgs`` validated into ``problem``): ``(call,
    addresses)``. ``blocks``: int32 ``[rows, block_topk]`` contiguous (the block indices); ``workspace``: int32, at
    least ``plan.workspace_words``, zeroed before its first launch; ``candidates``: int32, at least
    ``plan.candidate_words``, any contents; ``scores``: fp32 ``[rows, columns]`` (last dim
    contiguous) for the debug scores, or None; ``stamps``: int64, at least ``plan.stamp_words``, contiguous, for the
    debug phase stamps (``stamp_buffer``), or None."""
    score = problem.score
    cache, table = args.k_cache, args.page_table
    pages = cache.shape[0]
    page_stride, slot_stride, aligned = cache_layout(cache)  # the scorer's: 16-bit, fp8 or MXFP4 elements
    tokens, ratio, block_topk = score.num_tokens, score.compress_ratio, problem.block_topk
    for name, buffer, words in (("workspace", workspace, plan.workspace_words),
                                ("candidates", candidates, plan.candidate_words)):
        if buffer.dtype != torch.int32 or not buffer.is_contiguous() or buffer.numel() < words:
            raise ValueError(f"{name} must be a contiguous int32 tensor of at least {words} words")
    if blocks.dtype != torch.int32 or not blocks.is_contiguous() or tuple(blocks.shape) != (tokens, block_topk):
        raise ValueError(f"blocks must be a contiguous int32 [{tokens}, {block_topk}] tensor")
    if scores is not None and (scores.dtype != torch.float32 or scores.shape[1] < score.num_columns
                               or (scores.shape[1] > 1 and scores.stride(1) != 1)):
        raise ValueError(f"scores must be fp32 [{tokens}, >= {score.num_columns}] with a contiguous last dim")
    if stamps is not None and (stamps.dtype != torch.int64 or not stamps.is_contiguous()
                               or stamps.numel() < plan.stamp_words):
        raise ValueError(f"stamps must be a contiguous int64 tensor of at least {plan.stamp_words} words")
    out = args.out
    wide = wide_bits(args)
    values = dict(
        num_tokens=tokens, num_requests=table.shape[0], num_pages=pages, num_columns=score.num_columns,
        table_width=table.shape[1], table_stride=table.stride(0) if table.shape[0] > 1 else table.shape[1],
        page_stride=page_stride, slot_stride=slot_stride, K=block_topk, ratio=ratio,
        scale_bits=scorer.float_bits(1.0 / math.sqrt(score.head_dim)), wide=wide, aligned=int(aligned),
        width=problem.token_topk + ratio - 1, tok_ld=out.stride(0) if tokens > 1 else 0,
        scores_ld=0 if scores is None else (scores.stride(0) if tokens > 1 else scores.shape[1]),
    )
    call = kernels.launch_arguments(plan, values)
    addresses = [t.data_ptr() for t in (args.q, cache, scales_of(args), table, args.token_to_request,
                                        args.query_positions, args.context_lens, blocks, out)]
    addresses += [0 if scores is None else scores.data_ptr(), 0 if stamps is None else stamps.data_ptr(),
                  workspace.data_ptr(), candidates.data_ptr()]
    return call, addresses


def _checked_out(args):
    if args.out.stride(-1) != 1:
        raise ValueError("the output must have a contiguous last dim")


def fused_plan(problem, device: torch.device, plan: kernels.Plan | None = None, settings=None):
    """``(kernel, plan)``: the kernel of ``plan`` (default ``choose_plan``'s for ``problem`` on ``device``, a CUDA
    device) compiled or loaded, and the plan (the one to size ``stamp_buffer`` by)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    platform = Platform.of(torch.device("cuda", index))
    plan = plan or kernels.choose_plan(problem, platform)
    variant = plan.variant
    # (clusters above 8 CTAs allowed from sm_90, whatever this plan: the loaded kernel serves every plan)
    kernel = native.kernel_for(kernels.source(), variant.name, kernels.SPEC.defines(variant, platform.arch), index,
                               platform.arch, settings, non_portable_cluster=platform.capability >= (9, 0))
    return kernel, plan


def fused_select(problem, args, settings=None, plan: kernels.Plan | None = None,
                 scores: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                 stamps: torch.Tensor | None = None) -> torch.Tensor:
    """The fused selection of the call ``args`` (CUDA tensors, validated into ``problem``) into ``args.out``: one
    launch on the current stream, the kernel compiled into the JIT cache, or loaded from it, at its first use in a
    process (load it before capturing a graph). ``scores``: the debug scores' output; ``plan``: a ``kernels.Plan``
    instead of ``choose_plan``'s (tests, benchmarks); ``workspace``: int32, at least ``plan.workspace_words``,
    zeroed before its first launch and reused as the kernel leaves it (default: ``grid_topk.workspace_for``);
    ``stamps``: the debug phase stamps' output (``stamp_buffer`` of the plan). Returns the block indices."""
    _checked_out(args)
    score = problem.score
    blocks = torch.empty((score.num_tokens, problem.block_topk), dtype=torch.int32, device=args.device)
    if score.num_tokens == 0:
        return blocks
    kernel, plan = fused_plan(problem, args.q.device, plan, settings)
    if workspace is None:
        workspace = grid_topk.workspace_for(args.q.device, plan.workspace_words, WORKSPACE)
    candidates = grid_topk.workspace_for(args.q.device, plan.candidate_words, CANDIDATES)
    call, addresses = fused_select_call(problem, args, plan, blocks, workspace, candidates, scores, stamps)
    native.PreparedLaunch(FUSED_SELECT_LAUNCH, kernel, call.grid, call.block, call.shared_bytes,
                          tuple(name for name, _ in call.pointers), call.scalars, cluster=call.cluster)(*addresses)
    return blocks


#: The fused selection's kernels as the emulator builds them: name, pointer C types, scalar count.
EMULATED_FUSED_KERNELS = kernels.SPEC.emulator_kernels()


def emulated_fused_select(problem, args, plan: kernels.Plan, scores: torch.Tensor | None = None,
                          workspace: torch.Tensor | None = None, order_seed: int = 0,
                          stamps: torch.Tensor | None = None, candidates: torch.Tensor | None = None,
                          cached: int | None = None):
    """``fused_select`` on CPU tensors through the CUDA emulator, for tests on machines without a GPU: ``(blocks,
    workspace)``; ``candidates``: the candidates' buffer to use (default a poisoned one); ``cached``: the most
    candidates of a row the finish gathers into shared memory (default the source's ``FUSED_CACHE``; past it they are
    read from the workspace at each pass). The grid's CTAs run together
    where the emulator holds them all (``order_seed`` shuffles their threads' turns, so CTAs offer and arrive in other
    orders and the selectors wait), else one after another in index order; a cluster plan's clusters one after
    another, each cluster's CTAs together. Raises ``emulated.EmulationError`` where
    the emulated kernel fails."""
    _checked_out(args)
    if workspace is None:
        workspace = torch.zeros(plan.workspace_words, dtype=torch.int32)
    blocks = torch.full((problem.score.num_tokens, problem.block_topk), -9, dtype=torch.int32)
    if problem.score.num_tokens == 0:
        return blocks, workspace
    if candidates is None:
        candidates = torch.full((plan.candidate_words,), -7, dtype=torch.int32)  # never zeroed on a GPU either
    call, addresses = fused_select_call(problem, args, plan, blocks, workspace, candidates, scores, stamps)
    defines = ("TOPK_WARP_SIZE=32",) + (() if cached is None else (f"FUSED_CACHE={cached}",))
    lib = emulated.build(kernels.SOURCE_PATH, EMULATED_FUSED_KERNELS, defines, kernels.source())
    # A cluster plan's CTAs meet only within their cluster (run together, clusters one after another); the last
    # arriver's design runs the whole grid together where the emulator holds it, so that CTAs arrive in any order.
    together = call.cluster == 1 and call.grid[0] * call.block[0] <= emulated.MAX_COOPERATIVE_THREADS
    emulated.run(lib, call, addresses, call.cluster, order_seed, cooperative=together)
    return blocks, workspace


def candidates_offered(candidates: torch.Tensor, plan: kernels.Plan) -> torch.Tensor:
    """Each row's candidates at the last launch of ``plan`` on the candidates buffer ``candidates`` (the sum of its
    CTAs' count words), ``[row_groups * group_rows]`` (meaningful for the rows wider than the budget)."""
    rows = candidates[: plan.candidate_words].view(plan.row_groups * plan.group_rows, plan.scratch_row_words)
    return rows[:, : plan.split].sum(-1)


def stamp_buffer(plan: kernels.Plan, device=None) -> torch.Tensor:
    """A zeroed int64 buffer for ``plan``'s debug phase stamps (``plan.stamp_words``: ``STAMP_COUNT`` timer words
    a CTA, CTA ``b``'s at ``b * STAMP_COUNT``; the finish's stamps only in the CTAs that arrived last and the
    selectors)."""
    return torch.zeros(plan.stamp_words, dtype=torch.int64, device=device)


def phase_times(stamps: torch.Tensor, plan: kernels.Plan) -> dict[str, float]:
    """The debug stamps of a launch of ``plan`` as durations in microseconds: for each phase of ``kernels.PHASES``
    the median of its duration (the next stamp less its own) over the scoring CTAs, or for the finish's phases
    (``kernels.FINISH_PHASES``) over the CTAs that write them: each group's last arriver and the selectors, whose own
    records stamp their wait as "arrive"; ``"finish"``: the median of the finish's whole span over those CTAs,
    ``"span"``: the median over the scoring CTAs of their arrival less their start, and ``"last"``: the latest finish
    less the earliest start (the kernel's span)."""
    records = stamps[: plan.stamp_words].detach().to("cpu", torch.int64).view(plan.grid, kernels.STAMP_COUNT)
    flat = records.double()
    scoring = flat[: plan.row_groups * plan.split]
    finishing = flat[flat[:, -1] != 0]
    arrive = kernels.PHASES.index("arrive") + 1

    def median_us(rows: torch.Tensor, start: int, end: int) -> float:
        return float((rows[:, end] - rows[:, start]).median()) / 1e3 if len(rows) else float("nan")

    times = {name: median_us(finishing if name in kernels.FINISH_PHASES else scoring, i, i + 1)
             for i, name in enumerate(kernels.PHASES)}
    times["finish"] = median_us(finishing, arrive, kernels.STAMP_COUNT - 1)
    times["span"] = median_us(scoring, 0, arrive)
    ends = finishing[:, -1] if len(finishing) else scoring[:, arrive]
    times["last"] = float(ends.max() - flat[:, 0].min()) / 1e3
    return times

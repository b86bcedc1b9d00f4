"""Column-block maxima of scored rows: what the block top-k reads for long rows instead of a pass over every logit.

The maxima of a row are ``maxima[row, b] = max(logits[row, b*B : min((b+1)*B, visible)])`` for the blocks
``b < cdiv(visible, B)`` (blocks past them are not written). ``_block_maxima_kernel`` computes them with several
programs per row, so one long row is read at the bandwidth of the whole GPU rather than of the one multiprocessor
its top-k program runs on. Maxima are plain ``max`` reductions: whichever program writes a block, the value is the
same, so the top-k that reads them is deterministic.

Why they help: the ``k``-th largest block maximum is a floor that at least ``k`` columns reach (``k`` distinct
blocks reach it), and every column at or above the floor lies in a block whose maximum is at or above it, so the
top-k finds its candidates by reading those blocks only (``topk.block_candidates``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..platform import Platform
from ..spec import KernelSpec, cdiv, next_pow2
from .problem import SelectionProblem, example_inputs

#: Block widths the maxima may have (columns per block).
BLOCK_WIDTHS = (4, 8, 16, 32)


def maxima_block(columns: int, block_topk: int) -> int:
    """Columns per maxima block for logits ``columns`` wide and ``block_topk`` groups per row: the widest of
    ``BLOCK_WIDTHS`` that still leaves a full-width row at least ``4 * block_topk`` blocks (the narrowest where
    none does), so the floor is the k-th largest of many maxima and few blocks reach it."""
    fitting = [b for b in BLOCK_WIDTHS if columns // b >= 4 * block_topk]
    return fitting[-1] if fitting else BLOCK_WIDTHS[0]


def maxima_shape(rows: int, columns: int, block_topk: int) -> tuple[int, int]:
    """Shape of the maxima of ``rows`` rows of logits ``columns`` wide: one per block, rows padded to a multiple of 16
    maxima, so the row stride is always divisible by 16 (Triton specialises on it: one variant for every width)."""
    return rows, cdiv(cdiv(max(columns, 1), maxima_block(columns, block_topk)), 16) * 16


@triton.jit(do_not_specialize=["num_columns"])
def _block_maxima_kernel(logits_ptr, vis_ptr, max_ptr, logits_stride, max_stride, num_columns,
                         B: tl.constexpr, SPAN: tl.constexpr):
    """Grid ``(rows, programs per row)``: the programs of a row stride over its blocks, ``SPAN`` blocks a step."""
    row = tl.program_id(0)
    n = tl.minimum(tl.maximum(tl.load(vis_ptr + row), 0), num_columns)
    src = logits_ptr + row.to(tl.int64) * logits_stride
    dst = max_ptr + row.to(tl.int64) * max_stride
    blocks = tl.cdiv(n, B)
    offs = tl.arange(0, SPAN)
    within = tl.arange(0, B)
    for start in range(tl.program_id(1) * SPAN, blocks, tl.num_programs(1) * SPAN):
        blk = start + offs
        cols = blk[:, None] * B + within[None, :]
        x = tl.load(src + cols, mask=cols < n, other=float("-inf"))
        # A NaN ranks above +inf (topk.order_key) and tl.max drops it: a block holding one has maximum +inf, so
        # that it reaches any floor.
        x = tl.where(x != x, float("inf"), x)
        tl.store(dst + blk, tl.max(x, axis=1), mask=blk < blocks)


@dataclass(frozen=True)
class MaximaConfig:
    span_columns: int = 4096  # columns per program step
    programs_per_sm: int = 4  # programs aimed at over the whole grid, per multiprocessor
    num_warps: int = 4


class MaximaSpec(KernelSpec):
    name = "block_maxima"
    family = "selection"
    description = "column-block maxima of scored rows, several programs per row (for the top-k's floor)"
    fn = _block_maxima_kernel
    Config = MaximaConfig

    def default_config(self, problem, platform) -> MaximaConfig:
        return MaximaConfig()

    def constexprs(self, problem: SelectionProblem, platform, cfg: MaximaConfig) -> dict:
        block = maxima_block(problem.columns, problem.block_topk)
        return dict(B=block, SPAN=max(1, cfg.span_columns // block))

    def grid(self, problem: SelectionProblem, platform: Platform, cfg: MaximaConfig) -> tuple[int, int]:
        block = maxima_block(problem.columns, problem.block_topk)
        steps = cdiv(cdiv(max(problem.columns, 1), block), max(1, cfg.span_columns // block))
        per_row = max(1, min(steps, cdiv(platform.programs(cfg.programs_per_sm), max(problem.rows, 1))))
        return problem.rows, per_row

    def example_args(self, problem: SelectionProblem, index_dtype, device) -> tuple:
        x = example_inputs(problem, index_dtype, device)
        maxima = torch.empty(maxima_shape(problem.rows, problem.columns, problem.block_topk), dtype=torch.float32,
                             device=device)
        return x.logits, x.visible, maxima, x.logits.stride(0), maxima.stride(0), x.logits.shape[1]

    def warm_problems(self, context):
        yield "block maxima", context.selection_problem(2, fused=False, with_maxima=True)


SPEC = MaximaSpec()


def launch(logits: torch.Tensor, visible: torch.Tensor, maxima: torch.Tensor, block_topk: int) -> None:
    """Fill ``maxima`` (fp32 ``maxima_shape(...)``, last dim contiguous) from fp32 ``logits`` ``[rows, columns]``
    and int32 ``visible`` ``[rows]`` (read clamped to ``[0, columns]``)."""
    if logits.shape[0] == 0:
        return
    plan_for(logits, block_topk).launch(*kernel_args(logits, visible, maxima))


def plan_for(logits: torch.Tensor, block_topk: int):
    """The launch plan of ``launch`` for these logits (at least one row)."""
    return SPEC.plan(SelectionProblem(logits.shape[0], logits.shape[1], block_topk), Platform.of(logits.device))


def kernel_args(logits: torch.Tensor, visible: torch.Tensor, maxima: torch.Tensor) -> tuple:
    """The kernel's positional arguments."""
    return logits, visible, maxima, logits.stride(0), maxima.stride(0), logits.shape[1]


def register_blocks(columns: int, block_topk: int) -> int:
    """Register length of one row's maxima in the top-k kernel."""
    return next_pow2(cdiv(max(columns, 1), maxima_block(columns, block_topk)))

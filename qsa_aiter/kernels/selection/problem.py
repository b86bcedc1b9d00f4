"""The facts a selection kernel's launch depends on, and small example inputs shaped by them."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

#: Token indices are int32 (selection's output): expansion keeps tokens below ``min(context_len, 2**31)``, so an
#: int64 context that long cuts its tokens at or past 2**31 like tokens past the context.
TOKEN_INDEX_LIMIT = 2**31
#: The most groups a row may keep (``block_topk``, ``token_topk // R``): the Triton top-k holds a row's candidates,
#: ``next_pow2(2 * block_topk)`` of them, in one program's registers (``topk.capacity``), and a budget past what a
#: kernel holds would fail its compile and mark it broken for the process. The ops reject more on every path
#: (16x the model's 512).
MAX_BLOCK_TOPK = 2**13
#: The most token slots a row of expansion may have (``token_topk + R - 1``): the Triton expansion holds a row's
#: ``next_pow2(token_topk + R - 1)`` slots in one program's registers (``expand.constexprs``' ``BLOCK_W``).
MAX_TOKEN_SLOTS = 2**16


@dataclass(frozen=True)
class SelectionProblem:
    """A top-k or expansion launch: ``rows`` rows of fp32 logits ``columns`` wide (0: no logits, the expansion
    alone), ``block_topk`` groups per row, each of ``compress_ratio`` tokens, ``token_topk`` token slots;
    ``fused``: the top-k expands its groups in the same launch; ``num_requests``: the request count (Triton
    specialises it by value); ``with_maxima``: the top-k reads the rows' column-block maxima."""

    rows: int
    columns: int
    block_topk: int
    compress_ratio: int = 1
    token_topk: int = 0
    fused: bool = False
    num_requests: int = 0
    with_maxima: bool = False


def example_inputs(problem: SelectionProblem, index_dtype: torch.dtype, device) -> SimpleNamespace:
    """Inputs of a launch shaped like ``problem`` (rows = requests, one row each; every group visible)."""
    rows, width, ratio = problem.rows, max(problem.columns, 1), problem.compress_ratio
    contexts = torch.full((rows,), width * ratio, dtype=index_dtype, device=device)
    return SimpleNamespace(
        logits=torch.zeros(rows, width, dtype=torch.float32, device=device),
        visible=torch.full((rows,), width, dtype=torch.int32, device=device),
        groups=torch.full((rows, problem.block_topk), -1, dtype=torch.int32, device=device),
        contexts=contexts,
        t2r=torch.arange(rows, dtype=index_dtype, device=device),
        positions=(contexts - 1).to(index_dtype),
        tokens=torch.empty((rows, problem.token_topk + ratio - 1), dtype=torch.int32, device=device),
    )

"""The native top-k's plans side by side, on a GPU: the plan the op chooses against the others that serve a shape.

    python benchmarks/native_variants.py [--points 9x4@64K-128K,...] [--page-size 64] [--cache bf16] [--replays 30]

For each work point (the selection targets' by default) the logits are scored once (``tools.inputs``), then the
native top-k is timed alone and with the expansion fused into it (the launch ``qsa_select_paged_tokens`` makes after
scoring), each with ``time_graph`` (CUDA-graph medians, as ``benchmarks/selection.py`` times it), for:

- the plan the op chooses;
- the other plans that serve the shape (``other_plans``: the cluster sizes for few long rows, the 256- and
  512-thread row kernels, the uncached row kernel, and the 256-thread one with ``MIN_CANDIDATES`` candidate slots,
  whose smaller shared memory fits five CTAs on a multiprocessor where the row has at most 8192 columns).

The source's measured alternatives (compile-time switches, each timed here against the shipped build) are decided
and gone from the source: docs/design-log/2026-12-06-native-topk-switches.md.

Every timed launch's output is checked equal to ``torch_block_topk`` (and its tokens to
``torch_expand_block_indices``) on the timed inputs. Printed per point and plan: µs alone and with the expansion,
and their ratios to the op's plan, measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import native_topk as nt
from qsa_aiter.kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from qsa_aiter.runtime.native_topk import native_block_topk
from qsa_aiter.tools.cli_args import add_selection_point_options
from qsa_aiter.tools.inputs import selection_inputs
from qsa_aiter.tools.timing import time_graph


def other_plans(rows: int, columns: int, k: int, chosen: nt.Plan, platform: Platform) -> dict[str, nt.Plan]:
    """The plans other than ``chosen`` that serve ``rows x columns`` keeping ``k`` on ``platform`` (``plans_for``),
    and the 256-thread row kernel with ``MIN_CANDIDATES`` candidate slots, by name."""
    plans = nt.plans_for(rows, columns, k, platform)
    if "rows_256" in plans:
        plans["rows_256_few_candidates"] = dataclasses.replace(plans["rows_256"], candidates=nt.MIN_CANDIDATES)
    return {name: plan for name, plan in plans.items() if plan != chosen}


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/native_variants.py``."""
    ap = argparse.ArgumentParser()
    add_selection_point_options(ap)
    return ap


def main() -> None:
    a = build_parser().parse_args()
    print("point,rows,columns,plan,kernel,topk_us,over_chosen,topk_expand_us,expand_over_chosen")
    for point in a.points:
        inputs = selection_inputs(point, a.page, a.cache)
        logits, visible, groups = inputs.logits, inputs.visible, inputs.groups
        rows, columns = logits.shape
        k = groups.shape[1]
        platform = Platform.of(logits.device)
        chosen = nt.choose_plan(rows, columns, k, platform)
        expected = torch.empty_like(groups)
        torch_block_topk(logits, visible, k, expected)
        batch, tokens = inputs.batch, inputs.picked
        ratio, token_topk = batch.compress_ratio, tokens.shape[1] - batch.compress_ratio + 1
        expansion = (batch.query_positions, batch.context_lens, batch.token_to_request, tokens, ratio, token_topk)
        expected_tokens = torch.empty_like(tokens)
        torch_expand_block_indices(expected, *expansion[:3], ratio, token_topk, expected_tokens)
        runs = {"chosen": chosen, **other_plans(rows, columns, k, chosen, platform)}
        baseline = None
        for label, plan in runs.items():
            def launch(plan=plan):
                native_block_topk(logits, visible, groups, k, plan=plan)

            def launch_expanding(plan=plan):
                native_block_topk(logits, visible, groups, k, plan=plan, expand_into=expansion)

            name = f"{label} {plan.variant.name}/{plan.candidates}"
            groups.fill_(-7)
            tokens.fill_(-7)
            launch_expanding()
            if not (torch.equal(groups, expected) and torch.equal(tokens, expected_tokens)):
                raise SystemExit(f"{point.name}: {name} differs from torch_block_topk / torch_expand_block_indices")
            us, us_expanding = time_graph(launch, 1, a.replays), time_graph(launch_expanding, 1, a.replays)
            baseline = baseline or (us, us_expanding)
            print(f"{point.name},{rows},{columns},{name.replace(' ', ',')},{us:.2f},{us / baseline[0]:.3f},"
                  f"{us_expanding:.2f},{us_expanding / baseline[1]:.3f}")


if __name__ == "__main__":
    main()

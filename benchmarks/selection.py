"""Selection beside scoring alone, and every top-k candidate alone beside ``torch.topk`` plus a sort, on a GPU.

    python benchmarks/selection.py [--points 9x4@64K-128K,4x4@262K,...] [--page-size 64] [--cache bf16] [--replays 30]

The default points are those of the selection targets (docs/selection.md).

Each call is timed with the benchmark's CUDA-graph replay (``qsa_aiter.tools.timing.time_graph``: compilation before the
capture, median over ``--replays``). Scoring reads the keys from HBM (the caches are larger than L2); the top-k
steps read logits that scoring has just written, as they do inside ``qsa_select_paged_tokens``. Each candidate of the
top-k registry that serves the point (``triton``, ``native``, ``native_grid``, ``torch``, ...; ``registries.TOPK``) is
timed alone through its own launch and checked equal to ``torch_block_topk`` on the timed inputs; the candidates that
do not serve are listed with their reasons. (``native_grid``'s time in a graph includes the zeroing of the workspace
it allocates inside the capture, a memset of 8960 bytes per row slot: docs/selection.md.) Ratios: selection / scoring, and (torch.topk + sort) / the fastest candidate.
``selection_pdl_us``: the selection again with ``QSA_AITER_TOPK_PDL=1`` (the native top-k launched as a programmatic
dependent of the scorer), its tokens checked equal to the default launch's. ``scoring_native_us``: scoring alone
again with ``QSA_AITER_BACKEND=native`` (the native tensor-core scorer; empty where it does not serve the point).
"""

from __future__ import annotations

import argparse
import os

import torch

from qsa_aiter.kernels.selection.reference import torch_block_topk
from qsa_aiter.runtime import registries
from qsa_aiter.runtime.settings import get_settings
from qsa_aiter.tools.cli_args import RenamedOption, add_selection_point_options, cache_format
from qsa_aiter.tools.inputs import selection_inputs
from qsa_aiter.tools.timing import time_graph


def torch_topk_then_sort(logits: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The baseline: ``torch.topk`` over the visible columns, then the indices sorted ascending."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    masked = torch.where(cols[None, :] < visible[:, None], logits, float("-inf"))
    return torch.sort(torch.topk(masked, k, dim=1).indices, dim=1).values


def time_graph_with_pdl(select, replays: int) -> float:
    """``select`` timed as ``time_graph`` times it with ``QSA_AITER_TOPK_PDL=1`` (the native top-k launched as a
    programmatic dependent of the scorer), the variable restored after."""
    before = os.environ.get("QSA_AITER_TOPK_PDL")
    os.environ["QSA_AITER_TOPK_PDL"] = "1"
    try:
        return time_graph(select, 1, replays)
    finally:
        if before is None:
            del os.environ["QSA_AITER_TOPK_PDL"]
        else:
            os.environ["QSA_AITER_TOPK_PDL"] = before


def time_graph_with_backend(calls, replays: int, backend: str) -> float | None:
    """``calls`` timed as ``time_graph`` times it with ``QSA_AITER_BACKEND=<backend>`` (the variable restored after);
    None where the forced scorer does not serve the call (the op raises, naming its reasons)."""
    before = os.environ.get("QSA_AITER_BACKEND")
    os.environ["QSA_AITER_BACKEND"] = backend
    try:
        return time_graph(calls, 1, replays)
    except ValueError as err:
        print(f"# {backend} scorer does not serve: {str(err).splitlines()[-1].strip()[:200]}")
        return None
    finally:
        if before is None:
            del os.environ["QSA_AITER_BACKEND"]
        else:
            os.environ["QSA_AITER_BACKEND"] = before


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/selection.py``."""
    ap = argparse.ArgumentParser()
    add_selection_point_options(ap)
    ap.add_argument("--kv", dest="cache", type=cache_format, action=RenamedOption, renamed_to="--cache")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    print("point,cache,page,scoring_us,scoring_native_us,selection_us,selection_over_scoring,selection_pdl_us,"
          "topk_candidate,topk_us,torch_topk_sort_us,topk_speedup")
    settings = get_settings()
    for point in a.points:
        inputs = selection_inputs(point, a.page, a.cache)
        logits, visible, groups = inputs.logits, inputs.visible, inputs.groups
        block_topk = groups.shape[1]
        scoring = time_graph(inputs.score, 1, a.replays)
        scoring_native = time_graph_with_backend(inputs.score, a.replays, "native")
        native_text = "" if scoring_native is None else f"{scoring_native:.2f}"
        selection = time_graph(inputs.select, 1, a.replays)
        picked = inputs.picked.clone()
        selection_pdl = time_graph_with_pdl(inputs.select, a.replays)
        if not torch.equal(inputs.picked, picked):
            raise SystemExit(f"{point.name}: selection with QSA_AITER_TOPK_PDL=1 picked other tokens")
        torch_topk = time_graph(lambda: torch_topk_then_sort(logits, visible, block_topk), 1, a.replays)
        expected = torch.empty_like(groups)
        torch_block_topk(logits, visible, block_topk, expected)
        problem = registries.topk_problem(logits, block_topk, fused=False)
        args = registries.TopkArgs(logits, visible, groups, block_topk)
        times = {}
        for name, candidate in registries.TOPK.candidates.items():
            forced = settings.model_copy(update={"topk_backend": name})  # as QSA_AITER_TOPK_BACKEND=<name> asks it
            reasons = registries.TOPK.reasons(name, problem, forced)
            if reasons:
                print(f"# {point.name}: {name} does not serve: {'; '.join(reasons)}")
                continue
            launch = lambda candidate=candidate, forced=forced: candidate.launch(problem, args, forced)  # noqa: E731
            try:
                times[name] = time_graph(launch, 1, a.replays)
            except Exception as err:  # noqa: BLE001 (a candidate that fails here is reported, the others still run)
                print(f"# {point.name}: {name} failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
                continue
            # The timed kernel's result on these inputs: every candidate equals the torch path exactly.
            if not torch.equal(groups, expected):
                raise SystemExit(f"{point.name}: the {name} top-k differs from torch_block_topk")
        fastest = min(times.values()) if times else float("nan")
        for name, us in times.items():
            print(f"{point.name},{a.cache},{a.page},{scoring:.2f},{native_text},{selection:.2f},"
                  f"{selection / scoring:.2f},{selection_pdl:.2f},{name},{us:.2f},{torch_topk:.2f},"
                  f"{torch_topk / fastest:.2f}")

if __name__ == "__main__":
    main()

"""Selection beside scoring alone, and every top-k candidate alone beside ``torch.topk`` plus a sort, on a GPU.

    python benchmarks/selection.py [--points 9x4@64K-128K,4x4@262K,...] [--page-size 64] [--caches bf16,fp8,mxfp4]
                                   [--replays 30]

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
``fused_us``: the selection again with ``QSA_AITER_SELECT_BACKEND=native_fused`` (scoring, top-k and expansion in one
launch; empty where it does not serve), ``fused_agreement`` the share of its token slots equal to the default path's.
"""

from __future__ import annotations

import argparse
import os

import torch

from qsa_aiter.kernels.selection.reference import torch_block_topk
from qsa_aiter.runtime import registries
from qsa_aiter.runtime.settings import get_settings
from qsa_aiter.tools.cli_args import RenamedOption, add_selection_point_options, cache_formats
from qsa_aiter.tools.inputs import selection_inputs
from qsa_aiter.tools.timing import time_graph


def torch_topk_then_sort(logits: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """The baseline: ``torch.topk`` over the visible columns, then the indices sorted ascending."""
    cols = torch.arange(logits.shape[1], device=logits.device)
    masked = torch.where(cols[None, :] < visible[:, None], logits, float("-inf"))
    return torch.sort(torch.topk(masked, k, dim=1).indices, dim=1).values


def time_graph_with(calls, replays: int, variable: str, value: str) -> float | None:
    """``calls`` timed as ``time_graph`` times it with the environment variable ``variable`` set to ``value`` (restored
    after); None where the forced path does not serve the call (the op raises a ValueError naming its reasons)."""
    before = os.environ.get(variable)
    os.environ[variable] = value
    try:
        return time_graph(calls, 1, replays)
    except ValueError as err:
        print(f"# {variable}={value} does not serve: {str(err).splitlines()[-1].strip()[:200]}")
        return None
    finally:
        if before is None:
            del os.environ[variable]
        else:
            os.environ[variable] = before


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python benchmarks/selection.py``."""
    ap = argparse.ArgumentParser()
    add_selection_point_options(ap, many_caches=True)
    ap.add_argument("--kv", dest="caches", type=cache_formats, action=RenamedOption, renamed_to="--caches")
    return ap


def optional(us: float | None) -> str:
    return "" if us is None else f"{us:.2f}"


def agreement(picked: torch.Tensor, reference: torch.Tensor) -> float:
    """The share of the token slots two selections fill alike (1.0: identical)."""
    return float((picked == reference).float().mean())


def main() -> None:
    a = build_parser().parse_args()
    print("point,cache,page,scoring_us,scoring_native_us,selection_us,selection_over_scoring,selection_pdl_us,"
          "fused_us,fused_over_scoring,fused_agreement,topk_candidate,topk_us,torch_topk_sort_us,topk_speedup")
    settings = get_settings()
    for cache in a.caches:
        for point in a.points:
            measure_point(point, cache, a.page, a.replays, settings)


def measure_point(point, cache: str, page: int, replays: int, settings) -> None:
    """One work point on one cache format: prints a row per top-k candidate that serves it."""
    inputs = selection_inputs(point, page, cache)
    logits, visible, groups = inputs.logits, inputs.visible, inputs.groups
    block_topk = groups.shape[1]
    scoring = time_graph(inputs.score, 1, replays)
    scoring_native = time_graph_with(inputs.score, replays, "QSA_AITER_BACKEND", "native")
    selection = time_graph(inputs.select, 1, replays)
    picked = inputs.picked.clone()
    # The native top-k launched as a programmatic dependent of the scorer.
    selection_pdl = time_graph_with(inputs.select, replays, "QSA_AITER_TOPK_PDL", "1")
    if not torch.equal(inputs.picked, picked):
        raise SystemExit(f"{point.name}: selection with QSA_AITER_TOPK_PDL=1 picked other tokens")
    # The fused selection scores with its own kernel: its picks equal the composite path's up to near-ties of the
    # two scorers' roundings (the tests hold it to the exact top-k of its own scores), so the share that agrees is
    # printed rather than required.
    fused = time_graph_with(inputs.select, replays, "QSA_AITER_SELECT_BACKEND", "native_fused")
    fused_agree = "" if fused is None else f"{agreement(inputs.picked, picked):.4f}"
    fused_ratio = "" if fused is None else f"{fused / scoring:.2f}"
    torch_topk = time_graph(lambda: torch_topk_then_sort(logits, visible, block_topk), 1, replays)
    expected = torch.empty_like(groups)
    torch_block_topk(logits, visible, block_topk, expected)
    problem = registries.topk_problem(logits, block_topk, fused=False)
    args = registries.TopkArgs(logits, visible, groups, block_topk)
    times = {}
    for name, candidate in registries.TOPK.candidates.items():
        forced = settings.model_copy(update={"topk_backend": name})  # as QSA_AITER_TOPK_BACKEND=<name> asks it
        reasons = registries.TOPK.reasons(name, problem, forced)
        if reasons:
            print(f"# {point.name} {cache}: {name} does not serve: {'; '.join(reasons)}")
            continue
        launch = lambda candidate=candidate, forced=forced: candidate.launch(problem, args, forced)  # noqa: E731
        try:
            times[name] = time_graph(launch, 1, replays)
        except Exception as err:  # noqa: BLE001 (a candidate that fails here is reported, the others still run)
            print(f"# {point.name} {cache}: {name} failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            continue
        # The timed kernel's result on these inputs: every candidate equals the torch path exactly.
        if not torch.equal(groups, expected):
            raise SystemExit(f"{point.name} {cache}: the {name} top-k differs from torch_block_topk")
    fastest = min(times.values()) if times else float("nan")
    for name, us in times.items():
        print(f"{point.name},{cache},{page},{scoring:.2f},{optional(scoring_native)},{selection:.2f},"
              f"{selection / scoring:.2f},{optional(selection_pdl)},{optional(fused)},{fused_ratio},{fused_agree},"
              f"{name},{us:.2f},{torch_topk:.2f},{torch_topk / fastest:.2f}", flush=True)


if __name__ == "__main__":
    main()

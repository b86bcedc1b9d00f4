"""Shared checks of the kernel tests: poison the output, run the op, compare ``[0, visible)`` with the reference."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import qsa_aiter
from qsa_aiter.runtime import registries
from qsa_aiter.kernels.scoring.problem import PHASES
from qsa_aiter.kernels.scoring import SPECS
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits
from qsa_aiter.tools.testing import (  # noqa: F401 (re-exported for the tests)
    E4M3_MMA_TOL, POISON, assert_matches_reference, magnitude_args, magnitude_bound, mma_atol, poisoned_logits,
    uses_e4m3_mma, visible_bits, visible_mask,
)
from qsa_aiter.tools.workloads import make_batch

#: Triton kernels of the dispatch, by candidate name (every scoring spec).
KERNELS = tuple(spec.name for spec in SPECS)
#: What a test may force through ``QSA_AITER_BACKEND``: every candidate, plus ``auto`` (the registry decides).
BACKENDS = KERNELS + ("torch", "auto")
#: The kernel the registry prefers for each phase when every candidate can serve (README.md's kernel table): the
#: first scoring kernel of the phase's order.
PREFERRED = {phase: next(n for n in registries.SCORING_TABLE[("bf16", 64, phase)] if n in KERNELS) for phase in PHASES}


def auto_kernel(args: tuple, **hints) -> str:
    """The kernel ``auto`` must pick for the call: the phase's preferred one, unless the tuned tables measured
    another faster at its bucket on this arch (the measurement rule, tested on synthetic tables in
    tests/test_registry.py; on the H200 the shipped rows send decode to the stacked scorer)."""
    problem = describe_call(*args, **hints)
    decision = registries.SCORING.select(problem)
    return decision.chosen if decision.rule.startswith("measurement") else PREFERRED[problem.phase]


def write_new_lengths(gen, context_lens, query_positions, low: int, high: int, rows_per_request: int) -> None:
    """A new decode/verify step in place (for graph replays): each request's length drawn from ``[low, high]`` and
    its rows placed at the last ``rows_per_request`` positions (the first row last); padded rows after them keep
    theirs."""
    n = context_lens.shape[0]
    lens = torch.randint(low, high + 1, (n,), generator=gen)
    context_lens.copy_(lens.to(context_lens.dtype))
    positions = lens.repeat_interleave(rows_per_request) - torch.arange(rows_per_request).repeat(n) - 1
    query_positions[: n * rows_per_request].copy_(positions.to(query_positions.dtype))


def force_backend(monkeypatch, name: str) -> None:
    """Force ``name`` for every phase (``auto`` leaves the choice to the dispatch)."""
    if name == "auto":
        monkeypatch.delenv("QSA_AITER_BACKEND", raising=False)
    else:
        monkeypatch.setenv("QSA_AITER_BACKEND", name)


def skip_unless_serves(name: str, args: tuple, **kwargs):
    """Skip the test when candidate ``name`` does not serve this call (the check the registry itself makes).

    Returns the validated ``ScoreProblem``.
    """
    problem = describe_call(*args, **kwargs)
    if name != "auto":
        reasons = registries.SCORING.reasons(name, problem)
        if reasons:
            pytest.skip(f"{name} does not serve {problem.summary()}: " + "; ".join(reasons))
    return problem


poisoned_out = poisoned_logits


def run_poisoned(args: tuple, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the op into a NaN-poisoned ``out`` and check it was written in place and returned."""
    out = poisoned_out(args, kwargs.get("max_columns"))
    logits, visible = qsa_aiter.qsa_paged_mqa_logits(*args, out=out, **kwargs)
    assert logits is out, "the op must return the `out` tensor it was given"
    assert visible.dtype == torch.int32 and tuple(visible.shape) == (args[0].shape[0],)
    return logits, visible


def reference_of(args: tuple, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference for the same call (fp32 accumulation, same device)."""
    extra = {k: kwargs[k] for k in ("score_divisor", "max_columns", "k_scale") if k in kwargs}
    return reference_paged_mqa_logits(*args, **extra)


def check_call(args: tuple, *, rtol=1e-5, atol=1e-5, label: str = "", **kwargs):
    """Poison, run, and compare with the reference. Returns ``(logits, visible)``."""
    logits, visible = run_poisoned(args, **kwargs)
    ref_logits, ref_visible = reference_of(args, **kwargs)
    atol = mma_atol(args, atol, **kwargs)
    assert_matches_reference(logits, visible, ref_logits, ref_visible, rtol=rtol, atol=atol, label=label)
    return logits, visible


def check_forced_call(monkeypatch, backend: str, args: tuple, **hints):
    """Force ``backend`` (skip where it does not serve) and compare the call ``args`` with the reference."""
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    return check_call(args, **hints)


def phase_batch(phase: str, page_size: int, gen, *, dtype=torch.bfloat16, cache: str | None = None, heads=4, head_dim=64,
                device="cpu"):
    """A small batch of the kind each phase sees, and the host hints the engine would pass (``k_scale`` included)."""
    common = dict(heads=heads, head_dim=head_dim, page_size=page_size, dtype=dtype, cache=cache, device=device,
                  generator=gen)
    if phase == "prefill":
        # A chunk of four short requests in one row tile; the last starts at position 0 (rows with visible 0).
        batch = make_batch([300, 522, 801, 9], [3, 4, 3, 9], **common)
        return batch, dict(phase="prefill", **batch.kwargs())
    if phase == "verify":
        # MTP verify, uneven rows per request (row blocks straddle requests) and CUDA-graph padding.
        batch = make_batch([700, 1201, 403], [4, 3, 4], padded_rows=2, **common)
        return batch, dict(phase="verify", max_query_len=batch.max_query_len, **batch.kwargs())
    # draft / decode: one row per request, padded rows at the end.
    batch = make_batch([900, 301, 1700, 650, 1203], 1, padded_rows=3, **common)
    return batch, dict(phase=phase, max_query_len=1, **batch.kwargs())


def check_forced(monkeypatch, backend: str, batch, hints: dict, *, label: str, tol: float = 1e-5,
                 auto_is_preferred: bool = True):
    """Force ``backend`` (skip where it does not serve), check the registry picks it (or, for ``auto``, the phase's
    preferred kernel when ``auto_is_preferred``), and compare the call with the reference."""
    args = batch.args()
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    chosen = qsa_aiter.selected_kernel(*args, **hints)
    if backend != "auto":
        assert chosen == backend
    elif auto_is_preferred:
        assert chosen == auto_kernel(args, **hints), qsa_aiter.explain(*args, **hints)
    return check_call(args, rtol=tol, atol=tol, label=label, **hints)


# ---------------------------------------------------------------------------------------------------------------
# The package's import graph (tests of its layering)
# ---------------------------------------------------------------------------------------------------------------

PACKAGE = Path(qsa_aiter.__file__).resolve().parent


def module_name(path: Path) -> str:
    """The dotted name of the package file ``path``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def top_level_imports(path: Path) -> set[str]:
    """The modules ``path`` (a file of ``qsa_aiter``) imports at module level, not inside functions: relative imports
    resolved, ``from pkg import name`` counted as ``pkg.name`` too (it may be a module)."""
    return _imports(path, ast.parse(path.read_text()).body)


def assert_no_import_circle(graph: dict[str, set[str]]) -> None:
    """Fail naming the first circle in ``graph`` (module -> the modules it imports), if there is one."""
    done, active = set(), []

    def visit(name):
        assert name not in active, f"import circle: {' -> '.join(active[active.index(name):] + [name])}"
        if name in done:
            return
        active.append(name)
        for dependency in sorted(graph[name]):
            visit(dependency)
        active.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def all_imports(path: Path) -> set[str]:
    """The modules ``path`` imports anywhere: at module level and inside functions (lazy imports)."""
    return _imports(path, [node for node in ast.walk(ast.parse(path.read_text()))
                           if isinstance(node, (ast.Import, ast.ImportFrom))])


def _imports(path: Path, nodes) -> set[str]:
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else (package if node.level else "")
            module = ".".join(p for p in (base, node.module or "") if p)
            submodules = {f"{module}.{alias.name}" for alias in node.names}
            names |= submodules
            # ``from . import paths`` in a package's own module imports a sibling, not the package's __init__
            if not (submodules <= set(MODULES) and (package == module or package.startswith(module + "."))):
                names.add(module)
    return names


# ---------------------------------------------------------------------------------------------------------------
# Selection inputs
# ---------------------------------------------------------------------------------------------------------------

#: Where the selection tests run their kernels: the GPU if there is one, else the interpreter on the CPU.
SELECTION_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_logits(gen, tokens: int, columns: int, kind: str) -> torch.Tensor:
    """fp32 logits of a selection test on the test device: random, few-valued (\"ties\") or all equal, with -inf
    columns (bad pages) in row 0 and signed zeros in row 1 (where there is one)."""
    if kind == "ties":  # few distinct values: ties everywhere, broken by index
        logits = torch.randint(0, 6, (tokens, columns), generator=gen).float()
    elif kind == "equal":  # every score the same (equal keys): the lowest groups win
        logits = torch.full((tokens, columns), 1.5)
    else:
        logits = torch.randn(tokens, columns, generator=gen)
    logits[0, 3:40] = float("-inf")  # bad pages inside the visible range
    if tokens > 1:  # a one-row input keeps its bad pages; the signed zeros need a second row
        logits[1, ::5] = -0.0
        logits[1, 1::5] = 0.0
    return logits.to(SELECTION_DEVICE)


def visible_counts(tokens: int, columns: int, block_topk: int, gen) -> torch.Tensor:
    """int32 visible counts of a selection test: random, with the edge cases (full, one short, K, K + 1, 0, 3) first."""
    vis = torch.randint(0, columns + 1, (tokens,), generator=gen)
    vis[:6] = torch.tensor([columns, columns - 1, block_topk, block_topk + 1, 0, 3])
    return vis.to(torch.int32).to(SELECTION_DEVICE)

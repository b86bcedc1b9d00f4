"""Seeded fuzzing of the ops against the torch oracles over random metadata: ``python -m qsa_aiter fuzz``.

Each case is drawn from its own seed (``--seed`` plus the case number), so a mismatch is replayed by its seed alone.
Cases mix what engines send with what they should never send but the kernels must survive: requests without rows,
padded rows, rows out of request order, page sizes that do not divide any tile (1, 3, 5, 33, 100), page-table widths
that are not powers of two, contexts of 0-3000 tokens, positions before and past the context and negative, bad page
ids (negative, past the cache, past 2**31), int32 and int64 metadata mixed, int64 values past 2**31 (positions,
context lengths, request ids), keys shared by many slots (exact ties), every cache format.

Paths (``--paths``):

- ``tiled``, ``stacked``, ``rowwise``, ``torch`` (each forced with ``QSA_AITER_BACKEND``) and ``auto``: the output
  poisoned, visible counts compared exactly and logits on exactly ``[0, visible)`` with
  ``reference_paged_mqa_logits`` (tolerance scaled by the magnitude of the terms summed); columns whose keys are the
  same bytes must score bitwise-identically in each row; one row scored alone must equal, bitwise, the same row in
  the batch (forced kernels, ``ALONE_CHECKED``). A forced kernel that does not serve a case must refuse it with a
  ``ValueError`` and leave ``out`` untouched (counted as refused); any other exception is a mismatch.
- ``topk`` (``qsa_block_topk``: the Triton kernel where Triton runs) and ``topk_torch``: against
  ``reference_block_topk`` on random logits with ties, ``-inf``, ``-0.0`` and visible counts outside ``[0, columns]``.
- ``topk_native``: the native CUDA top-k on the same cases, its plan drawn per case from every plan that fits (row
  kernels cached and uncached, clusters of 2, 4 and 8 on sm_90): on an NVIDIA GPU where the native top-k serves,
  else through the CPU emulator (``runtime/jit/emulated.py``, an H200's plans), which needs a C++ compiler.
- ``expand`` (``qsa_expand_block_indices``) and ``expand_torch``: against ``reference_expand_block_indices`` with
  group ids, positions, context lengths and request ids out of range.

On the CPU the Triton kernels run only in Triton's interpreter, which a process must ask for before Triton's kernels
are defined (``TRITON_INTERPRET=1`` when ``qsa_aiter`` is imported). The command line (``main``) therefore runs
itself again in a child process with ``TRITON_INTERPRET=1`` where the tensors are on the CPU, the interpreter is off
and a path runs Triton kernels (``TRITON_PATHS``), instead of fuzzing the torch path under the kernels' names. A
path every case of which its kernel refused was not exercised at all: the command says so and exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..runtime import native_topk as native_topk_runtime, registries
from ..runtime.jit import emulated, native
from ..runtime.settings import get_settings
from ..kernels.cache.reference import write_reference
from .cli_args import comma_subset, positive_int, run_command
from ..runtime.jit.triton_compat import install_uniform_interpreter_dots
from ..kernels.platform import Platform, interpreting
from ..kernels.selection import native_topk
from ..kernels.scoring import SPECS as SCORING_SPECS
from ..ops.scoring import describe_call, qsa_paged_mqa_logits
from ..kernels.scoring.reference import reference_paged_mqa_logits
from ..kernels.scoring.problem import MAX_DECODE_ROWS
from ..kernels.selection.reference import torch_block_topk, torch_expand_block_indices
from ..ops.selection import qsa_block_topk, qsa_expand_block_indices
from ..kernels.selection.reference import reference_block_topk, reference_expand_block_indices
from .testing import assert_matches_reference, magnitude_bound, mma_atol, poisoned_logits
from .workloads import make_batch

SCORING_PATHS = tuple(spec.name for spec in SCORING_SPECS) + ("torch", "auto")
SELECTION_PATHS = ("topk", "topk_torch", "topk_native", "expand", "expand_torch")
PATHS = SCORING_PATHS + SELECTION_PATHS
#: The plans the CPU emulator runs the native top-k with: an H200's.
EMULATED_PLATFORM = Platform.named("sm_90")
#: The paths that run this project's Triton kernels (on CPU tensors only under the interpreter); the others run the
#: torch paths.
TRITON_PATHS = tuple(spec.name for spec in SCORING_SPECS) + ("auto", "topk", "expand")
PAGE_SIZES = (1, 3, 5, 16, 33, 64, 100)
#: Paths whose row scored alone must equal the row in the batch bitwise: every one (under the interpreter too, where
#: ``run`` makes every ``tl.dot`` sum in one fixed order, as an MMA does).
ALONE_CHECKED = tuple(spec.name for spec in SCORING_SPECS) + ("torch",)
#: The index-cache formats a case draws from (docs/cache_formats.md): bf16, the engines' usual one, twice as often.
CACHE_FORMATS_DRAWN = ("bf16", "bf16", "fp16", "fp8", "fp8_fnuz", "fp4")


class Draw:
    """Random choices from one seeded CPU generator."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def int(self, lo: int, hi: int) -> int:
        """Uniform in ``[lo, hi]``."""
        return int(torch.randint(lo, hi + 1, (1,), generator=self.gen))

    def chance(self, p: float) -> bool:
        return float(torch.rand((), generator=self.gen)) < p

    def pick(self, options):
        return options[self.int(0, len(options) - 1)]

    def index_dtype(self) -> torch.dtype:
        return self.pick((torch.int32, torch.int64))


@dataclass
class ScoringCase:
    """One ``qsa_paged_mqa_logits`` call: positional ``args``, keyword ``kwargs``, and ``tied`` (bool ``[pages *
    page_size]``: the cache slots that hold one and the same key)."""

    label: str
    args: tuple
    kwargs: dict
    tied: torch.Tensor


def _page_entry(draw: Draw, pages: int, dtype: torch.dtype) -> int:
    """A bad page id: negative, at or past the cache, or past 2**31 where the table is int64."""
    bad = [-1, -7, pages, pages + 5, -(2**31), 2**31 - 1]
    if dtype == torch.int64:
        bad += [2**31, 2**32 + 1, 2**40, -(2**40)]
    return draw.pick(bad)


def scoring_case(seed: int, device: torch.device) -> ScoringCase:
    """A random scoring call on ``device`` (see the module docstring for what it mixes): a ``make_batch`` batch whose
    metadata is then pushed to the edges."""
    draw = Draw(seed)
    ratio = draw.pick((4, 4, 4, 1, 2, 8))
    page_size = draw.pick(PAGE_SIZES)
    heads = draw.pick((4, 4, 8, 1, 2, 3))
    cache_format = draw.pick(CACHE_FORMATS_DRAWN)
    head_dim = draw.pick((32, 64) if cache_format == "fp4" else (16, 32, 64, 48))
    q_dtype = torch.float16 if cache_format == "fp16" else (torch.bfloat16 if cache_format == "bf16" else
                                                           draw.pick((torch.bfloat16, torch.float16)))
    requests = draw.int(1, 4)
    # Contexts of 0-3000 tokens, most of them short: the interpreter's time grows with the columns scored.
    contexts = [draw.int(0, draw.pick((64, 600, 600, 3000))) for _ in range(requests)]
    rows = [draw.int(0, 4) for _ in range(requests)]
    width = max(max(1, -(-(c // ratio) // page_size)) for c in contexts) + draw.int(0, 3)
    padded = max(draw.int(0, 2), int(sum(rows) == 0))
    batch = make_batch(contexts, rows, heads=heads, head_dim=head_dim, page_size=page_size, compress_ratio=ratio,
                       dtype=q_dtype, cache=cache_format, spare_pages=draw.int(1, 3), padded_rows=padded,
                       table_width=width, generator=draw.gen)
    num_pages = batch.compressed_k_cache.shape[0]

    table_dtype, t2r_dtype, pos_dtype, ctx_dtype = (draw.index_dtype() for _ in range(4))
    table, t2r = batch.page_table.to(table_dtype), batch.token_to_request.to(t2r_dtype)
    pos, ctx = batch.query_positions.to(pos_dtype), batch.context_lens.to(ctx_dtype)
    for _ in range(draw.int(0, 3)):
        table[draw.int(0, requests - 1), draw.int(0, width - 1)] = _page_entry(draw, num_pages, table_dtype)
    row = 0
    for c, n in zip(contexts, rows):  # each request's rows: at the context's end, before it, past it or negative
        mode = draw.pick(("tail", "tail", "tail", "before", "past", "negative"))
        for i in range(row, row + n):
            if mode == "before":
                pos[i] = draw.int(0, max(c, 0))
            elif mode == "past":
                pos[i] = c + draw.int(1, 5000)
            elif mode == "negative":
                pos[i] = draw.pick((-1, -7))
        row += n
    for i in range(row, row + padded):  # padded rows, or request ids past the table
        t2r[i] = draw.pick((-1, -1, requests) + ((2**32,) if t2r_dtype == torch.int64 else ()))
    if pos_dtype == torch.int64 and draw.chance(0.3):
        pos[draw.int(0, pos.numel() - 1)] = 2**32 + 3
    if ctx_dtype == torch.int64 and draw.chance(0.3):
        ctx[draw.int(0, requests - 1)] = 2**31 + 8
    tokens = t2r.numel()
    order = torch.randperm(tokens, generator=draw.gen) if draw.chance(0.3) else torch.arange(tokens)

    tied = torch.zeros(num_pages * page_size, dtype=torch.bool)
    if draw.chance(0.4):  # one key in many slots: its columns must score bitwise-identically in each row
        tied = torch.rand(num_pages * page_size, generator=draw.gen) < 0.5
        slots = torch.nonzero(tied).flatten()
        key = torch.randn(1, head_dim, generator=draw.gen).expand(slots.numel(), head_dim)
        write_reference(key.to(q_dtype if batch.k_scale is None else torch.float32), slots,
                        batch.compressed_k_cache, batch.k_scale)

    kwargs = {} if batch.k_scale is None else {"k_scale": batch.k_scale.to(device)}
    if draw.chance(0.2):
        kwargs["max_columns"] = draw.int(0, width * page_size)
    query_len, tokens = max(rows + [1]), batch.q.shape[0]
    if draw.chance(0.5):  # a hint the shapes allow (the ops refuse one that contradicts them)
        kwargs["phase"] = draw.pick(tuple(
            phase for phase in ("prefill", "verify", "draft", "decode")
            if not (phase in ("draft", "decode") and query_len > 1)
            and not (phase in ("verify", "draft") and tokens > MAX_DECODE_ROWS)))
    if draw.chance(0.5):
        kwargs["max_query_len"] = query_len
    args = (batch.q[order].contiguous().to(device), batch.compressed_k_cache.to(device), table.to(device),
            t2r[order].to(device), pos[order].to(device), ctx.to(device), ratio)
    label = (f"seed {seed}: {cache_format} cache, q {str(q_dtype).removeprefix('torch.')}, page {page_size}, "
             f"heads {heads}, head_dim {head_dim}, R {ratio}, contexts {ctx.tolist()}, rows {rows}, width {width}, "
             f"{int((t2r < 0).sum())} padded, index dtypes "
             f"{[str(d).removeprefix('torch.') for d in (table_dtype, t2r_dtype, pos_dtype, ctx_dtype)]}, "
             f"{kwargs.get('phase')}, max_columns {kwargs.get('max_columns')}, {int(tied.sum())} tied slots")
    return ScoringCase(label, args, kwargs, tied.to(device))


def _column_slots(case: ScoringCase, columns: int) -> torch.Tensor:
    """int64 ``[tokens, columns]``: the cache slot each (row, column) reads, ``-1`` where its page is bad."""
    q, cache, table, t2r = case.args[:4]
    page_size = cache.shape[1]
    req = t2r.long().clamp(0, max(table.shape[0] - 1, 0))
    cols = torch.arange(columns, device=q.device)
    pages = table.long()[req][:, cols // page_size]
    ok = (pages >= 0) & (pages < cache.shape[0])
    return torch.where(ok, pages * page_size + cols[None, :] % page_size, -1)


def _check_ties(case: ScoringCase, logits: torch.Tensor, visible: torch.Tensor) -> None:
    """Columns whose keys are the same (``case.tied``) score bitwise-identically in each row."""
    if not bool(case.tied.any()):
        return
    slots = _column_slots(case, logits.shape[1])
    for t in range(logits.shape[0]):
        n = int(visible[t])
        row_slots = slots[t, :n]
        same = (row_slots >= 0) & case.tied[row_slots.clamp_min(0)]
        values = logits[t, :n][same].view(torch.int32).unique()
        if values.numel() > 1:
            raise AssertionError(f"row {t}: {int(same.sum())} columns share one key but score {values.numel()} "
                                 f"different values, e.g. {logits[t, :n][same][:4].tolist()}")


def _check_alone(case: ScoringCase, logits: torch.Tensor, visible: torch.Tensor) -> None:
    """The first row that sees something, scored alone, equals the same row of the batch bitwise."""
    seen = torch.nonzero(visible > 0).flatten()
    if seen.numel() == 0:
        return
    t = int(seen[0])
    q, cache, table, t2r, pos, ctx, ratio = case.args
    kwargs = {k: v for k, v in case.kwargs.items() if k in ("k_scale", "max_columns", "phase")}
    alone, vis = qsa_paged_mqa_logits(q[t : t + 1], cache, table, t2r[t : t + 1], pos[t : t + 1], ctx, ratio,
                                      **kwargs)
    n = int(visible[t])
    if int(vis[0]) != n or not torch.equal(alone[0, :n].view(torch.int32), logits[t, :n].view(torch.int32)):
        raise AssertionError(f"row {t} scored alone differs from the same row in the batch")


def run_scoring(path: str, case: ScoringCase) -> str:
    """Run ``case`` through ``path`` (a kernel name or ``auto``) and check it. Returns ``ok`` or ``refused``;
    raises ``AssertionError`` on a mismatch."""
    previous = os.environ.get("QSA_AITER_BACKEND")
    if path == "auto":
        os.environ.pop("QSA_AITER_BACKEND", None)
    else:
        os.environ["QSA_AITER_BACKEND"] = path
    try:
        problem = describe_call(*case.args, **case.kwargs)
        out = poisoned_logits(case.args, case.kwargs.get("max_columns"))
        if path != "auto" and registries.SCORING.reasons(path, problem):
            try:
                qsa_paged_mqa_logits(*case.args, out=out, **case.kwargs)
            except ValueError:
                if not bool(torch.isnan(out).all()):
                    raise AssertionError("a refused call wrote into `out`") from None
                return "refused"
            raise AssertionError(f"{path} does not serve this case but ran without an error")
        logits, visible = qsa_paged_mqa_logits(*case.args, out=out, **case.kwargs)
        ref_logits, ref_visible = reference_paged_mqa_logits(
            *case.args, **{k: v for k, v in case.kwargs.items() if k in ("k_scale", "max_columns")})
        bound = magnitude_bound(case.args, **case.kwargs)
        atol = mma_atol(case.args, 1e-5, **case.kwargs) + 1e-5 * bound
        assert_matches_reference(logits, visible, ref_logits, ref_visible, atol=atol)
        _check_ties(case, logits, visible)
        if path in ALONE_CHECKED:
            _check_alone(case, logits, visible)
        return "ok"
    finally:
        if previous is None:
            os.environ.pop("QSA_AITER_BACKEND", None)
        else:
            os.environ["QSA_AITER_BACKEND"] = previous


def topk_case(seed: int, device: torch.device) -> tuple[str, torch.Tensor, torch.Tensor, int]:
    """Random ``(label, logits, visible, block_topk)``: scores with heavy ties, ``-inf``, ``-0.0`` and ``+0.0``;
    visible counts in ``[-3, columns + 40]``; sometimes a logits view with a row stride past its width."""
    draw = Draw(seed)
    rows, columns = draw.int(1, 6), draw.int(1, 2500)
    k = draw.int(1, min(600, columns + 5))
    mode = draw.pick(("randn", "ties", "constant", "signed_zeros"))
    if mode == "randn":
        values = torch.randn(rows, columns, generator=draw.gen)
    elif mode == "ties":
        values = torch.randint(0, 4, (rows, columns), generator=draw.gen).float()
    elif mode == "constant":
        values = torch.full((rows, columns), 1.5)
    else:
        values = torch.where(torch.rand(rows, columns, generator=draw.gen) < 0.5, -0.0, 0.0)
    values[torch.rand(rows, columns, generator=draw.gen) < 0.1] = float("-inf")
    visible = torch.tensor([draw.pick((columns, draw.int(0, columns), draw.int(-3, columns + 40), 0))
                            for _ in range(rows)], dtype=torch.int32)
    if draw.chance(0.3):  # rows of a wider buffer
        wide = torch.full((rows, columns + draw.int(1, 9)), float("nan"))
        wide[:, :columns] = values
        values = wide[:, :columns]
    label = f"seed {seed}: {rows} x {columns} {mode} logits, block_topk {k}, visible {visible.tolist()}"
    return label, values.to(device), visible.to(device), k


def run_native_topk(logits: torch.Tensor, visible: torch.Tensor, k: int, out: torch.Tensor, seed: int) -> str | None:
    """The native top-k of one case into ``out`` with a plan drawn from ``seed``: on the GPU where it serves, else
    emulated on the CPU (the plan's name is returned), or "refused" where neither can run."""
    problem = registries.topk_problem(logits, k, fused=False)
    on_gpu = logits.is_cuda and not native_topk_runtime.native_topk_reasons(problem, Platform.of(logits.device),
                                                                   get_settings())
    if not on_gpu and emulated.unavailable_reason() is not None:
        return "refused"
    platform = Platform.of(logits.device) if on_gpu else EMULATED_PLATFORM
    draw = Draw(seed * 7919 + 17)
    plan = draw.pick(list(native_topk.plans_for(logits.shape[0], logits.shape[1], k, platform).values()))
    if on_gpu:
        native_topk_runtime.native_block_topk(logits, visible, out, k, plan=plan)
    else:
        target = torch.empty(out.shape, dtype=torch.int32)
        native_topk_runtime.emulated_block_topk(logits.cpu(), visible.cpu(), target, k, plan, order_seed=draw.int(0, 2))
        out.copy_(target)
    return plan.describe()


def run_topk(path: str, seed: int, device: torch.device) -> str:
    label, logits, visible, k = topk_case(seed, device)
    out = torch.full((logits.shape[0], k), 12345, dtype=torch.int32, device=device)
    if path == "topk":
        qsa_block_topk(logits, visible, k, out=out)
    elif path == "topk_native":
        plan = run_native_topk(logits, visible, k, out, seed)
        if plan == "refused":
            return "refused"
        label += f", {plan}"
    else:
        torch_block_topk(logits, visible, k, out)
    expected = reference_block_topk(logits, visible, k)
    if not torch.equal(out.cpu(), expected.cpu()):
        bad = torch.nonzero((out.cpu() != expected.cpu()).any(dim=1)).flatten().tolist()
        raise AssertionError(f"{label}: rows {bad} differ from reference_block_topk")
    return "ok"


def expand_case(seed: int, device: torch.device):
    """Random expansion arguments: ``(label, block_indices, query_positions, context_lens, token_to_request, R,
    token_topk)`` with group ids, positions, context lengths and request ids in and far out of range."""
    draw = Draw(seed)
    rows, requests = draw.int(1, 6), draw.int(1, 4)
    ratio = draw.pick((1, 2, 4, 4, 8))
    token_topk = ratio * draw.int(1, 40)
    groups = draw.int(1, token_topk // ratio)
    blk_dtype, pos_dtype, ctx_dtype, t2r_dtype = (draw.index_dtype() for _ in range(4))
    wide = blk_dtype == torch.int64
    block = torch.full((rows, groups), -1, dtype=torch.int64)
    for t in range(rows):
        n = draw.int(0, groups)
        block[t, :n] = torch.randperm(3000, generator=draw.gen)[:n].sort().values
        for _ in range(draw.int(0, 2)):
            block[t, draw.int(0, groups - 1)] = draw.pick((-5, 2**31 - 1) + ((2**40, 2**62) if wide else ()))
    big = pos_dtype == torch.int64
    pos = torch.tensor([draw.pick((draw.int(-3, 12000), -1) + ((2**32 + 3,) if big else ())) for _ in range(rows)],
                       dtype=pos_dtype)
    big = ctx_dtype == torch.int64
    ctx = torch.tensor([draw.pick((draw.int(0, 12000), 0) + ((2**31 + 8, 2**40) if big else ()))
                        for _ in range(requests)], dtype=ctx_dtype)
    big = t2r_dtype == torch.int64
    t2r = torch.tensor([draw.pick((draw.int(0, requests - 1), -1, requests) + ((2**32,) if big else ()))
                        for _ in range(rows)], dtype=t2r_dtype)
    label = (f"seed {seed}: {rows} rows x {groups} groups, R {ratio}, token_topk {token_topk}, positions "
             f"{pos.tolist()}, contexts {ctx.tolist()}, requests {t2r.tolist()}")
    tensors = (block.to(blk_dtype), pos, ctx, t2r)
    return (label, *(t.to(device) for t in tensors), ratio, token_topk)


def run_expand(path: str, seed: int, device: torch.device) -> str:
    label, block, pos, ctx, t2r, ratio, token_topk = expand_case(seed, device)
    out = torch.full((block.shape[0], token_topk + ratio - 1), 12345, dtype=torch.int32, device=device)
    if path == "expand":
        qsa_expand_block_indices(block, pos, ctx, t2r, ratio, token_topk, out=out)
    else:
        torch_expand_block_indices(block, pos, ctx, t2r, ratio, token_topk, out)
    expected = reference_expand_block_indices(block, pos, ctx, t2r, ratio, token_topk)
    if not torch.equal(out.cpu(), expected.cpu()):
        bad = torch.nonzero((out.cpu() != expected.cpu()).any(dim=1)).flatten().tolist()
        raise AssertionError(f"{label}: rows {bad} differ from reference_expand_block_indices")
    return "ok"


@dataclass
class PathResult:
    path: str
    cases: int = 0
    refused: int = 0
    mismatches: list[str] = field(default_factory=list)

    @property
    def exercised(self) -> bool:
        """Whether at least one case ran through the path and was checked (not every one refused)."""
        return self.cases > self.refused

    def line(self) -> str:
        return (f"{self.path:>12}: {self.cases} cases, {self.refused} refused by the kernel's reasons, "
                f"{len(self.mismatches)} mismatches" + ("" if self.exercised else "  NOT EXERCISED"))


def run(paths: tuple[str, ...], cases: int, seed: int, device: torch.device,
        progress: Callable[[str], None] | None = None) -> list[PathResult]:
    """Run ``cases`` cases (seeds ``seed .. seed + cases - 1``) through each path. A scoring case is drawn once and
    run through every scoring path."""
    if interpreting():
        install_uniform_interpreter_dots()
    results = {path: PathResult(path) for path in paths}
    scoring = [p for p in paths if p in SCORING_PATHS]
    for i in range(cases):
        case_seed = seed + i
        if scoring:
            case = scoring_case(case_seed, device)
            for path in scoring:
                _record(results[path], lambda: run_scoring(path, case), case.label)
        for path in (p for p in paths if p in SELECTION_PATHS):
            runner = run_topk if path.startswith("topk") else run_expand
            _record(results[path], lambda: runner(path, case_seed, device), f"seed {case_seed}")
        if progress is not None:
            progress(f"case {i + 1}/{cases}")
    return list(results.values())


def _record(result: PathResult, check: Callable[[], str], label: str) -> None:
    result.cases += 1
    try:
        if check() == "refused":
            result.refused += 1
    except AssertionError as err:
        result.mismatches.append(f"{result.path}: {label}\n  {err}")
    except Exception as err:  # a path (or its oracle) that raises on a valid call is a finding too
        result.mismatches.append(f"{result.path}: {label}\n  raised {type(err).__name__}: {err}")


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m qsa_aiter fuzz``."""
    parser = argparse.ArgumentParser(
        prog="python -m qsa_aiter fuzz",
        description="Fuzz the scoring, top-k and expansion ops against the torch oracles over random metadata "
                    "(seeded; a mismatch prints the seed that replays it). Without a GPU the Triton kernels run in "
                    "Triton's interpreter (the command runs itself again with TRITON_INTERPRET=1 where it is not "
                    "set). Exits 1 on a mismatch, or when every case of a path was refused (nothing checked there).")
    parser.add_argument("--cases", type=positive_int, default=200, help="cases per path (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case (default 0)")
    parser.add_argument("--paths", type=comma_subset(PATHS), default=None, metavar="PATH,...",
                        help="paths to fuzz, comma-separated (default all, topk_native where it can run): "
                             + ",".join(PATHS))
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the tensors live (default: cuda if available and not interpreting, else cpu)")
    parser.add_argument("--show", type=positive_int, default=5, help="mismatches printed per path (default 5)")
    return parser


def default_paths() -> tuple[str, ...]:
    """Every path, less ``topk_native`` where it can run neither on a GPU (no run-time compiler or driver) nor in the
    CPU emulator (no C++ compiler): there every case would be refused."""
    vendor = "hip" if torch.version.hip is not None else "cuda"
    gpu = torch.cuda.is_available() and not native.unavailable_reasons(vendor)
    if gpu or emulated.unavailable_reason() is None:
        return PATHS
    return tuple(p for p in PATHS if p != "topk_native")


def _run_interpreted(argv: list[str]) -> int:
    """Run ``python -m qsa_aiter fuzz argv`` again in a child process with ``TRITON_INTERPRET=1`` (set before the
    child imports Triton, as the interpreter needs); returns its exit status."""
    print("note: the tensors are on the CPU and TRITON_INTERPRET is not set, so the Triton kernels would not run "
          "here; running the fuzzer again with TRITON_INTERPRET=1 (Triton's interpreter)", file=sys.stderr,
          flush=True)
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "qsa_aiter", "fuzz", *argv], env=env, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = build_parser().parse_args(argv)
    if opts.paths is None:
        opts.paths = list(default_paths())
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but no CUDA device is available", file=sys.stderr)
        return 2
    use_cuda = opts.device == "cuda" or (opts.device == "auto" and torch.cuda.is_available() and not interpreting())
    device = torch.device("cuda" if use_cuda else "cpu")
    if device.type == "cpu" and not interpreting() and any(path in TRITON_PATHS for path in opts.paths):
        return _run_interpreted(argv)
    mode = "the Triton interpreter" if interpreting() else ("the GPU" if use_cuda else "the CPU (torch paths)")
    if not use_cuda and "topk_native" in opts.paths:
        mode += ", the native top-k in the CUDA emulator"
    print(f"fuzzing {', '.join(opts.paths)} on {mode}: {opts.cases} cases from seed {opts.seed}")
    start = time.perf_counter()
    results = run(tuple(dict.fromkeys(opts.paths)), opts.cases, opts.seed, device,
                  progress=lambda text: print(text, end="\r", file=sys.stderr, flush=True))
    print(f"done in {time.perf_counter() - start:.1f} s" + " " * 20)
    for result in results:
        print(result.line())
        for text in result.mismatches[: opts.show]:
            print("  " + text.replace("\n", "\n  "))
    idle = [r.path for r in results if not r.exercised]
    if idle:
        print(f"error: every case of {', '.join(idle)} was refused by the kernel's reasons: nothing was checked "
              "there (more --cases, or other --seed)", file=sys.stderr)
    return 1 if idle or any(r.mismatches for r in results) else 0


if __name__ == "__main__":  # as ``python -m qsa_aiter fuzz`` runs it (environment check, closed pipes)
    raise SystemExit(run_command(main, sys.argv[1:]))

"""ROCm candidates of the registries: AITER's QSA Triton scorer and the FlyDSL prefill scorer (``AITER_SCORING``,
``FLYDSL_SCORING``); AITER's HIP top-k (``aiter_block_topk``, whose candidate ``registries.TOPK`` declares).

Neither library is a dependency. Each candidate answers the registry's question "do you serve this problem?" from
host facts, cheapest first, and imports its library only once everything else says yes (``aiter`` writes to the
environment at import, so it is never imported on a machine where it could not serve):

- ``aiter``: ``aiter.ops.triton.attention.qsa.qsa_paged_mqa_logits`` (AITER's portable QSA Triton op) on a ROCm
  build of torch, for bf16 queries and caches. It allocates its own logits and scores every column of the page table
  (no skip past a row's visible count), so the registry ranks it after the project's row-wise scorer: it serves when
  forced (``QSA_AITER_BACKEND=aiter``) or when the project's Triton kernels failed on this ROCm stack.
- ``flydsl``: ATOM's FlyDSL MFMA prefill scorer, ``atom.model_ops.qwen4_exp.ops.qsa_flydsl_layout
  .qsa_paged_mqa_logits_flydsl``, only with ``ROCM_QSA_FLYDSL=1`` (or ``VLLM_ROCM_QSA_FLYDSL=1``), ``flydsl``
  importable and a gfx942/gfx950 GPU; it hard-codes bf16, 4 heads, head_dim 128, R 4 and 16 compressed groups per
  page (the engine's 64-token KV block), and addresses its buffers with 32-bit byte offsets.
- ``flydsl_k1`` (``flydsl_k1_reasons``, ``run_flydsl_k1``; ``registries.SELECTION`` declares the candidate):
  AITER's FlyDSL fused selection ``aiter.ops.flydsl.qsa.qsa_k1_block_ids``, which scores and selects block ids in
  one pass, only with ``ROCM_QSA_FLYDSL=1`` on gfx942/gfx950 and where the library's own predicates
  (``qsa_k1_selection_serves``, ``qsa_k1_serves``) say yes; its block ids are sorted and expanded here.
- ``aiter_block_topk``: AITER's HIP radix top-k (``aiter.ops.topk.top_k_per_row_prefill``, ``stable=True``) with the
  contract of ``qsa_aiter.qsa_block_topk`` (kept groups ascending, then ``-1``).

The signatures called here were read from the public ROCm/aiter and ROCm/ATOM sources (docs/integration.md); these
paths have not been run on ROCm hardware in this project. Why a candidate does not serve is in ``qsa_aiter.explain``
and logged once (``warning`` when the FlyDSL scorer was asked for, ``info`` otherwise).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..kernels.scoring.problem import PHASES, ScoreProblem
from ..kernels.scoring.reference import visible_groups
from .arguments import check_index_out, check_topk_args, fail_argument
from .dispatch import Candidate
from .log import log_once
from .settings import QsaSettings, get_settings

AITER_SCORER = ("aiter.ops.triton.attention.qsa", "qsa_paged_mqa_logits")
AITER_TOPK = ("aiter.ops.topk", "top_k_per_row_prefill")
FLYDSL_PACKAGE = "flydsl"
FLYDSL_SCORER = ("atom.model_ops.qwen4_exp.ops.qsa_flydsl_layout", "qsa_paged_mqa_logits_flydsl")
FLYDSL_ARCHS = ("gfx942", "gfx950")
#: The FlyDSL kernel addresses logits and cache with signed 32-bit byte offsets.
FLYDSL_MAX_BYTES = 2**31 - 1

#: AITER's FlyDSL fused selection ("K1"): its module and the functions this project calls (ROCm/aiter#5996).
FLYDSL_K1 = "aiter.ops.flydsl.qsa"
FLYDSL_K1_FUNCTIONS = ("qsa_k1_selection_serves", "qsa_k1_serves", "qsa_k1_block_ids")

AITER_DESCRIPTION = "AITER's QSA Triton scorer (aiter.ops.triton.attention.qsa)"
FLYDSL_DESCRIPTION = "FlyDSL MFMA prefill scorer (ATOM's qsa_flydsl_layout)"
FLYDSL_K1_DESCRIPTION = ("AITER's FlyDSL fused selection K1 (aiter.ops.flydsl.qsa: scores and selects block ids in "
                         "one pass), its block ids sorted and expanded here")


@dataclass(frozen=True)
class FlydslShape:
    """The one shape the FlyDSL kernel is built for (its module constants; read from it when it is loaded)."""

    heads: int = 4
    head_dim: int = 128
    page_size: int = 16  # compressed groups per page: the engine's 64-token KV block over R = 4
    compress_ratio: int = 4

    @classmethod
    def of(cls, module) -> "FlydslShape":
        default = cls()
        return cls(heads=getattr(module, "Q_HEADS", default.heads), head_dim=getattr(module, "HDIMS", default.head_dim),
                   page_size=getattr(module, "PAGE_SIZE", default.page_size),
                   compress_ratio=getattr(module, "COMPRESS_RATIO", default.compress_ratio))


# ---------------------------------------------------------------------------------------------------------------
# Platform facts and imports (one look per process)
# ---------------------------------------------------------------------------------------------------------------

_loaded: dict[tuple[str, str], tuple[object | None, object | None, str | None]] = {}


def _rocm_runtime() -> str | None:
    """The HIP version torch was built with, or None for a CUDA or CPU build."""
    return torch.version.hip


def _gpu_arch() -> str:
    """The gfx name of the current GPU (a cached host query; no device work)."""
    from ..kernels.platform import Platform

    return Platform.of(torch.device("cuda")).arch


def _load(module_name: str, attr: str) -> tuple[object | None, object | None, str | None]:
    """``(module, function, None)``, or ``(None, None, why)`` when the import fails; remembered for the process."""
    key = (module_name, attr)
    if key not in _loaded:
        try:
            module = importlib.import_module(module_name)
            fn = getattr(module, attr)
            _loaded[key] = (module, fn, None)
        except Exception as err:  # any import-time failure means "does not serve", never a crash of the call
            text = f"{type(err).__name__}: {err}".splitlines()[0][:200]
            _loaded[key] = (None, None, f"{module_name}.{attr} is not importable ({text})")
    return _loaded[key]


def _package_importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def reset() -> None:
    """Forget the import results (tests install and remove stand-in modules)."""
    _loaded.clear()


def _log_reasons(name: str, problem: ScoreProblem, reasons: list[str], level: int) -> list[str]:
    if reasons:
        log_once(level, ("rocm-candidate", name, tuple(reasons)),
                 lambda: f"{name} does not serve {problem.summary()}: " + "; ".join(reasons))
    return reasons


def _rocm_gpu_reasons(problem: ScoreProblem) -> list[str]:
    if problem.device_type != "cuda":
        return [f"needs ROCm GPU tensors (tensors are on {problem.device_type})"]
    if _rocm_runtime() is None:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
        return [f"needs a ROCm build of torch (this one is {build})"]
    return []


def _dense_cache_reasons(problem: ScoreProblem) -> list[str]:
    """The libraries' scorers are handed the cache tensor and address it as a dense ``[pages, P, 1, D]`` block: a
    strided view (``ScoreProblem.key_strides``) is not theirs to read (the Triton scorers and torch take it)."""
    if problem.key_strides is None:
        return []
    page, slot = problem.key_strides
    return [f"reads a dense index cache only (this one is a strided view: page stride {page}, slot stride {slot})"]


# ---------------------------------------------------------------------------------------------------------------
# AITER's QSA Triton scorer
# ---------------------------------------------------------------------------------------------------------------


def aiter_reasons(problem: ScoreProblem, settings: QsaSettings | None = None) -> list[str]:
    """Why AITER's QSA op does not serve ``problem`` (empty: it serves)."""
    reasons = _rocm_gpu_reasons(problem)
    if problem.q_dtype != torch.bfloat16 or problem.cache_dtype != torch.bfloat16:
        reasons.append(f"serves bf16 queries and caches only (got q {str(problem.q_dtype).removeprefix('torch.')}, "
                       f"cache {str(problem.cache_dtype).removeprefix('torch.')})")
    reasons += _dense_cache_reasons(problem)
    if not reasons:
        _, fn, why = _load(*AITER_SCORER)
        if why:
            reasons.append(why)
        else:
            params = inspect.signature(fn).parameters
            missing = [p for p in ("num_columns", "score_divisor") if p not in params]
            if missing:
                reasons.append(f"{'.'.join(AITER_SCORER)} has no {', '.join(missing)} argument (an older aiter)")
    return _log_reasons("aiter", problem, reasons, logging.INFO)


def run_aiter(problem: ScoreProblem, args) -> None:
    """Score with AITER's op and copy its logits and visible counts into the call's buffers."""
    _, fn, why = _load(*AITER_SCORER)
    if why:
        raise RuntimeError(why)
    logits, visible = fn(args.q, args.k_cache, args.page_table, args.token_to_request, args.query_positions,
                         args.context_lens, args.compress_ratio, num_columns=args.num_columns,
                         score_divisor=1.0 / args.scale)
    args.logits.copy_(logits)
    args.visible.copy_(visible)


# ---------------------------------------------------------------------------------------------------------------
# The FlyDSL prefill scorer
# ---------------------------------------------------------------------------------------------------------------


def flydsl_reasons(problem: ScoreProblem, settings: QsaSettings | None = None) -> list[str]:
    """Why the FlyDSL scorer does not serve ``problem`` (empty: it serves)."""
    settings = settings or get_settings()
    if not settings.rocm_qsa_flydsl:
        # Not asked for: logged at debug level only.
        off = ["off (ROCM_QSA_FLYDSL=1 or VLLM_ROCM_QSA_FLYDSL=1 enables it)"]
        return _log_reasons("flydsl", problem, off, logging.DEBUG)
    reasons = _rocm_gpu_reasons(problem)
    if not reasons and _gpu_arch() not in FLYDSL_ARCHS:
        reasons.append(f"needs {' or '.join(FLYDSL_ARCHS)} (this GPU is {_gpu_arch()})")
    if problem.phase != "prefill":
        reasons.append(f"serves the prefill phase only (phase {problem.phase})")
    if problem.q_dtype != torch.bfloat16 or problem.cache_dtype != torch.bfloat16:
        reasons.append("serves bf16 queries and caches only")
    reasons += _dense_cache_reasons(problem)
    reasons += _flydsl_shape_reasons(problem, FlydslShape())
    if not reasons:
        if not _package_importable(FLYDSL_PACKAGE):
            reasons.append(f"the {FLYDSL_PACKAGE} package is not importable")
        else:
            module, _, why = _load(*FLYDSL_SCORER)
            if why:
                reasons.append(why)
            elif FlydslShape.of(module) != FlydslShape():  # a kernel version built for another shape
                reasons += _flydsl_shape_reasons(problem, FlydslShape.of(module))
    return _log_reasons("flydsl", problem, reasons, logging.WARNING)


def _flydsl_shape_reasons(problem: ScoreProblem, shape: FlydslShape) -> list[str]:
    reasons = []
    got = (problem.num_heads, problem.head_dim, problem.block_size, problem.compress_ratio)
    want = (shape.heads, shape.head_dim, shape.page_size, shape.compress_ratio)
    if got != want:
        reasons.append(f"serves {shape.heads} heads, head_dim {shape.head_dim}, {shape.page_size} groups per page, "
                       f"R {shape.compress_ratio} only (got {got[0]}, {got[1]}, {got[2]}, {got[3]})")
    if problem.num_tokens * problem.num_columns * 4 > FLYDSL_MAX_BYTES:
        reasons.append("logits exceed its 2 GiB buffer addressing")
    if problem.cache_bytes > FLYDSL_MAX_BYTES:
        reasons.append("the index cache exceeds its 2 GiB buffer addressing")
    return reasons


def run_flydsl(problem: ScoreProblem, args) -> None:
    """Score in place with the FlyDSL kernel (it writes ``logits`` on ``[0, visible)`` and ``visible``)."""
    _, fn, why = _load(*FLYDSL_SCORER)
    if why:
        raise RuntimeError(why)
    fn(args.q, args.k_cache, args.page_table, args.token_to_request, args.query_positions, args.context_lens,
       args.compress_ratio, 1.0 / args.scale, args.logits, args.visible, None)


# ---------------------------------------------------------------------------------------------------------------
# AITER's HIP top-k
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _takes_stable(fn) -> bool:
    """Whether AITER's top-k ``fn`` has a ``stable=`` argument (its signature read once, not per call)."""
    return "stable" in inspect.signature(fn).parameters


def aiter_topk_reasons(device_type: str) -> list[str]:
    """Why AITER's HIP top-k cannot rank logits on ``device_type`` here (empty: it can)."""
    if device_type != "cuda":
        return [f"needs ROCm GPU tensors (logits are on {device_type})"]
    if _rocm_runtime() is None:
        return ["needs a ROCm build of torch"]
    _, fn, why = _load(*AITER_TOPK)
    if why:
        return [why]
    if not _takes_stable(fn):
        return [f"{'.'.join(AITER_TOPK)} has no stable= argument (an older aiter): equal scores would not select "
                "the same groups in decode and verify"]
    return []


def aiter_block_topk(logits: torch.Tensor, visible: torch.Tensor, block_topk: int,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``qsa_aiter.qsa_block_topk`` on AITER's HIP radix top-k: int32 ``[tokens, block_topk]``.

    Args:
        logits: fp32 ``[tokens, columns]`` (last dim contiguous); only ``[0, visible)`` of each row is ranked.
        visible: int32 ``[tokens]``. block_topk: groups to keep per row. out: optional int32 ``[tokens, block_topk]``.

    Returns:
        Per row the kept groups in ascending order, then ``-1``. AITER ranks each row over ``[0, visible)`` with
        ``stable=True``; its output order is unspecified, so the kept groups are sorted here. Raises
        ``RuntimeError`` with the reasons when AITER's top-k cannot serve (``aiter_topk_reasons``).
    """
    op = "aiter_block_topk"
    block_topk = check_topk_args(op, logits, visible, block_topk)
    tokens = logits.shape[0]
    out = check_index_out(op, out, (tokens, block_topk), logits.device, "logits")
    if not out.is_contiguous():  # AITER writes [tokens, block_topk] as one dense block
        fail_argument(ValueError, "out", "contiguous", f"strides {out.stride()}", op)
    reasons = aiter_topk_reasons(logits.device.type)
    if reasons:
        raise RuntimeError("AITER's HIP top-k does not serve: " + "; ".join(reasons))
    if tokens == 0:
        return out
    _, fn, _ = _load(*AITER_TOPK)
    row_starts = torch.zeros(tokens, dtype=torch.int32, device=logits.device)
    fn(logits, row_starts, visible, out, None, tokens, logits.stride(0), logits.stride(1), block_topk, stable=True)
    return ascending_groups(out, visible)


def ascending_groups(groups: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Put a library's selected groups (int32 ``[rows, k]``, in the library's order, ``-1`` or any value outside
    ``[0, visible)`` in unused slots) in this project's order, in place: kept groups ascending, ``-1`` after them.
    ``visible``: int32 ``[rows]``. One sort of ``[rows, k]`` on the device (no host sync)."""
    big = torch.iinfo(torch.int32).max
    keep = (groups >= 0) & (groups < visible[:, None])
    ordered = torch.sort(torch.where(keep, groups, big), dim=1).values
    groups.copy_(torch.where(ordered == big, -1, ordered))
    return groups


# ---------------------------------------------------------------------------------------------------------------
# AITER's FlyDSL fused selection (K1)
# ---------------------------------------------------------------------------------------------------------------


def _k1_functions() -> tuple[dict[str, Callable[..., Any]], str | None]:
    """K1's three functions by name, or ``({}, why)`` when one does not import."""
    found: dict[str, Callable[..., Any]] = {}
    for attr in FLYDSL_K1_FUNCTIONS:
        _, fn, why = _load(FLYDSL_K1, attr)
        if why:
            return {}, why
        found[attr] = fn
    return found, None


def _k1_meta_tensors(problem: ScoreProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k_cache, page_table)`` as K1 would be handed them for ``problem``, as meta tensors (shapes, dtypes and
    strides, no memory): ``qsa_k1_serves`` answers from those, so the decision needs no call's tensors."""
    d, page = problem.head_dim, problem.block_size
    q = torch.empty((problem.num_tokens, problem.num_heads, d), dtype=problem.q_dtype, device="meta")
    page_stride, slot_stride = problem.key_strides or (page * d, d)
    k_cache = torch.empty_strided((problem.num_pages, page, 1, d), (page_stride, slot_stride, d, 1),
                                  dtype=problem.cache_dtype, device="meta")
    table = torch.empty((problem.num_requests, problem.num_columns // page), dtype=torch.int32, device="meta")
    return q, k_cache, table


def _k1_answer(name: str, fn, *args, **kwargs) -> str | None:
    """What K1's predicate ``fn`` says (None: it serves); a predicate that raises says no, with its error."""
    try:
        answer = fn(*args, **kwargs)
    except Exception as err:  # e.g. a head count outside the library's own set raises there
        return f"{FLYDSL_K1}.{name} refuses it ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
    return None if answer is None else f"{name}: {answer}"


def flydsl_k1_reasons(problem, settings: QsaSettings | None = None) -> list[str]:
    """Why K1 does not serve ``problem`` (a ``registries.SelectionProblem``; empty: it serves): off unless
    ``ROCM_QSA_FLYDSL=1``; a ROCm GPU of gfx942/gfx950; the logits width a whole number of pages (K1 scores whole
    pages of the table it is given); then the library's own answers, ``qsa_k1_selection_serves(token_topk, R)``
    and ``qsa_k1_serves(q, k_cache, page_table, heads=(H,))`` (asked with meta tensors of the call's shapes)."""
    settings = settings or get_settings()
    if not settings.rocm_qsa_flydsl:
        off = ["off (ROCM_QSA_FLYDSL=1 or VLLM_ROCM_QSA_FLYDSL=1 enables it)"]
        return _log_reasons("flydsl_k1", problem, off, logging.DEBUG)
    score = problem.score
    reasons = _rocm_gpu_reasons(score)
    if not reasons and _gpu_arch() not in FLYDSL_ARCHS:
        reasons.append(f"needs {' or '.join(FLYDSL_ARCHS)} (this GPU is {_gpu_arch()})")
    if score.num_columns % score.block_size:
        reasons.append(f"scores whole pages: the logits width ({score.num_columns} columns, from max_seq_len) is not a "
                       f"multiple of the page's {score.block_size} groups")
    if not reasons:
        functions, why = _k1_functions()
        if why:
            reasons.append(why)
        else:
            answers = (
                _k1_answer("qsa_k1_selection_serves", functions["qsa_k1_selection_serves"], problem.token_topk,
                           score.compress_ratio),
                _k1_answer("qsa_k1_serves", functions["qsa_k1_serves"], *_k1_meta_tensors(score),
                           heads=(score.num_heads,)),
            )
            reasons += [answer for answer in answers if answer]
    return _log_reasons("flydsl_k1", problem, reasons, logging.WARNING)


def run_flydsl_k1(problem, args, expand: Callable[[torch.Tensor, slice], None]) -> None:
    """Select with K1 (``problem``: a ``registries.SelectionProblem``; ``args``: its ``SelectionArgs``): per chunk of
    ``problem.chunk_rows`` rows (K1 scores long rows into an fp32 ``[rows, columns]`` buffer of its own, bounded like
    ours), ``qsa_k1_block_ids`` writes int32 ``[rows, token_topk // R]`` block ids, ``ascending_groups`` puts them
    in this project's order (K1's selector returns them in its own order), and ``expand(block_ids, rows)`` writes
    their tokens into ``args.out[rows]``.

    K1 takes int32 ``token_to_req``, ``query_positions`` (its ``positions_int32``), ``context_lens`` (per request,
    in tokens: it reads ``context_lens[token_to_req[row]]``) and ``page_table``: int64 ones are converted on the
    device (no host sync). The page table is narrowed to the logits width (``max_seq_len``); ``heads=(H,)`` pins the
    head count K1 compiles for; ``score_scale`` is ``head_dim ** -0.5``, the scale of this project's logits."""
    functions, why = _k1_functions()
    if why:
        raise RuntimeError(why)
    block_ids = functions["qsa_k1_block_ids"]
    score = problem.score
    tokens, rows = score.num_tokens, problem.chunk_rows
    requests, positions, lengths = (t.to(torch.int32) for t in (args.token_to_request, args.query_positions,
                                                                 args.context_lens))
    table = args.page_table[:, : score.num_columns // score.block_size].to(torch.int32)
    blocks = torch.empty((min(rows, tokens), problem.block_topk), dtype=torch.int32, device=args.q.device)
    for r0 in range(0, tokens, rows):
        r1 = min(tokens, r0 + rows)
        chunk = blocks[: r1 - r0]
        block_ids(args.q[r0:r1], args.k_cache, table, requests[r0:r1], positions[r0:r1], lengths, out=chunk,
                  score_scale=score.head_dim ** -0.5, heads=(score.num_heads,))
        visible = visible_groups(requests[r0:r1], positions[r0:r1], lengths, score.compress_ratio, score.num_columns)
        ascending_groups(chunk, visible)
        expand(chunk, slice(r0, r1))


# ---------------------------------------------------------------------------------------------------------------
# The registries' candidates
# ---------------------------------------------------------------------------------------------------------------

# FlyDSL leads prefill because it is opt-in (ROCM_QSA_FLYDSL): asking for it means preferring it. AITER's op scores
# every column of the page table, so it follows the row-wise scorer: it runs when forced, or on a ROCm stack where
# this project's kernels failed and were marked broken.
AITER_SCORING = Candidate("aiter", AITER_DESCRIPTION,
                          lambda problem, platform, settings: aiter_reasons(problem, settings),
                          lambda problem, args, settings: run_aiter(problem, args),
                          dict.fromkeys(PHASES, 40), universal=True)
FLYDSL_SCORING = Candidate("flydsl", FLYDSL_DESCRIPTION,
                           lambda problem, platform, settings: flydsl_reasons(problem, settings),
                           lambda problem, args, settings: run_flydsl(problem, args), {"prefill": 10})


def aiter_topk_candidate_reasons(problem, platform, settings: QsaSettings) -> list[str]:
    """Why AITER's HIP top-k is not the top-k registry's choice for ``problem`` (a ``TopkProblem``): it is asked
    for by ``QSA_AITER_TOPK_BACKEND=aiter`` or ``QSA_AITER_BACKEND=aiter`` only (the project's top-k leads
    otherwise), and it needs a ROCm GPU with a stable AITER top-k."""
    reasons = []
    if "aiter" not in (settings.backend, settings.topk_backend):
        reasons.append("used only when the AITER path is asked for (QSA_AITER_TOPK_BACKEND=aiter or "
                       "QSA_AITER_BACKEND=aiter)")
    return reasons + aiter_topk_reasons(problem.device_type)


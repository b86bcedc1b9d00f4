"""What the three scorers share on the host: their arguments (``ScoreArgs``), the base of their specs
(``ScorerSpec``: served cache formats, registry ranks, small example launches, the work points of warm-up), the
e4m3 MMA choice, and how a kernel reads the keys (for ``explain``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..platform import E4M3_FN, E4M3_FNUZ, Platform
from ..quant.dequant import E4M3_MIN_HEAD_DIM, KV_16BIT, KV_FP4, KV_FP8_E4M3FNUZ, dot_dtype, kernel_view, kv_kind
from ..quant.formats import allocate_index_cache
from ..spec import KernelSpec, cdiv, is_pow2, next_pow2

#: Scalars that change from call to call: never specialised (no recompiles when they hit 1 or a multiple of 16).
DYNAMIC_SCALARS = ["num_tokens", "num_requests", "num_pages", "num_columns"]
#: Index-cache formats the scorers serve (the registry's kv axis).
KV_DTYPES = ("bf16", "fp8", "fp4")


@dataclass(frozen=True)
class ScoreArgs:
    """Tensors and scalars every scoring kernel receives.

    q: ``[tokens, heads, head_dim]`` bf16/fp16, contiguous; k_cache: the index cache (docs/cache_formats.md),
    dense along its last dim, any page and slot strides (``ScoreProblem.key_strides``);
    k_scale: its scale tensor (fp8: fp32 ``[pages, page_size]``; fp4: e8m0 ``[pages, page_size, 1, head_dim // 32]``)
    or None for 16-bit caches; page_table: ``[requests, width]`` int32/int64 (last dim contiguous);
    token_to_request, query_positions: ``[tokens]``; context_lens: ``[requests]``; logits: fp32
    ``[tokens, num_columns]`` (last dim contiguous); visible: int32 ``[tokens]``, written by the kernel;
    histogram: int32 ``[tokens, HISTOGRAM_BINS]``, zeroed, that a kernel built for ``ScoreProblem.histogram`` adds
    the stored scores to (``histogram.py``), or None.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    page_table: torch.Tensor
    token_to_request: torch.Tensor
    query_positions: torch.Tensor
    context_lens: torch.Tensor
    logits: torch.Tensor
    visible: torch.Tensor
    num_columns: int
    compress_ratio: int
    scale: float  # 1 / score_divisor
    k_scale: torch.Tensor | None = None
    histogram: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        """Where the call runs (the device of ``q``)."""
        return self.q.device

    def kernel_args(self) -> tuple:
        """Positional arguments of every scoring kernel, in the order of their signatures: the tensors (the
        pointer parameters), then the scalars (a cached call replays them with the tensors' addresses,
        ``ScoringPlan``)."""
        cache = kernel_view(self.k_cache)
        # 16-bit caches have no scale tensor: the cache stands in for the never-read pointer.
        k_scale = cache if self.k_scale is None else kernel_view(self.k_scale)
        # Without a histogram the visible counts stand in for its never-read pointer.
        histogram = self.visible if self.histogram is None else self.histogram
        return (
            self.q, cache, k_scale, self.page_table, self.token_to_request, self.query_positions, self.context_lens,
            self.logits, self.visible, histogram, self.q.shape[0], self.page_table.shape[0], self.k_cache.shape[0],
            self.num_columns, self.page_table.stride(0), self.logits.stride(0), self.scale,
        )



def e4m3_mma_refusal(problem, platform: Platform) -> str | None:
    """Why ``problem``'s keys cannot go to low-precision matrix instructions on ``platform`` (for ``explain``), or
    None when they can. They can with ``QSA_AITER_E4M3_MMA`` on as read for the call (``problem.e4m3_mma``), bf16
    queries (8 significant bits: two e4m3 terms hold them, ``split_query_e4m3``), a head_dim of at least
    ``E4M3_MIN_HEAD_DIM``, and keys the device multiplies as stored (``Platform.e4m3_mma``; the interpreter emulates
    them with exact fp32 dots of the same terms): an e4m3 cache of a flavour it takes (e4m3fn on NVIDIA 8.9+ and
    gfx950, e4m3fnuz on gfx942), or an MXFP4 one where MXFP4 goes to block-scaled instructions
    (``Platform.block_scaled_mma``) or each e2m1 nibble becomes an exact e4m3fn byte (``fp4_e4m3_block``)."""
    if not problem.e4m3_mma:
        return "QSA_AITER_E4M3_MMA=0"
    if problem.q_dtype != torch.bfloat16:
        return "fp16 queries: two e4m3 terms cannot hold them"
    kind = kv_kind(problem.cache_dtype)
    if kind == KV_16BIT:
        return "16-bit keys are no e4m3 operand"
    if problem.head_dim < E4M3_MIN_HEAD_DIM:
        return f"head_dim {problem.head_dim} < {E4M3_MIN_HEAD_DIM}: e4m3 MMAs step head_dim by 32"
    if not platform.e4m3_mma and not platform.block_scaled_mma:
        return "no e4m3 matrix instructions on this device"
    if kind == KV_FP4:
        if platform.block_scaled_mma or E4M3_FN in platform.e4m3_mma:
            return None
        return (f"MXFP4 keys need e4m3fn or block-scaled matrix instructions ({platform.arch} multiplies "
                f"{', '.join(platform.e4m3_mma)})")
    flavour = E4M3_FNUZ if kind == KV_FP8_E4M3FNUZ else E4M3_FN
    if flavour not in platform.e4m3_mma:
        return f"an {flavour} cache: {platform.arch}'s matrix instructions take {', '.join(platform.e4m3_mma)}"
    return None


def e4m3_mma_serves(problem, platform: Platform) -> bool:
    """Whether a kernel with the e4m3 MMA path (``ScorerSpec.e4m3_mma_path``) feeds ``problem``'s keys to
    low-precision matrix instructions on ``platform`` (its ``E4M3_MMA`` constexpr): whenever ``e4m3_mma_refusal``
    finds no reason against it."""
    return e4m3_mma_refusal(problem, platform) is None


def scaled_mma_serves(problem, platform: Platform) -> bool:
    """Whether ``problem``'s MXFP4 keys go to block-scaled matrix instructions on ``platform`` (the ``SCALED_MMA``
    constexpr: the packed nibbles and e8m0 exponents as stored, ``tiles.fp4_scaled_dots``) rather than as e4m3 bytes
    one 32-element block per MMA K-step."""
    return (kv_kind(problem.cache_dtype) == KV_FP4 and platform.block_scaled_mma
            and e4m3_mma_serves(problem, platform))


def scale_words_fit(head_dim: int) -> bool:
    """Whether an MXFP4 key's ``head_dim // 32`` exponent bytes form one integer (1, 2, 4 or 8 bytes) that
    ``fp4_block_factors`` can load at once (``SCALE_WORDS``, with an aligned scale tensor)."""
    return head_dim // 32 in (1, 2, 4, 8)


def column_programs(row_blocks: int, num_columns: int, block_n: int, target: int) -> int:
    """Programs per row block: the column tiles split so the whole grid fills ``target`` programs at most once.

    Rounded down (one wave, no straggling partial wave), at least 1, never more than the column tiles.
    """
    tiles = cdiv(max(num_columns, 1), block_n)
    return max(1, min(tiles, target // max(row_blocks, 1)))


def stacked_shape_reason(problem) -> str | None:
    """Why a kernel that stacks a block's rows x heads into one MMA operand cannot take ``problem``'s shape."""
    if not (is_pow2(problem.num_heads) and problem.num_heads >= 4):
        return f"needs a power-of-two head count >= 4 (got {problem.num_heads})"
    if not (is_pow2(problem.head_dim) and problem.head_dim >= 16):
        return f"needs a power-of-two head_dim >= 16 (got {problem.head_dim})"
    return None


def request_block_rows(problem) -> int:
    """Rows per block of a stacked kernel: one request's verify rows (a power of two), enough that rows x heads reach
    the MMA's 16, at most 16."""
    rows = next_pow2(problem.max_query_len or max(1, problem.num_tokens // max(problem.num_requests, 1)))
    return min(max(rows, 16 // problem.num_heads, 1), 16)


def stacked_constexprs(problem, platform: Platform, cfg) -> dict:
    """The constexprs the stacked and keys-major scorers share, from ``cfg`` (``block_rows``, ``block_n``,
    ``scalar_pages``)."""
    mma = e4m3_mma_serves(problem, platform)
    kind = kv_kind(problem.cache_dtype)
    return dict(
        RATIO=problem.compress_ratio, NUM_HEADS=problem.num_heads, HEAD_DIM=problem.head_dim,
        PAGE_SIZE=problem.block_size, BLOCK_ROWS=cfg.block_rows, BLOCK_N=cfg.block_n,
        KV_KIND=kind, DOT_DTYPE=dot_dtype(problem, platform.upcast, mma),
        FAST_DECODE=kind != KV_16BIT and platform.fast_decode, SCALAR_PAGES=bool(cfg.scalar_pages),
        E4M3_MMA=mma, SCALED_MMA=scaled_mma_serves(problem, platform),
        SCALE_WORDS=problem.scale_aligned and scale_words_fit(problem.head_dim), HISTOGRAM=problem.histogram,
        **key_stride_constexprs(problem),
    )


def key_stride_constexprs(problem) -> dict:
    """``KEY_PAGE_STRIDE`` and ``KEY_SLOT_STRIDE`` (``dequant.key_rows``) of a cache that is a strided view
    (``ScoreProblem.key_strides``); nothing for a dense cache, so its launches, warm-up variants and ahead-of-time
    builds stay the ones a dense cache always had (the kernels default both to 0). Constexprs, not runtime ints: a
    dense-like view compiles to a multiply by a constant, and an engine keeps one layout for the whole run, so a
    strided layout compiles once (at its first call; warm-up covers the dense layout)."""
    if problem.key_strides is None:
        return {}
    page_stride, slot_stride = problem.key_strides
    return {"KEY_PAGE_STRIDE": page_stride, "KEY_SLOT_STRIDE": slot_stride}


class ScorerSpec(KernelSpec):
    """A scoring kernel: the common arguments (``ScoreArgs``), every cache format, and its place in the registry's
    order per phase (``ranks``: lower runs first; the ROCm libraries and the torch reference rank among them)."""

    family: ClassVar[str] = "scoring"
    kv_dtypes: ClassVar[tuple[str, ...]] = KV_DTYPES
    #: phase -> rank in the registry's order; phases absent are not served by this kernel's row of the table.
    ranks: ClassVar[dict[str, int]] = {}
    #: Serves every problem of a page size outside the registry table (the universal fallback order).
    universal: ClassVar[bool] = False
    #: A ``QsaSettings`` switch that, when off, rules the kernel out (None: none).
    switch: ClassVar[str | None] = None
    #: Scores with ``tl.dot`` (tensor cores).
    tensor_cores: ClassVar[bool] = True
    #: Has the e4m3 MMA path: feeds e4m3fn and MXFP4 keys to e4m3 tensor cores where ``e4m3_mma_serves`` says so
    #: (its ``E4M3_MMA`` constexpr).
    e4m3_mma_path: ClassVar[bool] = False

    def reasons(self, problem, platform) -> list[str]:
        reasons = super().reasons(problem, platform)
        if problem.kv_dtype not in self.kv_dtypes:
            reasons.append(f"kv dtype {problem.kv_dtype} is not served (serves {', '.join(self.kv_dtypes)})")
        why = self.shape_reason(problem)
        if why:
            reasons.append(why)
        return reasons

    def shape_reason(self, problem) -> str | None:
        """Why the kernel cannot take ``problem``'s shape (head count, head_dim), or None."""
        return None

    def key_reading(self, problem, platform, plan) -> str:
        """One line for ``explain``: how this kernel reads ``problem``'s keys on ``platform`` under ``plan``, its
        launch plan there (the path its ``E4M3_MMA`` / ``SCALED_MMA`` constexprs take)."""
        kind = kv_kind(problem.cache_dtype)
        mma, scaled = plan.constexprs.get("E4M3_MMA", False), plan.constexprs.get("SCALED_MMA", False)
        if mma:
            if scaled:
                keys = ("the stored MXFP4 nibbles and e8m0 exponents as the operand and scales of block-scaled MMAs "
                        "(tl.dot_scaled)")
            elif kind == KV_FP4:
                keys = ("MXFP4 nibbles placed as exact e4m3 bytes, one k32 MMA step per 32-element block, scaled by "
                        "its e8m0 exponent in fp32")
            else:
                keys = f"the stored {E4M3_FNUZ if kind == KV_FP8_E4M3FNUZ else E4M3_FN} bytes as the MMA operand"
            emulated = " (emulated with exact fp32 dots under TRITON_INTERPRET=1)" if platform.interpreter else ""
            units = "MFMAs" if platform.backend == "hip" else "tensor cores"
            return f"e4m3 {units} (QSA_AITER_E4M3_MMA=1): {keys}; q split into two e4m3 terms{emulated}"
        if kind == KV_16BIT:
            return "as stored"
        dtype = "fp32" if platform.upcast else str(dot_dtype(problem, False))
        return f"decoded to {dtype} in registers ({self.decoding_reason(problem, platform)})"

    def decoding_reason(self, problem, platform) -> str:
        """Why quantised keys are decoded rather than fed to e4m3 tensor cores."""
        if not self.e4m3_mma_path:
            return "this kernel has no e4m3 MMA path"
        return e4m3_mma_refusal(problem, platform) or "e4m3 MMAs would serve"

    def example_args(self, problem, index_dtype, device) -> tuple:
        """Two requests of two rows on two pages each, laid out like the public op's (page-table and logits row
        strides multiples of 16), with ``problem``'s dtypes, heads, head_dim and page size."""
        return example_score_args(problem, index_dtype, device).kernel_args()

    def warm_problems(self, context):
        """The registry's work points of every phase whose order lists this kernel, and the buckets of its tuned
        rows on the context's arch, for every cache, page size and index dtype of the warm-up."""
        return context.scorer_problems(self)


#: Row strides of the example launches' page tables and logits: multiples of 16, like the engine's.
EXAMPLE_TABLE_WIDTH = 16
EXAMPLE_LOGITS_WIDTH = 1024


def example_score_args(problem, index_dtype: torch.dtype, device) -> ScoreArgs:
    """``ScoreArgs`` of a small call shaped like ``problem`` (see ``ScorerSpec.example_args``)."""
    requests, rows = 2, 2
    ratio, page_size, head_dim = problem.compress_ratio, problem.block_size, problem.head_dim
    kind = {KV_16BIT: "bf16" if problem.q_dtype == torch.bfloat16 else "fp16", KV_FP4: "fp4"}.get(
        kv_kind(problem.cache_dtype), "fp8")
    extra = {"fp8_dtype": problem.cache_dtype} if kind == "fp8" else {}
    cache, k_scale = allocate_index_cache(kind, requests * 2 + 1, page_size, head_dim, device=device, **extra)
    table = torch.full((requests, EXAMPLE_TABLE_WIDTH), -1, dtype=index_dtype)
    table[:, :2] = torch.arange(requests * 2).view(requests, 2)
    contexts = torch.full((requests,), 2 * page_size * ratio, dtype=index_dtype)
    t2r = torch.arange(requests).repeat_interleave(rows).to(index_dtype)
    pos = (contexts[t2r.long()] - rows + torch.arange(rows).repeat(requests)).to(index_dtype)
    q = torch.zeros(requests * rows, problem.num_heads, head_dim, dtype=problem.q_dtype, device=device)
    table, contexts, t2r, pos = (t.to(device) for t in (table, contexts, t2r, pos))
    logits = torch.empty((q.shape[0], EXAMPLE_LOGITS_WIDTH), dtype=torch.float32, device=device)
    visible = torch.empty((q.shape[0],), dtype=torch.int32, device=device)
    return ScoreArgs(q, cache, table, t2r, pos, contexts, logits, visible, EXAMPLE_LOGITS_WIDTH, ratio,
                     1.0 / math.sqrt(head_dim), k_scale)


def work_problem(problem, requests: int, rows: int, context: int, phase: str):
    """``problem`` (a model-shaped ``ScoreProblem``) at a work point: ``requests`` x ``rows`` query rows over
    ``context`` tokens, on a GPU."""
    width = max(1, math.ceil(context / problem.compress_ratio / problem.block_size))
    return replace(problem, device_type="cuda", num_tokens=requests * rows, num_requests=requests, table_width=width,
                   num_columns=width * problem.block_size, max_query_len=rows, num_pages=requests * width,
                   phase=phase, phase_source="hint")


def example_problem(**overrides):
    """A model-shaped ``ScoreProblem`` (4 heads, head_dim 128, R 4, page 64, bf16 cache, 9x4 verify over 32K
    columns) to specialise kernels for; ``overrides`` replace fields."""
    from .problem import ScoreProblem

    base = ScoreProblem(
        device_type="cuda", q_dtype=torch.bfloat16, kv_dtype="bf16", cache_dtype=torch.bfloat16, block_size=64,
        num_tokens=36, num_heads=4, head_dim=128, num_requests=9, table_width=512, num_pages=4096,
        num_columns=32768, compress_ratio=4, phase="verify", phase_source="hint", max_query_len=4, cache_bytes=0,
    )
    return replace(base, **overrides)

"""Block top-k over each row's visible logits: deterministic, ties to the lower group, groups listed ascending.

One program per row. A row with ``visible <= K`` takes groups ``0 .. visible-1`` without reading a score. Otherwise
the scores are mapped to order-preserving 32-bit keys and the row is cut down to a few candidates before anything
exact is done:

1. **Lane maxima.** The row is read once as ``CAPACITY`` interleaved lanes (column ``c`` belongs to lane
   ``c % CAPACITY``; every load is contiguous) and each lane keeps its maximum. The K-th largest lane maximum is a
   floor with at least K columns at or above it (K distinct columns reach it), whatever the scores are; a radix
   select over the maxima, held in registers, finds its top 16 bits, a slightly lower floor.
2. **Candidates.** One more pass keeps the columns at or above the floor, in column order (a prefix sum over groups
   of 4 adjacent columns gives their slots), in a per-row buffer. For scores without heavy ties about
   ``L * ln(L / (L - K))`` columns pass with ``L = CAPACITY`` lanes (about 1.4 K for ``L = 2 K``, the default).
3. **Exact select.** The candidates (at most ``CAPACITY``) are loaded into registers; a radix select of eight 4-bit
   digits (16-bin ``tl.histogram``; a 256-bin one costs about 80 instructions per element) finds the K-th largest
   key and how many columns equal to it still belong to the top K; a prefix sum over the candidates, still in
   column order, writes the columns above it and the first ones equal to it.

Rows of at most ``CAPACITY`` columns skip steps 1-2 (the whole row is the candidate set). When more than
``CAPACITY`` columns reach the floor (heavy ties, a constant row, rows ordered against the lanes) the same exact
select runs over the whole row in chunks instead: the result is identical, only slower. Nothing is sorted; the
output is exactly the first K columns by ``(-score, index)``, in ascending order, then ``-1``.

With ``EXPAND`` the program goes on to expand its row's groups into token indices (``expand.expand_row``), so the
selection pipeline needs no separate expansion launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..platform import Platform
from ..spec import KernelSpec, is_pow2, next_pow2
from . import expand
from .problem import SelectionProblem, example_inputs


@triton.jit
def _order_key(scores):
    """fp32 -> uint32 whose unsigned order is the float order (-inf lowest; -0.0 keyed as +0.0, they compare equal)."""
    bits = scores.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    flipped = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: reverse the magnitude order
    return flipped.to(tl.uint32, bitcast=True) ^ 0x80000000


@triton.jit
def _key_to_float(key):
    """The float whose order key is ``key`` (``-inf`` for keys at or below that of ``-inf``, which would decode to
    NaN), so that ``x >= _key_to_float(key)`` is ``_order_key(x) >= key`` for every non-NaN ``x``."""
    flipped = (key ^ 0x80000000).to(tl.int32, bitcast=True)
    bits = flipped ^ ((flipped >> 31) & 0x7FFFFFFF)
    return tl.where(key <= 0x007FFFFF, float("-inf"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _descend(hist, need, prefix, prefix_mask, shift):
    """One radix step. ``hist`` counts the next 4-bit digit of the keys that match ``prefix`` under ``prefix_mask``;
    the digit taken is the highest one at which the count from the top reaches ``need`` (the keys still owed to the
    top k). Returns the longer prefix and mask, and what is still owed among keys that match it."""
    bins = tl.arange(0, 16)
    from_top = tl.cumsum(hist, axis=0, reverse=True)
    digit = tl.max(tl.where(from_top >= need, bins, -1), axis=0)
    need = need - tl.sum(tl.where(bins > digit, hist, 0), axis=0)
    return prefix | (digit.to(tl.uint32) << shift), prefix_mask | (tl.full((), 0xF, tl.uint32) << shift), need


@triton.jit
def _kth_key(keys, valid, k, DIGITS: tl.constexpr):
    """Radix select over register-resident ``keys`` (where ``valid``; at least ``k`` of them): the top
    ``4 * DIGITS`` bits of the k-th largest key (low bits zero), and how many keys equal to that prefix belong to the
    top k. With ``DIGITS = 8`` the key is exact; with fewer it is a floor with at least ``k`` keys at or above it."""
    prefix = tl.zeros((), tl.uint32)
    prefix_mask = tl.zeros((), tl.uint32)
    need = k
    for p in tl.static_range(DIGITS):
        shift = 28 - 4 * p
        match = valid & ((keys & prefix_mask) == prefix)
        hist = tl.histogram(((keys >> shift) & 0xF).to(tl.int32), 16, mask=match)
        prefix, prefix_mask, need = _descend(hist, need, prefix, prefix_mask, shift)
    return prefix, need


@triton.jit
def _kth_key_of_row(src, n, k, CHUNK: tl.constexpr):
    """``_kth_key`` (exact) over the first ``n`` columns at ``src``, read in chunks: the fallback for rows whose
    candidates do not fit in registers. Eight passes over the row."""
    offs = tl.arange(0, CHUNK)
    prefix = tl.zeros((), tl.uint32)
    prefix_mask = tl.zeros((), tl.uint32)
    need = k
    for p in tl.static_range(8):
        shift = 28 - 4 * p
        hist = tl.zeros((16,), tl.int32)
        for start in range(0, n, CHUNK):
            cols = start + offs
            keys = _order_key(tl.load(src + cols, mask=cols < n, other=0.0))
            match = (cols < n) & ((keys & prefix_mask) == prefix)
            hist += tl.histogram(((keys >> shift) & 0xF).to(tl.int32), 16, mask=match)
        prefix, prefix_mask, need = _descend(hist, need, prefix, prefix_mask, shift)
    return prefix, need


@triton.jit
def _chosen(keys, valid, threshold, need, equal_before):
    """Which of ``keys`` (in column order) are in the top k: above ``threshold``, or equal to it and among the first
    ``need`` equal ones (``equal_before`` equal ones came in earlier chunks). Also returns the equal-key mask."""
    equal = valid & (keys == threshold)
    equal_rank = equal_before + tl.cumsum(equal.to(tl.int32), axis=0) - 1
    return valid & ((keys > threshold) | (equal & (equal_rank < need))), equal


@triton.jit
def _select_row(src, cols, valid, k, out_row):
    """Exact top ``k`` of the columns ``cols`` (ascending, where ``valid``; at least ``k``) of the row at ``src``:
    writes them, in column order, to ``out_row[0:k]``."""
    keys = _order_key(tl.load(src + cols, mask=valid, other=0.0))
    threshold, need = _kth_key(keys, valid, k, 8)
    chosen, _ = _chosen(keys, valid, threshold, need, 0)
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    tl.store(out_row + slot, cols, mask=chosen)


@triton.jit
def _select_whole_row(src, n, k, out_row, CHUNK: tl.constexpr):
    """``_select_row`` over all ``n`` columns, in chunks (the fallback for heavy ties)."""
    threshold, need = _kth_key_of_row(src, n, k, CHUNK)
    offs = tl.arange(0, CHUNK)
    taken = tl.zeros((), tl.int32)
    equal_seen = tl.zeros((), tl.int32)
    for start in range(0, n, CHUNK):
        cols = start + offs
        keys = _order_key(tl.load(src + cols, mask=cols < n, other=0.0))
        chosen, equal = _chosen(keys, cols < n, threshold, need, equal_seen)
        slot = taken + tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(out_row + slot, cols, mask=chosen)
        taken += tl.sum(chosen.to(tl.int32), axis=0)
        equal_seen += tl.sum(equal.to(tl.int32), axis=0)


@triton.jit
def vector_end(n, PAST_END_OK: tl.constexpr):
    """Where a row's loads may stop: ``n`` rounded up to a multiple of 4 where the row has the columns
    (``PAST_END_OK``), so that loads stay 16-byte vectors; the up to 3 scores past ``n`` are ignored."""
    if PAST_END_OK:
        return tl.multiple_of((n + 3) // 4 * 4, 4)
    return n


@triton.jit
def lane_maxima(src, n, n_vec, CAPACITY: tl.constexpr, TILE: tl.constexpr):
    """fp32 ``[CAPACITY]``: the maximum of each lane of the first ``n`` columns at ``src`` (column ``c`` is in lane
    ``c % CAPACITY``, so every load is contiguous), ``-inf`` for lanes without a column; ``TILE`` columns a step."""
    lanes = tl.arange(0, CAPACITY)
    STEPS: tl.constexpr = TILE // CAPACITY
    tile_offs = tl.arange(0, STEPS)[:, None] * CAPACITY + lanes[None, :]
    lane_max = tl.full((CAPACITY,), float("-inf"), tl.float32)
    for start in range(0, n, TILE):
        cols = start + tile_offs
        x = tl.load(src + cols, mask=cols < n_vec, other=float("-inf"))
        lane_max = tl.maximum(lane_max, tl.max(tl.where(cols < n, x, float("-inf")), axis=0))
    return lane_max


@triton.jit
def lane_floor(lane_max, n, k, CAPACITY: tl.constexpr):
    """A score at least ``k`` of the row's ``n > CAPACITY`` columns reach: the top 16 bits of the ``k``-th largest
    lane maximum (``k`` distinct columns reach that maximum)."""
    lanes = tl.arange(0, CAPACITY)
    return _key_to_float(_kth_key(_order_key(lane_max), lanes < n, k, 4)[0])


@triton.jit
def collect_candidates(src, n, n_vec, floor, buf_row, CAPACITY: tl.constexpr, SCAN: tl.constexpr):
    """Write the columns of the first ``n`` at ``src`` whose score is ``>= floor``, in column order, to
    ``buf_row[0:CAPACITY]`` (those past the capacity are dropped) and return how many there are. Slots come from a
    prefix sum over groups of 4 adjacent columns (each group in one thread's registers) plus one within the group: a
    quarter of the scan work of a scan over every column. ``SCAN`` columns a step."""
    QUADS: tl.constexpr = SCAN // 4
    quad = tl.arange(0, QUADS)[:, None] * 4 + tl.arange(0, 4)[None, :]
    kept = tl.zeros((), tl.int32)
    for start in range(0, n, SCAN):
        cols = start + quad
        x = tl.load(src + cols, mask=cols < n_vec, other=0.0)
        keep = ((cols < n) & (x >= floor)).to(tl.int32)
        per_quad = tl.sum(keep, axis=1)
        quad_first = kept + tl.cumsum(per_quad, axis=0) - per_quad
        slot = quad_first[:, None] + tl.cumsum(keep, axis=1) - keep
        tl.store(buf_row + slot, cols, mask=(keep > 0) & (slot < CAPACITY))
        kept += tl.sum(per_quad, axis=0)
    return kept


@triton.jit(do_not_specialize=["num_columns"])
def _block_topk_kernel(
    logits_ptr, vis_ptr, out_ptr, buf_ptr, pos_ptr, ctx_ptr, t2r_ptr, tok_ptr,
    logits_stride, out_stride, buf_stride, num_requests, tok_stride, num_columns,
    K: tl.constexpr, BLOCK_K: tl.constexpr, CAPACITY: tl.constexpr, TILE: tl.constexpr, SCAN: tl.constexpr,
    CHUNK: tl.constexpr, PAST_END_OK: tl.constexpr,
    EXPAND: tl.constexpr, RATIO: tl.constexpr, BLOCK_R: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
):
    row = tl.program_id(0)
    # The visible count is device data: clamped to the row, so no value makes the kernel read past it.
    n = tl.minimum(tl.maximum(tl.load(vis_ptr + row), 0), num_columns)
    out_row = out_ptr + row.to(tl.int64) * out_stride
    if n <= K:
        # Short rows take every visible group, scores unread.
        kk = tl.arange(0, BLOCK_K)
        tl.store(out_row + kk, tl.where(kk < n, kk, -1), mask=kk < K)
    else:
        src = logits_ptr + row.to(tl.int64) * logits_stride
        lanes = tl.arange(0, CAPACITY)
        if n <= CAPACITY:
            _select_row(src, lanes, lanes < n, K, out_row)
        else:
            n_vec = vector_end(n, PAST_END_OK)
            # 1. The floor: top 16 bits of the K-th largest of the lane maxima (at least K columns reach it).
            floor = lane_floor(lane_maxima(src, n, n_vec, CAPACITY, TILE), n, K, CAPACITY)
            # 2. The columns at or above the floor, in column order, into the row's candidate buffer.
            buf_row = buf_ptr + row.to(tl.int64) * buf_stride
            kept = collect_candidates(src, n, n_vec, floor, buf_row, CAPACITY, SCAN)
            # The candidates are read back by other threads of the program: make their stores visible first.
            tl.debug_barrier()
            if kept <= CAPACITY:
                # 3. The exact select over the candidates.
                cand = tl.load(buf_row + lanes, mask=lanes < kept, other=0)
                _select_row(src, cand, lanes < kept, K, out_row)
            else:
                _select_whole_row(src, n, K, out_row, CHUNK)
    if EXPAND:
        tl.debug_barrier()  # the groups just stored are read back by other threads
        expand.expand_row(row, out_row, pos_ptr, ctx_ptr, t2r_ptr, tok_ptr + row.to(tl.int64) * tok_stride,
                          num_requests, RATIO, K, BLOCK_K, BLOCK_R, WIDTH, BLOCK_W)


@dataclass(frozen=True)
class TopkConfig:
    capacity_factor: int = 2  # lanes and candidate capacity: next_pow2(capacity_factor * K), at least 16
    tile: int = 8192  # columns per step of the lane-maxima pass (raised to the capacity if below it)
    scan: int = 4096  # columns per step of the candidate pass
    chunk: int = 2048  # columns per step of the whole-row fallback
    num_warps: int = 8

    def __post_init__(self):
        if self.capacity_factor < 2:
            raise ValueError(f"capacity_factor must be >= 2 (the lanes must outnumber K); got {self.capacity_factor}")
        for name in ("tile", "scan", "chunk"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two; got {getattr(self, name)}")


def capacity(block_topk: int, cfg: TopkConfig) -> int:
    """Lanes of the maxima pass and candidates held in registers for ``block_topk`` groups per row."""
    return max(16, next_pow2(cfg.capacity_factor * block_topk))


def constexprs(block_topk: int, cfg: TopkConfig, expansion: dict | None = None, columns: int = 0) -> dict:
    """The kernel's specialisation for ``block_topk`` groups per row under ``cfg``, for logits ``columns`` wide;
    ``expansion`` (``expand.constexprs``) fuses the expansion into the kernel."""
    cap = capacity(block_topk, cfg)
    fused = expansion or dict(RATIO=1, BLOCK_R=1, WIDTH=1, BLOCK_W=1)
    return dict(K=block_topk, BLOCK_K=next_pow2(block_topk), CAPACITY=cap, TILE=max(cfg.tile, cap), SCAN=cfg.scan,
                CHUNK=cfg.chunk, PAST_END_OK=columns % 4 == 0, EXPAND=expansion is not None, RATIO=fused["RATIO"],
                BLOCK_R=fused["BLOCK_R"], WIDTH=fused["WIDTH"], BLOCK_W=fused["BLOCK_W"])


class TopkSpec(KernelSpec):
    name = "topk"
    family = "selection"
    description = "block top-k, one program per row (lane-maxima floor, candidates, exact radix select)"
    fn = _block_topk_kernel
    Config = TopkConfig

    def default_config(self, problem, platform) -> TopkConfig:
        return TopkConfig()

    def constexprs(self, problem: SelectionProblem, platform, cfg: TopkConfig) -> dict:
        fused = (expand.constexprs(problem.compress_ratio, problem.block_topk, problem.token_topk)
                 if problem.fused else None)
        return constexprs(problem.block_topk, cfg, fused, problem.columns)

    def grid(self, problem: SelectionProblem, platform, cfg) -> tuple[int]:
        return (problem.rows,)

    def example_args(self, problem: SelectionProblem, index_dtype, device) -> tuple:
        x = example_inputs(problem, index_dtype, device)
        buf = torch.empty((problem.rows, capacity(problem.block_topk, TopkConfig())), dtype=torch.int32, device=device)
        if not problem.fused:  # unread: EXPAND is off
            return (x.logits, x.visible, x.groups, buf, x.visible, x.visible, x.visible, x.visible, x.logits.stride(0),
                    x.groups.stride(0), buf.stride(0), 0, 0, x.logits.shape[1])
        return (x.logits, x.visible, x.groups, buf, x.positions, x.contexts, x.t2r, x.tokens, x.logits.stride(0),
                x.groups.stride(0), buf.stride(0), problem.num_requests, x.tokens.stride(0), x.logits.shape[1])

    def warm_problems(self, context):
        yield "topk", context.selection_problem(2, fused=False)
        for requests in context.request_counts:  # as the selection op launches it: the expansion fused
            yield f"topk+expand {requests} requests", context.selection_problem(requests, fused=True)


SPEC = TopkSpec()


def launch(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int,
           cfg: TopkConfig | None = None, expand_into: tuple | None = None) -> None:
    """Fill ``out`` (int32 ``[tokens, block_topk]``, last dim contiguous) from fp32 ``logits`` ``[tokens, columns]``
    (last dim contiguous) and int32 ``visible`` ``[tokens]`` (read clamped to ``[0, columns]``).

    ``expand_into = (query_positions, context_lens, token_to_request, tokens_out, compress_ratio, token_topk)`` also
    writes each row's token indices (``qsa_expand_block_indices`` of ``out``) into ``tokens_out`` (int32
    ``[tokens, token_topk + R - 1]``, last dim contiguous) in the same launch."""
    tokens = logits.shape[0]
    if tokens == 0:
        return
    if expand_into is None:
        pos = ctx = t2r = tok = visible  # unread: EXPAND is off
        num_requests, tok_stride, ratio, token_topk = 0, 0, 1, 0
    else:
        pos, ctx, t2r, tok, ratio, token_topk = expand_into
        num_requests, tok_stride = ctx.shape[0], tok.stride(0)
    problem = SelectionProblem(tokens, logits.shape[1], block_topk, ratio, token_topk, expand_into is not None,
                               num_requests)
    plan = SPEC.plan(problem, Platform.of(logits.device), config=cfg)
    candidates = torch.empty((tokens, capacity(block_topk, plan.config)), dtype=torch.int32, device=logits.device)
    plan.launch(logits, visible, out, candidates, pos, ctx, t2r, tok, logits.stride(0), out.stride(0),
                candidates.stride(0), num_requests, tok_stride, logits.shape[1])

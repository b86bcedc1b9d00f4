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

**Long rows through column-block maxima** (``MAXIMA_BLOCK > 0``: few rows of at least ``MAXIMA_MIN_COLUMNS``, where
one program per row reads at the bandwidth of one multiprocessor): ``maxima.launch`` first writes each row's
column-block maxima with several programs per row, and steps 1-2 become ``block_candidates``: the floor is the top
16 bits of the K-th largest block maximum (at least ``FLOOR_BLOCKS * K`` blocks), and only the blocks whose maximum
reaches it are read. Shorter rows of the same launch take steps 1-2 as above.

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
from . import expand, maxima
from .problem import SelectionProblem, example_inputs


#: Rows with at least this many times K column blocks take their floor from the block maxima (fewer blocks would let
#: too many reach it); shorter rows use the lane maxima.
FLOOR_BLOCKS = tl.constexpr(2)


@triton.jit
def order_key(scores):
    """fp32 -> uint32 whose unsigned order is the float order (-inf lowest; -0.0 keyed as +0.0, they compare equal)
    with every NaN, whatever its sign and payload, one key above +inf's (NaN ranks first, ties by index, as in
    ``torch.sort``): the native top-k's ``f2key``, and the key the scorers' histogram bins
    (``scoring/histogram.py``). Five operations, one fewer than a sign-bit map with a ``-0.0`` test."""
    bits = scores.to(tl.uint32, bitcast=True)
    magnitude = tl.minimum(bits & 0x7FFFFFFF, 0x7F800001)  # every NaN alike, just above +inf
    # ``scores < 0`` is false for NaN and -0.0: both take the non-negative map (magnitude | sign bit).
    return magnitude ^ tl.where(scores < 0.0, 0x7FFFFFFF, 0x80000000).to(tl.uint32)


@triton.jit
def _key_to_float(key):
    """The float whose order key is ``key`` (``-inf`` for keys at or below that of ``-inf``, which would decode to
    NaN), so that ``x >= _key_to_float(key)`` is ``order_key(x) >= key`` for every non-NaN ``x``."""
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
            keys = order_key(tl.load(src + cols, mask=cols < n, other=0.0))
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
    keys = order_key(tl.load(src + cols, mask=valid, other=0.0))
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
        keys = order_key(tl.load(src + cols, mask=cols < n, other=0.0))
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
    return _key_to_float(_kth_key(order_key(lane_max), lanes < n, k, 4)[0])


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
        # not (x < floor): a NaN (ranked above +inf) is kept too, at no cost (one unordered compare).
        kept = _append_in_order(buf_row, cols, ((cols < n) & ~(x < floor)).to(tl.int32), kept, CAPACITY)
    return kept


@triton.jit
def _append_in_order(buf_row, cols, keep, kept, CAPACITY: tl.constexpr):
    """Append the ``cols`` ``[groups, width]`` (ascending in row-major order) where ``keep`` (int32 0/1) to
    ``buf_row`` after its ``kept`` entries, in that order, dropping those past ``CAPACITY``; returns the new count.
    Slots come from a prefix sum over the groups plus one within each group (held in one thread's registers)."""
    per_group = tl.sum(keep, axis=1)
    group_first = kept + tl.cumsum(per_group, axis=0) - per_group
    slot = group_first[:, None] + tl.cumsum(keep, axis=1) - keep
    tl.store(buf_row + slot, cols, mask=(keep > 0) & (slot < CAPACITY))
    return kept + tl.sum(per_group, axis=0)


@triton.jit
def block_candidates(src, n, max_row, buf_row, k, B: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                     CAPACITY: tl.constexpr, GATHER: tl.constexpr):
    """The candidates of a row from its column-block maxima (``maxima.py``; ``B`` columns a block, at least ``k``
    blocks): the floor is the top 16 bits of the ``k``-th largest maximum; the blocks whose
    maximum reaches it are listed (in ``buf_row[CAPACITY:]``) and only they are read, ``GATHER`` blocks a step, their
    columns at or above the floor written in column order to ``buf_row[0:CAPACITY]``. Returns how many there are
    (more than ``CAPACITY``: too many to hold; the caller selects over the whole row)."""
    b = tl.arange(0, MAX_BLOCKS)
    blocks = tl.cdiv(n, B)
    maxima = tl.load(max_row + b, mask=b < blocks, other=float("-inf"))
    floor = _key_to_float(_kth_key(order_key(maxima), b < blocks, k, 4)[0])
    reach = ((b < blocks) & ~(maxima < floor)).to(tl.int32)  # a NaN maximum (a NaN in the block) reaches
    reaching = tl.sum(reach, axis=0)
    slot = tl.cumsum(reach, axis=0) - reach
    # A reaching block holds at least one candidate: more blocks than the capacity means too many candidates.
    block_list = buf_row + CAPACITY
    tl.store(block_list + slot, b, mask=(reach > 0) & (slot < CAPACITY))
    tl.debug_barrier()  # the list is read back by other threads
    kept = tl.zeros((), tl.int32)
    if reaching > CAPACITY:
        kept = reaching
    else:
        step = tl.arange(0, GATHER)
        within = tl.arange(0, B)
        for start in range(0, reaching, GATHER):
            listed = start + step < reaching
            blk = tl.load(block_list + start + step, mask=listed, other=0)
            cols = blk[:, None] * B + within[None, :]
            x = tl.load(src + cols, mask=listed[:, None] & (cols < n), other=float("-inf"))
            keep = (listed[:, None] & (cols < n) & ~(x < floor)).to(tl.int32)
            kept = _append_in_order(buf_row, cols, keep, kept, CAPACITY)
    return kept


@triton.jit(do_not_specialize=["num_columns"])
def _block_topk_kernel(
    logits_ptr, vis_ptr, out_ptr, buf_ptr, max_ptr, pos_ptr, ctx_ptr, t2r_ptr, tok_ptr,
    logits_stride, out_stride, buf_stride, max_stride, num_requests, tok_stride, num_columns,
    K: tl.constexpr, BLOCK_K: tl.constexpr, CAPACITY: tl.constexpr, TILE: tl.constexpr, SCAN: tl.constexpr,
    CHUNK: tl.constexpr, PAST_END_OK: tl.constexpr,
    MAXIMA_BLOCK: tl.constexpr, MAX_BLOCKS: tl.constexpr, GATHER: tl.constexpr,
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
            buf_row = buf_ptr + row.to(tl.int64) * buf_stride
            if (MAXIMA_BLOCK > 0) and (n >= FLOOR_BLOCKS * K * MAXIMA_BLOCK):
                # 1-2 from the column-block maxima: only the blocks reaching their floor are read.
                kept = block_candidates(src, n, max_ptr + row.to(tl.int64) * max_stride, buf_row, K, MAXIMA_BLOCK,
                                        MAX_BLOCKS, CAPACITY, GATHER)
            else:
                n_vec = vector_end(n, PAST_END_OK)
                # 1. The floor: top 16 bits of the K-th largest of the lane maxima (at least K columns reach it).
                floor = lane_floor(lane_maxima(src, n, n_vec, CAPACITY, TILE), n, K, CAPACITY)
                # 2. The columns at or above the floor, in column order, into the row's candidate buffer.
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
    gather: int = 2048  # columns per step of the reaching-block reads (with maxima)
    num_warps: int = 8

    def __post_init__(self):
        if self.capacity_factor < 2:
            raise ValueError(f"capacity_factor must be >= 2 (the lanes must outnumber K); got {self.capacity_factor}")
        for name in ("tile", "scan", "chunk", "gather"):
            if not is_pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two; got {getattr(self, name)}")


#: From this many rows per multiprocessor (prefill batches) programs of 4 warps, not 8: there the rows fill the GPU
#: many times over and 4 warps measured faster on the H200 (docs/selection.md).
FEW_WARPS_ROWS_PER_MULTIPROCESSOR = 4


def warps_for(rows: int, platform: Platform) -> int:
    """Warps per program of a launch over ``rows`` rows: 8 (one row's chain of radix steps runs fastest), 4 once the
    rows are many times the multiprocessors."""
    if platform.multiprocessors and rows >= FEW_WARPS_ROWS_PER_MULTIPROCESSOR * platform.multiprocessors:
        return 4
    return TopkConfig.num_warps


def capacity(block_topk: int, cfg: TopkConfig) -> int:
    """Lanes of the maxima pass and candidates held in registers for ``block_topk`` groups per row."""
    return max(16, next_pow2(cfg.capacity_factor * block_topk))


def constexprs(block_topk: int, cfg: TopkConfig, expansion: dict | None = None, columns: int = 0,
               with_maxima: bool = False) -> dict:
    """The kernel's specialisation for ``block_topk`` groups per row under ``cfg``, for logits ``columns`` wide;
    ``expansion`` (``expand.constexprs``) fuses the expansion into the kernel; ``with_maxima``: the launch passes
    the rows' column-block maxima (``maxima.py``)."""
    cap = capacity(block_topk, cfg)
    fused = expansion or dict(RATIO=1, BLOCK_R=1, WIDTH=1, BLOCK_W=1)
    block = maxima.maxima_block(columns, block_topk) if with_maxima else 0
    return dict(K=block_topk, BLOCK_K=next_pow2(block_topk), CAPACITY=cap, TILE=max(cfg.tile, cap), SCAN=cfg.scan,
                CHUNK=cfg.chunk, PAST_END_OK=columns % 4 == 0, MAXIMA_BLOCK=block,
                MAX_BLOCKS=maxima.register_blocks(columns, block_topk) if with_maxima else 1,
                GATHER=max(1, cfg.gather // block) if with_maxima else 1, EXPAND=expansion is not None,
                RATIO=fused["RATIO"], BLOCK_R=fused["BLOCK_R"], WIDTH=fused["WIDTH"], BLOCK_W=fused["BLOCK_W"])


def buffer_width(block_topk: int, cfg: TopkConfig, with_maxima: bool) -> int:
    """Per-row scratch of a launch: the candidates, and with maxima the list of reaching blocks after them."""
    return capacity(block_topk, cfg) * (2 if with_maxima else 1)


class TopkSpec(KernelSpec):
    name = "topk"
    family = "selection"
    description = "block top-k, one program per row (lane-maxima floor, candidates, exact radix select)"
    fn = _block_topk_kernel
    Config = TopkConfig

    def default_config(self, problem, platform) -> TopkConfig:
        return TopkConfig(num_warps=warps_for(problem.rows, platform))

    def constexprs(self, problem: SelectionProblem, platform, cfg: TopkConfig) -> dict:
        fused = (expand.constexprs(problem.compress_ratio, problem.block_topk, problem.token_topk)
                 if problem.fused else None)
        return constexprs(problem.block_topk, cfg, fused, problem.columns, problem.with_maxima)

    def grid(self, problem: SelectionProblem, platform, cfg) -> tuple[int]:
        return (problem.rows,)

    def example_args(self, problem: SelectionProblem, index_dtype, device) -> tuple:
        x = example_inputs(problem, index_dtype, device)
        buf = torch.empty((problem.rows, buffer_width(problem.block_topk, TopkConfig(), problem.with_maxima)),
                          dtype=torch.int32, device=device)
        block_max = (torch.empty(maxima.maxima_shape(problem.rows, problem.columns, problem.block_topk),
                                 dtype=torch.float32, device=device) if problem.with_maxima else x.logits)
        if not problem.fused:  # unread: EXPAND is off
            return (x.logits, x.visible, x.groups, buf, block_max, x.visible, x.visible, x.visible, x.visible,
                    x.logits.stride(0), x.groups.stride(0), buf.stride(0), block_max.stride(0), 0, 0,
                    x.logits.shape[1])
        return (x.logits, x.visible, x.groups, buf, block_max, x.positions, x.contexts, x.t2r, x.tokens,
                x.logits.stride(0), x.groups.stride(0), buf.stride(0), block_max.stride(0), problem.num_requests,
                x.tokens.stride(0), x.logits.shape[1])

    def warm_problems(self, context):
        yield "topk", context.selection_problem(2, fused=False)
        yield "topk, long rows", context.selection_problem(2, fused=False, with_maxima=True)
        for requests in context.request_counts:  # as the selection op launches it: the expansion fused
            yield f"topk+expand {requests} requests", context.selection_problem(requests, fused=True)
            yield (f"topk+expand {requests} requests, long rows",
                   context.selection_problem(requests, fused=True, with_maxima=True))
        # A prefill batch: rows enough for programs of fewer warps (``warps_for``; none without a multiprocessor count).
        prefill_rows = FEW_WARPS_ROWS_PER_MULTIPROCESSOR * (context.platform.multiprocessors or 0)
        for requests in context.request_counts if prefill_rows else ():
            yield (f"topk+expand {requests} requests, {prefill_rows} prefill rows",
                   context.selection_problem(requests, fused=True, rows=prefill_rows))


SPEC = TopkSpec()


#: Logits at least this wide take the column-block maxima (``maxima.py``) when their rows leave multiprocessors idle.
MAXIMA_MIN_COLUMNS = 65536


def maxima_reason(rows: int, columns: int, platform: Platform) -> str | None:
    """Why the top-k of ``rows`` rows of logits ``columns`` wide reads each row itself (one program per row: the lane
    maxima, then the candidate pass) instead of first computing the rows' column-block maxima with several programs
    per row (``maxima.launch``) and reading only the blocks that reach the floor; None when it takes the maxima.
    The maxima pay for their extra launch only on rows long enough that one program's two passes dominate
    (docs/selection.md)."""
    if columns < MAXIMA_MIN_COLUMNS:
        return f"rows of {columns} columns are read by their own program (block maxima from {MAXIMA_MIN_COLUMNS})"
    if platform.multiprocessors and rows > platform.multiprocessors:
        return f"{rows} rows already give each of the {platform.multiprocessors} multiprocessors a program"
    return None


def launch(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int,
           cfg: TopkConfig | None = None, expand_into: tuple | None = None,
           block_maxima: torch.Tensor | None = None) -> None:
    """Fill ``out`` (int32 ``[tokens, block_topk]``, last dim contiguous) from fp32 ``logits`` ``[tokens, columns]``
    (last dim contiguous) and int32 ``visible`` ``[tokens]`` (read clamped to ``[0, columns]``).

    ``block_maxima``: the rows' column-block maxima (fp32 ``maxima.maxima_shape(tokens, columns, block_topk)``, from
    ``maxima.launch`` on these logits and visible counts): long rows then read only the blocks that reach their
    floor. Without them, the launch computes them first where ``maxima_reason`` gives no reason not to.

    ``expand_into = (query_positions, context_lens, token_to_request, tokens_out, compress_ratio, token_topk)`` also
    writes each row's token indices (``qsa_expand_block_indices`` of ``out``) into ``tokens_out`` (int32
    ``[tokens, token_topk + R - 1]``, last dim contiguous) in the same launch."""
    tokens, columns = logits.shape
    if tokens == 0:
        return
    platform = Platform.of(logits.device)
    maxima_plan = None
    if block_maxima is None and maxima_reason(tokens, columns, platform) is None:
        maxima_plan = maxima.plan_for(logits, block_topk)
    with_maxima = block_maxima is not None or maxima_plan is not None
    ratio, token_topk, num_requests = (1, 0, 0) if expand_into is None else (expand_into[4], expand_into[5],
                                                                              expand_into[1].shape[0])
    problem = SelectionProblem(tokens, columns, block_topk, ratio, token_topk, expand_into is not None, num_requests,
                               with_maxima)
    plan = SPEC.plan(problem, platform, config=cfg)
    candidates = torch.empty((tokens, buffer_width(block_topk, plan.config, with_maxima)), dtype=torch.int32,
                             device=logits.device)
    if expand_into is None:
        pos = ctx = t2r = tok = visible  # unread: EXPAND is off
        tok_stride = 0
    else:
        pos, ctx, t2r, tok, _, _ = expand_into
        tok_stride = tok.stride(0)
    if maxima_plan is not None:
        block_maxima = torch.empty(maxima.maxima_shape(tokens, columns, block_topk), dtype=torch.float32,
                                   device=logits.device)
        maxima_plan.launch(*maxima.kernel_args(logits, visible, block_maxima))
    block_max = block_maxima if block_maxima is not None else logits  # unread without maxima
    plan.launch(logits, visible, out, candidates, block_max, pos, ctx, t2r, tok, logits.stride(0), out.stride(0),
                candidates.stride(0), block_max.stride(0), num_requests, tok_stride, columns)


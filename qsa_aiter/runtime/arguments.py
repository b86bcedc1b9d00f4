"""Argument checks of the public ops (``ValueError``/``TypeError`` naming the op, the argument, what was expected and
what came), and the validation of a scoring call into its ``ScoreProblem``.

Nothing here reads device memory: every fact comes from shapes, dtypes, devices and the caller's host-side hints,
so the ops stay capturable in a CUDA graph.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..kernels.quant.formats import FP4_BLOCK, cache_kind, cache_width, scale_layout, view_strides
from ..kernels.scoring.problem import MAX_CONTEXT_TOKENS, MAX_DECODE_ROWS, PHASES, ScoreProblem, infer_phase
from ..kernels.selection.problem import MAX_BLOCK_TOPK, MAX_TOKEN_SLOTS

_INDEX_DTYPES = (torch.int32, torch.int64)
_CACHE_DTYPE_TEXT = "bf16, fp16 (like q), float8_e4m3fn, float8_e4m3fnuz or float4_e2m1fn_x2"


def fail_argument(kind: type[Exception], name: str, expected: str, got: object,
                  op: str = "qsa_paged_mqa_logits") -> None:
    """Raise ``kind`` naming the op, the argument, what was expected and what came."""
    raise kind(f"{op}: `{name}` must be {expected}; got {got}")


_fail = fail_argument


def check_tensor(name, t, *, ndim, dtypes, device=None, contiguous=False, op="qsa_paged_mqa_logits",
                 like="q") -> None:
    """``t`` must be a tensor of ``ndim`` dims, one of ``dtypes``, on ``device`` (if given, the device of the
    argument ``like``), contiguous (if asked)."""
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, "a torch.Tensor", type(t).__name__, op)
    if t.dim() != ndim:
        _fail(ValueError, name, f"{ndim}-D", f"shape {tuple(t.shape)}", op)
    if t.dtype not in dtypes:
        _fail(TypeError, name, "one of " + ", ".join(str(d).removeprefix("torch.") for d in dtypes), t.dtype, op)
    if device is not None and t.device != device:
        _fail(ValueError, name, f"on {device} like `{like}`", t.device, op)
    if contiguous and not t.is_contiguous():
        _fail(ValueError, name, "contiguous", f"strides {t.stride()}", op)


def check_int(name, value, *, minimum, maximum=None, op="qsa_paged_mqa_logits") -> int:
    """``value`` must be an int (not a bool) in ``[minimum, maximum]``; returns it as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(TypeError, name, "an int", type(value).__name__, op)
    value = int(value)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        _fail(ValueError, name, bound, value, op)
    return value



def index_cache_strides(cache, op: str = "qsa_paged_mqa_logits",
                        name: str = "compressed_k_cache") -> tuple[int, int] | None:
    """The ``(page stride, slot stride)`` of an index cache ``[pages, page_size, 1, width]`` that is a strided view
    of a larger buffer (an engine keeps the index keys inside a wider cache tensor and passes ``buffer[..., :width]``),
    in elements; None when it is laid out densely. Its last dim must be dense (stride 1, the packed bytes of MXFP4):
    the kernels read each key as one run of bytes. Pages and slots may lie any distance apart, as long as no two
    keys overlap (a view that repeats keys, such as an expanded one, is refused: the writer would race on it)."""
    pages, page_size, _, width = cache.shape
    if width > 1 and cache.stride(3) != 1:
        fail_argument(ValueError, name, "dense along its last dim (stride 1; a view of a larger buffer may have any "
                      "page and slot strides)", f"strides {cache.stride()}", op)
    strides = view_strides(cache)
    if strides is None:
        return None
    page, slot = strides
    inner, outer = sorted(((slot, page_size), (page, pages)))
    # Non-overlapping keys: the shorter step clears a key's width, the longer one clears the shorter one's whole run.
    if (inner[1] > 1 and inner[0] < width) or (outer[1] > 1 and outer[0] < max(width, inner[0] * inner[1])):
        fail_argument(ValueError, name, "a view whose keys do not overlap", f"strides {cache.stride()} of shape "
                      f"{tuple(cache.shape)}", op)
    return page, slot


def _check_k_scale(k_scale, kv: str, num_pages: int, page_size: int, head_dim: int, device, op: str) -> int:
    """The scale tensor must match the cache (docs/cache_formats.md). Returns its size in bytes."""
    layout = scale_layout(kv, num_pages, page_size, head_dim)
    if layout is None:
        if k_scale is not None:
            _fail(ValueError, "k_scale", "None for a 16-bit index cache", type(k_scale).__name__, op)
        return 0
    if k_scale is None:
        _fail(ValueError, "k_scale", f"the scale tensor of the {kv} index cache", None, op)
    shape, dtype = layout
    check_tensor("k_scale", k_scale, ndim=len(shape), dtypes=(dtype,), device=device, contiguous=True, op=op)
    if tuple(k_scale.shape) != shape:
        _fail(ValueError, "k_scale", f"shape {shape} to match compressed_k_cache", tuple(k_scale.shape), op)
    return k_scale.numel() * k_scale.element_size()


def validate_scoring_call(
    q,
    compressed_k_cache,
    page_table,
    token_to_request,
    query_positions,
    context_lens,
    compress_ratio,
    score_divisor,
    max_columns,
    row_starts,
    k_scale,
    out,
    phase,
    max_query_len,
    stacked_enabled: bool,
    e4m3_mma: bool = True,
    op: str = "qsa_paged_mqa_logits",
) -> tuple[ScoreProblem, float]:
    """Check every argument; return the problem description and the score divisor. Raises before anything is written;
    an error starts with ``op``, the public op called (the selection op and ``explain`` validate through here)."""

    def _fail(kind: type[Exception], name: str, expected: str, got: object) -> None:  # names the op called
        fail_argument(kind, name, expected, got, op)

    check_tensor("q", q, ndim=3, dtypes=(torch.bfloat16, torch.float16), contiguous=True, op=op)
    device = q.device
    tokens, heads, head_dim = q.shape
    if heads < 1 or head_dim < 1:
        _fail(ValueError, "q", "[tokens, heads >= 1, head_dim >= 1]", tuple(q.shape))
    cache = compressed_k_cache
    if not isinstance(cache, torch.Tensor):
        _fail(TypeError, "compressed_k_cache", "a torch.Tensor", type(cache).__name__)
    try:
        kv = cache_kind(cache)  # the registry axis: "bf16" covers both 16-bit caches, "fp8" both e4m3 flavours
    except TypeError:
        _fail(TypeError, "compressed_k_cache", _CACHE_DTYPE_TEXT, cache.dtype)
    check_tensor("compressed_k_cache", cache, ndim=4, dtypes=(q.dtype,) if kv == "bf16" else (cache.dtype,),
                  device=device, op=op)
    num_pages, block_size, kv_heads, cache_dim = cache.shape
    stored_dim = cache_width(kv, head_dim)
    if kv == "fp4" and head_dim % FP4_BLOCK:
        _fail(ValueError, "q", f"head_dim divisible by {FP4_BLOCK} for an MXFP4 cache", head_dim)
    if kv_heads != 1 or cache_dim != stored_dim:
        _fail(ValueError, "compressed_k_cache", f"[pages, page_size, 1, {stored_dim}]", tuple(cache.shape))
    if num_pages < 1 or block_size < 1:
        _fail(ValueError, "compressed_k_cache", "at least one page of at least one slot", tuple(cache.shape))
    key_strides = index_cache_strides(cache, op)
    scale_bytes = _check_k_scale(k_scale, kv, num_pages, block_size, head_dim, device, op)
    check_tensor("page_table", page_table, ndim=2, dtypes=_INDEX_DTYPES, device=device, op=op)
    if page_table.shape[1] > 0 and page_table.stride(1) != 1:
        _fail(ValueError, "page_table", "contiguous along its last dim", f"strides {page_table.stride()}")
    requests, width = page_table.shape
    for name, t in (("token_to_request", token_to_request), ("query_positions", query_positions),
                    ("context_lens", context_lens)):
        check_tensor(name, t, ndim=1, dtypes=_INDEX_DTYPES, device=device, contiguous=True, op=op)
    if token_to_request.numel() != tokens:
        _fail(ValueError, "token_to_request", f"length {tokens} (q's tokens)", token_to_request.numel())
    if query_positions.numel() != tokens:
        _fail(ValueError, "query_positions", f"length {tokens} (q's tokens)", query_positions.numel())
    if context_lens.numel() != requests:
        _fail(ValueError, "context_lens", f"length {requests} (page_table rows)", context_lens.numel())
    ratio = check_int("compress_ratio", compress_ratio, minimum=1, op=op)
    if score_divisor is None:
        divisor = math.sqrt(head_dim)
    else:
        if isinstance(score_divisor, bool) or not isinstance(score_divisor, numbers.Real):
            _fail(TypeError, "score_divisor", "a positive real number or None", type(score_divisor).__name__)
        divisor = float(score_divisor)
        if not (math.isfinite(divisor) and divisor > 0):
            _fail(ValueError, "score_divisor", "finite and > 0", score_divisor)
    capacity = width * block_size
    num_columns = (capacity if max_columns is None
                   else check_int("max_columns", max_columns, minimum=0, maximum=capacity, op=op))
    if num_columns * ratio > MAX_CONTEXT_TOKENS:
        _fail(ValueError, "page_table" if max_columns is None else "max_columns",
              f"at most {MAX_CONTEXT_TOKENS} tokens of columns (columns x compress_ratio {ratio})",
              f"{num_columns} columns")
    if row_starts is not None:
        check_tensor("row_starts", row_starts, ndim=1, dtypes=_INDEX_DTYPES, device=device, op=op)
        if row_starts.numel() != tokens:
            _fail(ValueError, "row_starts", f"length {tokens} (q's tokens)", row_starts.numel())
    if out is not None:
        check_tensor("out", out, ndim=2, dtypes=(torch.float32,), device=device, op=op)
        if tuple(out.shape) != (tokens, num_columns):
            _fail(ValueError, "out", f"shape ({tokens}, {num_columns})", tuple(out.shape))
        if num_columns > 0 and tokens > 0 and out.stride(1) != 1:
            _fail(ValueError, "out", "contiguous along its last dim", f"strides {out.stride()}")
        if tokens > 1 and num_columns > 0 and out.stride(0) < num_columns:
            _fail(ValueError, "out", f"rows that do not overlap (row stride >= {num_columns})",
                  f"strides {out.stride()}")
    max_query_len = check_max_query_len(max_query_len, tokens, op)
    if phase is None:
        phase_name, why = infer_phase(tokens, requests, max_query_len, stacked_enabled)
        source = "inferred: " + why
    else:
        phase_name, source = check_phase(phase, tokens, max_query_len, op), "hint"
    problem = ScoreProblem(
        device_type=device.type,
        q_dtype=q.dtype,
        kv_dtype=kv,
        cache_dtype=cache.dtype,
        block_size=block_size,
        num_tokens=tokens,
        num_heads=heads,
        head_dim=head_dim,
        num_requests=requests,
        table_width=width,
        num_pages=num_pages,
        num_columns=num_columns,
        compress_ratio=ratio,
        phase=phase_name,
        phase_source=source,
        max_query_len=max_query_len,
        cache_bytes=cache.numel() * cache.element_size() + scale_bytes,
        e4m3_mma=e4m3_mma,
        # One integer load per key's exponents needs the scale tensor aligned to them (a view may not be).
        scale_aligned=k_scale is None or kv != "fp4" or k_scale.data_ptr() % max(1, head_dim // 32) == 0,
        key_strides=key_strides,
    )
    return problem, divisor


def check_max_query_len(max_query_len, tokens: int, op: str) -> int | None:
    """The ``max_query_len`` hint (None, or an int in ``[1, tokens]``: no request has more rows than the call; a call
    of no rows takes 1)."""
    if max_query_len is None:
        return None
    value = check_int("max_query_len", max_query_len, minimum=1, op=op)
    if value > max(tokens, 1):
        fail_argument(ValueError, "max_query_len", f"in [1, {max(tokens, 1)}] (no request has more rows than q's "
                      f"{tokens})", value, op)
    return value


#: The phases of one row per request (draft, decode), and those of at most ``MAX_DECODE_ROWS`` rows (verify, draft).
_ONE_ROW_PHASES = ("draft", "decode")
_FEW_ROWS_PHASES = ("verify", "draft")


def check_phase(phase, tokens: int, max_query_len: int | None, op: str) -> str:
    """The ``phase`` hint, checked against the host-side facts its shape rule can be held to:
    ``verify`` and ``draft`` take at most ``MAX_DECODE_ROWS`` rows, ``draft`` and ``decode`` one row per request
    (checked where ``max_query_len`` says how many; padded rows make the row count alone no proof)."""
    if not isinstance(phase, str) or phase not in PHASES:
        fail_argument(ValueError, "phase", "None or one of " + ", ".join(PHASES), repr(phase), op)
    if phase in _FEW_ROWS_PHASES and tokens > MAX_DECODE_ROWS:
        fail_argument(ValueError, "phase", f"prefill or decode for {tokens} rows (verify and draft take at most "
                      f"{MAX_DECODE_ROWS})", repr(phase), op)
    if phase in _ONE_ROW_PHASES and max_query_len is not None and max_query_len > 1:
        fail_argument(ValueError, "phase", f"prefill or verify with max_query_len={max_query_len} (draft and decode "
                      "have one row per request)", repr(phase), op)
    return phase


def check_topk_budget(op: str, compress_ratio, token_topk) -> tuple[int, int]:
    """``(R, token_topk)`` of a selection or expansion call: integers >= 1, ``token_topk`` a multiple of ``R``, at most
    ``MAX_BLOCK_TOPK`` groups (``token_topk // R``) and ``MAX_TOKEN_SLOTS`` token slots (``token_topk + R - 1``) per
    row: what the kernels hold (``kernels/selection/problem.py``)."""
    ratio = check_int("compress_ratio", compress_ratio, minimum=1, op=op)
    topk = check_int("token_topk", token_topk, minimum=1, op=op)
    if topk % ratio:
        fail_argument(ValueError, "token_topk", f"a multiple of compress_ratio ({ratio})", topk, op)
    if topk // ratio > MAX_BLOCK_TOPK:
        fail_argument(ValueError, "token_topk", f"at most {MAX_BLOCK_TOPK * ratio} (token_topk // compress_ratio "
                      f"groups kept per row, at most {MAX_BLOCK_TOPK})", topk, op)
    if topk + ratio - 1 > MAX_TOKEN_SLOTS:
        fail_argument(ValueError, "token_topk", f"at most {MAX_TOKEN_SLOTS - ratio + 1} (token_topk + compress_ratio "
                      f"- 1 token slots per row, at most {MAX_TOKEN_SLOTS})", topk, op)
    return ratio, topk


def check_topk_args(op: str, logits, visible, block_topk) -> int:
    """Validate a block top-k call's inputs (fp32 ``logits [tokens, columns]``, last dim contiguous; int32
    ``visible [tokens]`` on its device; ``block_topk`` in ``[1, MAX_BLOCK_TOPK]``, what the kernels hold) and return
    ``block_topk``."""
    check_tensor("logits", logits, ndim=2, dtypes=(torch.float32,), op=op)
    if logits.stride(-1) != 1:
        fail_argument(ValueError, "logits", "contiguous in its last dimension", f"strides {logits.stride()}", op)
    check_tensor("visible", visible, ndim=1, dtypes=(torch.int32,), device=logits.device, op=op, like="logits")
    if visible.shape[0] != logits.shape[0]:
        fail_argument(ValueError, "visible", f"length {logits.shape[0]} like logits' rows", visible.shape[0], op)
    return check_int("block_topk", block_topk, minimum=1, maximum=MAX_BLOCK_TOPK, op=op)


def check_index_out(op: str, out, shape: tuple[int, ...], device, like: str) -> torch.Tensor:
    """``out`` must be int32 of ``shape`` on ``device`` with a contiguous last dim; None allocates one."""
    if out is None:
        return torch.empty(shape, dtype=torch.int32, device=device)
    check_tensor("out", out, ndim=len(shape), dtypes=(torch.int32,), device=device, op=op, like=like)
    if tuple(out.shape) != shape:
        fail_argument(ValueError, "out", f"shape {shape}", tuple(out.shape), op)
    if out.stride(-1) != 1:
        fail_argument(ValueError, "out", "contiguous in its last dimension", f"strides {out.stride()}", op)
    return out

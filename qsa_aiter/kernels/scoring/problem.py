"""``ScoreProblem``: the host-side description of a scoring call that dispatch decides from, and the phase rule.

Nothing here reads device memory: every fact comes from shapes, dtypes, devices and the caller's host-side hints,
so the op stays capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PHASES = ("prefill", "verify", "draft", "decode")
#: Above this many query rows a call without a phase hint is treated as prefill (README, kernels and when each runs).
MAX_DECODE_ROWS = 256
#: The most tokens of context a call's columns may stand for (``num_columns * R``): the kernels clamp positions and
#: context lengths to 32 bits, which changes no visible count only below it.
MAX_CONTEXT_TOKENS = 2**31 - 1


@dataclass(frozen=True)
class ScoreProblem:
    """Everything dispatch may know about a call, all from host-side facts."""

    device_type: str
    q_dtype: torch.dtype
    kv_dtype: str  # registry axis: "bf16" (bf16 and fp16 caches), "fp8" (e4m3fn, e4m3fnuz) or "fp4" (MXFP4)
    cache_dtype: torch.dtype
    block_size: int  # compressed groups per page
    num_tokens: int
    num_heads: int
    head_dim: int
    num_requests: int
    table_width: int
    num_pages: int
    num_columns: int
    compress_ratio: int
    phase: str
    phase_source: str  # "hint" or "inferred: <why>"
    max_query_len: int | None
    cache_bytes: int  # the cache plus its scale tensor
    e4m3_mma: bool = True  # QSA_AITER_E4M3_MMA as read for the call: e4m3 tensor cores may score e4m3fn/MXFP4 keys
    scale_aligned: bool = True  # an MXFP4 scale tensor's address is a multiple of a key's exponent bytes
    histogram: bool = False  # the Triton scorers also count the stored scores per row (scoring/histogram.py)
    #: ``(page stride, slot stride)`` in elements of the cache's kernel view when the cache is a strided view of a
    #: larger buffer (pages or slots further apart than a dense cache's), None when it is laid out densely.
    key_strides: tuple[int, int] | None = None

    def summary(self) -> str:
        return (
            f"kv={self.kv_dtype}({str(self.cache_dtype).removeprefix('torch.')}) page={self.block_size} "
            f"phase={self.phase} rows={self.num_tokens} heads={self.num_heads} head_dim={self.head_dim} "
            f"requests={self.num_requests} columns={self.num_columns} device={self.device_type}"
        )


def infer_phase(num_tokens: int, num_requests: int, max_query_len: int | None,
                stacked_enabled: bool) -> tuple[str, str]:
    """Phase from host-side facts (README, kernels and when each runs). Returns ``(phase, why)``."""
    if num_tokens > MAX_DECODE_ROWS:
        return "prefill", f"{num_tokens} rows > {MAX_DECODE_ROWS}"
    if max_query_len is not None:
        multi, why = max_query_len > 1, f"max_query_len={max_query_len}"
    else:
        multi, why = num_tokens > num_requests, f"{num_tokens} rows over {num_requests} requests"
    if multi:
        return "verify", why + " (several rows per request)"
    if stacked_enabled:
        return "draft", why + " (one row per request, stacked scorer on)"
    return "decode", why + " (one row per request, stacked scorer off)"

"""Public cache writer: ``qsa_write_index_cache`` quantises new index keys into a paged cache of any format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..kernels.quant.formats import FP4_BLOCK, cache_kind, scale_layout
from ..runtime import registries, replay
from ..runtime.arguments import fail_argument, index_cache_strides
from ..runtime.settings import get_settings
from .traced import through_custom_op


def _fail(kind: type[Exception], name: str, expected: str, got: object) -> None:
    fail_argument(kind, name, expected, got, op="qsa_write_index_cache")


@through_custom_op
def qsa_write_index_cache(keys: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor,
                          k_scale: torch.Tensor | None = None) -> None:
    """Write ``keys`` into ``cache`` at ``slot_mapping`` (``slot = page * page_size + offset``; ``-1`` skips).

    Args:
        keys: ``[tokens, 1, D]`` or ``[tokens, D]``, bf16/fp16/fp32, last dim contiguous.
        slot_mapping: ``[tokens]`` int32/int64. Slots outside ``[0, pages * page_size)`` write nothing; a slot named
            more than once takes the last of its keys (``cache.reference.last_writer_slots``'s rule).
        cache: ``[pages, P, 1, D]`` bf16/fp16/``float8_e4m3fn``/``float8_e4m3fnuz``, or ``[pages, P, 1, D // 2]``
            ``float4_e2m1fn_x2``; dense along its last dim, any page and slot strides (a view of a larger buffer,
            ``buffer[..., :width]``, is written in place; nothing else of the buffer is touched).
        k_scale: fp32 ``[pages, P]`` for fp8; ``float8_e8m0fnu`` ``[pages, P, 1, D // 32]`` for fp4; None otherwise.

    16-bit caches take the keys rounded to nearest-even (fp32 keys into a bf16 cache included). The Triton kernel
    runs on GPU tensors (and under ``TRITON_INTERPRET=1``); CPU tensors otherwise take the torch reference, which
    writes the same bytes.
    """
    settings = get_settings()  # a bad variable is a ConfigurationError on every path, raised before any work
    replay.cached_call("qsa_write_index_cache", settings, (keys, slot_mapping, cache, k_scale), (),
                       lambda: (None, _write_validated(keys, slot_mapping, cache, k_scale, settings)))


def _write_validated(keys, slot_mapping, cache, k_scale, settings):
    """Validate a ``qsa_write_index_cache`` call and write it through the ``WRITER`` registry; returns how to build
    the call's plan from its launches (None: nothing to replay)."""
    if not isinstance(keys, torch.Tensor):
        _fail(TypeError, "keys", "a torch.Tensor", type(keys).__name__)
    if keys.dim() == 3:
        if keys.shape[1] != 1:
            _fail(ValueError, "keys", "[tokens, 1, head_dim] or [tokens, head_dim]", tuple(keys.shape))
        keys = keys[:, 0]
    if keys.dim() != 2:
        _fail(ValueError, "keys", "[tokens, 1, head_dim] or [tokens, head_dim]", tuple(keys.shape))
    if keys.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        _fail(TypeError, "keys", "bf16, fp16 or fp32", keys.dtype)
    if keys.shape[1] > 0 and keys.stride(1) != 1:
        _fail(ValueError, "keys", "contiguous along head_dim", f"strides {keys.stride()}")
    if not isinstance(cache, torch.Tensor):
        _fail(TypeError, "cache", "a torch.Tensor", type(cache).__name__)
    try:
        kind = cache_kind(cache)
    except TypeError as err:
        _fail(TypeError, "cache", "an index cache", str(err))
    if cache.dim() != 4 or cache.shape[2] != 1:
        _fail(ValueError, "cache", "a [pages, page_size, 1, width] tensor", tuple(cache.shape))
    # A strided view of a larger buffer is written in place; its last dim must be dense, its keys apart.
    index_cache_strides(cache, op="qsa_write_index_cache", name="cache")
    if cache.device != keys.device:
        _fail(ValueError, "cache", f"on {keys.device} like `keys`", cache.device)
    head_dim = keys.shape[1]
    # The cache's layout fixes the format's head_dim: keys of another one are the argument at fault.
    cache_dim = cache.shape[3] * 2 if kind == "fp4" else cache.shape[3]
    if head_dim != cache_dim:
        _fail(ValueError, "keys", f"[tokens, 1, {cache_dim}] or [tokens, {cache_dim}] (the head_dim of the {kind} "
              f"cache {tuple(cache.shape)})", tuple(keys.shape))
    if kind == "fp4" and head_dim % FP4_BLOCK:
        _fail(ValueError, "cache", f"a head_dim divisible by {FP4_BLOCK} for an fp4 cache (last dim a multiple of "
              f"{FP4_BLOCK // 2})", tuple(cache.shape))
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail(TypeError, "slot_mapping", "an int32/int64 tensor", getattr(slot_mapping, "dtype", type(slot_mapping)))
    if slot_mapping.dim() != 1 or slot_mapping.numel() != keys.shape[0] or not slot_mapping.is_contiguous():
        _fail(ValueError, "slot_mapping", f"contiguous [{keys.shape[0]}]", tuple(slot_mapping.shape))
    if slot_mapping.device != keys.device:
        _fail(ValueError, "slot_mapping", f"on {keys.device} like `keys`", slot_mapping.device)
    pages, page_size = cache.shape[:2]
    want = scale_layout(kind, pages, page_size, head_dim)
    if want is None:
        if k_scale is not None:
            _fail(ValueError, "k_scale", "None for a 16-bit cache", type(k_scale).__name__)
    else:
        if not isinstance(k_scale, torch.Tensor):
            _fail(TypeError, "k_scale", f"a {want[1]} tensor of shape {want[0]} for a {kind} cache",
                  type(k_scale).__name__)
        if tuple(k_scale.shape) != want[0] or k_scale.dtype != want[1] or not k_scale.is_contiguous():
            _fail(ValueError, "k_scale", f"contiguous {want[1]} of shape {want[0]}",
                  f"{k_scale.dtype} {tuple(k_scale.shape)}")
        if k_scale.device != keys.device:
            _fail(ValueError, "k_scale", f"on {keys.device} like `keys`", k_scale.device)
    if keys.shape[0] == 0:
        return None
    addresses = [t.data_ptr() if t is not None else 0 for t in (keys, slot_mapping, cache, k_scale)]
    registries.WRITER.dispatch(registries.WriteProblem(keys.device.type, keys.shape[0], kind, head_dim),
                               registries.WriteArgs(keys, slot_mapping, cache, k_scale), settings)
    return lambda launches: WriterPlan.of(addresses, launches)


#: The writer kernel's pointer parameters, in the order a replay passes their addresses.
WRITER_POINTERS = ("keys_ptr", "slot_ptr", "cache_ptr", "scale_ptr")


@dataclass(frozen=True)
class WriterPlan:
    """A validated ``qsa_write_index_cache`` signature and its recorded launch."""

    launch: Callable  # the recorded launch, taking WRITER_POINTERS' addresses (DirectLaunch.taking)

    @classmethod
    def of(cls, addresses: list[int], launches: list) -> "WriterPlan | None":
        """The plan of a call with tensors at ``addresses`` (keys, slots, cache, scale or 0) that made ``launches``:
        None unless it was one writer launch whose pointer arguments are those tensors (a call longer than
        ``SCAN_MAX_TOKENS`` launches on a deduplicated copy of the slots: not replayable)."""
        from ..kernels.cache.writer import SPEC

        if len(launches) != 1 or [launches[0].arg(n).data_ptr() for n in WRITER_POINTERS] != _pointer_args(addresses):
            return None
        direct = replay.direct_launches(launches, (SPEC.name,))
        launch = direct[0].taking(*WRITER_POINTERS) if direct else None
        return None if launch is None else cls(launch)

    def replay(self, addresses: list[int], tensors) -> None:
        """The call: ``qsa_write_index_cache``'s tensors (keys, slot_mapping, cache, k_scale) at ``addresses``."""
        self.launch(*_pointer_args(addresses))


def _pointer_args(addresses: list[int]) -> list[int]:
    """The writer kernel's pointer arguments for a call's tensors at ``addresses``: the scale's stands in for the
    cache's when there is none."""
    keys_at, slots_at, cache_at, scale_at = addresses
    return [keys_at, slots_at, cache_at, scale_at or cache_at]

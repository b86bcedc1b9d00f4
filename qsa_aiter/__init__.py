"""qsa_aiter: GPU kernels for the QSA indexer (sparse-attention key-group scoring) of Qwen3.8-Flash-Next."""

from . import custom_ops  # noqa: F401  (registers the torch.ops.qsa_aiter custom ops)
from .cache.op import qsa_write_index_cache
from .quant.formats import allocate_index_cache, dequantize_cache
from .scoring.op import explain, qsa_paged_mqa_logits, selected_kernel
from .scoring.reference import reference_paged_mqa_logits
from .selection.ops import qsa_block_topk, qsa_expand_block_indices, qsa_select_paged_tokens
from .selection.reference import reference_block_topk, reference_expand_block_indices

__all__ = [
    "qsa_paged_mqa_logits", "explain", "selected_kernel", "reference_paged_mqa_logits",
    "qsa_write_index_cache", "allocate_index_cache", "dequantize_cache",
    "qsa_select_paged_tokens", "qsa_block_topk", "qsa_expand_block_indices",
    "reference_block_topk", "reference_expand_block_indices",
]
__version__ = "0.1.0"

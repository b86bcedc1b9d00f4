"""qsa_aiter: GPU kernels for the QSA indexer (sparse-attention key-group scoring) of Qwen3.8-Flash-Next.

The package is layered (docs/architecture.md): ``kernels`` (the kernels and their specs), ``runtime`` (the JIT
cache, tuned tables, dispatch and replay of cached calls), ``ops`` and ``integrations`` (the public ops, their
custom ops and the engine adapters), and ``tools`` (warm-up, AOT builds, tuner, benchmarks, fuzzer, demo, CLI),
each importing only from the layers below it. ``qsa_aiter.runtime.jit`` is the launch-time JIT cache (``jit.load()``).
"""

from .kernels.quant.formats import allocate_index_cache, dequantize_cache
from .kernels.scoring.reference import reference_paged_mqa_logits
from .kernels.selection.reference import reference_block_topk, reference_expand_block_indices
from .ops import custom_ops  # noqa: F401  (registers the torch.ops.qsa_aiter custom ops)
from .ops.cache import qsa_write_index_cache
from .ops.scoring import explain, qsa_paged_mqa_logits, selected_kernel
from .ops.selection import explain_selection, qsa_block_topk, qsa_expand_block_indices, qsa_select_paged_tokens
from .runtime import jit

__all__ = [
    "qsa_paged_mqa_logits", "explain", "selected_kernel", "reference_paged_mqa_logits",
    "qsa_write_index_cache", "allocate_index_cache", "dequantize_cache",
    "qsa_select_paged_tokens", "qsa_block_topk", "qsa_expand_block_indices", "explain_selection",
    "reference_block_topk", "reference_expand_block_indices", "jit",
]
__version__ = "0.1.0"

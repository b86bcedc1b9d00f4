"""The indexer ops as PyTorch custom ops (``torch.library``), so ``torch.compile`` and CUDA graphs see opaque calls.

Each public op is declared once, by its function's signature (``qsa_aiter.ops.scoring``, ``selection``, ``cache``);
``DECLARATIONS`` below adds what a signature cannot say (the arguments written in place besides ``out``, and the fake
implementation), and ``declarations.register`` generates the rest: the op, its ``_out`` variant, their calls into
the eager op and the wrapper of the same name here. Registered under the ``qsa_aiter`` namespace when this module is
imported (``import qsa_aiter`` imports it); the generated schemas (``Tensor(aN!)``: written in place; ``int`` becomes
``SymInt``; tests/ops/test_custom_ops.py asserts them):

    qsa_aiter::paged_mqa_logits(Tensor q, Tensor compressed_k_cache, Tensor page_table, Tensor token_to_request,
        Tensor query_positions, Tensor context_lens, SymInt compress_ratio, float? score_divisor,
        SymInt? max_columns, Tensor(a9!)? row_starts, Tensor? k_scale, str? phase, SymInt? max_query_len)
        -> (Tensor, Tensor)
    qsa_aiter::paged_mqa_logits_out(Tensor q, Tensor compressed_k_cache, Tensor page_table,
        Tensor token_to_request, Tensor query_positions, Tensor context_lens, SymInt compress_ratio,
        float? score_divisor, SymInt? max_columns, Tensor(a9!)? row_starts, Tensor? k_scale, str? phase,
        SymInt? max_query_len, Tensor(a13!) out) -> Tensor
    qsa_aiter::block_topk(Tensor logits, Tensor visible, SymInt block_topk) -> Tensor
    qsa_aiter::block_topk_out(Tensor logits, Tensor visible, SymInt block_topk, Tensor(a3!) out) -> ()
    qsa_aiter::expand_block_indices(Tensor block_indices, Tensor query_positions, Tensor context_lens,
        Tensor token_to_request, SymInt compress_ratio, SymInt token_topk) -> Tensor
    qsa_aiter::expand_block_indices_out(Tensor block_indices, Tensor query_positions, Tensor context_lens,
        Tensor token_to_request, SymInt compress_ratio, SymInt token_topk, Tensor(a6!) out) -> ()
    qsa_aiter::select_paged_tokens(Tensor q, Tensor compressed_k_cache, Tensor page_table,
        Tensor token_to_request, Tensor query_positions, Tensor context_lens, SymInt token_topk,
        SymInt compress_ratio, SymInt? logits_workspace_bytes, SymInt? max_seq_len, Tensor? k_scale, str? phase,
        SymInt? max_query_len) -> Tensor
    qsa_aiter::select_paged_tokens_out(Tensor q, Tensor compressed_k_cache, Tensor page_table,
        Tensor token_to_request, Tensor query_positions, Tensor context_lens, SymInt token_topk,
        SymInt compress_ratio, SymInt? logits_workspace_bytes, SymInt? max_seq_len, Tensor? k_scale, str? phase,
        SymInt? max_query_len, Tensor(a13!) out) -> ()
    qsa_aiter::write_index_cache(Tensor keys, Tensor slot_mapping, Tensor(a2!) cache, Tensor(a3!)? k_scale) -> ()

A custom op may not return one of its inputs, so every op that takes ``out=`` has an ``_out`` variant that declares
the mutation and returns the public results after ``out``. The functions here (``qsa_paged_mqa_logits``, ...) keep
the public signatures and pick the variant: code that ``torch.compile(fullgraph=True)`` traces calls these instead of
the eager functions, whose dispatch logic (registry, settings, logging) dynamo cannot trace (``traced.py`` makes the
plain public functions do so while traced).

Each op's fake (meta) implementation derives output shapes and dtypes from the arguments without reading tensor
data; where every shape is static it also runs the eager validation, so a bad argument fails at trace time with the
same ``ValueError``/``TypeError``.
"""

from __future__ import annotations

import torch

from ..runtime.arguments import check_int, check_topk_budget
from . import cache, scoring, selection
from .declarations import Call, OpDeclaration, register

NAMESPACE = "qsa_aiter"


def _static(call: Call) -> bool:
    """Whether every tensor argument's shape is concrete (no symbolic sizes): the eager validation can then run."""
    return all(not any(isinstance(s, torch.SymInt) for s in value.shape)
               for value in call.values() if isinstance(value, torch.Tensor))


# Fakes: ``fake(call)`` -> the public results as new tensors (``call``: the public call's arguments by name).


def _scoring_fake(call: Call) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits ``[tokens, num_columns]`` and int32 ``visible_groups`` ``[tokens]``."""
    if _static(call):
        columns = scoring.describe_call(**call).num_columns
    elif call["max_columns"] is None:
        columns = call["page_table"].shape[1] * call["compressed_k_cache"].shape[1]
    else:
        columns = call["max_columns"]
    q = call["q"]
    return q.new_empty((q.shape[0], columns), dtype=torch.float32), q.new_empty((q.shape[0],), dtype=torch.int32)


def _block_topk_fake(call: Call) -> torch.Tensor:
    """int32 ``[tokens, block_topk]``."""
    block_topk = check_int("block_topk", call["block_topk"], minimum=1, op="qsa_block_topk")
    logits = call["logits"]
    return logits.new_empty((logits.shape[0], block_topk), dtype=torch.int32)


def _expand_fake(call: Call) -> torch.Tensor:
    """int32 ``[tokens, token_topk + R - 1]``."""
    ratio, topk = check_topk_budget("qsa_expand_block_indices", call["compress_ratio"], call["token_topk"])
    block_indices = call["block_indices"]
    return block_indices.new_empty((block_indices.shape[0], topk + ratio - 1), dtype=torch.int32)


def _selection_fake(call: Call) -> torch.Tensor:
    """int32 ``[tokens, token_topk + R - 1]``."""
    op = "qsa_select_paged_tokens"
    ratio, topk = check_topk_budget(op, call["compress_ratio"], call["token_topk"])
    if call["logits_workspace_bytes"] is not None:  # None: the bound is chosen when the op runs
        check_int("logits_workspace_bytes", call["logits_workspace_bytes"], minimum=1, op=op)
    if _static(call):
        selection.selection_problem(call["q"], call["compressed_k_cache"], call["page_table"],
                                    call["token_to_request"], call["query_positions"], call["context_lens"], ratio,
                                    call["max_seq_len"], k_scale=call["k_scale"], phase=call["phase"],
                                    max_query_len=call["max_query_len"])
    q = call["q"]
    return q.new_empty((q.shape[0], topk + ratio - 1), dtype=torch.int32)


def _writer_fake(call: Call) -> None:
    """Nothing: the writer only writes ``cache`` and ``k_scale`` in place."""
    return None


#: The public ops as custom ops: the public function, the arguments it writes besides ``out``, its fake.
DECLARATIONS = (
    OpDeclaration(scoring.qsa_paged_mqa_logits, mutated=("row_starts",), fake=_scoring_fake),
    OpDeclaration(selection.qsa_block_topk, mutated=(), fake=_block_topk_fake),
    OpDeclaration(selection.qsa_expand_block_indices, mutated=(), fake=_expand_fake),
    OpDeclaration(selection.qsa_select_paged_tokens, mutated=(), fake=_selection_fake),
    OpDeclaration(cache.qsa_write_index_cache, mutated=("cache", "k_scale"), fake=_writer_fake),
)

# The wrappers, by public name: the public signatures, through the custom ops.
_WRAPPERS = {declaration.public.__name__: register(declaration, NAMESPACE, __name__) for declaration in DECLARATIONS}
qsa_paged_mqa_logits = _WRAPPERS["qsa_paged_mqa_logits"]
qsa_block_topk = _WRAPPERS["qsa_block_topk"]
qsa_expand_block_indices = _WRAPPERS["qsa_expand_block_indices"]
qsa_select_paged_tokens = _WRAPPERS["qsa_select_paged_tokens"]
qsa_write_index_cache = _WRAPPERS["qsa_write_index_cache"]

__all__ = ["NAMESPACE", "DECLARATIONS", "qsa_paged_mqa_logits", "qsa_block_topk", "qsa_expand_block_indices",
           "qsa_select_paged_tokens", "qsa_write_index_cache"]

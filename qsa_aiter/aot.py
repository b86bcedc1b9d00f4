"""Ahead-of-time compilation of the scoring kernels for a named GPU target, without a GPU.

``compile_kernel("stacked", "gfx950")`` builds the kernel for that target with ``triton.compile`` and returns the
compiled object (``.asm`` holds ptx/cubin or amdgcn/hsaco). Tests use it to prove every kernel builds for sm_90,
gfx942 and gfx950 and to read the assembly.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import replace

import torch
import triton

from .kernels.common import common_signature, interpreting
from .kernels.dequant import KV_16BIT, fast_decode_at, fp8_dot, fp8_tensor_cores_at, kv_kind
from .problem import ScoreProblem
from .triton_compat import ASTSource, GPUTarget

TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}
KERNEL_MODULES = ("rowwise", "stacked", "tiled")
_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def example_problem(**overrides) -> ScoreProblem:
    """A model-shaped problem (4 heads, head_dim 128, R 4, page 64, bf16 cache) to specialise kernels for."""
    base = ScoreProblem(
        device_type="cuda", q_dtype=torch.bfloat16, kv_dtype="bf16", cache_dtype=torch.bfloat16, block_size=64,
        num_tokens=36, num_heads=4, head_dim=128, num_requests=9, table_width=512, num_pages=4096,
        num_columns=32768, compress_ratio=4, phase="verify", phase_source="hint", max_query_len=4, cache_bytes=0,
    )
    return replace(base, **overrides)


def _check_target(target: str, what: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}; got {target!r}")
    if interpreting():
        raise RuntimeError(f"{what} needs a process without TRITON_INTERPRET=1: under the interpreter the kernels "
                           "are interpreted functions that Triton cannot compile")


def _compile(kernel, signature: dict, constexprs: dict, aligned, target: str, options: dict):
    """``triton.compile`` of ``kernel`` for ``target``. The launcher's runtime specialisation marks 16-byte-aligned
    pointers (and strides divisible by 16); ``aligned`` names the arguments to mark the same way, or the AOT build
    loses vectorised (and asynchronous, pipelined) loads."""
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGETS[target], options=options)


def _pointers(signature: dict) -> list[str]:
    return [n for n, kind in signature.items() if kind.startswith("*")]


def target_capability(target: str) -> tuple[int, int]:
    """The NVIDIA compute capability of ``target`` (``sm_90`` -> (9, 0)); ``(0, 0)`` for AMD targets."""
    gpu = TARGETS[target]
    return divmod(gpu.arch, 10) if gpu.backend == "cuda" else (0, 0)


def _target_choices(target: str, problem: ScoreProblem, e4m3_mma: bool | None) -> tuple[bool, bool]:
    """``(fast_decode, e4m3_mma)`` of a build for ``target``: the PTX decoders of quantised caches and the e4m3
    MMAs are built for NVIDIA targets that have them (sm_90 has both), the portable decoders for AMD ones."""
    capability = target_capability(target)
    fast_decode = fast_decode_at(capability) and kv_kind(problem.cache_dtype) != KV_16BIT
    return fast_decode, fp8_dot(problem.q_dtype, problem.cache_dtype, problem.head_dim,
                                tensor_cores=fp8_tensor_cores_at(capability) and e4m3_mma is not False)


def kernel_config(kernel: str, target: str, problem: ScoreProblem, e4m3_mma: bool | None = None,
                  overrides: dict | None = None):
    """The tile config ``compile_kernel`` builds ``kernel`` with: its ``default_config`` on ``target``, fields
    replaced by ``overrides``."""
    module = importlib.import_module(f"qsa_aiter.kernels.{kernel}")
    cfg = module.default_config(problem, _target_choices(target, problem, e4m3_mma)[1])
    return dataclasses.replace(cfg, **(overrides or {}))


def compile_kernel(kernel: str, target: str, problem: ScoreProblem | None = None, index_dtype: str = "i32",
                   e4m3_mma: bool | None = None, overrides: dict | None = None):
    """Compile ``kernel`` (rowwise/stacked/tiled) for ``target`` (sm_90/gfx942/gfx950) with its default config
    (fields replaced by ``overrides``), for ``problem`` (its cache dtype picks the key decoding). ``e4m3_mma=False``
    builds the decoding path where e4m3 MMAs would serve (``QSA_AITER_FP8_MMA=0``); None: as the target allows."""
    if kernel not in KERNEL_MODULES:
        raise ValueError(f"kernel must be one of {', '.join(KERNEL_MODULES)}; got {kernel!r}")
    _check_target(target, "compile_kernel")
    problem = problem or example_problem()
    module = importlib.import_module(f"qsa_aiter.kernels.{kernel}")
    fast_decode, e4m3_mma = _target_choices(target, problem, e4m3_mma)
    cfg = kernel_config(kernel, target, problem, e4m3_mma, overrides)
    constexprs = module.constexprs(problem, cfg, upcast=False, fast_decode=fast_decode, fp8_dot=e4m3_mma)
    signature = common_signature(_TRITON_DTYPES[problem.q_dtype], index_dtype, kv_kind(problem.cache_dtype))
    aligned = _pointers(signature) + ["pt_stride", "out_stride"]
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return _compile(module.KERNEL, signature, constexprs, aligned, target, options)


def compile_cache_writer(kind: str, target: str, head_dim: int = 128):
    """Compile the index-cache writer for ``kind`` (bf16, fp8_e4m3fn, fp8_e4m3fnuz, fp4) and ``target``."""
    from .kernels import cache_writer

    if kind not in cache_writer.KIND_CODES:
        raise ValueError(f"kind must be one of {', '.join(cache_writer.KIND_CODES)}; got {kind!r}")
    _check_target(target, "compile_cache_writer")
    cache_type = "*bf16" if kind == "bf16" else "*u8"
    scale_type = "*fp32" if kind.startswith("fp8") else ("*u8" if kind == "fp4" else cache_type)
    signature = {"keys_ptr": "*bf16", "slot_ptr": "*i32", "cache_ptr": cache_type, "scale_ptr": scale_type,
                 "num_slots": "i32", "keys_stride": "i32"}
    return _compile(cache_writer.KERNEL, signature, cache_writer.constexprs(kind, head_dim), _pointers(signature),
                    target, {"num_warps": 4})


def compile_selection_kernel(kernel: str, target: str, block_topk: int = 512, compress_ratio: int = 4,
                             index_dtype: str = "i32"):
    """Compile a selection kernel (``topk``: block top-k over fp32 logits; ``expand``: groups to tokens) for
    ``target`` with the model's budget (``block_topk`` groups of ``compress_ratio`` tokens)."""
    from .kernels import expand, topk

    if kernel not in ("topk", "expand"):
        raise ValueError(f"kernel must be topk or expand; got {kernel!r}")
    _check_target(target, "compile_selection_kernel")
    if kernel == "topk":  # as the selection op launches it: the expansion fused
        cfg = topk.TopkConfig()
        signature = {"logits_ptr": "*fp32", "vis_ptr": "*i32", "out_ptr": "*i32", "buf_ptr": "*i32",
                     "pos_ptr": f"*{index_dtype}", "ctx_ptr": f"*{index_dtype}", "t2r_ptr": f"*{index_dtype}",
                     "tok_ptr": "*i32", "logits_stride": "i32", "out_stride": "i32", "buf_stride": "i32",
                     "num_requests": "i32", "tok_stride": "i32", "num_columns": "i32"}
        fused = expand.constexprs(compress_ratio, block_topk, block_topk * compress_ratio)
        constexprs = topk.constexprs(block_topk, cfg, fused, columns=32768)
        aligned = _pointers(signature) + ["logits_stride", "out_stride", "tok_stride"]
        return _compile(topk.KERNEL, signature, constexprs, aligned, target, {"num_warps": cfg.num_warps})
    signature = {"blk_ptr": "*i32", "pos_ptr": f"*{index_dtype}", "ctx_ptr": f"*{index_dtype}",
                 "t2r_ptr": f"*{index_dtype}", "out_ptr": "*i32", "num_requests": "i32", "blk_stride": "i32",
                 "out_stride": "i32"}
    constexprs = expand.constexprs(compress_ratio, block_topk, block_topk * compress_ratio)
    return _compile(expand.KERNEL, signature, constexprs, _pointers(signature), target,
                    {"num_warps": expand.NUM_WARPS})

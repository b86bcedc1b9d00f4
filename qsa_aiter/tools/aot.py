"""Ahead-of-time compilation of the kernels for a named GPU target, without a GPU.

``compile_kernel("stacked", "gfx950")`` builds a kernel for that target and returns the compiled object (``.asm``
holds ptx/cubin or amdgcn/hsaco). A build is the kernel's ``LaunchPlan`` for ``Platform.named(target)`` (the plan a
launch on that GPU makes, default tile config unless one is given), specialised with Triton's own binder on the
spec's small example inputs (``KernelSpec.example_args``), so the build is the variant a launch there compiles.
Tests use it to prove every kernel builds for sm_90, gfx942 and gfx950 and to read the assembly.
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from ..kernels import catalog
from ..kernels.cache import writer
from ..kernels.cache.writer import WriterProblem, kind_of
from ..kernels.platform import Platform, interpreting
from ..kernels.quant.formats import CACHE_FORMATS, canonical_format
from ..kernels.scoring import SPECS as SCORING_SPECS
from ..kernels.scoring.base import example_problem
from ..kernels.selection import expand, maxima, topk
from ..kernels.selection.problem import SelectionProblem
from ..runtime.jit.triton_compat import ASTSource, GPUTarget
from .build import specialise

TARGETS = {
    "sm_90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
    "gfx950": GPUTarget("hip", "gfx950", 64),
}
#: The scoring kernels, by name.
SCORERS = tuple(spec.name for spec in SCORING_SPECS)
_INDEX_DTYPES = {"i32": torch.int32, "i64": torch.int64}


def _check_target(target: str, what: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}; got {target!r}")
    if interpreting():
        raise RuntimeError(f"{what} needs a process without TRITON_INTERPRET=1: under the interpreter the kernels "
                           "are interpreted functions that Triton cannot compile")


def compile_plan(spec, problem, target: str, index_dtype: str = "i32", config=None):
    """Compile ``spec``'s plan for ``problem`` on ``target`` (``config``: its tile config; None: the default)."""
    _check_target(target, "compile_kernel")
    if index_dtype not in _INDEX_DTYPES:
        raise ValueError(f"index_dtype must be one of {', '.join(_INDEX_DTYPES)}; got {index_dtype!r}")
    plan = spec.plan(problem, Platform.named(target), config=config)
    args = spec.example_args(problem, _INDEX_DTYPES[index_dtype], torch.device("cpu"))
    built = specialise(plan.fn, TARGETS[target], args, plan.kwargs)
    source = ASTSource(plan.fn, built.signature, built.constexprs, built.attrs)
    return triton.compile(source, target=TARGETS[target], options=built.options.__dict__)


def _scoring_problem(problem, e4m3_mma: bool | None):
    # e4m3_mma=False builds the decoding path where e4m3 MMAs would serve (QSA_AITER_E4M3_MMA=0).
    problem = problem or example_problem()
    return dataclasses.replace(problem, e4m3_mma=e4m3_mma is not False)


def kernel_config(kernel: str, target: str, problem=None, e4m3_mma: bool | None = None,
                  overrides: dict | None = None):
    """The tile config ``compile_kernel`` builds scorer ``kernel`` with: its default config on ``target``, fields
    replaced by ``overrides``."""
    spec = catalog.spec_named(kernel)
    cfg = spec.default_config(_scoring_problem(problem, e4m3_mma), Platform.named(target))
    return dataclasses.replace(cfg, **(overrides or {}))


def compile_kernel(kernel: str, target: str, problem=None, index_dtype: str = "i32", e4m3_mma: bool | None = None,
                   overrides: dict | None = None):
    """Compile scorer ``kernel`` for ``target`` (sm_90/gfx942/gfx950) with its default config (fields replaced by
    ``overrides``), for ``problem`` (a ``ScoreProblem``; default ``example_problem()``; its cache dtype picks the
    key decoding). ``e4m3_mma=False`` builds the decoding path where e4m3 MMAs would serve; None: as the target
    allows."""
    if kernel not in SCORERS:
        raise ValueError(f"kernel must be one of {', '.join(SCORERS)}; got {kernel!r}")
    _check_target(target, "compile_kernel")
    problem = _scoring_problem(problem, e4m3_mma)
    return compile_plan(catalog.spec_named(kernel), problem, target, index_dtype,
                        kernel_config(kernel, target, problem, e4m3_mma, overrides))


def writer_kind(cache_format: str) -> str:
    """The writer kernel's kind (its ``KIND_CODES`` key) for a cache of ``cache_format`` (a ``CACHE_FORMATS`` name):
    the writer tells the two e4m3 dtypes apart, and writes both 16-bit formats alike."""
    fmt = CACHE_FORMATS[cache_format]
    return kind_of(torch.empty(0, dtype=fmt.dtype), fmt.kind)


def compile_cache_writer(cache_format: str, target: str, head_dim: int = 128):
    """Compile the index-cache writer for a cache of ``cache_format`` (``bf16``, ``fp16``, ``fp8``, ``fp8_fnuz``,
    ``fp4``; a former spelling is accepted with a ``DeprecationWarning``), keys of the format's query dtype, and
    ``target``."""
    fmt = CACHE_FORMATS[canonical_format(cache_format, stacklevel=2)]
    _check_target(target, "compile_cache_writer")
    problem = WriterProblem(4, writer_kind(fmt.name), head_dim, fmt.query_dtype)
    return compile_plan(catalog.spec_named(writer.SPEC.name), problem, target)


#: The selection kernels ``compile_selection_kernel`` builds.
SELECTION_KERNELS = catalog.family_names("selection")


def compile_selection_kernel(kernel: str, target: str, block_topk: int = 512, compress_ratio: int = 4,
                             index_dtype: str = "i32", with_maxima: bool = False):
    """Compile a selection kernel (``topk``: block top-k over fp32 logits, the expansion fused as the selection op
    launches it, ``with_maxima`` reading column-block maxima as it does for long rows; ``block_maxima``: those
    maxima; ``expand``: groups to tokens) for ``target`` with the model's budget (``block_topk`` groups of
    ``compress_ratio`` tokens)."""
    if kernel not in SELECTION_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(SELECTION_KERNELS)}; got {kernel!r}")
    _check_target(target, "compile_selection_kernel")
    requests = 9
    fused = kernel == topk.SPEC.name
    columns = {topk.SPEC.name: 65536 if with_maxima else 32768, maxima.SPEC.name: 65536, expand.SPEC.name: 0}[kernel]
    problem = SelectionProblem(requests, columns, block_topk, compress_ratio, block_topk * compress_ratio,
                               fused, requests, with_maxima and fused)
    return compile_plan(catalog.spec_named(kernel), problem, target, index_dtype)

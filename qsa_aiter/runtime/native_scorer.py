"""The native tensor-core scorer at launch time: its reasons (``native_scorer_reasons``, the ``native`` candidate's of
the ``SCORING`` registry), the marshalling of a scoring call's arguments (``ScoreArgs``) into its kernel's
(``native_scorer_call``), the launch on a GPU (``native_score``: compiled through NVRTC into the JIT cache, loaded
and launched by ``runtime/jit/native.py``) and on the CPU through the CUDA emulator (``emulated_score``). What the
kernels are is declared once in ``kernels/scoring/native_scorer.py`` (``SPEC``)."""

from __future__ import annotations

import torch

from ..kernels.platform import Platform
from ..kernels.quant.formats import view_strides
from ..kernels.scoring import native_scorer as kernels
from ..kernels.spec import record
from .jit import emulated, native

#: The name a native scorer launch is recorded under (``kernels.spec.record``; ``ops.scoring.ScoringPlan`` replays
#: it).
NATIVE_SCORER_LAUNCH = "native_scorer"


def native_scorer_reasons(problem, platform: Platform, settings) -> list[str]:
    """Why the native scorer does not serve ``problem`` (a ``ScoreProblem``; empty: it serves), from host facts only:
    GPU tensors of a CUDA build of torch, the kernels' own limits on the platform and the shape (``kernels.SPEC``:
    an NVIDIA GPU of compute capability 8.0+, a bf16, fp16, fp8 e4m3fn or MXFP4 (bf16 queries) cache, 4 heads,
    head_dim 128, pages of 16 or 64, no prefill beyond 256 rows), the per-row histogram (which it does not count),
    and NVRTC and the driver library loadable."""
    found = native.cuda_only_reasons(
        problem.device_type, "no AMD version yet (a ROCm build of torch; the matrix primitives of native_mma.h are "
        "NVIDIA's)")
    if problem.device_type == "cuda" and torch.version.cuda is not None:
        found += kernels.SPEC.reasons(problem, platform)
    else:
        found += kernels.shape_reasons(problem)
    if problem.histogram:
        found.append("does not count the scores' per-row histogram (the Triton scorers do)")
    return found + (native.unavailable_reasons("cuda") if torch.version.hip is None else [])


def describe_plan(problem, platform: Platform) -> str:
    """The native plan ``explain`` prints for ``problem`` on ``platform``."""
    return kernels.SPEC.describe_plan(problem, platform)


def wide_bits(args) -> int:
    """The kernels' ``wide`` argument (the scorer's and the fused selection's): a ``QSA_WIDE_*`` bit for each of the
    page table, the rows' requests, positions and the context lengths that is int64."""
    return sum(bit for tensor, bit in ((args.page_table, kernels.WIDE_PAGES),
                                       (args.token_to_request, kernels.WIDE_REQUESTS),
                                       (args.query_positions, kernels.WIDE_POSITIONS),
                                       (args.context_lens, kernels.WIDE_CONTEXTS)) if tensor.dtype == torch.int64)


def cache_layout(cache: torch.Tensor) -> tuple[int, int, bool]:
    """``(page_stride, slot_stride, aligned)`` of a key cache ``[pages, P, 1, width]`` as the kernels read it (the
    native scorer's and the fused selection's): strides in its elements (2 bytes, or 1 for fp8 and MXFP4), pages
    and slots any distance apart (its last dim dense); ``aligned``: cp.async copies a key in 16-byte pieces, so the
    base and both strides in bytes are multiples of 16 (else plain loads)."""
    _, page_size, _, width = cache.shape
    strides = view_strides(cache)
    page_stride, slot_stride = strides if strides is not None else (page_size * width, width)
    item = cache.dtype.itemsize
    aligned = cache.data_ptr() % 16 == 0 and (page_stride * item) % 16 == 0 and (slot_stride * item) % 16 == 0
    return page_stride, slot_stride, aligned


def scales_of(args) -> torch.Tensor:
    """The ``k_scale`` argument's tensor: the quantised caches' scales (fp8: fp32 ``[pages, P]``; MXFP4: e8m0
    ``[pages, P, 1, 4]``), 4 bytes a key, contiguous (validated); a 16-bit cache passes its own address, unread."""
    return args.k_scale if args.k_scale is not None else args.k_cache


def native_scorer_call(problem, args, plan: kernels.Plan):
    """The launch of ``plan`` for the scoring call ``args`` (a ``ScoreArgs`` validated into ``problem``): ``(call,
    addresses)``, the ``NativeLaunch`` and its pointer arguments' addresses in the kernel's order. The tensors are
    passed as they are: q, the metadata and the page table's last dim are contiguous (validated), the cache's pages
    and slots any distance apart (its last dim dense), the logits' rows any stride."""
    cache, table, logits = args.k_cache, args.page_table, args.logits
    pages = cache.shape[0]
    page_stride, slot_stride, aligned = cache_layout(cache)
    tokens = args.q.shape[0]
    wide = wide_bits(args)
    values = dict(
        num_tokens=tokens, num_requests=table.shape[0], num_pages=pages, num_columns=args.num_columns,
        table_width=table.shape[1], table_stride=table.stride(0) if table.shape[0] > 1 else table.shape[1],
        logits_stride=logits.stride(0) if tokens > 1 else max(args.num_columns, 1), page_stride=page_stride,
        slot_stride=slot_stride, ratio=args.compress_ratio, scale_bits=kernels.float_bits(args.scale), wide=wide,
        aligned=int(aligned),
    )
    call = kernels.launch_arguments(plan, values)
    addresses = [t.data_ptr() for t in (args.q, cache, scales_of(args), table, args.token_to_request,
                                        args.query_positions, args.context_lens, logits, args.visible)]
    return call, addresses


def native_score(problem, args, settings=None, plan: kernels.Plan | None = None) -> None:
    """Score the call ``args`` (a ``ScoreArgs`` on CUDA tensors, validated into ``problem``) with the native scorer:
    one launch on the current stream, the kernel compiled into the JIT cache, or loaded from it, at its first use in
    a process. ``plan``: a ``kernels.Plan`` instead of the one ``choose_plan`` makes (tests, benchmarks). The launch
    is recorded (``kernels.spec.record``) for the replay of later calls of the same signature."""
    if problem.num_tokens == 0:
        return
    device = args.q.device.index if args.q.device.index is not None else torch.cuda.current_device()
    platform = Platform.of(torch.device("cuda", device))
    plan = plan or kernels.choose_plan(problem, platform)
    call, addresses = native_scorer_call(problem, args, plan)
    variant = plan.variant
    kernel = native.kernel_for(kernels.source(), variant.name, kernels.SPEC.defines(variant, platform.arch), device,
                               platform.arch, settings)
    prepared = native.PreparedLaunch(NATIVE_SCORER_LAUNCH, kernel, call.grid, call.block, call.shared_bytes,
                                     tuple(name for name, _ in call.pointers), call.scalars)
    prepared(*addresses)
    record(prepared)


#: The native scorer's kernels as the emulator builds them: name, pointer C types, scalar count (from the spec).
EMULATED_SCORER_KERNELS = kernels.SPEC.emulator_kernels()


def emulated_score(problem, args, plan: kernels.Plan, order_seed: int = 0) -> None:
    """``native_score`` on CPU tensors: the kernel of ``plan`` run by the CUDA emulator (``runtime/jit/emulated.py``;
    tests on machines without a GPU), at the warp width of 32 (the NVIDIA target). ``order_seed`` picks the order the
    emulator resumes waiting threads in. Raises ``emulated.EmulationError`` where the emulated kernel fails."""
    if problem.num_tokens == 0:
        return
    call, addresses = native_scorer_call(problem, args, plan)
    lib = emulated.build(kernels.SOURCE_PATH, EMULATED_SCORER_KERNELS, ("TOPK_WARP_SIZE=32",), kernels.source())
    emulated.run(lib, call, addresses, 1, order_seed)

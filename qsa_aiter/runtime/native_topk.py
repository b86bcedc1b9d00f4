"""The native top-k at launch time: its reasons (``native_topk_reasons``, the ``native`` candidate's of the ``TOPK``
registry), its plan (``plan_choice``: the measured one of the tuned top-k table, else ``choose_plan``'s), the
marshalling of a call's tensors into its kernel's arguments (``native_topk_call``), the launch on a GPU
(``native_block_topk``: compiled through NVRTC or hipRTC into the JIT cache, loaded and launched by
``runtime/jit/native.py``) and on the CPU through the CUDA emulator (``emulated_block_topk``). What the kernels are
is declared once in ``kernels/selection/native_topk.py`` (``SPEC``)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from ..kernels.platform import Platform
from ..kernels.selection import native_topk as kernels
from ..kernels.spec import record
from . import tuned
from .jit import emulated, native
from .log import log_once
from .settings import QsaSettings, get_settings

#: The names a native top-k launch is recorded under, without and with the fused expansion (``kernels.spec.record``;
#: the selection replays match them).
NATIVE_TOPK_LAUNCH, NATIVE_TOPK_EXPAND_LAUNCH = "native_topk", "native_topk+expand"
#: The native top-k's name among the top-k candidates (``registries.TOPK``) and in the tuned top-k table.
CANDIDATE = "native"

def native_topk_reasons(problem, platform: Platform, settings) -> list[str]:
    """Why the native top-k does not serve ``problem`` (a ``registries.TopkProblem``; empty: it serves), from host
    facts only: GPU tensors of a CUDA or ROCm build of torch, the kernels' own limits on the platform and the shape
    (``kernels.SPEC.reasons``: an NVIDIA GPU of compute capability 8.0+, or gfx942 / gfx950), and the vendor's
    run-time compiler (NVRTC, hipRTC) and driver library loadable."""
    found = []
    if problem.device_type != "cuda":
        found.append(f"needs CUDA GPU tensors (tensors are on {problem.device_type})")
    hip = torch.version.hip is not None
    if not hip and torch.version.cuda is None:
        found.append(f"needs a CUDA or ROCm build of torch (torch {torch.__version__} has neither)")
    elif problem.device_type == "cuda":
        found += kernels.SPEC.reasons(problem, platform)
    return found + native.unavailable_reasons("hip" if hip else "cuda")


@dataclass(frozen=True)
class PlanChoice:
    """The native top-k's plan for a shape: ``plan``, ``row``: the measured row of the tuned top-k table it came from
    (None: ``choose_plan``'s heuristic), and ``note``: how it was chosen (``explain`` prints it)."""

    plan: kernels.Plan
    row: tuned.TopkRow | None
    note: str


@dataclass(frozen=True)
class _Shape:
    """A top-k shape as ``kernels.SPEC`` and the tuned table read one."""

    rows: int
    columns: int
    block_topk: int


def plan_choice(rows: int, columns: int, block_topk: int, platform: Platform,
                settings: QsaSettings | None = None) -> PlanChoice:
    """The plan of a native top-k of ``rows`` rows of ``columns`` keeping ``block_topk`` on ``platform``, with the
    tuned tables of ``settings`` (host facts only): of the plans measured at the bucket nearest the shape
    (``TunedTable.measured_topk``), the fastest that serves the shape on the platform (``kernels.plans_for``: a
    cluster plan needs compute capability 9.0, a cached row must fit the shared memory); where the table has none,
    or none of them serves, ``choose_plan``'s, and the note says why."""
    settings = settings or get_settings()
    return _plan_choice(rows, columns, block_topk, platform, tuned.load_tables(tuple(settings.tuned_config)))


@functools.lru_cache(maxsize=512)  # a launch asks for it every call; memoised per table (by identity)
def _plan_choice(rows: int, columns: int, block_topk: int, platform: Platform, table: tuned.TunedTable) -> PlanChoice:
    plan, row, note = measured_plan(rows, columns, block_topk, platform, table)
    if plan is None:  # choose_plan's (made only here: measured_plan asks no more of the platform than plans_for)
        plan = kernels.SPEC.plan(_Shape(rows, columns, block_topk), platform)
    return PlanChoice(plan, row, note)


def measured_plan(rows: int, columns: int, block_topk: int, platform: Platform,
                  table: tuned.TunedTable) -> tuple[kernels.Plan | None, tuned.TopkRow | None, str]:
    """``(plan, row, note)``: the measured plan ``plan_choice`` takes and its row, or ``(None, None, note)`` where it
    takes ``choose_plan``'s; ``note`` says why."""
    if columns <= block_topk:
        return None, None, "the trivial plan (no row is wider than block_topk)"
    measured = table.measured_topk(platform.arch, CANDIDATE, _Shape(rows, columns, block_topk))
    if not measured:
        log_once(logging.INFO, ("untuned", platform.arch, CANDIDATE, block_topk),
                 f"no measured {CANDIDATE} top-k row for arch={platform.arch} block_topk={block_topk}: choose_plan's "
                 "heuristic plans its launches (python -m qsa_aiter tune --op topk measures them)")
        return None, None, (f"choose_plan's heuristic (no measured {CANDIDATE} row for arch {platform.arch}, "
                            f"block_topk {block_topk})")
    serving = kernels.plans_for(rows, columns, block_topk, platform)
    passed = []  # the measured plans faster than the one taken that do not serve the shape here
    bucket = f"{measured[0].rows} rows x {measured[0].columns} columns"
    for row in measured:  # fastest first
        if row.plan in serving:
            skipped = (f"; faster but not serving {rows} x {columns} on {platform.arch}: {', '.join(passed)}"
                       if passed else "")
            return serving[row.plan], row, (f"measured plan {row.plan}: {row.us:.2f} us at {bucket} "
                                            f"({row.source or 'no source'}){skipped}")
        passed.append(f"{row.plan} {row.us:.2f} us")
    return None, None, (f"choose_plan's heuristic: none of the plans measured at {bucket} ({', '.join(passed)}) "
                        f"serves {rows} x {columns} on {platform.arch} (those that do: "
                        f"{', '.join(serving) or 'none'})")


def describe_plan(problem, platform: Platform) -> str:
    """The native plan ``explain`` prints for ``problem`` on ``platform``: the kernel and its layout, how the plan was
    chosen (``plan_choice``), and on ROCm why no cluster is planned (``none``, with the reasons, where the platform
    has no plan)."""
    reasons = kernels.SPEC.reasons(problem, platform)
    if reasons:
        return f"none ({'; '.join(reasons)})"
    choice = plan_choice(problem.rows, problem.columns, problem.block_topk, platform)
    text = f"{choice.plan.describe()}; {choice.note}"
    return f"{text}; {kernels.CLUSTERS_ON_ROCM}" if platform.backend == "hip" else text


def _check_histogram(logits: torch.Tensor, histogram: torch.Tensor | None) -> None:
    """A scorer's histogram for ``logits`` is a contiguous int32 ``[rows, HISTOGRAM_BINS]`` on their device."""
    rows, bins = logits.shape[0], kernels.HISTOGRAM_BINS
    if histogram is not None and (histogram.shape != (rows, bins) or histogram.dtype != torch.int32
                                  or not histogram.is_contiguous() or histogram.device != logits.device):
        raise ValueError(f"histogram must be a contiguous int32 [{rows}, {bins}] tensor on {logits.device} (got "
                         f"{histogram.dtype} {tuple(histogram.shape)} on {histogram.device})")


def native_topk_call(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int,
                      plan: kernels.Plan, expand_into: tuple | None, histogram: torch.Tensor | None):
    """The launch of ``plan`` for ``native_block_topk``'s arguments (also what ``benchmarks/topk_trace.py`` launches a
    traced build with): ``(call, addresses, target, direct, keep)``, where
    ``target`` is ``out`` or the contiguous buffer the kernel writes instead, ``direct`` says the kernel takes the
    tensors as they are (no copies), and ``keep`` holds the copies ``addresses`` point into (alive until the launch
    is issued)."""
    rows, columns = logits.shape
    row_stride = logits.stride(0) if rows > 1 else max(columns, 1)
    # float4 loads and bulk copies need every row to start 16-byte aligned
    vectorised = logits.data_ptr() % 16 == 0 and (row_stride % 4 == 0 or rows == 1)
    # The kernel reads visible[row] (and the expansion's positions, lengths and requests) at stride 1 and writes
    # groups rows block_topk apart: other layouts go through contiguous copies, and such a launch is not recorded.
    inputs = (visible,) if expand_into is None else (visible, *expand_into[:3])
    direct = all(t.stride(0) == 1 for t in inputs) and out.is_contiguous()
    visible = visible if visible.stride(0) == 1 else visible.contiguous()
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=torch.int32, device=out.device)
    addresses = [logits.data_ptr(), visible.data_ptr(), target.data_ptr()]
    expansion = None
    keep = [visible]  # copies the addresses point into, alive until the launch is issued
    if expand_into is not None:
        positions, context_lens, token_to_request, tokens_out, ratio, token_topk = expand_into
        positions, context_lens, token_to_request = (t if t.stride(0) == 1 else t.contiguous()
                                                     for t in (positions, context_lens, token_to_request))
        keep += [positions, context_lens, token_to_request]
        expansion = kernels.Expansion(
            context_lens.shape[0], ratio, token_topk + ratio - 1, tokens_out.stride(0) if rows > 1 else 0,
            positions.dtype == torch.int64, context_lens.dtype == torch.int64, token_to_request.dtype == torch.int64)
        addresses += [positions.data_ptr(), context_lens.data_ptr(), token_to_request.data_ptr(),
                      tokens_out.data_ptr()]
    else:
        addresses += [0, 0, 0, 0]
    addresses.append(0 if histogram is None else histogram.data_ptr())
    call = kernels.launch_arguments(plan, rows, columns, row_stride, block_topk, vectorised, expansion)
    return call, addresses, target, direct, keep


def native_block_topk(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int,
                      settings=None, plan: kernels.Plan | None = None, expand_into: tuple | None = None,
                      histogram: torch.Tensor | None = None, defines: tuple[str, ...] = (),
                      programmatic: bool | None = None) -> None:
    """The native CUDA block top-k into ``out`` (int32 ``[tokens, block_topk]``, last dim contiguous) from fp32
    ``logits [tokens, columns]`` (last dim contiguous, any row stride) and int32 ``visible [tokens]`` (read on the
    device, clamped to ``[0, columns]``), on CUDA tensors; ``expand_into`` (``TopkArgs.expand_into``) fuses the
    expansion into the launch, as the Triton top-k does; ``plan``: a ``kernels.Plan`` instead of ``plan_choice``'s
    (the measured plan of the tuned top-k table, else ``choose_plan``'s; the tuner, tests, benchmarks);
    ``histogram``: the scorer's per-row histogram of these logits (int32 ``[tokens, HISTOGRAM_BINS]``, contiguous;
    ``kernels/scoring/histogram.py``), which the kernels start from
    instead of counting the row's top bits themselves; ``defines``: compile-time switches of the source
    (``NAME=VALUE``; benchmarks of its candidate changes); ``programmatic``: launch it as a programmatic dependent of
    the kernel before it on the stream (compute capability 9.0+; None: as ``QSA_AITER_TOPK_PDL`` says). One launch
    on the current stream; the kernel is compiled into the JIT cache, or loaded from it, at its first use in a
    process. A launch whose tensors the kernel takes as
    they are is recorded (``kernels.spec.record``) for the replay of later calls (one with a histogram or defines is
    not)."""
    rows, columns = logits.shape
    if rows == 0:
        return
    _check_histogram(logits, histogram)  # before any device work
    device = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    platform = Platform.of(torch.device("cuda", device))
    plan = plan or plan_choice(rows, columns, block_topk, platform, settings).plan
    call, addresses, target, direct, _keep = native_topk_call(logits, visible, out, block_topk, plan, expand_into,
                                                               histogram)
    variant = plan.variant
    program = (*kernels.SPEC.defines(variant, platform.arch), *defines)
    kernel = native.kernel_for(kernels.source(), variant.name, program, device, platform.arch, settings,
                               non_portable_cluster=variant.non_portable_cluster)
    name = NATIVE_TOPK_LAUNCH if expand_into is None else NATIVE_TOPK_EXPAND_LAUNCH
    if programmatic is None:
        programmatic = (settings or get_settings()).topk_pdl
    prepared = native.PreparedLaunch(name, kernel, call.grid, call.block, call.shared_bytes,
                                     tuple(pointer for pointer, _ in call.pointers), call.scalars,
                                     programmatic=programmatic and platform.capability >= (9, 0))
    prepared(*addresses)
    if target is not out:
        out.copy_(target)
    elif direct and histogram is None and not defines:  # a later call of the same signature replays this launch
        record(prepared)


#: The native top-k's kernels as the emulator builds them: name, pointer C types, scalar count (from the spec).
EMULATED_TOPK_KERNELS = kernels.SPEC.emulator_kernels()


def emulated_block_topk(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int,
                        plan: kernels.Plan, expand_into: tuple | None = None,
                        histogram: torch.Tensor | None = None, order_seed: int = 0,
                        defines: tuple[str, ...] = ()) -> None:
    """``native_block_topk`` on CPU tensors: the kernel of ``plan`` run by the CUDA emulator
    (``runtime/jit/emulated.py``; tests on machines without a GPU). ``order_seed`` picks the order the emulator
    resumes waiting threads in; ``defines`` are the source's compile-time switches (``NAME=VALUE``). Raises
    ``emulated.EmulationError`` where the emulated kernel fails."""
    if logits.shape[0] == 0:
        return
    _check_histogram(logits, histogram)
    call, addresses, target, _direct, _keep = native_topk_call(logits, visible, out, block_topk, plan, expand_into,
                                                                histogram)
    lib = emulated.build(kernels.SOURCE_PATH, EMULATED_TOPK_KERNELS, tuple(defines))
    emulated.run(lib, call, addresses, plan.variant.cluster, order_seed)
    if target is not out:
        out.copy_(target)



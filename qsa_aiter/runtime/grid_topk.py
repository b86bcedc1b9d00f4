"""The grid select at launch time: its reasons (``grid_topk_reasons``, the ``native_grid`` candidate's of the ``TOPK``
registry), its workspace (``workspace_for``), the marshalling of a call's tensors into its kernel's arguments
(``grid_topk_call``), the cooperative launch on a GPU (``grid_block_topk``: compiled through NVRTC into the JIT cache,
loaded and launched by ``runtime/jit/native.py``) and the run on the CPU through the CUDA emulator
(``emulated_grid_topk``, every CTA of the grid together). What the kernels are is declared once in
``kernels/selection/grid_topk.py`` (``SPEC``).

The workspace (``Plan.workspace_words`` int32 words: a slot of histogram, counter, flag and per-CTA words per row in
flight) is zeroed once and left clean by every launch, so it is reused without re-zeroing: one per device and stream
(launches on one stream are ordered), grown when a plan needs more. Inside a CUDA-graph capture a fresh workspace
is allocated instead (its zeroing, a memset node, is captured with the launch and runs at every replay): a
workspace kept from outside the capture could be used by an eager call on another stream while the graph replays.
A grid-select launch is not recorded for the replay of later calls (``kernels.spec.record``): its workspace is not
one of the buffers a replay lays out, so a repeated call takes the host path again.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

import torch

from ..kernels.platform import Platform
from ..kernels.selection import grid_topk as kernels
from ..kernels.selection.native_topk import Expansion
from .jit import emulated, native
from .jit.cuda_driver import current_stream, resident_blocks

#: The names a grid-select launch goes under, without and with the fused expansion.
#: The grid select's name among the top-k candidates and in the tuned top-k table.
CANDIDATE = "native_grid"
GRID_TOPK_LAUNCH, GRID_TOPK_EXPAND_LAUNCH = "grid_topk", "grid_topk+expand"
#: (device index, stream handle, owner) -> the workspace of an owner's launches on that stream.
_workspaces: dict[tuple[int, int], torch.Tensor] = {}
#: (loaded kernel, threads, shared bytes) -> CTAs a multiprocessor holds, as the driver counts them.
_resident: dict[tuple, int] = {}
#: Prepared launches by (loaded kernel, launch): a repeated call converts no scalar again.
_prepared: OrderedDict = OrderedDict()
_MAX_PREPARED = 64
_lock = threading.Lock()


def grid_topk_reasons(problem, platform: Platform, settings) -> list[str]:
    """Why the grid select does not serve ``problem`` (a ``registries.TopkProblem``; empty: it serves), from host
    facts only: CUDA GPU tensors on a CUDA build of torch (no cooperative launch is wired for ROCm), the kernels'
    own limits on the platform and the shape (``kernels.SPEC.reasons``: an NVIDIA GPU of compute capability 8.0+, a
    row's scores held in shared memory across a co-resident grid), NVRTC and the CUDA driver library loadable."""
    found = native.cuda_only_reasons(problem.device_type,
                                     "needs a CUDA build of torch (no cooperative launch is wired for ROCm yet)")
    if problem.device_type == "cuda" and torch.version.cuda is not None:
        found += kernels.SPEC.reasons(problem, platform)
    return found + (native.unavailable_reasons("cuda") if torch.version.hip is None else [])


def describe_plan(problem, platform: Platform) -> str:
    """The plan ``explain`` prints for ``problem`` on ``platform``."""
    return kernels.SPEC.describe_plan(problem, platform)


def workspace_for(device: torch.device, words: int, owner: str = CANDIDATE) -> torch.Tensor:
    """A workspace of at least ``words`` int32 words on CUDA ``device`` for a launch on its current stream: the
    stream's own for ``owner`` (a layout: the grid select's slots, the fused selection's rows or its candidates; each
    keeps its own buffer), zeroed when made and left as its kernels leave it, or inside a graph capture a fresh zeroed
    one (its memset captured with the launch). Grown to the larger size when a plan needs more (the old one is
    released in stream order)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(words, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, current_stream(index), owner)
    with _lock:
        found = _workspaces.get(key)
        if found is None or found.numel() < words:
            found = torch.zeros(max(words, 0 if found is None else found.numel()), dtype=torch.int32,
                                device=torch.device("cuda", index))
            _workspaces[key] = found
    return found


def forget_workspaces() -> None:
    """Drop the kept workspaces (tests)."""
    with _lock:
        _workspaces.clear()


def _check_workspace(workspace: torch.Tensor, plan: kernels.Plan, device: torch.device) -> None:
    if (workspace.dtype != torch.int32 or not workspace.is_contiguous() or workspace.device != device
            or workspace.numel() < plan.workspace_words):
        raise ValueError(f"workspace must be a contiguous int32 tensor of at least {plan.workspace_words} words on "
                         f"{device} (got {workspace.dtype} {tuple(workspace.shape)} on {workspace.device})")


def grid_topk_call(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int,
                   plan: kernels.Plan, expand_into: tuple | None, workspace: torch.Tensor):
    """The launch of ``plan`` for ``grid_block_topk``'s arguments: ``(call, addresses, target, keep)``, where
    ``target`` is ``out`` or the contiguous buffer the kernel writes instead and ``keep`` holds the copies
    ``addresses`` point into (alive until the launch is issued)."""
    rows, columns = logits.shape
    if columns > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits must have a contiguous last dim (strides {tuple(logits.stride())})")
    _check_workspace(workspace, plan, logits.device)
    row_stride = logits.stride(0) if rows > 1 else max(columns, 1)
    vectorised = logits.data_ptr() % 16 == 0 and (row_stride % 4 == 0 or rows == 1)
    visible = visible if visible.stride(0) == 1 else visible.contiguous()
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=torch.int32, device=out.device)
    keep = [visible]
    addresses = [logits.data_ptr(), visible.data_ptr(), target.data_ptr()]
    expansion = None
    if expand_into is not None:
        positions, context_lens, token_to_request, tokens_out, ratio, token_topk = expand_into
        if tokens_out.stride(-1) != 1:
            raise ValueError("the expansion's output must have a contiguous last dim")
        positions, context_lens, token_to_request = (t if t.stride(0) == 1 else t.contiguous()
                                                     for t in (positions, context_lens, token_to_request))
        keep += [positions, context_lens, token_to_request]
        expansion = Expansion(context_lens.shape[0], ratio, token_topk + ratio - 1,
                              tokens_out.stride(0) if rows > 1 else 0, positions.dtype == torch.int64,
                              context_lens.dtype == torch.int64, token_to_request.dtype == torch.int64)
        addresses += [positions.data_ptr(), context_lens.data_ptr(), token_to_request.data_ptr(),
                      tokens_out.data_ptr()]
    else:
        addresses += [0, 0, 0, 0]
    addresses.append(workspace.data_ptr())
    call = kernels.launch_arguments(plan, rows, columns, row_stride, block_topk, vectorised, expansion)
    return call, addresses, target, keep


def _prepared_launch(name: str, kernel, call) -> native.PreparedLaunch:
    key = (id(kernel), name, call)
    with _lock:
        found = _prepared.get(key)
        if found is not None and found.kernel is kernel:
            _prepared.move_to_end(key)
            return found
    found = native.PreparedLaunch(name, kernel, call.grid, call.block, call.shared_bytes,
                                  tuple(pointer for pointer, _ in call.pointers), call.scalars, cooperative=True)
    with _lock:
        _prepared[key] = found
        if len(_prepared) > _MAX_PREPARED:
            _prepared.popitem(last=False)
    return found


def resident_plan(plan: kernels.Plan, kernel, platform: Platform, rows: int) -> kernels.Plan:
    """``plan`` with no more rows in flight than the driver's count of co-resident CTAs allows for the loaded
    ``kernel`` (the plan counts on its launch bounds' promise; registers or the shared-memory carveout could give
    fewer): the cooperative launch then never fails for its size. ``RuntimeError`` where not one row's CTAs fit."""
    key = (id(kernel), kernel.function.value, plan.variant.threads, plan.shared_bytes)
    per_multiprocessor = _resident.get(key)
    if per_multiprocessor is None:
        per_multiprocessor = _resident[key] = resident_blocks(kernel, plan.variant.threads, plan.shared_bytes)
    most = min(max(rows, 1), platform.multiprocessors * per_multiprocessor // plan.split)
    if most < 1:
        raise RuntimeError(f"{plan.describe()}: the driver fits {per_multiprocessor} CTAs a multiprocessor, fewer than "
                           f"one row's {plan.split} on {platform.multiprocessors} multiprocessors")
    return plan if plan.slots <= most else dataclasses.replace(plan, slots=most)


def grid_block_topk(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int, settings=None,
                    plan: kernels.Plan | None = None, expand_into: tuple | None = None,
                    workspace: torch.Tensor | None = None) -> None:
    """The grid select into ``out`` (int32 ``[tokens, block_topk]``, last dim contiguous) from fp32 ``logits [tokens,
    columns]`` (last dim contiguous, any row stride) and int32 ``visible [tokens]`` (read on the device, clamped to
    ``[0, columns]``), on CUDA tensors; ``expand_into`` (``TopkArgs.expand_into``) fuses the expansion; ``plan``: a
    ``kernels.Plan`` instead of ``choose_plan``'s (tests, benchmarks); ``workspace``: an int32 tensor of at least
    ``plan.workspace_words`` words, zeroed before its first launch and reused as the kernels leave it (default:
    ``workspace_for``). One cooperative launch on the current stream, with no more rows in flight than the driver
    fits at once (``resident_plan``: the grid is co-resident, or the launch fails rather than wait forever); the
    kernel is compiled into the JIT cache, or loaded from it, at its first use in a process (load it before
    capturing a graph: the first launch also sets its shared-memory attributes)."""
    rows, columns = logits.shape
    if rows == 0:
        return
    device = logits.device.index if logits.device.index is not None else torch.cuda.current_device()
    platform = Platform.of(torch.device("cuda", device))
    plan = plan or kernels.choose_plan(rows, columns, block_topk, platform)
    variant = plan.variant
    kernel = native.kernel_for(kernels.source(), variant.name, kernels.SPEC.defines(variant, platform.arch), device,
                               platform.arch, settings)
    plan = resident_plan(plan, kernel, platform, rows)
    if workspace is None:
        workspace = workspace_for(logits.device, plan.workspace_words)
    call, addresses, target, _keep = grid_topk_call(logits, visible, out, block_topk, plan, expand_into, workspace)
    name = GRID_TOPK_LAUNCH if expand_into is None else GRID_TOPK_EXPAND_LAUNCH
    _prepared_launch(name, kernel, call)(*addresses)
    if target is not out:
        out.copy_(target)


#: The grid select's kernels as the emulator builds them: name, pointer C types, scalar count (from the spec).
EMULATED_GRID_KERNELS = kernels.SPEC.emulator_kernels()


def emulated_grid_topk(logits: torch.Tensor, visible: torch.Tensor, out: torch.Tensor, block_topk: int,
                       plan: kernels.Plan, expand_into: tuple | None = None, workspace: torch.Tensor | None = None,
                       order_seed: int = 0, defines: tuple[str, ...] = ()) -> torch.Tensor:
    """``grid_block_topk`` on CPU tensors: the kernel of ``plan`` run by the CUDA emulator as a cooperative launch
    (every CTA of the grid together; ``runtime/jit/emulated.py``), for tests on machines without a GPU.
    ``workspace``: as on the GPU (default: a fresh zeroed one); ``order_seed`` picks the order the emulator resumes
    waiting threads in. Returns the workspace (to launch again with it). Raises ``emulated.EmulationError`` where the
    emulated kernel fails (a deadlock included)."""
    if workspace is None:
        workspace = torch.zeros(plan.workspace_words, dtype=torch.int32)
    if logits.shape[0] == 0:
        return workspace
    call, addresses, target, _keep = grid_topk_call(logits, visible, out, block_topk, plan, expand_into, workspace)
    lib = emulated.build(kernels.SOURCE_PATH, EMULATED_GRID_KERNELS, tuple(defines))
    emulated.run(lib, call, addresses, 1, order_seed, cooperative=True)
    if target is not out:
        out.copy_(target)
    return workspace

"""The Triton internals this library uses, in one place, with a branch where a release changed them.

Tested on Triton 3.6 (the GPU machine's) and 3.9 (what current torch installs); ``pyproject.toml`` declares that
range. The JIT cache (the ``runtime/jit`` package) and the ahead-of-time builds (``tools/aot.py``, ``tools/build.py``)
import Triton's private names from here only, and reach a ``JITFunction``'s internals (its per-device caches, binder
and argument packing, compile path and launch entry) and Triton's hooks through the functions here, so a new release
is adapted in this module. The JIT cache's two subclasses of Triton's classes (``CompiledKernel``,
``FileCacheManager``) are the other contact; the interpreter's dot, replaced for the tests and the fuzzer
(``install_uniform_interpreter_dots``), is the last.
"""

from __future__ import annotations

import importlib.util
import inspect
from functools import lru_cache

from triton import knobs  # noqa: F401 (re-exported)
from triton.knobs import HookChain
from triton._C.libtriton import get_cache_invalidating_env_vars  # noqa: F401
from triton.backends.compiler import GPUTarget  # noqa: F401
from triton.compiler.compiler import ASTSource, CompiledKernel, make_backend  # noqa: F401
from triton.runtime import driver  # noqa: F401
from triton.runtime.cache import FileCacheManager  # noqa: F401
from triton.runtime.jit import JITFunction, compute_cache_key, convert_to_tuple_if_list, create_function_from_signature  # noqa: F401
from triton.runtime.jit import serialize_specialization_data as _serialize_specialization_data

#: The Triton releases the CPU suite runs on (CI: the whole suite on the first, the compiler-facing tests on the
#: second).
TESTED_TRITON = ("3.6.0", "3.9.0")


@lru_cache(maxsize=1)
def _serialize_takes_target() -> bool:
    # Triton 3.9 added the compile target to the specialisation data (3.6: name .. key only).
    return "target" in inspect.signature(_serialize_specialization_data).parameters


def serialize_specialization(name: str, signature: dict, constants: dict, attrs: dict, options, key: str,
                             target) -> str:
    """Triton's JSON of a specialisation (what ``JITFunction.preload`` reads back), for ``target`` (a ``GPUTarget``)
    on releases that record it."""
    if _serialize_takes_target():
        return _serialize_specialization_data(name, signature, constants, attrs, options, key, target)
    return _serialize_specialization_data(name, signature, constants, attrs, options, key)


@lru_cache(maxsize=1)
def resolves_placeholders() -> bool:
    """Whether Triton's launch path resolves a cached object's ``result()`` (it came with asynchronous compilation,
    ``triton.runtime._async_compile``; Triton 3.6 has it)."""
    return importlib.util.find_spec("triton.runtime._async_compile") is not None


def kernel_cache(fn: JITFunction, device: int) -> dict:
    """A ``@triton.jit`` function's in-memory cache of compiled kernels for ``device``, keyed by launch key (made on
    first access, as a launch's binder creation makes it)."""
    return fn.device_caches[device][0]


def kernel_backend(fn: JITFunction, device: int):
    """The compiler backend of ``fn``'s cache for ``device``."""
    return fn.device_caches[device][3]


def compile_into_cache(fn: JITFunction, key: str, src: ASTSource, device: int, options) -> CompiledKernel:
    """Compile ``src`` through ``fn``'s own compile path for ``device`` (hooks, file cache and all) as a launch that
    missed its in-memory cache would, without launching."""
    return fn._do_compile(key, src.signature, device, src.constants, options, src.attrs, warmup=True)


def specialize_launch(fn: JITFunction, backend, args: tuple, kwargs: dict):
    """``fn(*args, **kwargs)`` bound and specialised as ``JITFunction.run`` does for ``backend``: ``(key, options,
    signature, constexprs, attrs)``, ``key`` being the launch key of Triton's in-memory cache."""
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug  # as JITFunction.run adds them
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound_args, specialization, options = binder(*args, **kwargs)
    key = compute_cache_key({}, specialization, options)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    return key, options, signature, constexprs, attrs


def install_compile_hooks(manager_class: type, before_compile, after_compile, chain) -> type:
    """Make ``manager_class`` Triton's file cache manager and ``before_compile`` / ``after_compile`` its pre- and
    post-compile hooks, each chained (``chain(ours, previous)``) with any already set. Returns the manager class
    Triton used before."""
    previous = knobs.cache.manager_class or FileCacheManager
    knobs.cache.manager_class = manager_class  # a class: Triton writes no environment variable for it
    knobs.runtime.jit_cache_hook = chain(before_compile, knobs.runtime.jit_cache_hook)
    knobs.runtime.jit_post_compile_hook = chain(after_compile, knobs.runtime.jit_post_compile_hook)
    return previous


def compiled_launcher(kernel: CompiledKernel, grid: tuple[int, int, int], device: int):
    """A function ``launch(params)`` launching the compiled ``kernel`` on ``device``'s current stream as
    ``JITFunction.run`` does once it has found it (same launcher, metadata and hooks), without binding or
    specialising: ``params`` are the values of every parameter of the kernel's signature, in order, constexprs
    included. Where the launcher's Python layer only inserts constants (``_launcher_entry``), its C entry is
    called directly."""
    current_stream = driver.active.get_current_stream
    run, function, packed = kernel.run, kernel.function, kernel.packed_metadata
    grid_x, grid_y, grid_z = grid
    entry = _launcher_entry(run)

    def launch(params: tuple) -> None:
        stream = current_stream(device)
        enter_hook, exit_hook = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _idle(enter_hook) and _idle(exit_hook):  # no hook to call: no launch metadata to build for one
            if entry is not None:
                entry[0](grid_x, grid_y, grid_z, stream, function, *entry[1], packed, None, None, None, *params)
            else:
                run(grid_x, grid_y, grid_z, stream, function, packed, None, None, None, *params)
            return
        metadata = kernel.launch_metadata(grid, stream, *params) if enter_hook is not None else None
        run(grid_x, grid_y, grid_z, stream, function, packed, metadata, enter_hook, exit_hook, *params)

    return launch


def _launcher_entry(launcher) -> tuple | None:
    """``(c_launch, inserted)``: the C function behind a kernel's launcher and the arguments its ``__call__``
    inserts after ``function``, where that is all the call does: Triton 3.6's CUDA launcher (``__call__(gridX, gridY,
    gridZ, stream, function, *args)``) for a kernel without global or profile scratch memory. None elsewhere (other
    releases and backends go through the launcher's ``__call__``)."""
    if type(launcher).__name__ != "CudaLauncher" or not _plain_call(type(launcher)):
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    return launcher.launch, (launcher.launch_cooperative_grid, launcher.launch_pdl, None, None)


@lru_cache(maxsize=None)
def _plain_call(launcher_type: type) -> bool:
    """Whether ``launcher_type.__call__`` takes ``(gridX, gridY, gridZ, stream, function, *args)`` (read once per
    type: ``inspect.signature`` is slow, and every plan's launches ask)."""
    params = list(inspect.signature(launcher_type.__call__).parameters)
    return params == ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]


def _idle(hook) -> bool:
    """Whether a launch hook knob calls nothing (unset, or a ``HookChain`` without hooks)."""
    return hook is None or (isinstance(hook, HookChain) and not hook.calls)


def install_uniform_interpreter_dots() -> None:
    """Make the Triton interpreter's ``tl.dot`` sum every output element in the same order (idempotent).

    The interpreter computes a dot with ``np.matmul``, whose BLAS kernel rounds an element by its place in the tile
    (vector body against tail, fused or separate multiply-adds, chosen by the CPU), so identical keys can score
    differently on one machine and alike on another. A GPU's MMA treats every element alike; this does too: fp32
    products, then one add per K step in K order, the same for every element. The package installs it at its first
    launch under the interpreter (``launching.scope``, never at import), as the test suite and the fuzzer do at
    their start; it changes nothing outside the interpreter.
    """
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "uniform_sums", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():
            a_data = interpreter._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
        if b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating():
            b_data = interpreter._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        acc = d.data.dtype
        # [..., M, K, N] products summed over K: a reduction over a non-contiguous axis adds K slices in order.
        products = a_data.astype(acc)[..., :, :, None] * b_data.astype(acc)[..., None, :, :]
        return interpreter.TensorHandle(products.sum(axis=-2, dtype=acc) + d.data, d.dtype.scalar)

    create_dot.uniform_sums = True
    builder.create_dot = create_dot


def interpreter_has_dot_scaled() -> bool:
    """Whether Triton's interpreter runs ``tl.dot_scaled`` (Triton 3.9 does; 3.6's has no ``create_dot_scaled``), so
    that the block-scaled MXFP4 path (``SCALED_MMA``) can be checked on a CPU."""
    from triton.runtime import interpreter

    return hasattr(interpreter.InterpreterBuilder, "create_dot_scaled")


def ptxas_path(capability: int) -> str:
    """The ``ptxas`` Triton compiles PTX for compute capability ``capability`` (90 for sm_90) with: Triton 3.9 uses
    its newer ``ptxas-blackwell`` from sm_90 on (the other cannot read the PTX version it writes), 3.6 from sm_100."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(capability).path

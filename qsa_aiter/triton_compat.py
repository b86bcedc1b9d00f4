"""The Triton internals this library uses, in one place, with a branch where a release changed them.

Tested on Triton 3.6 (the GPU machine's) and 3.9 (what current torch installs); ``pyproject.toml`` declares that
range. The JIT cache (``jit_cache``) and the ahead-of-time builds (``aot``) import Triton's private names from here
only, so a new release is adapted in this module. The attribute-level internals the JIT cache still reaches into
(a ``JITFunction``'s ``device_caches`` and ``_pack_args``, the ``knobs`` hooks) are named in its docstrings.
"""

from __future__ import annotations

import importlib.util
import inspect
from functools import lru_cache

from triton import knobs  # noqa: F401 (re-exported)
from triton._C.libtriton import get_cache_invalidating_env_vars  # noqa: F401
from triton.backends.compiler import GPUTarget  # noqa: F401
from triton.compiler.compiler import ASTSource, CompiledKernel, make_backend  # noqa: F401
from triton.runtime import driver  # noqa: F401
from triton.runtime.cache import FileCacheManager  # noqa: F401
from triton.runtime.jit import (  # noqa: F401
    JITFunction, compute_cache_key, convert_to_tuple_if_list, create_function_from_signature,
    serialize_specialization_data as _serialize_specialization_data,
)

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

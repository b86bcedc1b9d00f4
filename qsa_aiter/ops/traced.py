"""The public functions under ``torch.compile``: traced, each becomes its custom op (``qsa_aiter.ops.custom_ops``).

Dynamo cannot trace the eager functions' dispatch (registry, settings, logging, memo tables), so while it traces a
decorated function the call goes to the custom-op wrapper of the same name and arguments, which it records as one
opaque call; eagerly (and inside the custom op itself) the function runs as written. Code that calls the plain
``qsa_aiter.qsa_*`` functions therefore compiles with ``fullgraph=True``. The decorated function's signature is the
op's one declaration: ``custom_ops`` generates the custom ops and the wrapper from it (``declarations.py``), and
type checkers see it too (the decorator is typed with a ``ParamSpec``: tests/typing/public_api.py checks it).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")

#: Every decorated public function by name: each needs an ``OpDeclaration`` in ``custom_ops`` (a test checks it).
TRACED: dict[str, Callable[..., Any]] = {}


def through_custom_op(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate public function ``fn``: traced by ``torch.compile``, ``custom_ops.<fn.__name__>`` runs instead.
    The result keeps ``fn``'s signature and return type, for ``inspect.signature`` and for type checkers."""

    @functools.wraps(fn)
    def public(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.compiler.is_compiling():
            from . import custom_ops  # imports this package's op modules: not at import time

            # The wrapper of the same name has fn's signature and results (declarations.register).
            result: R = getattr(custom_ops, fn.__name__)(*args, **kwargs)
            return result
        return fn(*args, **kwargs)

    TRACED[fn.__name__] = public
    return public

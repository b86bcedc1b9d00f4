"""A public op's custom ops, generated from its one declaration: the public function's Python signature.

``register(OpDeclaration(public, mutated, fake), namespace)`` reads ``inspect.signature(public)`` (parameter names,
order, annotations, defaults and the return annotation) and registers:

- ``<namespace>::<name>`` (``name``: the public name without its ``qsa_`` prefix): the public parameters but ``out``,
  in their order, all positional and without defaults (keyword-only ones included, so that a schema has one calling
  convention); it returns what the public function returns and declares ``mutated`` as written in place.
- Where the public function takes ``out``: ``<name>_out``, the same parameters then ``Tensor(a!) out``. A custom op
  may not return one of its inputs, so it returns the public results after the first (which is ``out``), or nothing.
- Their implementations: the public (eager) function, called with the arguments by name.
- Their fakes: ``fake(call)``, written once per op, gets the public call's arguments by name (``call["out"]`` is None
  for the plain op) and returns the public results as new (fake) tensors; the ``_out`` variant drops the first.

and returns the wrapper: a function with the public signature (``inspect.signature`` equal to the public one) that
calls the plain op, or the ``_out`` op when ``out`` is given, and returns what the public function returns (``out``
itself in first place). ``torch.compile`` traces the wrapper and records the op as one opaque call.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, ParamSpec, TypeVar

import torch

#: A call's arguments by parameter name (defaults filled in), as the fakes and the engine drop-ins receive them.
Call = dict[str, Any]

P = ParamSpec("P")
R = TypeVar("R")


def argument_binder(signature: inspect.Signature) -> Callable[[tuple, dict], Call]:
    """``bind(args, kwargs)``: the arguments of a call to a function with ``signature``, by name, defaults filled in
    (what ``signature.bind(*args, **kwargs)`` plus ``apply_defaults()`` gives).

    Plain dict work rather than ``inspect.Signature.bind``: several times faster on the host path, and code that
    dynamo traces (``fullgraph=True``) without relying on its support for ``inspect``. A call the signature does not
    accept raises ``signature.bind``'s own ``TypeError``. Positional-only and ``*args``/``**kwargs`` parameters are
    not supported (no public op has them).
    """
    parameters = signature.parameters.values()
    odd = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if odd:
        raise TypeError(f"argument_binder: parameters {odd} are positional-only or variadic")
    positional = tuple(p.name for p in parameters if p.kind == p.POSITIONAL_OR_KEYWORD)
    names = frozenset(signature.parameters)
    defaults = {p.name: p.default for p in parameters if p.default is not p.empty}

    def bind(args: tuple, kwargs: dict) -> Call:
        values = dict(defaults)
        values.update(zip(positional, args))
        values.update(kwargs)
        # A valid call fills every name exactly once; anything else is left to `signature.bind` to name.
        if len(args) > len(positional) or len(values) != len(names) or (kwargs and any(
                [name not in names or name in positional[:len(args)] for name in kwargs])):
            signature.bind(*args, **kwargs)
        return values

    return bind


def taking_arguments_of(public: Callable[P, Any]) -> Callable[[Callable[[Call], R]], Callable[P, R]]:
    """Decorate ``body(call) -> R`` into a function that takes ``public``'s arguments: its signature (names, order,
    defaults, keyword-only ones; the return annotation is ``body``'s), for ``inspect.signature``, type checkers
    (``ParamSpec``) and ``help()``. The call's arguments reach ``body`` by name, defaults filled in
    (``argument_binder``). A call that ``public`` would not accept raises ``TypeError`` naming the function, what is
    missing or not accepted, and ``public``'s parameters (``explain()`` with no arguments names the six it needs)."""

    def make(body: Callable[[Call], R]) -> Callable[P, R]:
        declared = inspect.signature(public)
        bind = argument_binder(declared)

        def taking(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                call = bind(args, kwargs)
            except TypeError as err:
                raise _not_accepted(body.__name__, public.__name__, declared, args, kwargs, err) from None
            return body(call)

        functools.update_wrapper(taking, body)
        # A function's __signature__ is what inspect.signature reports (a run-time attribute typeshed lacks).
        taking.__signature__ = declared.replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(body).return_annotation)
        return taking

    return make


def _not_accepted(name: str, public: str, signature: inspect.Signature, args: tuple, kwargs: dict,
                  err: TypeError) -> TypeError:
    """The ``TypeError`` of a call of ``name`` (taking ``public``'s ``signature``) with ``args`` and ``kwargs`` that
    the signature does not accept (``err``: what ``signature.bind`` said): every required parameter not given, or
    ``err``'s reason."""
    parameters = signature.parameters
    positional = [p.name for p in parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    given = set(positional[: len(args)]) | set(kwargs)
    missing = [p.name for p in parameters.values() if p.default is p.empty and p.name not in given]
    reason = f"missing {', '.join(missing)}" if missing else str(err)
    plain = signature.replace(parameters=[p.replace(annotation=p.empty) for p in parameters.values()],
                              return_annotation=inspect.Signature.empty)
    return TypeError(f"{name}() takes the arguments of {public}{plain}: {reason}")


@dataclass(frozen=True)
class OpDeclaration:
    """A public op as a custom op: everything but ``mutated`` and ``fake`` comes from ``public``'s signature."""

    #: The public eager function (``qsa_aiter.ops.scoring.qsa_paged_mqa_logits``, ...): the declaration.
    public: Callable
    #: Arguments it writes in place other than ``out`` (``out`` is declared written in the ``_out`` variant).
    mutated: tuple[str, ...]
    #: ``fake(call) -> results``: the public results' shapes and dtypes (new tensors) without reading tensor data,
    #: validating the arguments like the eager op where every shape is static.
    fake: Callable[[Call], Any]

    @property
    def name(self) -> str:
        """The op's name in its namespace: the public name without ``qsa_``."""
        return self.public.__name__.removeprefix("qsa_")


def _results(annotation) -> tuple:
    """The result types of a return annotation: ``tuple[A, B]`` -> ``(A, B)``, ``A`` -> ``(A,)``, ``None`` -> ``()``."""
    if annotation is None or annotation is type(None):
        return ()
    if typing.get_origin(annotation) is tuple:
        return typing.get_args(annotation)
    return (annotation,)


def _returning(results: tuple):
    """The return annotation of ``results`` (the inverse of ``_results``)."""
    if not results:
        return None
    # A tuple type built at run time, for torch.library's schema inference (not a static annotation).
    return results[0] if len(results) == 1 else tuple[results]  # type: ignore[valid-type]


def _custom_op(namespace: str, name: str, parameters: list[inspect.Parameter], returns, mutated: tuple[str, ...],
               run: Callable[[Call], Any], fake: Callable[[Call], Any]):
    """Register ``namespace::name`` taking ``parameters`` (positional, no defaults; the schema is inferred from their
    annotations) and returning ``returns``; its implementation ``run(call)`` and fake ``fake(call)`` get the
    arguments by name. Returns the ``torch.ops`` overload packet."""
    names = tuple(p.name for p in parameters)

    def by_name(args: tuple, kwargs: dict) -> Call:
        call = dict(zip(names, args))
        call.update(kwargs)
        return call

    def implementation(*args, **kwargs):
        return run(by_name(args, kwargs))

    def fake_implementation(*args, **kwargs):
        return fake(by_name(args, kwargs))

    implementation.__name__ = implementation.__qualname__ = name
    implementation.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        parameters, return_annotation=returns)
    torch.library.custom_op(f"{namespace}::{name}", implementation, mutates_args=mutated).register_fake(
        fake_implementation)
    return getattr(getattr(torch.ops, namespace), name)


def register(declaration: OpDeclaration, namespace: str, module: str) -> Callable:
    """Register ``declaration``'s custom op (and ``_out`` variant) under ``namespace``; return its wrapper, named as
    the public function and defined in ``module`` (where it is bound, so that it pickles and documents by name)."""
    public, name, fake = declaration.public, declaration.name, declaration.fake
    declared = inspect.signature(public)  # as callers see it (annotations as written)
    resolved = inspect.signature(public, eval_str=True)  # annotations as types, for the schema
    results = _results(resolved.return_annotation)
    takes_out = "out" in declared.parameters
    if takes_out and (not results or results[0] is not torch.Tensor):
        raise TypeError(f"{public.__name__}: an op taking `out` must return it first; returns {results}")
    parameters = [p.replace(kind=p.POSITIONAL_OR_KEYWORD, default=p.empty)
                  for p in resolved.parameters.values() if p.name != "out"]
    names = tuple(p.name for p in parameters)
    count = len(results)

    def after_out(public_results):
        """The ``_out`` variant's return: the public results after ``out``."""
        if count == 1:
            return None
        return public_results[1] if count == 2 else tuple(public_results[1:])

    plain_op = _custom_op(namespace, name, parameters, resolved.return_annotation, declaration.mutated,
                          run=lambda call: public(**call),
                          fake=lambda call: fake({**call, "out": None} if takes_out else call))
    out_op = None
    if takes_out:
        out_parameter = inspect.Parameter("out", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)
        out_op = _custom_op(namespace, f"{name}_out", [*parameters, out_parameter], _returning(results[1:]),
                            ("out", *declaration.mutated),
                            run=lambda call: after_out(public(**call)), fake=lambda call: after_out(fake(call)))
    bind = argument_binder(declared)

    def wrapper(*args, **kwargs):
        call = bind(args, kwargs)
        values = [call[n] for n in names]
        out = call["out"] if takes_out else None
        if out is None:
            return plain_op(*values)
        rest = out_op(*values, out)
        if count == 1:
            return out
        return (out, rest) if count == 2 else (out, *rest)

    wrapper.__name__ = wrapper.__qualname__ = public.__name__
    wrapper.__module__ = module
    wrapper.__signature__ = declared  # type: ignore[attr-defined]
    variants = f"``torch.ops.{namespace}.{name}``" + (f" (``{name}_out`` when ``out`` is given)" if takes_out else "")
    wrapper.__doc__ = (f"``qsa_aiter.{public.__name__}`` through the custom op {variants}: the same arguments, "
                       f"results, shapes and dtypes.\n\n{inspect.getdoc(public) or ''}")
    return wrapper

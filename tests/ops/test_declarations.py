"""``qsa_aiter.ops.declarations``: the argument binder against ``inspect.Signature.bind``, and the custom ops, fakes
and wrapper generated from a toy public function (three results, an ``out``, a keyword-only argument and a second
argument written in place), registered in a namespace of their own."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from qsa_aiter.ops.declarations import OpDeclaration, argument_binder, register

NAMESPACE = "qsa_aiter_declarations_test"


def qsa_scale_rows(x: torch.Tensor, factor: float = 2.0, counts: torch.Tensor | None = None, *,
                   bias: int | None = None, out: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x * factor + bias, row sums, row maxima)`` of fp32 ``x`` ``[rows, cols]``; the first result is written
    into ``out`` when given; ``counts`` (int32 ``[rows]``), when given, is filled with ``cols``."""
    if factor <= 0:
        raise ValueError("qsa_scale_rows: `factor` must be positive")
    scaled = x * factor + (bias or 0)
    if out is not None:
        out.copy_(scaled)
        scaled = out
    if counts is not None:
        counts.fill_(x.shape[1])
    return scaled, scaled.sum(dim=1), scaled.amax(dim=1)


def _scale_rows_fake(call):
    if call["factor"] <= 0:
        raise ValueError("qsa_scale_rows: `factor` must be positive")
    x = call["x"]
    return torch.empty_like(x), x.new_empty((x.shape[0],)), x.new_empty((x.shape[0],))


@pytest.fixture(scope="module")
def scale_rows():
    return register(OpDeclaration(qsa_scale_rows, mutated=("counts",), fake=_scale_rows_fake), NAMESPACE, __name__)


# ---------------------------------------------------------------------------------------------------------------
# argument_binder
# ---------------------------------------------------------------------------------------------------------------


def bound(signature, *args, **kwargs):
    """What ``inspect.Signature.bind`` gives (the reference), or the ``TypeError`` it raises."""
    try:
        b = signature.bind(*args, **kwargs)
    except TypeError as err:
        return err
    b.apply_defaults()
    return dict(b.arguments)


CALLS = [((1,), {}), ((1, 3.0), {}), ((1, 3.0, 5), {"bias": 2}), ((1,), {"out": 7, "counts": 4}),
         ((), {"x": 1, "factor": 9.0}),
         # Not accepted: missing, too many, twice, unknown, keyword-only given positionally.
         ((), {}), ((1, 2.0, 3, 4), {}), ((1,), {"x": 1}), ((1,), {"bogus": 1}), ((1,), {"factor": 2.0, "y": 0})]


@pytest.mark.parametrize("args,kwargs", CALLS)
def test_binder_gives_what_signature_bind_gives(args, kwargs):
    signature = inspect.signature(qsa_scale_rows)
    want = bound(signature, *args, **kwargs)
    bind = argument_binder(signature)
    if isinstance(want, TypeError):
        with pytest.raises(TypeError, match=re.escape(str(want))):
            bind(args, kwargs)
    else:
        assert bind(args, kwargs) == want


def test_binder_refuses_variadic_signatures():
    with pytest.raises(TypeError, match="variadic"):
        argument_binder(inspect.signature(lambda x, *rest: None))


# ---------------------------------------------------------------------------------------------------------------
# register
# ---------------------------------------------------------------------------------------------------------------


def test_schemas_are_derived_from_the_signature(scale_rows):
    ops = getattr(torch.ops, NAMESPACE)
    assert str(ops.scale_rows.default._schema) == (
        f"{NAMESPACE}::scale_rows(Tensor x, float factor, Tensor(a2!)? counts, SymInt? bias)"
        " -> (Tensor, Tensor, Tensor)")
    assert str(ops.scale_rows_out.default._schema) == (
        f"{NAMESPACE}::scale_rows_out(Tensor x, float factor, Tensor(a2!)? counts, SymInt? bias, Tensor(a4!) out)"
        " -> (Tensor, Tensor)")


def test_wrapper_keeps_the_public_signature_and_results(scale_rows):
    assert inspect.signature(scale_rows) == inspect.signature(qsa_scale_rows)
    assert (scale_rows.__name__, scale_rows.__module__) == ("qsa_scale_rows", __name__)
    x = torch.arange(12.0).view(3, 4)
    counts = torch.zeros(3, dtype=torch.int32)
    want = qsa_scale_rows(x, 3.0, bias=1)
    got = scale_rows(x, 3.0, counts, bias=1)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)) and bool((counts == 4).all())
    out = torch.zeros(3, 4)
    got = scale_rows(x, factor=3.0, bias=1, out=out)
    assert got[0] is out and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with pytest.raises(TypeError, match="bogus"):
        scale_rows(x, bogus=1)


def test_fakes_give_shapes_and_the_eager_errors(scale_rows):
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.zeros(5, 3))
        scaled, sums, maxima = scale_rows(x)
        assert (scaled.shape, sums.shape, maxima.shape) == ((5, 3), (5,), (5,))
        out = mode.from_tensor(torch.zeros(5, 3))
        assert scale_rows(x, out=out)[0] is out
        with pytest.raises(ValueError, match="`factor`"):
            scale_rows(x, -1.0, out=out)


@pytest.mark.parametrize("variant", ["scale_rows", "scale_rows_out"])
def test_opcheck_of_the_generated_ops(scale_rows, variant):
    x = torch.randn(4, 6)
    args = (x, 1.5, torch.zeros(4, dtype=torch.int32), 2)
    if variant == "scale_rows_out":
        args = (*args, torch.zeros(4, 6))
    result = torch.library.opcheck(getattr(getattr(torch.ops, NAMESPACE), variant).default, args)
    assert set(result.values()) == {"SUCCESS"}, result


def test_an_op_taking_out_must_return_it_first():
    def qsa_bad(x: torch.Tensor, out: torch.Tensor | None = None) -> None:
        pass

    with pytest.raises(TypeError, match="must return it first"):
        register(OpDeclaration(qsa_bad, mutated=(), fake=lambda call: None), NAMESPACE, __name__)


def test_the_wrapper_compiles_with_fullgraph(scale_rows):
    x = torch.arange(12.0).view(3, 4)
    out = torch.zeros(3, 4)
    compiled = torch.compile(lambda x, out: scale_rows(x, 2.0, bias=3, out=out)[1], fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, out), qsa_scale_rows(x, 2.0, bias=3)[1])
    assert torch.equal(out, x * 2 + 3)

"""The Triton interpreter's ``tl.dot`` with ``install_uniform_interpreter_dots``: every output element is summed in
one order, so identical columns (keys) and identical rows give identical bits at any place in the tile, on any CPU."""

import pytest
import torch
import triton
import triton.language as tl

from qsa_aiter.runtime.jit.triton_compat import install_uniform_interpreter_dots
from qsa_aiter.kernels.platform import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="checks the interpreter's dot (TRITON_INTERPRET=1)")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    m = tl.arange(0, M)
    k = tl.arange(0, K)
    n = tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(16, 64, 16), (64, 128, 64), (32, 32, 128)])
def test_identical_columns_and_rows_give_identical_bits(rng, dtype, shape):
    install_uniform_interpreter_dots()
    install_uniform_interpreter_dots()  # idempotent: the second call keeps the first wrapper
    M, K, N = shape
    a = torch.randn(M, K, generator=rng).to(dtype)
    a[M // 2:] = a[0]  # identical rows in the lower half
    b = torch.randn(K, 1, generator=rng).to(dtype).repeat(1, N)  # every column the same key
    b[:, N // 3] = torch.randn(K, generator=rng).to(dtype)  # and one that differs
    out = torch.full((M, N), float("nan"))
    _dot_kernel[(1,)](a, b, out, M, K, N)
    expected = a.double() @ b.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    same = torch.ones(N, dtype=torch.bool)
    same[N // 3] = False
    bits = out.view(torch.int32)
    assert (bits[:, same] == bits[:, same][:, :1]).all(), "identical columns summed differently"
    assert (bits[M // 2:] == bits[0]).all(), "identical rows summed differently"

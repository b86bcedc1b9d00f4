"""``make_batch`` (``qsa_aiter/tools/workloads.py``) speaks the cache formats' vocabulary: a format by name, q of the
format's query dtype by default, a 16-bit cache of q's dtype when no format is named, the former ``16bit`` with a
``DeprecationWarning``, and a 16-bit format that contradicts q's dtype refused."""

from __future__ import annotations

import warnings

import pytest
import torch

from qsa_aiter.kernels.quant.formats import CACHE_FORMATS
from qsa_aiter.tools.workloads import make_batch


def _batch(**kwargs):
    return make_batch([300, 70], 2, head_dim=64, page_size=16, generator=torch.Generator().manual_seed(0), **kwargs)


@pytest.mark.parametrize("name", list(CACHE_FORMATS))
def test_every_format_by_name(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batch = _batch(cache=name)
    fmt = CACHE_FORMATS[name]
    assert batch.cache_format == name and batch.compressed_k_cache.dtype == fmt.dtype
    assert batch.q.dtype == fmt.query_dtype and (batch.k_scale is None) == (fmt.kind == "bf16")


def test_no_format_is_a_16bit_cache_of_q():
    assert _batch().compressed_k_cache.dtype == torch.bfloat16
    fp16 = _batch(dtype=torch.float16)
    assert fp16.cache_format == "fp16" and fp16.q.dtype == fp16.compressed_k_cache.dtype == torch.float16
    fp8 = _batch(cache="fp8", dtype=torch.float16)
    assert fp8.q.dtype == torch.float16 and fp8.compressed_k_cache.dtype == torch.float8_e4m3fn


def test_the_same_inputs_under_the_former_spelling():
    with pytest.warns(DeprecationWarning, match="'16bit' is now spelled 'fp16'") as caught:
        former = _batch(cache="16bit", dtype=torch.float16)
    assert caught[0].filename == __file__
    now = _batch(cache="fp16")
    assert former.cache_format == "fp16"
    for a, b in zip(former.args(), now.args()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_a_16bit_format_must_be_qs_dtype():
    with pytest.raises(ValueError, match="a 16-bit cache has q's dtype"):
        _batch(cache="bf16", dtype=torch.float16)
    with pytest.raises(ValueError, match="index-cache format must be one of"):
        _batch(cache="int8")

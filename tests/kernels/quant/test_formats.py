"""The index-cache formats' one vocabulary (``qsa_aiter/kernels/quant/formats.py``, docs/cache_formats.md): every
format by its name, former spellings accepted with a ``DeprecationWarning`` that names the new one, anything else a
``ValueError`` that names what is accepted; ``allocate_index_cache`` speaks it."""

from __future__ import annotations

import warnings

import pytest
import torch

from qsa_aiter import allocate_index_cache
from qsa_aiter.kernels.quant.formats import CACHE_FORMATS, FORMER_SPELLINGS, cache_kind, canonical_format

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn,
          "fp8_fnuz": torch.float8_e4m3fnuz, "fp4": torch.float4_e2m1fn_x2}


def test_the_formats_and_their_kinds():
    assert {name: fmt.dtype for name, fmt in CACHE_FORMATS.items()} == DTYPES
    assert {name: fmt.kind for name, fmt in CACHE_FORMATS.items()} == {
        "bf16": "bf16", "fp16": "bf16", "fp8": "fp8", "fp8_fnuz": "fp8", "fp4": "fp4"}
    assert {name: fmt.query_dtype for name, fmt in CACHE_FORMATS.items()} == {
        "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16, "fp8_fnuz": torch.bfloat16,
        "fp4": torch.bfloat16}


@pytest.mark.parametrize("name", list(CACHE_FORMATS))
def test_a_format_name_is_its_own_spelling(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert canonical_format(name) == name


@pytest.mark.parametrize("spelling, q_dtype, name", [
    ("fp8_e4m3fn", torch.bfloat16, "fp8"), ("fp8_e4m3fnuz", torch.bfloat16, "fp8_fnuz"),
    ("16bit", torch.bfloat16, "bf16"), ("16bit", torch.float16, "fp16")])
def test_former_spellings_warn_naming_the_new_one(spelling, q_dtype, name):
    with pytest.warns(DeprecationWarning, match=f"'{spelling}' is now spelled '{name}'") as caught:
        assert canonical_format(spelling, q_dtype=q_dtype) == name
    assert caught[0].filename == __file__  # the warning names the caller's line
    assert set(FORMER_SPELLINGS) == {"fp8_e4m3fn", "fp8_e4m3fnuz", "16bit"}


@pytest.mark.parametrize("spelling", ["fp6", "FP8", "e4m3", "", None])
def test_anything_else_names_the_accepted_spellings(spelling):
    with pytest.raises(ValueError, match="bf16, fp16, fp8, fp8_fnuz, fp4") as info:
        canonical_format(spelling)
    assert repr(spelling) in str(info.value) and "fp8_e4m3fn" in str(info.value)


@pytest.mark.parametrize("name", list(CACHE_FORMATS))
def test_allocate_every_format_by_name(name):
    cache, scale = allocate_index_cache(name, 3, 16, 64)
    assert cache.dtype == DTYPES[name] and cache_kind(cache) == CACHE_FORMATS[name].kind
    assert cache.shape == (3, 16, 1, 32 if name == "fp4" else 64)
    assert (scale is None) == (CACHE_FORMATS[name].kind == "bf16")


def test_allocate_takes_former_spellings_and_the_fp8_dtype():
    with pytest.warns(DeprecationWarning, match="'fp8_e4m3fnuz' is now spelled 'fp8_fnuz'") as caught:
        cache, _ = allocate_index_cache("fp8_e4m3fnuz", 2, 16, 64)
    assert cache.dtype == torch.float8_e4m3fnuz and caught[0].filename == __file__
    assert allocate_index_cache("fp8", 2, 16, 64, fp8_dtype=torch.float8_e4m3fnuz)[0].dtype == torch.float8_e4m3fnuz
    with pytest.raises(ValueError, match="`fp8_dtype` must be float8_e4m3fnuz"):
        allocate_index_cache("fp8_fnuz", 2, 16, 64, fp8_dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="allocate_index_cache: `fp8_dtype` must be"):
        allocate_index_cache("fp8", 2, 16, 64, fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="allocate_index_cache: `cache_format` must be one of"):
        allocate_index_cache("int8", 2, 16, 64)

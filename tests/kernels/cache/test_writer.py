"""Index-cache formats and the writer: byte-level rules, the Triton writer against the torch reference, validation.

On CPU-only machines the Triton writer runs under the interpreter (tests/conftest.py); the GPU test runs it on the
device. Both must write exactly the reference's bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from qsa_aiter.kernels.cache import writer
from qsa_aiter.ops.cache import qsa_write_index_cache
from qsa_aiter.kernels.cache.reference import last_writer_slots, write_reference
from qsa_aiter.kernels.quant.formats import (
    E2M1_VALUES, allocate_index_cache, dequantize_cache, e2m1_codes, quantize_fp4, quantize_fp8,
)

ROOT = Path(__file__).resolve().parents[3]
FORMATS = [("bf16", None), ("fp16", None), ("fp8", torch.float8_e4m3fn), ("fp8", torch.float8_e4m3fnuz),
           ("fp4", None)]


def _alloc(kind, fp8_dtype, pages=4, page_size=16, head_dim=128, device="cpu"):
    cache, scale = allocate_index_cache(kind, pages, page_size, head_dim, device=device,
                                        **({"fp8_dtype": fp8_dtype} if fp8_dtype else {}))
    # Poison: every byte 0x5A, so untouched slots are visible.
    cache.view(torch.uint8).fill_(0x5A)
    if scale is not None:
        scale.view(torch.uint8).fill_(0x5A)
    return cache, scale


def _bytes(t):
    return None if t is None else t.view(torch.uint8).clone()


def test_e2m1_ties_go_to_even_and_saturate_at_6():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e9, 0.26, 0.0, -0.25, -0.5, -6.5])
    assert e2m1_codes(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 1, 0, 0, 9, 15]
    assert E2M1_VALUES[2] == 1.0 and E2M1_VALUES[7] == 6.0


def test_fp4_exponent_nibble_order_and_zero_block():
    keys = torch.zeros(1, 64)
    keys[0, 0], keys[0, 1], keys[0, 2] = 6.0, 1.0, -0.5  # block 0: amax 6 -> floor(log2 6) - 2 = 0 -> e8m0 127
    packed, exps = quantize_fp4(keys)
    assert exps.tolist() == [[127, 0]]  # block 1 is all zero: exponent byte 0
    assert packed[0, 0].item() == 0x7 | (0x2 << 4)  # element 0 (6.0 -> code 7) low, element 1 (1.0 -> code 2) high
    assert packed[0, 1].item() == 0x9  # element 2: -0.5 -> sign | code 1
    assert int(packed[0, 16:].sum()) == 0
    keys2 = torch.zeros(1, 32)
    keys2[0, 0] = 1.0  # amax 1 -> exponent 2**-2 -> 1.0 / 0.25 = 4 -> code 6
    packed2, exps2 = quantize_fp4(keys2)
    assert exps2.tolist() == [[125]] and packed2[0, 0].item() == 6


def test_fp8_scale_rule():
    keys = torch.zeros(2, 128)
    keys[1, 5] = -3.0
    for dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        values, scale = quantize_fp8(keys, dtype)
        fmax = torch.finfo(dtype).max
        assert scale[0].item() == pytest.approx(1e-4 / fmax, rel=1e-6)  # all-zero row: the 1e-4 floor
        assert scale[1].item() == pytest.approx(3.0 / fmax, rel=1e-6)
        assert values[1, 5].float().item() == -fmax and values[0].float().abs().max().item() == 0


@pytest.mark.parametrize("kind,fp8_dtype", FORMATS, ids=lambda v: str(v).removeprefix("torch."))
def test_writer_matches_reference_bytes_and_skips(kind, fp8_dtype, rng):
    tokens = 24
    keys = (torch.randn(tokens, 1, 128, generator=rng) * torch.logspace(-4, 4, tokens)[:, None, None])
    keys = keys.to(torch.bfloat16)
    keys[3] = 0
    keys[5, 0, :6] = torch.tensor([0.25, 0.75, -1.25, 1.75, 2.5, 5.0])
    slots = torch.randperm(64, generator=rng)[:tokens].to(torch.int32)
    slots[2], slots[7] = -1, 4 * 16 + 3  # a skipped token and a slot past the cache
    got, got_scale = _alloc(kind, fp8_dtype)
    want, want_scale = _alloc(kind, fp8_dtype)
    qsa_write_index_cache(keys, slots, got, got_scale)
    write_reference(keys[:, 0], slots, want, want_scale)
    assert torch.equal(_bytes(got), _bytes(want))
    if got_scale is not None:
        assert torch.equal(_bytes(got_scale), _bytes(want_scale))
    # Slots nobody wrote keep the poison, in every page.
    written = set(slots[(slots >= 0) & (slots < 64)].tolist())
    flat = _bytes(got).reshape(64, -1)
    for slot in range(64):
        if slot not in written:
            assert bool((flat[slot] == 0x5A).all()), f"slot {slot} was written"


@pytest.mark.parametrize("kind,fp8_dtype", FORMATS, ids=lambda v: str(v).removeprefix("torch."))
def test_dequantised_cache_is_close(kind, fp8_dtype, rng):
    keys = torch.randn(16, 128, generator=rng).to(torch.bfloat16)
    cache, scale = allocate_index_cache(kind, 1, 16, 128, **({"fp8_dtype": fp8_dtype} if fp8_dtype else {}))
    qsa_write_index_cache(keys, torch.arange(16, dtype=torch.int32), cache, scale)
    err = (dequantize_cache(cache, scale)[0, :, 0] - keys.float()).abs()
    amax = keys.float().abs().amax(dim=1, keepdim=True)
    # Half a quantum at the top of each format's range, relative to the row's (or block's) amax.
    bound = {"bf16": 0.0, "fp16": 2.0**-11, "fp8": 2.0**-4, "fp4": 0.25}[kind]
    assert bool((err <= bound * amax + 1e-6).all()), float((err / amax).max())


def test_writer_validation_names_the_argument():
    cache, scale = allocate_index_cache("fp8", 2, 16, 128)
    keys = torch.randn(4, 128).to(torch.bfloat16)
    slots = torch.arange(4, dtype=torch.int32)
    before = _bytes(cache)
    cases = [
        (dict(keys=keys[:, :64]), ValueError, "`keys`"),  # the cache fixes head_dim: the keys are at fault
        (dict(keys=keys.float()[:, None, None]), ValueError, "`keys`"),
        (dict(keys=keys.to(torch.int32)), TypeError, "`keys`"),
        (dict(slot_mapping=slots.float()), TypeError, "`slot_mapping`"),
        (dict(slot_mapping=slots[:3]), ValueError, "`slot_mapping`"),
        (dict(k_scale=None), TypeError, "`k_scale`"),
        (dict(k_scale=scale[:1]), ValueError, "`k_scale`"),
        (dict(cache=cache.view(torch.uint8)), TypeError, "`cache`"),
    ]
    for change, kind, name in cases:
        call = dict(keys=keys, slot_mapping=slots, cache=cache, k_scale=scale) | change
        with pytest.raises(kind, match=name):
            qsa_write_index_cache(**call)
    assert torch.equal(_bytes(cache), before)
    with pytest.raises(ValueError, match="`head_dim` must be divisible by 32"):
        allocate_index_cache("fp4", 1, 16, 100)


_CHILD = r"""
from qsa_aiter.tools.aot import TARGETS, compile_cache_writer
for kind in ("bf16", "fp8", "fp8_fnuz", "fp4"):
    for target in TARGETS:
        asm = compile_cache_writer(kind, target).asm
        assert asm.get("cubin") or asm.get("hsaco"), (kind, target)
print("WRITER-AOT-OK")
"""


def test_writer_compiles_for_every_target():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "WRITER-AOT-OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/HIP GPU")
@pytest.mark.parametrize("kind,fp8_dtype", FORMATS, ids=lambda v: str(v).removeprefix("torch."))
def test_gpu_writer_matches_reference_bytes(kind, fp8_dtype):
    gen = torch.Generator().manual_seed(7)
    keys = (torch.randn(300, 128, generator=gen) * torch.logspace(-4, 4, 300)[:, None]).to(torch.bfloat16)
    slots = torch.randperm(4096, generator=gen)[:300].to(torch.int32)
    slots[::17] = -1
    got, got_scale = _alloc(kind, fp8_dtype, pages=64, page_size=64, device="cuda")
    want, want_scale = _alloc(kind, fp8_dtype, pages=64, page_size=64)
    qsa_write_index_cache(keys.cuda(), slots.cuda(), got, got_scale)
    write_reference(keys, slots, want, want_scale)
    assert torch.equal(_bytes(got).cpu(), _bytes(want))
    if got_scale is not None:
        assert torch.equal(_bytes(got_scale).cpu(), _bytes(want_scale))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind,fp8_dtype", FORMATS, ids=["bf16", "fp16", "fp8", "fp8_fnuz", "fp4"])
@pytest.mark.parametrize("tokens,scan_max", [(40, None), (600, None), (40, 0)],
                         ids=["in-kernel", "in-kernel-past-one-block", "torch-first"])
def test_a_slot_written_twice_takes_the_last_key(monkeypatch, rng, kind, fp8_dtype, device, tokens, scan_max):
    """Duplicate slots in one call: the later key wins, in the Triton writer and the reference alike: found inside
    the kernel (600 keys: a slot's later names lie more than one ``LATER_BLOCK`` on), or by ``last_writer_slots``
    before it (a call longer than ``SCAN_MAX_TOKENS``)."""
    if scan_max is not None:
        monkeypatch.setattr(writer, "SCAN_MAX_TOKENS", scan_max)
    keys = torch.randn(tokens, 128, generator=rng).to(torch.bfloat16)
    # Most slots named several times; int64 slots from randint.
    slots = torch.randint(0, 12 if tokens < 100 else 40, (tokens,), generator=rng)
    slots[[3, 17]] = -1
    slots[5] = 4 * 16  # past the cache: writes nothing
    cache, scale = _alloc(kind, fp8_dtype, device=device)
    qsa_write_index_cache(keys.to(device), slots.to(device), cache, scale)
    ref_cache, ref_scale = _alloc(kind, fp8_dtype)
    write_reference(keys, slots, ref_cache, ref_scale)
    # The oracle: one key at a time, in call order.
    seq_cache, seq_scale = _alloc(kind, fp8_dtype)
    for i in range(tokens):
        write_reference(keys[i : i + 1], slots[i : i + 1], seq_cache, seq_scale)
    assert torch.equal(_bytes(ref_cache), _bytes(seq_cache))
    assert torch.equal(_bytes(cache).cpu(), _bytes(seq_cache))
    if scale is not None:
        assert torch.equal(_bytes(ref_scale), _bytes(seq_scale))
        assert torch.equal(_bytes(scale).cpu(), _bytes(seq_scale))


@triton.jit
def _not_named_later_kernel(slot_ptr, out_ptr, scan_tokens, LATER_BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    tl.store(out_ptr + token, writer.not_named_later(slot_ptr, token, slot, scan_tokens, LATER_BLOCK).to(
        tl.int32))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("later_block", [16, writer.LATER_BLOCK])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_in_kernel_last_writer_rule_matches_last_writer_slots(rng, index_dtype, later_block, device):
    """The writer kernel's own duplicate check (``not_named_later``) keeps exactly the entries that
    ``last_writer_slots`` keeps, at any distance between a slot's names (the interpreter runs a grid's programs in
    order, so the writer's output alone would not show a kept duplicate). Compared where a slot is not -1 (the
    writer asks only for slots it would write)."""
    slots = torch.randint(-1, 50, (300,), generator=rng).to(index_dtype)
    slots[[0, 299]] = 7  # the first and the last token name one slot
    out = torch.empty(300, dtype=torch.int32, device=device)
    _not_named_later_kernel[(300,)](slots.to(device), out, 300, later_block)
    real = slots >= 0
    assert torch.equal(out.cpu().bool()[real], (last_writer_slots(slots) == slots)[real])
    assert out[0].item() == 0 and out[299].item() == 1
    # Nothing scanned: every slot is free.
    _not_named_later_kernel[(300,)](slots.to(device), out, 0, later_block)
    assert bool(out.cpu().bool()[real].all())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("key_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_wider_keys_round_to_nearest_even_into_a_bf16_cache(rng, key_dtype, device):
    keys = torch.randn(64, 128, generator=rng).to(key_dtype)
    if key_dtype == torch.float32:
        # Exact ties (bf16 ulp halves) both ways, the largest finite values (round to infinity), a subnormal, NaN.
        keys[0, :4] = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 1.5 + 2.0**-9])
        keys[1, :4] = torch.tensor([3.4028235e38, -3.4028235e38, 1e-40, float("nan")])
    cache, _ = _alloc("bf16", None, device=device)
    qsa_write_index_cache(keys.to(device), torch.arange(64, device=device), cache)
    expected = keys.to(torch.bfloat16)
    got = cache.view(-1, 128)[:64].cpu()
    assert torch.equal(got.isnan(), expected.isnan())
    same = got.view(torch.int16) == expected.view(torch.int16)
    assert bool((same | expected.isnan()).all()), f"{int((~same).sum())} elements not rounded to nearest-even"

"""The scoring kernels on fp8 (e4m3fn, e4m3fnuz) and MXFP4 index caches, against the reference run on the same cache.

The reference dequantises the keys it gathers exactly (``qsa_aiter.cache_formats``), so kernel and reference differ
only in summation order: rtol = atol = 1e-5 under the interpreter (fp32 throughout), 1e-4 on a GPU (16-bit operands
on tensor cores, fp32 accumulation; every fp8 value and dequantised fp4 key is exact in bf16), plus ``E4M3_MMA_TOL`` of
the magnitude bound where e4m3 tensor cores score an e4m3fn or MXFP4 cache (their sums round internally; the
interpreter emulates them exactly, so the CPU run checks the split of q, the nibble unpacking and the per-block
exponents at 1e-5). Besides caches written
from realistic keys, one test fills caches with random bytes, so every fp8 code (subnormals included) and every e2m1
code under exponents from 0 (2**-127) to 200 is decoded; there the tolerance is relative to the sum of the
magnitudes of the products, since random codes make large terms cancel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

import qsa_aiter
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.quant.dequant import E2M1_TO_E4M3_ASM, fp4_block_order, fp4_e4m3_block, split_query_e4m3
from qsa_aiter.kernels.quant.formats import E2M1_VALUES
from qsa_aiter.kernels.scoring import stacked
from qsa_aiter.ops.scoring import describe_call
from qsa_aiter.kernels.scoring.reference import reference_paged_mqa_logits

from helpers import (
    BACKENDS, E4M3_MMA_TOL, KERNELS, PREFERRED, check_call, check_forced, force_backend, magnitude_bound, phase_batch,
    run_poisoned, skip_unless_serves, uses_e4m3_mma,
)

QUANTISED = ("fp8", "fp8_fnuz", "fp4")
PAGES = (16, 64)
PHASES = ("prefill", "verify", "draft", "decode")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
TOL = 1e-4 if ON_GPU else 1e-5


def quantised_batch(phase: str, cache: str, page_size: int, gen, **kwargs):
    """``phase_batch`` with a ``cache`` index cache, on the GPU when there is one."""
    return phase_batch(phase, page_size, gen, cache=cache, device=DEVICE, **kwargs)


def fill_random_codes(batch, cache: str, gen) -> None:
    """Overwrite the cache with random bytes (every code but NaN) and the scales with random positive values."""
    raw = batch.compressed_k_cache.view(torch.uint8)
    codes = torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.int32)
    if cache == "fp8":
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes)  # 0x7F / 0xFF are NaN in e4m3fn
    elif cache == "fp8_fnuz":
        codes = torch.where(codes == 0x80, 0, codes)  # 0x80 is NaN in e4m3fnuz
    raw.copy_(codes.to(torch.uint8))
    if cache == "fp4":
        # Exponents around 2**0, with 0 (the subnormal 2**-127), 1 and 200 among them.
        exps = torch.randint(110, 140, batch.k_scale.shape, generator=gen)
        exps.view(-1)[::7] = 0
        exps.view(-1)[3::11] = 1
        exps.view(-1)[5::13] = 200
        batch.k_scale.view(torch.uint8).copy_(exps.to(torch.uint8))
    else:
        batch.k_scale.copy_(torch.rand(batch.k_scale.shape, generator=gen) * 0.01 + 1e-4)


#: (cache, page size) pairs of the default set: each format once, both page sizes; the rest is marked slow.
DEFAULT_CACHE_PAGES = {("fp8", 64), ("fp8_fnuz", 16), ("fp4", 16)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("cache,page_size", [
    pytest.param(c, p, id=f"{c}-{p}", marks=() if (c, p) in DEFAULT_CACHE_PAGES else pytest.mark.slow)
    for c in QUANTISED for p in PAGES])
def test_quantised_kernel_matrix(monkeypatch, rng, cache, page_size, phase, backend):
    batch, hints = quantised_batch(phase, cache, page_size, rng)
    check_forced(monkeypatch, backend, batch, hints, label=f"{backend}/{phase}/{cache}/page{page_size}", tol=TOL)


@pytest.mark.parametrize("backend", ("tiled", "stacked"))
@pytest.mark.parametrize("page_size", (5, 33, 100))
@pytest.mark.parametrize("cache", QUANTISED)
def test_quantised_odd_page_sizes(monkeypatch, rng, cache, page_size, backend):
    """Page sizes that divide no key tile, on the kernels whose tiles may read page ids as scalars (the e4m3 MMA
    path of the stacked scorer included)."""
    phase = "prefill" if backend == "tiled" else "verify"
    batch, hints = quantised_batch(phase, cache, page_size, rng)
    check_forced(monkeypatch, backend, batch, hints, label=f"{backend}/{cache}/page{page_size}", tol=TOL)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("phase", ("prefill", "verify", "decode"))
@pytest.mark.parametrize("cache", ("fp8", "fp4"))
def test_fp16_queries(monkeypatch, rng, cache, phase, backend):
    batch, hints = quantised_batch(phase, cache, 16, rng, dtype=torch.float16)
    check_forced(monkeypatch, backend, batch, hints, label=f"fp16/{backend}/{phase}/{cache}", tol=TOL)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("phase", ("prefill", "verify", "decode"))
@pytest.mark.parametrize("page_size", (16, pytest.param(64, marks=pytest.mark.slow)))
@pytest.mark.parametrize("cache", QUANTISED)
def test_every_code_decodes_exactly(monkeypatch, rng, cache, page_size, phase, backend):
    """Random bytes in the cache: every code, subnormal fp8 values and extreme fp4 exponents included."""
    batch, hints = quantised_batch(phase, cache, page_size, rng, head_dim=128)
    fill_random_codes(batch, cache, rng)
    args = batch.args()
    force_backend(monkeypatch, backend)
    skip_unless_serves(backend, args, **hints)
    logits, visible = run_poisoned(args, **hints)
    ref_logits, ref_visible = reference_paged_mqa_logits(*args, k_scale=batch.k_scale)
    bound = magnitude_bound(args, k_scale=batch.k_scale)
    # Scores within 1e-5 of the magnitude sum (fp32 summation in another order; e4m3 tensor cores round inside
    # their sums: E4M3_MMA_TOL more), compared on [0, visible).
    rel = 1e-5 + (E4M3_MMA_TOL if uses_e4m3_mma(args, **hints) else 0.0)
    mask = torch.arange(logits.shape[1], device=logits.device)[None, :] < visible.long()[:, None]
    assert torch.equal(visible, ref_visible.to(visible.device))
    got, exp, lim = logits[mask], ref_logits[mask], bound[mask]
    finite = torch.isfinite(exp)
    assert torch.equal(torch.isneginf(got), torch.isneginf(exp))
    err = (got[finite] - exp[finite]).abs()
    assert bool((err <= rel * lim[finite] + 1e-30).all()), (
        f"{backend}/{phase}/{cache}: max error {err.max().item():.3g} over bound "
        f"{(err / lim[finite].clamp_min(1e-30)).max().item():.3g} (x magnitude sum)")


@pytest.mark.parametrize("cache", QUANTISED)
def test_auto_choice_per_phase_and_explain(rng, cache):
    for phase in PHASES:
        batch, hints = quantised_batch(phase, cache, 64, rng)
        text = qsa_aiter.explain(*batch.args(), **hints)
        kv = "fp4" if cache == "fp4" else "fp8"
        assert f"kv={kv}(" in text and f"registry row ('{kv}', 64, '{phase}')" in text, text
        assert qsa_aiter.selected_kernel(*batch.args(), **hints) == PREFERRED[phase], text


def test_bad_page_ids_and_padded_rows_on_a_quantised_cache(monkeypatch, rng):
    for cache in ("fp8", "fp4"):
        batch, hints = quantised_batch("verify", cache, 16, rng)
        batch.page_table[0, 1] = batch.compressed_k_cache.shape[0] + 5  # out of range: -inf columns
        batch.page_table[1, 0] = -7
        for backend in KERNELS:
            force_backend(monkeypatch, backend)
            logits, visible = check_call(batch.args(), rtol=TOL, atol=TOL, label=f"{cache}/{backend}", **hints)
            assert bool(torch.isneginf(logits[0, 16:32]).all())


def stacked_plan(batch, hints: dict, e4m3_mma: bool):
    """The stacked scorer's launch plan for ``batch`` with ``QSA_AITER_E4M3_MMA`` as ``e4m3_mma`` (what it would
    launch)."""
    problem = dataclasses.replace(describe_call(*batch.args(), **hints), e4m3_mma=e4m3_mma)
    return stacked.SPEC.plan(problem, Platform.of(batch.q.device))


#: Per target, the refusal of each cache (``None``: its keys go to matrix instructions) on the example problem:
#: NVIDIA and gfx950 take e4m3fn, gfx942 e4m3fnuz; MXFP4 needs e4m3fn (nibbles as e4m3 bytes) or block-scaled MFMAs.
TARGET_REFUSALS = {
    "sm_90": {"fp8": None, "fp8_fnuz": "an e4m3fnuz cache: sm_90's matrix instructions take e4m3fn", "fp4": None},
    "gfx950": {"fp8": None, "fp8_fnuz": "an e4m3fnuz cache: gfx950's matrix instructions take e4m3fn", "fp4": None},
    "gfx942": {"fp8": "an e4m3fn cache: gfx942's matrix instructions take e4m3fnuz", "fp8_fnuz": None,
               "fp4": "MXFP4 keys need e4m3fn or block-scaled matrix instructions (gfx942 multiplies e4m3fnuz)"},
}
CACHE_DTYPES = {"fp8": (torch.float8_e4m3fn, "fp8"), "fp8_fnuz": (torch.float8_e4m3fnuz, "fp8"),
                "fp4": (torch.float4_e2m1fn_x2, "fp4")}


@pytest.mark.parametrize("change,refusal", [
    ({}, None),
    ({"e4m3_mma": False}, "QSA_AITER_E4M3_MMA=0"),
    ({"q_dtype": torch.float16}, "fp16 queries: two e4m3 terms cannot hold them"),
    ({"cache_dtype": torch.bfloat16, "kv_dtype": "bf16"}, "16-bit keys are no e4m3 operand"),
    ({"head_dim": 16}, "head_dim 16 < 32: e4m3 MMAs step head_dim by 32"),
])
@pytest.mark.parametrize("cache", CACHE_DTYPES)
@pytest.mark.parametrize("arch", ("sm_90", "gfx942", "gfx950"))
def test_one_rule_decides_the_e4m3_mma_path_and_explains_it(change, refusal, cache, arch):
    """``e4m3_mma_serves`` is true exactly where ``e4m3_mma_refusal`` finds no reason, and the kernels with the path
    set their ``E4M3_MMA`` constexpr from it (host side only: plans, no launch); ``SCALED_MMA`` is on exactly for
    MXFP4 on gfx950, and the MMA operand's flavour follows the cache's."""
    from qsa_aiter.kernels.scoring import keys_major
    from qsa_aiter.kernels.scoring.base import e4m3_mma_refusal, e4m3_mma_serves, example_problem

    platform = Platform.named(arch)
    dtype, kv = CACHE_DTYPES[cache]
    problem = dataclasses.replace(example_problem(device_type="cuda", cache_dtype=dtype, kv_dtype=kv), **change)
    if refusal is None:
        refusal = TARGET_REFUSALS[arch][cache]
    assert e4m3_mma_refusal(problem, platform) == refusal
    assert e4m3_mma_serves(problem, platform) is (refusal is None)
    for spec in (stacked.SPEC, keys_major.SPEC):
        assert spec.e4m3_mma_path
        constexprs = spec.plan(problem, platform).constexprs
        assert constexprs["E4M3_MMA"] is (refusal is None), spec.name
        assert constexprs["SCALED_MMA"] is (refusal is None and cache == "fp4" and arch == "gfx950"), spec.name
        if refusal is None and cache != "fp4":
            assert constexprs["DOT_DTYPE"] == (tl.float8e4b8 if cache == "fp8_fnuz" else tl.float8e4nv)


def test_a_head_dim_below_32_is_decoded_not_sent_to_e4m3_mmas(monkeypatch, rng):
    """e4m3 MMAs step head_dim by 32: at head_dim 16 the stacked scorer decodes e4m3fn keys (on the H200 the e4m3
    path failed to compile there), and ``explain`` says why."""
    batch, hints = quantised_batch("verify", "fp8", 16, rng, head_dim=16)
    assert not stacked_plan(batch, hints, True).constexprs["E4M3_MMA"]
    keys = qsa_aiter.explain(*batch.args(), **hints).splitlines()[-1]
    assert "head_dim 16 < 32" in keys, keys
    check_forced(monkeypatch, "stacked", batch, hints, label="stacked/fp8/head_dim 16", tol=TOL)


@pytest.mark.parametrize("cache", ("fp8", "fp4"))
@pytest.mark.parametrize("phase", ("verify", "draft"))
@pytest.mark.parametrize("page_size", PAGES)
def test_keys_decoded_when_the_mma_switch_is_off(monkeypatch, rng, cache, phase, page_size):
    """QSA_AITER_E4M3_MMA=0: the stacked scorer decodes e4m3fn and MXFP4 keys to bf16 in registers (exact fp32 sums);
    ``explain`` says so, where with the switch on it names the e4m3 tensor cores (emulated under the interpreter)."""
    batch, hints = quantised_batch(phase, cache, page_size, rng)
    on = qsa_aiter.explain(*batch.args(), **hints).splitlines()[-1]
    assert on.startswith("  keys: e4m3 tensor cores (QSA_AITER_E4M3_MMA=1)"), on
    assert ("MXFP4 nibbles placed as exact e4m3 bytes" in on) == (cache == "fp4"), on
    monkeypatch.setenv("QSA_AITER_E4M3_MMA", "0")
    off = qsa_aiter.explain(*batch.args(), **hints).splitlines()[-1]
    assert off.startswith("  keys: decoded to ") and off.endswith("(QSA_AITER_E4M3_MMA=0)"), off
    # The launch takes the decoding path (E4M3_MMA off) and its own tile settings.
    assert stacked_plan(batch, hints, True).constexprs["E4M3_MMA"]
    assert not stacked_plan(batch, hints, False).constexprs["E4M3_MMA"]
    rows = stacked_plan(batch, hints, True).config.block_rows
    decoding = (stacked.StackedConfig(block_rows=rows, block_n=64, num_warps=2, programs_per_sm=16) if cache == "fp4"
                else stacked.StackedConfig(block_rows=rows))
    assert stacked_plan(batch, hints, False).config == decoding
    assert not uses_e4m3_mma(batch.args(), **hints)
    check_forced(monkeypatch, "stacked", batch, hints, label=f"stacked/{phase}/{cache} decoded/page{page_size}",
                 tol=TOL)


# ---------------------------------------------------------------------------------------------------------------
# MXFP4 on e4m3 tensor cores: the nibble -> e4m3 byte rule, the PTX that applies it, the stacked path's variants
# ---------------------------------------------------------------------------------------------------------------


def e2m1_value(nibble: int) -> float:
    return (-1.0 if nibble & 8 else 1.0) * E2M1_VALUES[nibble & 7]


def e4m3_rule(nibble: int) -> int:
    """The e4m3 byte the kernels make of an e2m1 nibble (docs/kernels.md): sign to bit 7, magnitude to bits 4..2."""
    return ((nibble & 8) << 4) | ((nibble & 7) << 2)


def test_e2m1_to_e4m3_rule_is_exact():
    """Every e2m1 code, placed as an e4m3 byte, is its value times 2**-6 (zero, the subnormal 0.5 and -0 included),
    as torch's own e4m3fn decoding reads it."""
    codes = torch.tensor([e4m3_rule(n) for n in range(16)], dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    expected = torch.tensor([e2m1_value(n) * 2.0**-6 for n in range(16)])
    assert torch.equal(values, expected)
    assert torch.equal(torch.signbit(values), torch.tensor([n >= 8 for n in range(16)]))


@triton.jit
def _unpack_kernel(packed_ptr, bytes_ptr, values_ptr, FAST_DECODE: tl.constexpr):
    rows = tl.arange(0, 16)
    packed = tl.load(packed_ptr + rows[:, None] * 16 + tl.arange(0, 16)[None, :])
    out = rows[:, None] * 32 + tl.arange(0, 32)[None, :]
    keys = fp4_e4m3_block(packed, tl.float8e4nv, FAST_DECODE)
    tl.store(bytes_ptr + out, keys.to(tl.uint8, bitcast=True))
    tl.store(values_ptr + out, fp4_e4m3_block(packed, tl.float32, FAST_DECODE))


@pytest.mark.parametrize("fast", [False, True], ids=["portable", "ptx"])
def test_fp4_block_unpacks_every_byte_in_mma_order(fast):
    """``fp4_e4m3_block`` on all 256 bytes (every nibble as the low and as the high nibble): position ``p`` of a row
    holds element ``fp4_block_order[p]``, as the e4m3 byte of the rule (and, for the interpreter's emulation, its exact
    fp32 value). The PTX unpack runs on an NVIDIA GPU of compute capability 9.0+ only."""
    if fast and not (ON_GPU and Platform.of(torch.device("cuda")).fast_decode):
        pytest.skip("the PTX unpack needs an NVIDIA GPU of compute capability 9.0+ (no interpreter)")
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).to(DEVICE)
    got_bytes = torch.empty(16, 32, dtype=torch.uint8, device=DEVICE)
    got_values = torch.empty(16, 32, dtype=torch.float32, device=DEVICE)
    _unpack_kernel[(1,)](packed, got_bytes, got_values, fast)
    order = [2 * (p % 16) + p // 16 for p in range(32)]
    expected = torch.tensor([[e4m3_rule((int(packed[r, e // 2]) >> (4 * (e % 2))) & 15) for e in order]
                             for r in range(16)], dtype=torch.uint8)
    assert torch.equal(got_bytes.cpu(), expected)
    assert torch.equal(got_values.cpu(), expected.view(torch.float8_e4m3fn).float())


@triton.jit
def _order_kernel(out_ptr):
    tl.store(out_ptr + tl.arange(0, 32), fp4_block_order())


def test_fp4_block_order():
    out = torch.empty(32, dtype=torch.int32, device=DEVICE)
    _order_kernel[(1,)](out)
    assert out.tolist() == list(range(0, 32, 2)) + list(range(1, 32, 2))


def run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Evaluate straight-line PTX of 32-bit ``shl/shr/and/or/mov`` (the unpack's instructions) from the input
    registers ``inputs`` (e.g. ``{"$2": word}``); returns every register written, the outputs ``$0``... included."""
    regs = dict(inputs)

    def value(token: str) -> int:
        return int(token, 16) if token.startswith("0x") else int(token) if token.isdigit() else regs[token]

    ops = {"shl.b32": lambda a, b: (a << b) & 0xFFFFFFFF, "shr.b32": lambda a, b: a >> b,
           "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b}
    for line in asm.strip().removeprefix("{").removesuffix("}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *srcs = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[dst] = value(srcs[0])
        else:
            assert op in ops, f"unexpected PTX instruction {line!r}"
            regs[dst] = ops[op](*map(value, srcs))
    return regs


def test_ptx_unpack_applies_the_rule_to_every_byte_lane():
    """The PTX of the NVIDIA unpack (``E2M1_TO_E4M3_ASM``), evaluated instruction by instruction: for every byte value
    in each of the four byte lanes of a register, ``$0`` holds the low nibbles' e4m3 bytes and ``$1`` the high
    nibbles', lane for lane (neighbouring lanes hold other bytes, so a bit crossing a lane would show)."""
    for lane in range(4):
        for value in range(256):
            lanes = [(value * 37 + 11 * k + 5) & 255 for k in range(4)]
            lanes[lane] = value
            word = sum(b << (8 * k) for k, b in enumerate(lanes))
            regs = run_ptx(E2M1_TO_E4M3_ASM.value, {"$2": word})
            for k, b in enumerate(lanes):
                assert (regs["$0"] >> (8 * k)) & 255 == e4m3_rule(b & 15), (lane, value, k)
                assert (regs["$1"] >> (8 * k)) & 255 == e4m3_rule(b >> 4), (lane, value, k)


def test_fp4_mma_path_reads_unaligned_scales(monkeypatch, rng):
    """An MXFP4 scale tensor that is a view at an odd address: its exponents cannot be loaded as one integer per key,
    and the stacked e4m3 path reads them byte by byte instead (same scores)."""
    batch, hints = quantised_batch("verify", "fp4", 16, rng, head_dim=128)
    raw = batch.k_scale.view(torch.uint8)
    buffer = torch.zeros(raw.numel() + 1, dtype=torch.uint8, device=raw.device)
    shifted = buffer[1:].view(raw.shape)
    shifted.copy_(raw)
    assert shifted.data_ptr() % 4 != 0
    batch.k_scale = shifted.view(torch.float8_e8m0fnu)
    hints = dict(hints, k_scale=batch.k_scale)
    assert not stacked_plan(batch, hints, True).constexprs["SCALE_WORDS"]
    check_forced(monkeypatch, "stacked", batch, hints, label="stacked/fp4/unaligned scales", tol=TOL)


@pytest.mark.parametrize("head_dim", [32, 256])
def test_fp4_mma_path_block_counts(monkeypatch, rng, head_dim):
    """One and eight 32-element blocks per key (the exponents as one byte and as one 64-bit integer per key); with
    eight, the accumulators take more registers and the default runs fewer programs per SM."""
    batch, hints = quantised_batch("verify", "fp4", 16, rng, head_dim=head_dim)
    cfg = stacked_plan(batch, hints, True).config
    assert (cfg.block_n, cfg.programs_per_sm) == (64, 4 if head_dim == 32 else 2)
    check_forced(monkeypatch, "stacked", batch, hints, label=f"stacked/fp4/head_dim {head_dim}", tol=TOL)


@triton.jit
def _split_kernel(q_ptr, out_ptr, hi_ptr, ROWS: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]
    hi, lo, row_scale = split_query_e4m3(tl.load(q_ptr + offs).to(tl.float32), True)
    tl.store(hi_ptr + offs, hi.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
    tl.store(out_ptr + offs, (hi.to(tl.float32) + lo.to(tl.float32)) * row_scale[:, None])


def test_split_of_bf16_queries_into_two_e4m3_terms(rng):
    """``hi + lo`` rebuilds every bf16 element of at least 2**-9 of its row's largest exactly, smaller ones within
    2**-17 of it; ``hi`` is the row scaled into [128, 256) and rounded to nearest e4m3 (ties to even), as torch does.
    Rows: ordinary, all zero, tiny (1e-30) and huge (1e30) scales, one with a 1e-4 half."""
    q = torch.randn(8, 128, generator=rng) * torch.tensor([3.0, 1.0, 1e-30, 1e30, 1e-3, 7.0, 1.0, 250.0])[:, None]
    q[1] = 0.0
    q[6, :64] *= 1e-4
    q = q.to(torch.bfloat16).to(DEVICE)
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    hi = torch.empty(q.shape, dtype=torch.uint8, device=DEVICE)
    _split_kernel[(1,)](q, out, hi, 8, 128)
    q32 = q.float()
    row_max = q32.abs().amax(dim=1, keepdim=True)
    err = (out - q32).abs()
    large = q32.abs() >= row_max * 2.0**-9
    assert bool((err[large] == 0).all())
    assert bool((err <= row_max * 2.0**-17).all())
    scale = torch.exp2(torch.floor(torch.log2(row_max.clamp_min(1e-38))) - 7)
    expected_hi = (q32 / scale).to(torch.float8_e4m3fn).float()
    assert torch.equal(hi.view(torch.float8_e4m3fn).float(), expected_hi)  # by value: -0 and +0 both round tiny ones

"""Every kernel compiles ahead of time, without a GPU, for sm_90, gfx942 and gfx950; the assembly shows its kind.

The compilations run in child processes (one per target) without ``TRITON_INTERPRET``: in this process the kernels
were decorated under the interpreter (CPU-only machines), and an interpreted kernel cannot be compiled.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qsa_aiter.tools.aot import SCORERS, TARGETS, compile_kernel
from qsa_aiter.kernels.platform import interpreting
from qsa_aiter.kernels.scoring import SPECS as SCORING_SPECS

ROOT = Path(__file__).resolve().parents[2]
TENSOR_CORE_KERNELS = tuple(spec.name for spec in SCORING_SPECS if spec.tensor_cores)
# Specialisations besides the default (bf16 q, int32 indices, page 64, 4 heads, head_dim 128).
VARIANTS = {
    "default": ({}, "i32"),
    "fp16-page16-i64": ({"q_dtype": "float16", "cache_dtype": "float16", "block_size": 16}, "i64"),
    "fp8": ({"cache_dtype": "float8_e4m3fn", "kv_dtype": "fp8"}, "i32"),
    "fp8-fnuz-fp16-page16": ({"q_dtype": "float16", "cache_dtype": "float8_e4m3fnuz", "kv_dtype": "fp8",
                              "block_size": 16}, "i32"),
    "fp4": ({"cache_dtype": "float4_e2m1fn_x2", "kv_dtype": "fp4"}, "i32"),
}
#: variant -> (problem overrides, index dtype, targets). With VARIANTS, every cache format is built at both page
#: sizes for every target. Page 16 is the engine's 64-token KV block (and the FlyDSL scorer's shape); bf16 queries
#: over an e4m3fnuz cache are gfx942's fp8 configuration. Each build costs seconds on a CI CPU, so the fnuz one is
#: built for gfx942 only.
MATRIX_VARIANTS = {
    "bf16-page16": ({"block_size": 16}, "i32", list(TARGETS)),
    "fp8-page16": ({"cache_dtype": "float8_e4m3fn", "kv_dtype": "fp8", "block_size": 16}, "i32", list(TARGETS)),
    "fp4-page16": ({"cache_dtype": "float4_e2m1fn_x2", "kv_dtype": "fp4", "block_size": 16}, "i32", list(TARGETS)),
    "fp8-fnuz-bf16": ({"cache_dtype": "float8_e4m3fnuz", "kv_dtype": "fp8"}, "i32", ["gfx942"]),
    # Strided cache views (KEY_PAGE_STRIDE / KEY_SLOT_STRIDE): slots twice a key apart (bf16), pages padded (MXFP4).
    "bf16-strided-slots": ({"key_strides": [64 * 256, 256]}, "i32", ["sm_90"]),
    "fp4-strided-pages": ({"cache_dtype": "float4_e2m1fn_x2", "kv_dtype": "fp4", "block_size": 16,
                           "key_strides": [19 * 64, 64]}, "i32", ["sm_90", "gfx950"]),
}
# A constant only each PTX decoder's text holds: its 16-bit multiplier (fp8) or its e2m1 high-byte table (fp4).
# The tensor-core kernels decode to q's dtype; the row-wise one to bf16, then fp32.
DECODER_MARKS = {"fp8": "0x7B807B80", "fp8-fnuz-fp16-page16": "0x58005800", "fp4": "0x3F3F3F00"}
ROWWISE_DECODER_MARKS = dict(DECODER_MARKS, **{"fp8-fnuz-fp16-page16": "0x7B007B00"})
# The MXFP4 -> e4m3 unpack's magnitude mask (``dequant.E2M1_TO_E4M3_ASM``): only the e4m3 MMA path of MXFP4 holds it.
UNPACK_MARK = "0x1C1C1C1C"
ALL_MARKS = sorted(set(DECODER_MARKS.values()) | set(ROWWISE_DECODER_MARKS.values()) | {UNPACK_MARK})
# The builds that score with e4m3 tensor cores instead of decoding the keys (QSA_AITER_E4M3_MMA): e4m3fn keys as
# stored, MXFP4 keys unpacked to e4m3 bytes.
E4M3_MMA_BUILDS = {(kernel, "sm_90", variant) for kernel in ("stacked", "keys_major") for variant in ("fp8", "fp4")}
# Those builds again with QSA_AITER_E4M3_MMA=0 (``compile_kernel(..., e4m3_mma=False)``): the PTX decoders instead.
DECODED_BUILDS = sorted(E4M3_MMA_BUILDS)

#: Tiled keys-major builds with every head stacked as N: (name, ``VARIANTS`` key, rows per tile, targets). 32-row
#: tiles on every target (a 64-row tile's q stack takes 64 KiB: all of a gfx942 CU's LDS), 64-row ones on sm_90 (the
#: shipped H200 rows).
STACKED_N_BUILDS = [("stacked-n-bf16-32", "default", 32, list(TARGETS)),
                    ("stacked-n-bf16-64", "default", 64, ["sm_90"]),
                    ("stacked-n-fp8-32", "fp8", 32, ["sm_90"]), ("stacked-n-fp4-32", "fp4", 32, ["sm_90"])]

_CHILD = r"""
import json, re, sys
import torch
from qsa_aiter.tools.aot import SCORERS, TARGETS, compile_kernel, compile_selection_kernel
from qsa_aiter.kernels.scoring.base import example_problem

variants = json.loads(sys.argv[1])
marks = json.loads(sys.argv[2])
decoded = json.loads(sys.argv[3])
only = sys.argv[6]  # the one target this process builds for
results = {}
for kernel, target, variant in decoded:
    if target != only:
        continue
    overrides = dict(variants[variant][0])
    overrides["cache_dtype"] = getattr(torch, overrides["cache_dtype"])
    text = compile_kernel(kernel, target, example_problem(**overrides), e4m3_mma=False).asm["ptx"]
    results[f"{variant}-decoded/{kernel}/{target}"] = {
        "decoder_marks": [m for m in marks if m in text], "e4m3_mma": ".e4m3.e4m3" in text}
for variant, (overrides, index_dtype, targets) in json.loads(sys.argv[4]).items():
    for key in ("q_dtype", "cache_dtype"):
        if key in overrides:
            overrides[key] = getattr(torch, overrides[key])
    if "key_strides" in overrides:  # a JSON list; the problem is hashed
        overrides["key_strides"] = tuple(overrides["key_strides"])
    problem = example_problem(**overrides)
    for kernel in SCORERS:
        for target in (t for t in targets if t == only):
            name = f"{variant}/{kernel}/{target}"
            try:
                asm = compile_kernel(kernel, target, problem, index_dtype).asm
            except Exception as err:
                results[name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
                continue
            text = asm.get("ptx") or asm.get("amdgcn") or ""
            results[name] = {
                "keys": sorted(asm),
                "binary_bytes": len(asm.get("cubin") or asm.get("hsaco") or b""),
                "mma": "mma" in text,
                "mfma": "mfma" in text,
                "dot_in_ttir": "tt.dot" in asm.get("ttir", ""),
                "decoder_marks": [m for m in marks if m in text],
                "e4m3_mma": ".e4m3.e4m3" in text,
            }
for name, kv, block_m, targets in json.loads(sys.argv[5]):  # tiled keys-major tiles with every head stacked as N
    overrides = dict(variants[kv][0])
    overrides["cache_dtype"] = getattr(torch, overrides.get("cache_dtype", "bfloat16"))
    problem = example_problem(phase="prefill", num_tokens=4096, num_requests=1, max_query_len=4096, **overrides)
    for target in (t for t in targets if t == only):
        try:
            asm = compile_kernel("tiled", target, problem, overrides={"keys_major": 1, "stack_heads": 1,
                                                                       "block_m": block_m, "block_n": 64}).asm
        except Exception as err:
            results[f"{name}/{target}"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            continue
        text = asm.get("ptx") or asm.get("amdgcn") or ""
        shapes = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", text)))
        results[f"{name}/{target}"] = {"binary_bytes": len(asm.get("cubin") or asm.get("hsaco") or b""),
                                       "mma": "mma" in text, "mfma": "mfma" in text, "wgmma_shapes": shapes}
# A register cap (StackedConfig.max_registers) reaches the PTX as .maxnreg.
for cap in (0, 80) if only == "sm_90" else ():
    ptx = compile_kernel("stacked", "sm_90", overrides={"max_registers": cap}).asm["ptx"]
    results[f"register-cap-{cap}/stacked/sm_90"] = {"maxnreg": [l.strip() for l in ptx.splitlines() if ".maxnreg" in l]}
for label, kernel, with_maxima in (("topk", "topk", False), ("topk+maxima", "topk", True),
                                   ("block_maxima", "block_maxima", False), ("expand", "expand", False)):
    for target in (only,):
        try:
            asm = compile_selection_kernel(kernel, target, with_maxima=with_maxima).asm
            results[f"selection/{label}/{target}"] = {"keys": sorted(asm),
                                                      "binary_bytes": len(asm.get("cubin") or asm.get("hsaco") or b"")}
        except Exception as err:
            results[f"selection/{label}/{target}"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
print("AOT-RESULTS " + json.dumps(results))
"""


# Compiling every build takes minutes on a CPU: the tests that read these builds are marked slow (.ci/run runs them).
@pytest.fixture(scope="module")
def compiled():
    """Every build of this module (``VARIANTS`` for every target, ``MATRIX_VARIANTS`` for theirs, the decoding
    builds and the selection kernels), compiled in one child process."""
    builds = {v: (overrides, index_dtype, list(TARGETS)) for v, (overrides, index_dtype) in VARIANTS.items()}
    builds.update(MATRIX_VARIANTS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    results = {}
    # One process per target, as one process serves one GPU: Triton 3.6's AMD backend fails to lower a gfx942 build
    # made after gfx950 ones in the same process.
    for target in TARGETS:
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(VARIANTS), json.dumps(ALL_MARKS),
                               json.dumps(DECODED_BUILDS), json.dumps(builds), json.dumps(STACKED_N_BUILDS), target],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("AOT-RESULTS ")]
        assert proc.returncode == 0 and lines, f"compile process failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        results.update(json.loads(lines[-1].removeprefix("AOT-RESULTS ")))
    return results


#: Every kernel x target x specialisation compiled by the ``compiled`` fixture.
EVERY_BUILD = pytest.mark.parametrize(
    "kernel,target,variant", list(itertools.product(SCORERS, TARGETS, VARIANTS)))


def build(compiled: dict, kernel: str, target: str, variant: str) -> dict:
    """One build's record; it must have compiled."""
    result = compiled[f"{variant}/{kernel}/{target}"]
    assert "error" not in result, result.get("error")
    return result


@EVERY_BUILD
@pytest.mark.slow
def test_kernel_compiles_for_target(compiled, kernel, target, variant):
    result = build(compiled, kernel, target, variant)
    if target.startswith("sm_"):
        assert {"ptx", "cubin"} <= set(result["keys"]), result["keys"]
    else:
        assert {"amdgcn", "hsaco"} <= set(result["keys"]), result["keys"]
    assert result["binary_bytes"] > 0


@EVERY_BUILD
@pytest.mark.slow
def test_tensor_core_use(compiled, kernel, target, variant):
    result = build(compiled, kernel, target, variant)
    if kernel in TENSOR_CORE_KERNELS:
        assert result["dot_in_ttir"]
        if target.startswith("sm_"):
            assert result["mma"], f"{kernel} must use tensor cores (mma) on {target}"
        else:
            assert result["mfma"], f"{kernel} must use matrix cores (mfma) on {target}"
    else:
        # The row-wise scorer is the CUDA-core fallback: no dot, no mma/mfma.
        assert not result["dot_in_ttir"]
        assert not result["mma"] and not result["mfma"], f"{kernel} must not use tensor cores on {target}"


@EVERY_BUILD
@pytest.mark.slow
def test_quantised_decoders_per_target(compiled, kernel, target, variant):
    """NVIDIA builds decode quantised keys with the PTX decoders, except the stacked and keys-major scorers with bf16 q
    on e4m3fn keys, which feed the stored keys to e4m3 tensor cores, and on MXFP4 keys, which they unpack to e4m3 bytes (the unpack's
    PTX) for them; AMD builds (and 16-bit caches) use neither."""
    result = build(compiled, kernel, target, variant)
    marks = ROWWISE_DECODER_MARKS if kernel == "rowwise" else DECODER_MARKS
    e4m3_mma = (kernel, target, variant) in E4M3_MMA_BUILDS
    want = [marks[variant]] if target.startswith("sm_") and variant in marks and not e4m3_mma else []
    if e4m3_mma and variant == "fp4":
        want = [UNPACK_MARK]
    assert result["decoder_marks"] == want
    assert result["e4m3_mma"] == e4m3_mma


@pytest.mark.parametrize("kernel,target,variant", DECODED_BUILDS)
@pytest.mark.slow
def test_decoding_builds_with_the_mma_switch_off(compiled, kernel, target, variant):
    """With QSA_AITER_E4M3_MMA=0 the e4m3 MMA builds decode with the PTX decoders and hold no e4m3 MMA."""
    result = compiled[f"{variant}-decoded/{kernel}/{target}"]
    assert result["decoder_marks"] == [DECODER_MARKS[variant]]
    assert not result["e4m3_mma"]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kernel", ["topk", "topk+maxima", "block_maxima", "expand"])
@pytest.mark.slow
def test_selection_kernels_compile_for_target(compiled, kernel, target):
    result = compiled[f"selection/{kernel}/{target}"]
    assert "error" not in result, result.get("error")
    assert result["binary_bytes"] > 0


def test_unknown_kernel_or_target():
    with pytest.raises(ValueError, match="kernel must be one of"):
        compile_kernel("flash", "sm_90")
    with pytest.raises(ValueError, match="target must be one of"):
        compile_kernel("rowwise", "sm_80")


def test_targets_and_kernels():
    assert set(TARGETS) == {"sm_90", "gfx942", "gfx950"}
    assert set(SCORERS) == {"rowwise", "stacked", "keys_major", "tiled"}


@pytest.mark.parametrize("name,target", [(name, t) for name, _, _, targets in STACKED_N_BUILDS for t in targets])
@pytest.mark.slow
def test_tiled_stacked_heads_as_n_builds(compiled, name, target):
    """Keys-major tiles with every head's rows stacked as one N operand build for their targets on the tensor cores;
    on sm_90 the 64-row bf16 tile is one m64n256k16 wgmma chain (4 heads x 64 rows), the 32-row ones m64n128k16."""
    result = compiled[f"{name}/{target}"]
    assert "error" not in result, result.get("error")
    assert result["binary_bytes"] > 0
    assert result["mma"] if target.startswith("sm_") else result["mfma"]
    if name == "stacked-n-bf16-64":
        assert result["wgmma_shapes"] == ["m64n256k16"]
    elif target == "sm_90" and name == "stacked-n-bf16-32":
        assert result["wgmma_shapes"] == ["m64n128k16"]


@pytest.mark.slow
def test_register_cap_reaches_the_ptx(compiled):
    assert compiled["register-cap-0/stacked/sm_90"]["maxnreg"] == []
    assert compiled["register-cap-80/stacked/sm_90"]["maxnreg"] == [".maxnreg 80"]


@pytest.mark.skipif(not interpreting(), reason="only kernels decorated under TRITON_INTERPRET=1 are affected")
def test_compile_in_an_interpreted_process_says_why_not():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        compile_kernel("rowwise", "sm_90")


# ---------------------------------------------------------------------------------------------------------------
# More specialisations with bf16 queries (MATRIX_VARIANTS; the others differ from the builds above only in constexprs
# covered there)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel,target,variant", [(k, t, v) for v, (_, _, targets) in MATRIX_VARIANTS.items()
                                                   for k in SCORERS for t in targets])
@pytest.mark.slow
def test_matrix_variant_compiles_and_uses_matrix_cores(compiled, kernel, target, variant):
    result = build(compiled, kernel, target, variant)
    assert result["binary_bytes"] > 0
    cores = "mma" if target.startswith("sm_") else "mfma"
    if kernel in TENSOR_CORE_KERNELS:
        assert result[cores], f"{kernel} must use {cores} on {target} for {variant}"
    else:
        assert not result["mma"] and not result["mfma"], f"{kernel} must not use tensor cores on {target}"

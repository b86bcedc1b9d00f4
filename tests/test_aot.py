"""Every kernel compiles ahead of time, without a GPU, for sm_90, gfx942 and gfx950; the assembly shows its kind.

The compilations run in one child process without ``TRITON_INTERPRET``: in this process the kernels were decorated
under the interpreter (CPU-only machines), and an interpreted kernel cannot be compiled.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qsa_aiter.aot import KERNEL_MODULES, TARGETS, compile_kernel
from qsa_aiter.kernels.common import interpreting

ROOT = Path(__file__).resolve().parents[1]
TENSOR_CORE_KERNELS = ("stacked", "tiled")
# Specialisations besides the default (bf16 q, int32 indices, page 64, 4 heads, head_dim 128).
VARIANTS = {
    "default": ({}, "i32"),
    "fp16-page16-i64": ({"q_dtype": "float16", "cache_dtype": "float16", "block_size": 16}, "i64"),
    "fp8": ({"cache_dtype": "float8_e4m3fn", "kv_dtype": "fp8"}, "i32"),
    "fp8-fnuz-fp16-page16": ({"q_dtype": "float16", "cache_dtype": "float8_e4m3fnuz", "kv_dtype": "fp8",
                              "block_size": 16}, "i32"),
    "fp4": ({"cache_dtype": "float4_e2m1fn_x2", "kv_dtype": "fp4"}, "i32"),
}
# A constant only each PTX decoder's text holds: its 16-bit multiplier (fp8) or its e2m1 high-byte table (fp4).
# The tensor-core kernels decode to q's dtype; the row-wise one to bf16, then fp32.
DECODER_MARKS = {"fp8": "0x7B807B80", "fp8-fnuz-fp16-page16": "0x58005800", "fp4": "0x3F3F3F00"}
ROWWISE_DECODER_MARKS = dict(DECODER_MARKS, **{"fp8-fnuz-fp16-page16": "0x7B007B00"})
ALL_MARKS = sorted(set(DECODER_MARKS.values()) | set(ROWWISE_DECODER_MARKS.values()))
# The builds that read the stored e4m3 keys with e4m3 tensor cores instead of decoding them (QSA_AITER_FP8_MMA).
FP8_MMA_BUILDS = {("stacked", "sm_90", "fp8")}

_CHILD = r"""
import json, sys
import torch
from qsa_aiter.aot import KERNEL_MODULES, TARGETS, compile_kernel, compile_selection_kernel, example_problem

variants = json.loads(sys.argv[1])
marks = json.loads(sys.argv[2])
results = {}
for variant, (overrides, index_dtype) in variants.items():
    for key in ("q_dtype", "cache_dtype"):
        if key in overrides:
            overrides[key] = getattr(torch, overrides[key])
    problem = example_problem(**overrides)
    for kernel in KERNEL_MODULES:
        for target in TARGETS:
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
for kernel in ("topk", "expand"):
    for target in TARGETS:
        try:
            asm = compile_selection_kernel(kernel, target).asm
            results[f"selection/{kernel}/{target}"] = {"keys": sorted(asm),
                                                      "binary_bytes": len(asm.get("cubin") or asm.get("hsaco") or b"")}
        except Exception as err:
            results[f"selection/{kernel}/{target}"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
print("AOT-RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(VARIANTS), json.dumps(ALL_MARKS)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("AOT-RESULTS ")]
    assert proc.returncode == 0 and lines, f"compile process failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("AOT-RESULTS "))


#: Every kernel x target x specialisation compiled by the ``compiled`` fixture.
EVERY_BUILD = pytest.mark.parametrize(
    "kernel,target,variant", list(itertools.product(KERNEL_MODULES, TARGETS, VARIANTS)))


def build(compiled: dict, kernel: str, target: str, variant: str) -> dict:
    """One build's record; it must have compiled."""
    result = compiled[f"{variant}/{kernel}/{target}"]
    assert "error" not in result, result.get("error")
    return result


@EVERY_BUILD
def test_kernel_compiles_for_target(compiled, kernel, target, variant):
    result = build(compiled, kernel, target, variant)
    if target.startswith("sm_"):
        assert {"ptx", "cubin"} <= set(result["keys"]), result["keys"]
    else:
        assert {"amdgcn", "hsaco"} <= set(result["keys"]), result["keys"]
    assert result["binary_bytes"] > 0


@EVERY_BUILD
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
def test_quantised_decoders_per_target(compiled, kernel, target, variant):
    """NVIDIA builds decode quantised keys with the PTX decoders, except the stacked scorer on e4m3fn keys with bf16
    q, which feeds the stored keys to e4m3 tensor cores; AMD builds (and 16-bit caches) use neither."""
    result = build(compiled, kernel, target, variant)
    marks = ROWWISE_DECODER_MARKS if kernel == "rowwise" else DECODER_MARKS
    e4m3_mma = (kernel, target, variant) in FP8_MMA_BUILDS
    want = [marks[variant]] if target.startswith("sm_") and variant in marks and not e4m3_mma else []
    assert result["decoder_marks"] == want
    assert result["e4m3_mma"] == e4m3_mma


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kernel", ["topk", "expand"])
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
    assert set(KERNEL_MODULES) == {"rowwise", "stacked", "tiled"}


@pytest.mark.skipif(not interpreting(), reason="only kernels decorated under TRITON_INTERPRET=1 are affected")
def test_compile_in_an_interpreted_process_says_why_not():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        compile_kernel("rowwise", "sm_90")

"""What the compiler makes of the kernels for each target, read from the assembly without a GPU (``tools/assembly.py``):

- the quantised caches reach the AMD GPUs' own matrix instructions: on gfx950 e4m3fn keys the f8f6f4 MFMAs and
  MXFP4 keys the block-scaled ones, on gfx942 e4m3fnuz keys the fp8 MFMAs (no bf16 MFMA left in those builds);
- no variant of the warm-up matrix spills on any target (AMD: no scratch; sm_90: no spill stores from ``ptxas
  -v``), and the decode/verify MFMA scorers keep at least 2 waves per SIMD on gfx942 and gfx950;
- the parsers, on text of the shape the compilers write.

The builds run in child processes without ``TRITON_INTERPRET`` (in this process the kernels may be interpreted
functions, which Triton cannot compile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from qsa_aiter.tools import assembly as isa

ROOT = Path(__file__).resolve().parents[2]

AMDGCN = """
\tv_mfma_f32_16x16x128_f8f6f4 a[0:3], v[4:11], v[12:19], a[0:3]
\tv_mfma_scale_f32_16x16x128_f8f6f4 v[0:3], v[4:11], v[12:19], v[0:3], v20, v21
\tv_mfma_f32_16x16x128_f8f6f4 a[0:3], v[4:11], v[12:19], a[0:3]
; NumVgprs: 120
; NumAgprs: 8
; TotalNumVgprs: 128
; ScratchSize: 0
; Occupancy: 4
  - .agpr_count:     8
    .private_segment_fixed_size: 16
    .sgpr_count:     40
    .vgpr_count:     128
    .vgpr_spill_count: 3
"""


def test_amd_resources_and_mma_mix_are_read_from_the_assembly():
    res = isa.amd_resources(AMDGCN)
    assert res == {"vgprs": 120, "agprs": 8, "sgprs": 40, "scratch": 16, "vgpr_spills": 3, "sgpr_spills": 0,
                   "occupancy": 4}
    assert isa.mma_mix(AMDGCN, True) == {"v_mfma_f32_16x16x128_f8f6f4": 2, "v_mfma_scale_f32_16x16x128_f8f6f4": 1}
    ptx = "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {..}\nmma.sync.aligned.m16n8k16.row.col.f32.bf16\n"
    assert isa.mma_mix(ptx, False) == {"mma.sync.aligned.m16n8k16.row.col.f32.bf16": 1,
                                       "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3": 1}


@pytest.mark.parametrize("occupancy,lds,warps,lds_per_cu,expected", [
    (4, 0, 4, 65536, (4, "registers")),
    (4, 17920, 4, 65536, (3, "LDS")),  # 3 workgroups of 4 waves on 4 SIMDs
    (2, 17920, 4, 163840, (2, "registers")),
    (8, 66048, 4, 65536, (0, "LDS")),  # more LDS than a gfx942 CU has: never resident
])
def test_waves_per_simd_are_the_smaller_limit(occupancy, lds, warps, lds_per_cu, expected):
    assert isa.amd_waves(occupancy, lds, warps, lds_per_cu) == expected


_MMA_CHILD = r"""
import dataclasses, json, sys
import torch
from qsa_aiter.tools import aot
from qsa_aiter.tools import assembly as isa
from qsa_aiter.kernels.scoring.base import example_problem

DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_fnuz": torch.float8_e4m3fnuz, "fp4": torch.float4_e2m1fn_x2}
out = {}
for arch, cache, kernel, page in json.loads(sys.argv[1]):
    problem = example_problem(cache_dtype=DTYPES[cache], kv_dtype="fp4" if cache == "fp4" else "fp8",
                              block_size=page)
    if kernel == "tiled":
        problem = dataclasses.replace(problem, phase="prefill", num_tokens=4096, num_requests=1, max_query_len=4096)
    built = aot.compile_kernel(kernel, arch, problem)
    res = isa.amd_resources(built.asm["amdgcn"])
    waves, _ = isa.amd_waves(res["occupancy"], built.metadata.shared, built.metadata.num_warps,
                             aot.Platform.named(arch).shared_memory_per_multiprocessor)
    out[f"{arch}/{cache}/{kernel}/{page}"] = dict(mma=isa.mma_mix(built.asm["amdgcn"], True),
                                                  scratch=res["scratch"], waves=waves)
print("ISA " + json.dumps(out))
"""

#: (target, cache) -> the matrix instructions its quantised builds must use: every MFMA of the build matches.
NATIVE_MMA = {("gfx950", "fp8"): "_f8f6f4", ("gfx950", "fp4"): "v_mfma_scale_f32_", ("gfx942", "fp8_fnuz"): "_fp8_fp8"}
MMA_BUILDS = [(arch, cache, kernel, page) for (arch, cache) in NATIVE_MMA
              for kernel in ("stacked", "keys_major", "tiled") for page in (16, 64)]


def _child(code: str, *args: str, timeout: int = 1800) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("ISA ", "MATRIX "))]
    assert proc.returncode == 0 and lines, f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="module")
def native_builds() -> dict:
    """The ``MMA_BUILDS``, one child process per target (Triton 3.6's AMD backend fails to lower a gfx942 build made
    after gfx950 ones in the same process; one process serves one GPU in use)."""
    requires_amd_triton()
    builds = {}
    for arch in sorted({build[0] for build in MMA_BUILDS}):
        builds.update(_child(_MMA_CHILD, json.dumps([b for b in MMA_BUILDS if b[0] == arch])))
    return builds


def requires_amd_triton() -> None:
    """Skip below Triton 3.9: the AMD builds are held to what the Triton of current ROCm torch builds (3.9; 3.6
    allocates registers differently, and several of its gfx builds spill where 3.9's do not)."""
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip(f"the AMD targets are checked with Triton 3.9 (current ROCm torch's); this is {triton.__version__}")


@pytest.mark.parametrize("arch,cache,kernel,page", MMA_BUILDS)
def test_quantised_caches_use_the_targets_own_mfmas(native_builds, arch, cache, kernel, page):
    """Each MFMA scorer's build for a quantised cache multiplies with the target's own low-precision MFMAs only
    (no key is decoded to bf16 for a bf16 MFMA), without scratch, and the decode/verify ones at 2+ waves/SIMD."""
    result = native_builds[f"{arch}/{cache}/{kernel}/{page}"]
    want = NATIVE_MMA[(arch, cache)]
    assert result["mma"] and all(want in name for name in result["mma"]), result["mma"]
    assert result["scratch"] == 0
    assert result["waves"] >= (1 if kernel == "tiled" else 2), result


_MATRIX_CHILD = r"""
import json, sys, tempfile
from qsa_aiter.tools import assembly as isa
from qsa_aiter.tools.warmup import KERNELS, Matrix

arch = sys.argv[1]
with tempfile.TemporaryDirectory() as root:
    rows = isa.analyse(arch, root=root, matrix=Matrix(kernels=KERNELS, index_dtypes=("int32",)))
print("MATRIX " + json.dumps([dict(kernel=r.kernel, cache=r.cache, page=r.page_size, variant=r.variant,
                                   spills=r.spills, scratch=r.scratch, spill_bytes=r.spill_bytes, waves=r.waves,
                                   config={k: str(v) for k, v in r.config.items()})
                              for r in rows]))
"""

#: sm_90 builds that spill and are kept: H200-tuned tiles for which every tile without spills measured slower on the
#: H200 in the same sweeps (docs/kernels.md, "Spills kept on sm_90"), as (kernel, cache, page size, the settings that
#: identify the tile); every other variant of every target must not spill.
MEASURED_SPILLS = [
    *(("tiled", cache, page, {"BLOCK_M": "32", "BLOCK_N": "128", "num_stages": "3", "KEYS_MAJOR": "True"})
      for cache in ("fp8", "fp8_fnuz") for page in (16, 64)),
    ("tiled", "fp4", 16, {"BLOCK_M": "64", "BLOCK_N": "128", "num_stages": "2", "PER_HEAD": "True"}),
    ("tiled", "fp4", 64, {"BLOCK_M": "64", "BLOCK_N": "64", "num_stages": "2", "PER_HEAD": "True"}),
    ("rowwise", "fp4", 16, {"BLOCK_N": "128"}),  # Triton 3.6 only: 4 bytes
]


def kept_spill(row: dict) -> bool:
    """Whether ``row`` (an sm_90 variant) is one of ``MEASURED_SPILLS``."""
    return any(row["kernel"] == kernel and row["cache"] == cache and row["page"] == page
               and all(row["config"].get(k) == v for k, v in settings.items())
               for kernel, cache, page, settings in MEASURED_SPILLS)


@pytest.mark.parametrize("arch", ("gfx950", "gfx942", "sm_90"))
@pytest.mark.slow
def test_no_variant_of_the_warmup_matrix_spills(arch):
    """Every Triton kernel x cache format x page size x tile config the warm-up builds for ``arch`` (int32 indices)
    keeps its registers: no scratch on AMD, no spill stores on sm_90 (but for ``MEASURED_SPILLS``); the
    decode/verify MFMA scorers run 2+ waves per SIMD on AMD."""
    if arch.startswith("gfx"):
        requires_amd_triton()
    rows = _child(_MATRIX_CHILD, arch)
    assert len(rows) > 40, len(rows)
    spilling = [r for r in rows if r["spills"] and not (arch == "sm_90" and kept_spill(r))]
    assert not spilling, spilling
    if arch.startswith("gfx"):
        thin = [r for r in rows if r["kernel"] in ("stacked", "keys_major") and r["waves"] < 2]
        assert not thin, thin


@pytest.mark.parametrize("constexprs, pointer, name", [
    ({"KV_KIND": 0}, "*bf16", "bf16"), ({"KV_KIND": 0}, "*fp16%16", "fp16"), ({"KIND": 0}, "*fp16", "fp16"),
    ({"KIND": 0}, "*bf16", "bf16"), ({"KIND": 2}, "*bf16", "fp8_fnuz"), ({}, "*fp32", "-")])
def test_a_variant_names_its_cache_as_the_library_does(constexprs, pointer, name):
    """The table's cache column uses the format names (``CACHE_FORMATS``): a 16-bit variant is ``bf16`` or ``fp16``
    by its pointers' element type, never the former ``16bit``."""
    from qsa_aiter.kernels.quant.dequant import KV_16BIT
    from qsa_aiter.runtime.jit.manifest import Entry

    assert KV_16BIT == 0
    entry = Entry.model_construct(constexprs=constexprs, arguments={"q_ptr": pointer, "pt": "*i32"})
    assert isa._cache_of(entry) == name

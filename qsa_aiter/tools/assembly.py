"""What the compiler made of each kernel variant, for any target and without its GPU: the matrix-instruction mix,
registers, LDS / shared memory, scratch (spills) and waves per SIMD (the library of ``python -m qsa_aiter isa``,
``tools/isa.py``, and of the static model, ``tools/static_model.py``).

The variants are those of the warm-up matrix (``warmup.Matrix``), compiled into the JIT cache first (entries already
there are reused), then read from the files Triton keeps beside each binary:

- AMD (``.amdgcn``): the MFMA / SMFMAC instructions by name; the architectural and accumulation VGPRs (``;
  NumVgprs`` and ``; NumAgprs``: they share one file of 512 per lane on CDNA3/CDNA4), ``.sgpr_count``,
  ``.private_segment_fixed_size`` (scratch bytes per lane: spills or private arrays), the spill counts, and the
  register-limited occupancy LLVM prints (``; Occupancy:``). The LDS a workgroup takes is Triton's (``shared`` of its
  metadata: Triton allocates LDS dynamically, so the code object's static size is 0). Waves per SIMD are the smaller
  of the register limit and what the LDS of one CU allows (``Platform.shared_memory_per_multiprocessor``).
- NVIDIA (``.ptx``): the ``mma`` / ``wgmma`` instructions by shape and types, and ``ptxas -v`` on the PTX (the
  ``ptxas`` Triton compiled it with, ``triton_compat.ptxas_path``) for registers, spill stores and loads, and stack
  frame.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels.platform import Platform
from ..kernels.quant.dequant import KV_16BIT, KV_FP4, KV_FP8_E4M3FN, KV_FP8_E4M3FNUZ
from ..runtime.jit.launching import store_for
from ..runtime.jit.manifest import Entry
from ..runtime.jit.paths import jit_root
from ..runtime.jit.store import Store
from ..runtime.jit.triton_compat import ptxas_path
from ..runtime.settings import get_settings
from .warmup import KERNELS, Matrix, warmup

#: AMD matrix instructions (dense and sparse), NVIDIA ones (``mma.sync`` and warpgroup ``wgmma``).
_AMD_MATRIX = re.compile(r"\b(v_mfma_\w+|v_smfmac_\w+)")
_NV_MATRIX = re.compile(r"\b((?:wgmma\.mma_async|mma)(?:\.\w+)+)")
#: The HSA metadata fields read from an ``.amdgcn`` file, by the name they get here.
_AMD_FIELDS = {
    "vgprs": r";\s*NumVgprs:\s+(\d+)", "agprs": r";\s*NumAgprs:\s+(\d+)", "sgprs": r"\.sgpr_count:\s+(\d+)",
    "scratch": r"\.private_segment_fixed_size:\s+(\d+)", "vgpr_spills": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spills": r"\.sgpr_spill_count:\s+(\d+)", "occupancy": r";\s*Occupancy:\s+(\d+)",
}
#: ``ptxas -v`` lines: registers, spill bytes, stack frame.
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame")
#: SIMDs per CU on CDNA3/CDNA4: a workgroup's waves spread over them.
SIMDS_PER_CU = 4
#: The cache format a scorer variant reads, from its ``KV_KIND`` constexpr (16-bit: its tensors' dtype decides
#: bf16 or fp16, ``_sixteen_bit``).
_CACHE_OF_KIND = {KV_FP8_E4M3FN: "fp8", KV_FP8_E4M3FNUZ: "fp8_fnuz", KV_FP4: "fp4"}
#: Constexprs that say which code path a variant took (shown in ``variant``), besides its format and page size.
PATH_CONSTEXPRS = ("E4M3_MMA", "FP8_MMA", "SCALED_MMA", "KEYS_MAJOR", "PER_HEAD", "TILES", "FUSED", "WITH_MAXIMA")


@dataclass(frozen=True)
class VariantIsa:
    """One compiled variant as the compiler left it.

    ``vgprs``: vector registers per lane (AMD; on NVIDIA the registers per thread); ``agprs``: accumulation registers
    (AMD, 0 elsewhere); ``scratch``: bytes of scratch per lane (AMD private segment; NVIDIA stack frame);
    ``spill_bytes``: NVIDIA spill stores in bytes, AMD spilled VGPRs times 4 (spilled SGPRs go to VGPR lanes, not
    to memory); ``waves``: waves per SIMD (AMD; 0
    on NVIDIA) and ``limit`` what bounds them (``registers``, ``LDS``).
    """

    entry: str
    kernel: str
    cache: str
    page_size: int | None
    variant: str
    num_warps: int
    mma: dict[str, int]
    vgprs: int
    agprs: int
    sgprs: int
    lds: int
    scratch: int
    spill_bytes: int
    waves: int
    limit: str
    backend: str = "hip"
    config: dict = field(default_factory=dict, compare=False)

    @property
    def spills(self) -> bool:
        """Whether registers went to memory: on AMD any scratch (``.private_segment_fixed_size``), on NVIDIA spill
        stores (a stack frame alone holds local arrays, not spilled registers)."""
        return self.spill_bytes > 0 or (self.backend == "hip" and self.scratch > 0)


def mma_mix(text: str, amd: bool) -> dict[str, int]:
    """Matrix instructions in assembly ``text`` (``.amdgcn``, or ``.ptx`` when not ``amd``), by name, with counts."""
    pattern = _AMD_MATRIX if amd else _NV_MATRIX
    return dict(sorted(collections.Counter(pattern.findall(text)).items()))


def amd_resources(text: str) -> dict[str, int]:
    """The HSA metadata of an ``.amdgcn`` file of one kernel (``_AMD_FIELDS``; a field absent reads 0)."""
    found = {}
    for name, pattern in _AMD_FIELDS.items():
        match = re.search(pattern, text)
        found[name] = int(match.group(1)) if match else 0
    return found


def amd_waves(occupancy: int, lds: int, num_warps: int, lds_per_cu: int) -> tuple[int, str]:
    """Waves per SIMD of a kernel with register-limited ``occupancy`` whose workgroups of ``num_warps`` waves take
    ``lds`` bytes each, on a CU of ``lds_per_cu`` bytes, and which of the two limits it."""
    if lds <= 0:
        return occupancy, "registers"
    by_lds = (lds_per_cu // lds) * num_warps // SIMDS_PER_CU
    return (occupancy, "registers") if occupancy <= by_lds else (by_lds, "LDS")


def ptxas_resources(ptx: Path, arch: str, ptxas: str | None = None) -> dict[str, int]:
    """``ptxas -v`` of a PTX file for ``arch`` (``sm_90``: built as ``sm_90a``, as Triton does): registers, spill
    store and load bytes, stack frame bytes."""
    if ptxas is None:
        ptxas = ptxas_path(int(arch.removeprefix("sm_")))
    gpu = arch + ("a" if arch == "sm_90" else "")
    done = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", str(ptx), "-o", "/dev/null"], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx}: {done.stderr.strip()[-2000:]}")
    log = done.stderr + done.stdout
    registers = _PTXAS_REGISTERS.search(log)
    spills = _PTXAS_SPILLS.search(log)
    stack = _PTXAS_STACK.search(log)
    return {
        "registers": int(registers.group(1)) if registers else 0,
        "spill_stores": int(spills.group(1)) if spills else 0,
        "spill_loads": int(spills.group(2)) if spills else 0,
        "stack": int(stack.group(1)) if stack else 0,
    }


def _sixteen_bit(entry: Entry) -> str:
    """The 16-bit format (``bf16`` or ``fp16``) of a variant of a 16-bit cache: its pointers' element type."""
    return "fp16" if any(t.startswith("*fp16") for t in entry.arguments.values()) else "bf16"


def _cache_of(entry: Entry) -> str:
    """The index-cache format a variant was built for, by the library's name (``CACHE_FORMATS``), '-' for none."""
    kind = entry.constexprs.get("KV_KIND")
    if kind is None:
        kind = entry.constexprs.get("KIND")  # the cache writer's
        if kind == 0:
            return _sixteen_bit(entry)
        return {1: "fp8", 2: "fp8_fnuz", 3: "fp4"}.get(kind, "-") if kind is not None else "-"
    return _sixteen_bit(entry) if kind == KV_16BIT else _CACHE_OF_KIND.get(kind, str(kind))


def _variant(entry: Entry) -> str:
    c = entry.constexprs
    parts = [f"{name}={c[name]}" for name in PATH_CONSTEXPRS if name in c and c[name] not in (False, None)]
    tiles = [f"{k}={c[k]}" for k in ("BLOCK_ROWS", "BLOCK_M", "BLOCK_N", "DOT_DTYPE") if k in c]
    # The index dtype (page table, else the first int pointer) tells apart variants that differ only in it.
    index = next((t for name, t in entry.arguments.items() if t in ("*i32", "*i64") and name.startswith("pt")),
                 next((t for t in entry.arguments.values() if t in ("*i32", "*i64")), ""))
    launch = f"w{entry.options.get('num_warps', '?')}s{entry.options.get('num_stages', '?')}"
    return " ".join(parts + tiles + [launch] + ([index.lstrip("*")] if index else []))


def read_variant(store: Store, eid: str, entry: Entry, platform: Platform) -> VariantIsa:
    """The ``VariantIsa`` of one JIT cache entry of ``store`` (its files in the entry's Triton group)."""
    group = store.triton_dir / entry.group
    metadata = json.loads((group / entry.metadata).read_text())
    name = metadata["name"]
    num_warps = int(entry.options.get("num_warps", metadata.get("num_warps", 4)))
    lds = int(metadata.get("shared", 0))
    common = dict(entry=eid, kernel=entry.kernel, cache=_cache_of(entry),
                  page_size=entry.constexprs.get("PAGE_SIZE"), variant=_variant(entry), num_warps=num_warps, lds=lds,
                  config=dict(entry.constexprs) | dict(entry.options))
    if platform.backend == "hip":
        text = (group / f"{name}.amdgcn").read_text()
        res = amd_resources(text)
        waves, limit = amd_waves(res["occupancy"], lds, num_warps, platform.shared_memory_per_multiprocessor)
        return VariantIsa(mma=mma_mix(text, True), vgprs=res["vgprs"], agprs=res["agprs"], sgprs=res["sgprs"],
                          scratch=res["scratch"], spill_bytes=4 * res["vgpr_spills"],
                          waves=waves, limit=limit, **common)
    ptx = group / f"{name}.ptx"
    res = ptxas_resources(ptx, platform.arch)
    return VariantIsa(mma=mma_mix(ptx.read_text(), False), vgprs=res["registers"], agprs=0, sgprs=0,
                      scratch=res["stack"], spill_bytes=res["spill_stores"], waves=0, limit="-", backend="cuda",
                      **common)


def read_store(store: Store, kernels: tuple[str, ...] | None = None) -> list[VariantIsa]:
    """Every entry of ``store`` (those of ``kernels`` when given), read, sorted by kernel, cache, page size and
    variant."""
    platform = Platform.named(store.arch)
    rows = [read_variant(store, eid, entry, platform) for eid, entry in store.read().entries.items()
            if kernels is None or entry.kernel in kernels]
    return sorted(rows, key=lambda r: (r.kernel, r.cache, r.page_size or 0, r.variant, r.entry))


def analyse(arch: str, *, root=None, matrix=None, progress: bool = False, settings=None) -> list[VariantIsa]:
    """Warm ``matrix`` (default: the whole warm-up matrix) up for ``arch`` into the JIT cache under ``root``
    (default: the JIT root) and read every variant it launches. A variant that fails to build is an error."""
    settings = settings or get_settings()
    matrix = matrix or Matrix(kernels=KERNELS)
    root = jit_root(settings) if root is None else root
    report = warmup(arch, root=root, matrix=matrix, progress=progress, settings=settings)
    if report.failed:
        raise RuntimeError("isa: some variants failed to build:\n" + report.summary())
    wanted = set(report.compiled) | set(report.found)
    store = store_for(root, arch, False)
    return [row for row in read_store(store, tuple(k for k in matrix.kernels if k in KERNELS)) if row.entry in wanted]


def table(rows: list[VariantIsa], backend: str) -> str:
    """A Markdown table of ``rows`` (one ``backend``'s: ``hip`` shows AGPRs and waves per SIMD)."""
    amd = backend == "hip"
    head = (["kernel", "cache", "page", "variant", "matrix instructions"]
            + (["VGPR", "AGPR", "SGPR", "LDS", "scratch", "waves/SIMD"] if amd
               else ["registers", "shared", "spill stores", "stack"]))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mix = ", ".join(f"{name} x{count}" for name, count in r.mma.items()) or "none"
        cells = [r.kernel, r.cache, str(r.page_size or "-"), r.variant, mix]
        if amd:
            cells += [str(r.vgprs), str(r.agprs), str(r.sgprs), str(r.lds), str(r.scratch), f"{r.waves} ({r.limit})"]
        else:
            cells += [str(r.vgprs), str(r.lds), str(r.spill_bytes), str(r.scratch)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)

"""Offline AMD builds of the native kernels: clang compiles a native source as HIP for ``gfx942`` / ``gfx950`` on a
machine without the GPU (``warmup --arch gfx942``), as hipRTC would on the ROCm machine: ``clang -x hip
--offload-device-only --offload-arch=<arch> -include hip/hip_runtime.h`` (hipRTC pre-includes that header), the
device libraries linked, one code object per kernel. The entries go into ``native/<arch>/`` of the JIT cache, where
a launch on a ROCm GPU loads them without compiling (``NativeStore.prebuilt``).

What it needs (``toolchain``): a clang with the AMDGPU target (``QSA_AITER_HIP_CLANG``; default: Debian's clang-22,
found through ``llvm-config-22``), and a HIP SDK directory with the HIP headers and the AMDGPU device bitcode
(``QSA_AITER_HIP_SDK``; default: what the project's ``.ci/amd-toolchain.sh`` installs and unpacks under
``${HIP_COMPILE_HOME:-${TMPDIR:-/tmp}/hip-compile}/sdk``, else ``$ROCM_PATH``, else ``/opt/rocm``).
``unavailable_reason`` says what is missing. The compile's ``-Rpass-analysis=kernel-resource-usage`` remarks give
each kernel's registers, scratch, spills, LDS and waves per SIMD (``kernel_remarks``, ``AmdResources``; an entry
records its VGPRs, scratch and spills: ``amd_resources``), and ``llvm-readelf --notes`` reads the same figures from
the code object's AMDGPU metadata note (``ClangCompiler.code_object_notes``): ``python -m qsa_aiter
native-resources`` (``tools/native_resources.py``) holds every variant to no scratch and no VGPR spills by both.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..settings import QsaSettings, get_settings
from .native_store import Compiled, Resources

LLVM_VERSION = 22
#: Options of every compile after the arch (the SDK's path is given apart: it is not part of what is built).
BASE_OPTIONS = ("-x", "hip", "-std=c++17", "--offload-device-only", "--no-gpu-bundle-output", "-include",
                "hip/hip_runtime.h", "-O3")
_RESOURCE_REMARK = "-Rpass-analysis=kernel-resource-usage"


class ClangError(RuntimeError):
    """clang rejected a source, or is missing: the message holds the command and its log."""


def _default_clang() -> str | None:
    config = shutil.which(f"llvm-config-{LLVM_VERSION}")
    if config:
        done = subprocess.run([config, "--bindir"], capture_output=True, text=True)
        candidate = Path(done.stdout.strip()) / "clang"
        if done.returncode == 0 and candidate.is_file():
            return str(candidate)
    return shutil.which(f"clang-{LLVM_VERSION}") or shutil.which("clang")


def sdk_candidates(settings: QsaSettings) -> list[Path]:
    """The HIP SDK directories looked at, in order (``QSA_AITER_HIP_SDK`` alone where set)."""
    if settings.hip_sdk:
        return [Path(settings.hip_sdk)]
    home = os.environ.get("HIP_COMPILE_HOME") or str(Path(os.environ.get("TMPDIR") or "/tmp") / "hip-compile")
    found = [Path(home) / "sdk"]
    if os.environ.get("ROCM_PATH"):
        found.append(Path(os.environ["ROCM_PATH"]))
    return found + [Path("/opt/rocm")]


def _sdk_ok(path: Path, arch: str) -> bool:
    bitcode = f"oclc_isa_version_{arch.removeprefix('gfx')}.bc"
    return (path / "include/hip/hip_runtime.h").is_file() and any(
        (path / sub / bitcode).is_file() for sub in ("amdgcn/bitcode", "lib/llvm/lib/clang/amdgcn/bitcode"))


@dataclass(frozen=True)
class ClangCompiler:
    """``native_store.Compiler`` for AMD archs offline: ``clang`` with the HIP SDK at ``sdk``; ``version`` is the
    clang version and the HIP headers' (both shape the code object)."""

    clang: str
    sdk: str
    version: str
    kind = "clang"

    @property
    def path(self) -> str:
        return self.clang

    def options(self, arch: str, defines: tuple[str, ...]) -> tuple[str, ...]:
        return (f"--offload-arch={arch}", *BASE_OPTIONS, *(f"-D{d}" for d in defines))

    def compile(self, source: str, kernel: str, arch: str, defines: tuple[str, ...]) -> Compiled:
        """Compile ``source`` for ``arch``; ``ClangError`` with the log where it does not compile."""
        with tempfile.TemporaryDirectory(prefix="qsa_hip_") as tmp:
            src, out = Path(tmp) / f"{kernel}.cu", Path(tmp) / f"{kernel}.hsaco"
            src.write_text(source)
            command = [self.clang, *self.options(arch, defines), f"--rocm-path={self.sdk}", _RESOURCE_REMARK,
                       "-c", str(src), "-o", str(out)]
            start = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True)
            seconds = time.perf_counter() - start
            log = done.stderr
            if done.returncode != 0 or not out.is_file():
                raise ClangError(f"clang {self.version} could not compile {kernel} for {arch} (exit "
                                 f"{done.returncode}; {' '.join(command)}):\n{log.strip()[-4000:]}")
            binary = out.read_bytes()
        report = "\n".join(line.split("remark: ", 1)[1].split(" [-Rpass")[0].rstrip()
                           for line in log.splitlines() if "remark: " in line and "kernel-resource-usage" in line)
        return Compiled(binary, log, seconds, amd_resources(log, kernel), report)

    def readelf(self) -> str | None:
        """The ``llvm-readelf`` beside ``clang`` (the same LLVM), else ``llvm-readelf-22`` on the PATH; None:
        neither."""
        beside = Path(self.clang).parent / "llvm-readelf"
        return str(beside) if beside.is_file() else shutil.which(f"llvm-readelf-{LLVM_VERSION}")

    def code_object_notes(self, binary: bytes) -> dict[str, dict[str, int | bool]]:
        """Each kernel's ``NOTE_FIELDS`` read from code object ``binary``'s AMDGPU metadata note (what the loader
        allocates by); ``ClangError`` where no ``llvm-readelf`` reads it."""
        readelf = self.readelf()
        if readelf is None:
            raise ClangError(f"no llvm-readelf beside {self.clang} or on the PATH to read the code object's metadata: "
                             f"install llvm-{LLVM_VERSION}")
        with tempfile.TemporaryDirectory(prefix="qsa_hip_") as tmp:
            path = Path(tmp) / "kernel.hsaco"
            path.write_bytes(binary)
            done = subprocess.run([readelf, "--notes", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            raise ClangError(f"{readelf} --notes failed (exit {done.returncode}): {done.stderr.strip()[:300]}")
        return note_fields(done.stdout)


#: clang's kernel-resource-usage remarks (``-Rpass-analysis=kernel-resource-usage``, clang 20+), by the name
#: ``AmdResources`` gives each figure.
REMARK_FIELDS = {"VGPRs": "vgprs", "AGPRs": "agprs", "TotalSGPRs": "sgprs", "ScratchSize [bytes/lane]": "scratch",
                 "Dynamic Stack": "dynamic_stack", "VGPRs Spill": "vgpr_spills", "SGPRs Spill": "sgpr_spills",
                 "LDS Size [bytes/block]": "lds", "Occupancy [waves/SIMD]": "waves"}
#: A remark line of clang's log (``a.cu:1:2: remark:     VGPRs: 62 [-Rpass-analysis=...]``) or of a record's report
#: (``    VGPRs: 62``, the log's remarks without their prefix).
_REMARK = re.compile(r"(?:^|remark:)\s*(Function Name|" + "|".join(map(re.escape, REMARK_FIELDS)) + r"): (\S+)")
#: The fields of the code object's AMDGPU metadata note (``llvm-readelf --notes``) that say the same as a remark.
NOTE_FIELDS = {".agpr_count": "agprs", ".sgpr_count": "sgprs", ".private_segment_fixed_size": "scratch",
               ".uses_dynamic_stack": "dynamic_stack", ".vgpr_spill_count": "vgpr_spills",
               ".sgpr_spill_count": "sgpr_spills", ".group_segment_fixed_size": "lds"}
_NOTE_LINE = re.compile(r"^(  - |    )(\.\w+):\s*(.*?)\s*$")


@dataclass(frozen=True)
class AmdResources:
    """One AMD kernel's resources as its compiler reports them: architectural ``vgprs`` and accumulation ``agprs``
    per lane (one file of 512 on gfx942 / gfx950), ``sgprs`` (all, VCC and flat scratch included), ``scratch`` bytes
    per lane, a ``dynamic_stack`` (scratch of a size unknown at compile time), spilled VGPRs and SGPRs (SGPRs spill
    into VGPR lanes, not memory), static ``lds`` bytes per workgroup (the dynamic part is set at launch) and the
    ``waves`` per SIMD its registers and LDS allow."""

    vgprs: int
    agprs: int
    sgprs: int
    scratch: int
    dynamic_stack: bool
    vgpr_spills: int
    sgpr_spills: int
    lds: int
    waves: int

    @classmethod
    def of(cls, fields: dict[str, int | bool], kernel: str) -> AmdResources:
        """From ``kernel_remarks``' figures of one kernel; ``ValueError`` naming what clang did not report (AGPRs are
        reported only where the arch has MFMAs: 0 otherwise)."""
        fields = {"agprs": 0, **fields}
        missing = [remark for remark, name in REMARK_FIELDS.items() if name not in fields]
        if missing:
            raise ValueError(f"clang reported no {', '.join(missing)} for {kernel}")
        return cls(**{name: fields[name] for name in REMARK_FIELDS.values()})

    @property
    def spills(self) -> bool:
        """Whether the kernel uses memory for what should be in registers: scratch, a dynamic stack or spilled
        VGPRs."""
        return self.scratch > 0 or self.dynamic_stack or self.vgpr_spills > 0

    def resources(self) -> Resources:
        """As a native entry records them (VGPRs as registers, spills at 4 bytes a VGPR, scratch as the stack)."""
        return Resources(self.vgprs, 4 * self.vgpr_spills, None, self.scratch)


def kernel_remarks(text: str) -> dict[str, dict[str, int | bool]]:
    """Each function's figures from clang's kernel-resource-usage remarks in ``text`` (a compile's log, or a record's
    report), by function name and ``REMARK_FIELDS`` name."""
    found: dict[str, dict[str, int | bool]] = {}
    current = None
    for line in text.splitlines():
        match = _REMARK.search(line)
        if not match:
            continue
        remark, value = match.groups()
        if remark == "Function Name":
            current = found.setdefault(value, {})
        elif current is not None:
            current[REMARK_FIELDS[remark]] = value.lower() == "true" if remark == "Dynamic Stack" else int(value)
    return found


def amd_resources(log: str, kernel: str) -> Resources:
    """``kernel``'s VGPRs (``registers``), scratch bytes per lane (``stack_bytes``) and VGPR spills (4 bytes each,
    ``spill_store_bytes``) from clang's kernel-resource-usage remarks in ``log``; None where it reports none."""
    values = kernel_remarks(log).get(kernel)
    if not values:
        return Resources()
    spills = values.get("vgpr_spills")
    return Resources(values.get("vgprs"), None if spills is None else 4 * spills, None, values.get("scratch"))


def note_fields(notes: str) -> dict[str, dict[str, int | bool]]:
    """Each kernel's ``NOTE_FIELDS`` from ``llvm-readelf --notes`` of a code object, by kernel name."""
    kernels, current = {}, None
    for line in notes.splitlines():
        match = _NOTE_LINE.match(line)
        if not match:
            continue
        start, key, value = match.groups()
        if start == "  - ":
            current = {}
        if current is None:
            continue
        if key == ".name":
            kernels[value] = current
        elif key in NOTE_FIELDS:
            current[NOTE_FIELDS[key]] = value == "true" if key == ".uses_dynamic_stack" else int(value)
    return kernels


def _hip_version(sdk: Path) -> str:
    header = sdk / "include/hip/hip_version.h"
    text = header.read_text() if header.is_file() else ""
    parts = [re.search(rf"#define HIP_VERSION_{name} (\d+)", text) for name in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts if m) or "unknown"


def toolchain(settings: QsaSettings | None = None, arch: str = "gfx942") -> ClangCompiler | str:
    """The offline compiler for ``arch``, or why there is none (a sentence naming what is missing and how to get
    it)."""
    settings = settings or get_settings()
    clang = settings.hip_clang or _default_clang()
    if not clang or not Path(clang).is_file() and not shutil.which(clang):
        what = f"QSA_AITER_HIP_CLANG={settings.hip_clang} is not a file" if settings.hip_clang else \
            f"clang-{LLVM_VERSION} not found"
        return (f"no clang with the AMDGPU target ({what}): run the project's .ci/amd-toolchain.sh (it installs "
                f"clang-{LLVM_VERSION}, lld-{LLVM_VERSION} and llvm-{LLVM_VERSION}), or set QSA_AITER_HIP_CLANG")
    sdk = next((p for p in sdk_candidates(settings) if _sdk_ok(p, arch)), None)
    if sdk is None:
        looked = ", ".join(str(p) for p in sdk_candidates(settings))
        return (f"no HIP headers and {arch} device bitcode (looked in {looked}): run the project's "
                ".ci/amd-toolchain.sh, or set QSA_AITER_HIP_SDK to a directory with include/hip/hip_runtime.h and "
                "amdgcn/bitcode")
    done = subprocess.run([clang, "--version"], capture_output=True, text=True)
    match = re.search(r"clang version (\S+)", done.stdout)
    if done.returncode != 0 or not match:
        return f"{clang} --version failed: {(done.stderr or done.stdout).strip()[:200]}"
    return ClangCompiler(clang, str(sdk), f"{match.group(1)} (HIP {_hip_version(sdk)})")


def unavailable_reason(settings: QsaSettings | None = None, arch: str = "gfx942") -> str | None:
    """Why AMD code objects cannot be built here offline (None: they can)."""
    found = toolchain(settings, arch)
    return found if isinstance(found, str) else None

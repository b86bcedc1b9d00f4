"""The native kernels for AMD targets on a machine without an AMD GPU: ``warmup --arch gfx942`` / ``gfx950`` builds
code objects into the JIT cache through clang and ``jit list`` shows them; a ROCm launch's lookup finds those offline
entries (``NativeStore.prebuilt``); hipRTC's host-side logic against a stand-in library; the HIP module driver's
calls against a stand-in; clang's resource remarks and the code object's metadata note read per kernel; the
toolchain's absence named. The tests that compile are marked ``amd``: they run where ``.ci/amd-toolchain.sh`` has set
the toolchain up."""

from __future__ import annotations

import ctypes
import sys

import pytest

from qsa_aiter.kernels.selection import native_topk as nt
from qsa_aiter.runtime.jit import hip_clang, hip_driver, hiprtc, native
from qsa_aiter.runtime.jit.native_store import NativeStore
from qsa_aiter.runtime.settings import get_settings
from qsa_aiter.tools.cli import main

AMD = ("gfx942", "gfx950")


@pytest.mark.amd
@pytest.mark.parametrize("arch", AMD)
def test_warmup_builds_amd_code_objects_and_jit_list_shows_them(arch, tmp_path, capsys):
    root = tmp_path / "jit"
    assert main(["warmup", "--arch", arch, "--kernels", "native_topk", "--jit-dir", str(root), "--no-progress"]) == 0
    assert f"warm-up {arch}: 2 variants, 2 compiled" in capsys.readouterr().out
    store = NativeStore(root, arch)
    records = [store.read(eid) for eid in store.entry_ids()]
    assert sorted(r.kernel for r in records) == ["topk_rows_256", "topk_rows_512"]
    for record in records:
        assert record.compiler == "clang" and record.built_by == "target" and "-DTOPK_WARP_SIZE=64" in record.options
        assert f"--offload-arch={arch}" in record.options and record.binary.endswith(".hsaco")
        assert record.stack_bytes == 0 and record.spill_store_bytes == 0 and record.registers > 0
        assert (store.dir / record.binary).read_bytes()[:4] == b"\x7fELF"
    assert main(["jit", "list", "--jit-dir", str(root)]) == 0
    listing = capsys.readouterr().out
    assert f"native / {arch}: 2 entries" in listing and listing.count("  ok\n") == 2
    assert "topk_rows_256 clang " in listing
    # Warmed again: found, not compiled.
    assert main(["warmup", "--arch", arch, "--kernels", "native_topk", "--jit-dir", str(root), "--no-progress"]) == 0
    assert "0 compiled" in capsys.readouterr().out


class StandInHiprtc:
    """hipRTC's functions, answering through their out-parameters (``hiprtc.open_library`` sets their types)."""

    def __init__(self, fail_compile: bool = False):
        self.options: list[str] = []
        self.fail_compile = fail_compile
        self.destroyed = 0
        for name in hiprtc._FUNCTIONS:
            setattr(self, name, _Function(getattr(self, "_" + name)))

    def _hiprtcVersion(self, major, minor):
        major._obj.value, minor._obj.value = 7, 2
        return 0

    def _hiprtcGetErrorString(self, result):
        return b"HIPRTC_ERROR_COMPILATION"

    def _hiprtcCreateProgram(self, program, source, name, *rest):
        program._obj.value = 0x1234
        self.source, self.name = source, name
        return 0

    def _hiprtcCompileProgram(self, program, count, options):
        self.options = [options[i].decode() for i in range(count)]
        return 6 if self.fail_compile else 0

    def _hiprtcGetProgramLogSize(self, program, size):
        size._obj.value = 9
        return 0

    def _hiprtcGetProgramLog(self, program, buffer):
        ctypes.memmove(buffer, b"the log.\0", 9)
        return 0

    def _hiprtcGetCodeSize(self, program, size):
        size._obj.value = 4
        return 0

    def _hiprtcGetCode(self, program, buffer):
        ctypes.memmove(buffer, b"\x7fELF", 4)
        return 0

    def _hiprtcDestroyProgram(self, program):
        self.destroyed += 1
        return 0


class _Function:
    def __init__(self, call):
        self.call, self.argtypes, self.restype = call, None, None

    def __call__(self, *args):
        return self.call(*args)


def test_hiprtc_compiles_with_the_targets_options_through_the_library():
    lib = StandInHiprtc()
    compiler = hiprtc.open_library(lib, "/opt/rocm/lib/libhiprtc.so")
    assert (compiler.kind, compiler.version) == ("hiprtc", "7.2")
    defines = nt.SPEC.defines(nt.BY_NAME["topk_rows_256"], "gfx942")
    compiled = compiler.compile("source", "topk_rows_256", "gfx942", defines)
    assert compiled.binary == b"\x7fELF" and compiled.log == "the log." and lib.destroyed == 1
    assert lib.options == ["--offload-arch=gfx942", "-std=c++17", "-O3", "-DTOPK_SINGLE",
                           "-DTOPK_KERNEL_topk_rows_256", "-DTOPK_WARP_SIZE=64"]
    assert lib.name == b"topk_rows_256.cu" and compiler.options("gfx942", defines) == tuple(lib.options)
    failing = hiprtc.open_library(StandInHiprtc(fail_compile=True), "libhiprtc.so")
    with pytest.raises(hiprtc.HiprtcError, match=r"could not compile k for gfx950 \(HIPRTC_ERROR_COMPILATION") as info:
        failing.compile("source", "k", "gfx950", ())
    assert info.value.log == "the log."


def test_hiprtc_is_looked_for_on_rocm_builds_only():
    hiprtc.forget()  # the search is remembered per process: a test that faked a ROCm build may have made it
    if __import__("torch").version.hip is None:
        assert hiprtc.unavailable_reason() == "hipRTC is looked for on a ROCm build of torch only"
        with pytest.raises(hiprtc.HiprtcUnavailable):
            hiprtc.find()
    assert hiprtc.library_candidates()[-len(hiprtc.SYSTEM_NAMES):] == list(hiprtc.SYSTEM_NAMES)


class _Clang:
    kind, version, path = "clang", "22.1.8 (HIP 7.2)", "/usr/bin/clang"

    def options(self, arch, defines):
        return (f"--offload-arch={arch}", *(f"-D{d}" for d in defines))

    def compile(self, source, kernel, arch, defines):
        from qsa_aiter.runtime.jit.native_store import Compiled, Resources

        return Compiled(b"\x7fELF code", "", 0.1, Resources(40, 0, None, 0), "VGPRs: 40")


class _Hiprtc(_Clang):
    kind, version = "hiprtc", "7.2"


def test_a_rocm_launch_loads_the_offline_clang_entry(tmp_path):
    """Where no hipRTC entry is cached, the clang entry of the same source, kernel and macros serves: nothing is
    compiled; another source or other macros do not match it."""
    store = NativeStore(tmp_path, "gfx942")
    defines = nt.SPEC.defines(nt.BY_NAME["topk_rows_256"], "gfx942")
    offline = store.build("source", "topk_rows_256", defines, _Clang(), built_by="target")
    launch = NativeStore(tmp_path, "gfx942").build("source", "topk_rows_256", defines, _Hiprtc(), prebuilt=True)
    assert not launch.event.compiled and launch.entry_id == offline.entry_id and launch.binary == b"\x7fELF code"
    other = NativeStore(tmp_path, "gfx942")
    assert other.prebuilt("other source", "topk_rows_256", defines) is None
    assert other.prebuilt("source", "topk_rows_256", defines[:2]) is None
    assert other.build("source", "topk_rows_256", defines[:2], _Hiprtc(), prebuilt=True).event.compiled


class StandInHip:
    def __init__(self):
        self.calls = []
        self.device = 0

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name == "hipGetDevice":
                args[0]._obj.value = self.device
            elif name in ("hipModuleLoadData", "hipModuleGetFunction"):
                args[0]._obj.value = 0xAB
            elif name in ("hipGetErrorName", "hipGetErrorString"):
                return b"hipErrorInvalidValue"
            elif name == "hipModuleLaunchKernel":
                return 1
            return 0
        return call


def test_the_hip_driver_loads_on_the_device_and_launches(monkeypatch):
    lib = StandInHip()
    monkeypatch.setattr(hip_driver, "_hip", lambda: lib)
    kernel = hip_driver.load_code_object(b"\x7fELF", "topk_rows_256", "topk_rows_256-x", 1)
    names = [n for n, _ in lib.calls]
    assert names == ["hipGetDevice", "hipSetDevice", "hipModuleLoadData", "hipModuleGetFunction", "hipSetDevice"]
    assert [a[0] for n, a in lib.calls if n == "hipSetDevice"] == [1, 0] and kernel.vendor == "hip"
    launch = native.PreparedLaunch("native_topk", kernel, (4, 1, 1), (256, 1, 1), 70000, ("a", "b"),
                                   (("rows", "int", 4),))
    assert "hipFuncSetAttribute" not in [n for n, _ in lib.calls]
    with pytest.raises(hip_driver.DriverError, match=r"hipModuleLaunchKernel\(topk_rows_256, grid \(4, 1, 1\), "
                                                      r"block \(256, 1, 1\), 70000 B shared\) failed: "
                                                      "hipErrorInvalidValue"):
        launch(1, 2, stream=5)
    args = next(a for n, a in lib.calls if n == "hipModuleLaunchKernel")
    assert args[1:8] == (4, 1, 1, 256, 1, 1, 70000) and args[8].value == 5


#: clang 22.1.8's log of ``topk_rows_512`` for gfx950 (-Rpass-analysis=kernel-resource-usage) as captured, less most of
#: the source lines and notes it prints after each remark; the second function, written here, spills.
CAPTURED_LOG = """\
native_topk.cu:1039:55: remark: Function Name: topk_rows_512 [-Rpass-analysis=kernel-resource-usage]
 1039 | extern "C" __global__ void TOPK_LAUNCH_BOUNDS(512, 2) topk_rows_512(TOPK_ROW_PARAMS) {
      |                                                       ^
native_topk.cu:1039:55: note: could not determine the original source location for native_topk.cu:1039:0
native_topk.cu:1039:55: remark:     TotalSGPRs: 106 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:1039:55: remark:     VGPRs: 52 [-Rpass-analysis=kernel-resource-usage]
 1039 | extern "C" __global__ void TOPK_LAUNCH_BOUNDS(512, 2) topk_rows_512(TOPK_ROW_PARAMS) {
native_topk.cu:1039:55: remark:     AGPRs: 0 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:1039:55: remark:     ScratchSize [bytes/lane]: 0 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:1039:55: remark:     Dynamic Stack: False [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:1039:55: remark:     Occupancy [waves/SIMD]: 7 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:1039:55: remark:     SGPRs Spill: 4 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:1039:55: remark:     VGPRs Spill: 0 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:1039:55: remark:     LDS Size [bytes/block]: 0 [-Rpass-analysis=kernel-resource-usage]
 1039 | extern "C" __global__ void TOPK_LAUNCH_BOUNDS(512, 2) topk_rows_512(TOPK_ROW_PARAMS) {
native_topk.cu:9:1: remark: Function Name: spilling [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:9:1: remark:     TotalSGPRs: 40 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:9:1: remark:     VGPRs: 256 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:9:1: remark:     AGPRs: 12 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:9:1: remark:     ScratchSize [bytes/lane]: 16 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:9:1: remark:     Dynamic Stack: True [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:9:1: remark:     Occupancy [waves/SIMD]: 1 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:9:1: remark:     SGPRs Spill: 0 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:9:1: remark:     VGPRs Spill: 3 [-Rpass-analysis=kernel-resource-usage]
native_topk.cu:9:1: remark:     LDS Size [bytes/block]: 1024 [-Rpass-analysis=kernel-resource-usage]
"""
#: ``llvm-readelf --notes`` of that code object, as captured (the kernel's arguments cut short).
CAPTURED_NOTES = """\
Displaying notes found in: .note
  Owner                Data size 	Description
  AMDGPU               0x00000648	NT_AMDGPU_METADATA (AMDGPU Metadata)
    AMDGPU Metadata:
        ---
amdhsa.kernels:
  - .agpr_count:     0
    .args:
      - .address_space:  global
        .name:           logits
        .offset:         0
        .size:           8
        .value_kind:     global_buffer
    .group_segment_fixed_size: 0
    .kernarg_segment_align: 8
    .kernarg_segment_size: 116
    .max_flat_workgroup_size: 512
    .name:           topk_rows_512
    .private_segment_fixed_size: 0
    .sgpr_count:     106
    .sgpr_spill_count: 4
    .symbol:         topk_rows_512.kd
    .uses_dynamic_stack: false
    .vgpr_count:     52
    .vgpr_spill_count: 0
    .wavefront_size: 64
amdhsa.target:   amdgcn-amd-amdhsa--gfx950
amdhsa.version:
  - 1
  - 2
...
"""


def test_clang_remarks_give_each_kernels_resources():
    remarks = hip_clang.kernel_remarks(CAPTURED_LOG)
    assert sorted(remarks) == ["spilling", "topk_rows_512"]
    found = hip_clang.AmdResources.of(remarks["topk_rows_512"], "topk_rows_512")
    assert found == hip_clang.AmdResources(vgprs=52, agprs=0, sgprs=106, scratch=0, dynamic_stack=False,
                                           vgpr_spills=0, sgpr_spills=4, lds=0, waves=7)
    assert not found.spills  # SGPR spills go to VGPR lanes
    spilling = hip_clang.AmdResources.of(remarks["spilling"], "spilling")
    assert (spilling.agprs, spilling.scratch, spilling.dynamic_stack, spilling.vgpr_spills, spilling.lds,
            spilling.waves) == (12, 16, True, 3, 1024, 1) and spilling.spills
    # What an entry records: VGPRs, 4 bytes a spilled VGPR, scratch.
    entry = hip_clang.amd_resources(CAPTURED_LOG, "spilling")
    assert (entry.registers, entry.stack_bytes, entry.spill_store_bytes) == (256, 16, 12)
    assert hip_clang.amd_resources(CAPTURED_LOG, "missing").registers is None
    # A record's report (the remarks without their prefix) reads the same.
    report = "\n".join(line.split("remark: ", 1)[1].split(" [-Rpass")[0] for line in CAPTURED_LOG.splitlines()
                       if "remark: " in line)
    assert hip_clang.kernel_remarks(report) == remarks
    fields = dict(remarks["topk_rows_512"])
    del fields["vgprs"], fields["agprs"]
    with pytest.raises(ValueError, match="clang reported no VGPRs for topk_rows_512"):
        hip_clang.AmdResources.of(fields, "topk_rows_512")
    assert hip_clang.AmdResources.of({**remarks["topk_rows_512"], "agprs": 0}, "k") == found  # AGPRs: 0 unreported


def test_the_code_objects_metadata_note_gives_the_same_figures():
    notes = hip_clang.note_fields(CAPTURED_NOTES)
    assert notes == {"topk_rows_512": {"agprs": 0, "lds": 0, "scratch": 0, "sgprs": 106, "sgpr_spills": 4,
                                       "dynamic_stack": False, "vgpr_spills": 0}}
    remarks = hip_clang.AmdResources.of(hip_clang.kernel_remarks(CAPTURED_LOG)["topk_rows_512"], "topk_rows_512")
    assert all(getattr(remarks, name) == value for name, value in notes["topk_rows_512"].items())


def test_a_missing_toolchain_is_named(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("QSA_AITER_HIP_CLANG", sys.executable)  # a file: the SDK is what is missing
    monkeypatch.setenv("QSA_AITER_HIP_SDK", str(tmp_path / "nothing"))
    found = hip_clang.unavailable_reason(get_settings(), "gfx942")
    assert found == (f"no HIP headers and gfx942 device bitcode (looked in {tmp_path / 'nothing'}): run the project's "
                     ".ci/amd-toolchain.sh, or set QSA_AITER_HIP_SDK to a directory with "
                     "include/hip/hip_runtime.h and amdgcn/bitcode")
    monkeypatch.setenv("QSA_AITER_HIP_CLANG", str(tmp_path / "no-clang"))
    reason = hip_clang.unavailable_reason(get_settings(), "gfx950")
    assert reason.startswith("no clang with the AMDGPU target (QSA_AITER_HIP_CLANG=") and "is not a file" in reason
    report_code = main(["warmup", "--arch", "gfx950", "--kernels", "native_topk", "--jit-dir", str(tmp_path / "jit"),
                        "--no-progress"])
    assert report_code == 1  # nothing built: a failure, with the reason
    assert "native_topk: not built: no clang with the AMDGPU target" in capsys.readouterr().out
    assert not (tmp_path / "jit" / "native" / "gfx950").exists()

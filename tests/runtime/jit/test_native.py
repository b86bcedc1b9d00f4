"""The native entries of the JIT cache (``runtime/jit/nvrtc.py``, ``runtime/jit/native.py``) on a machine without a
GPU: every native top-k variant compiles through NVRTC for sm_90 with no spills; the cache's lifecycle (a second
build is a hit, corrupt entries are rebuilt with a warning, ``QSA_AITER_REBUILD`` rebuilds each entry once, two
processes building one entry compile it once, a busy entry, a read-only directory); NVRTC missing or too old and a
compile error are named; the driver-API launch path against a stand-in driver (argument packing, context, the
shared-memory and cluster attributes, error text); ``jit list``/``jit clear`` and ``warmup`` with native entries.
"""

from __future__ import annotations

import ctypes
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import native_topk as nt
from qsa_aiter.runtime import registries
from qsa_aiter.runtime import native_topk as native_topk_runtime
from qsa_aiter.runtime.jit import cuda_driver, native, native_store, nvrtc
from qsa_aiter.runtime.jit.native_store import NativeStore
from qsa_aiter.runtime.jit.store import VariantBusy
from qsa_aiter.tools import inventory
from qsa_aiter.tools.cli import main
from qsa_aiter.tools.warmup import Matrix, warmup

from jit_children import (  # noqa: F401 (sources, same_sources_here: the module's autouse fixtures)
    child_env,
    once_per_run,
    same_sources_here,
    source_dir,
    sources,
)

# Skipped without NVRTC (tests/conftest.py), except under --require-nvrtc (.ci/run, which installs it): there a
# missing NVRTC fails the tests.
pytestmark = pytest.mark.nvrtc
ARCH = "sm_90"
SOURCE = nt.source()
ROWS_256 = nt.BY_NAME["topk_rows_256"]
ROWS_256_DEFINES = nt.SPEC.defines(ROWS_256, ARCH)
DEFINES = {variant.name: nt.SPEC.defines(variant, ARCH) for variant in nt.VARIANTS}


def _compile_all(root: Path) -> dict:
    store = NativeStore(root, ARCH)
    result = {}
    for variant in nt.VARIANTS:
        built = store.build(SOURCE, variant.name, nt.SPEC.defines(variant, ARCH), built_by="target")
        result[variant.name] = {"entry": built.entry_id, "compiled": built.event.compiled}
    return result


@pytest.fixture
def compiled(tmp_path_factory) -> tuple[Path, dict]:
    """Every variant compiled for sm_90 into one JIT root, once per pytest run (the tests that change it copy it)."""
    return once_per_run(tmp_path_factory, "native-sm90", _compile_all)


def _copy(compiled, tmp_path: Path) -> Path:
    root = tmp_path / "jit"
    shutil.copytree(compiled[0], root)
    return root


# ---------------------------------------------------------------------------------------------------------------
# NVRTC
# ---------------------------------------------------------------------------------------------------------------


def test_every_variant_compiles_for_sm_90_without_spills(compiled):
    root, built = compiled
    store = NativeStore(root, ARCH)
    found = nvrtc.find()
    assert set(built) == {v.name for v in nt.VARIANTS} and all(b["compiled"] for b in built.values())
    for variant in nt.VARIANTS:
        eid = built[variant.name]["entry"]
        record = store.read(eid)
        assert eid.startswith(f"{variant.name}-") and store.problem(eid, record) is None
        assert (record.spill_store_bytes, record.spill_load_bytes, record.stack_bytes) == (0, 0, 0), record.report
        assert 0 < record.registers <= variant.max_registers
        assert store.binary_path(eid).read_bytes()[:4] == b"\x7fELF"
        assert record.options[0] == "--gpu-architecture=sm_90" and record.options[-3:] == [
            f"-D{d}" for d in nt.SPEC.defines(variant, ARCH)]
        assert (record.compiler, record.compiler_version, record.compiler_path) == (
            "nvrtc", found.version_text, found.path)
        assert record.source_sha256 == native_store.source_hash(SOURCE) and record.built_by == "target"
        assert record.compile_seconds > 0 and f"Function properties for {variant.name}" in record.report


def test_below_sm_90_the_switches_leave_the_row_kernels():
    """For sm_80 the clusters and bulk copies compile out (``TOPK_CLUSTERS``, ``TOPK_BULK``): the whole source builds
    the two row kernels, without spills."""
    built = nvrtc.compile_cubin(SOURCE, "sm_80", name="native_topk.cu")
    report = nvrtc.ptxas_report(built.log)
    assert set(report) == {"topk_rows_256", "topk_rows_512"}
    assert all((r.spill_store_bytes, r.spill_load_bytes, r.stack_bytes) == (0, 0, 0) for r in report.values())
    ampere = Platform("sm_80", "cuda", (8, 0), 108, False)
    assert [v.name for v in nt.variants_for(ampere)] == ["topk_rows_256", "topk_rows_512"]


def test_ptxas_report_reads_each_kernel():
    log = ("ptxas info    : Compiling entry function 'a' for 'sm_90'\n"
           "ptxas info    : Function properties for helper\n"
           "ptxas         .     8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Function properties for a\n"
           "ptxas         .     16 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n"
           "ptxas info    : Function properties for b\n"
           "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 40 registers\n")
    report = nvrtc.ptxas_report(log)
    assert set(report) == {"a", "b"}
    assert report["a"] == nvrtc.PtxasReport(255, 12, 4, 16) and report["b"].registers == 40


def test_a_compile_error_carries_the_log():
    with pytest.raises(nvrtc.NvrtcError, match="undefined_name") as info:
        nvrtc.compile_cubin('extern "C" __global__ void k(int* p) { p[0] = undefined_name; }', ARCH, name="bad.cu")
    assert "bad.cu" in str(info.value) and "--gpu-architecture=sm_90" in str(info.value)
    assert "undefined_name" in info.value.log


def test_archs_nvrtc_cannot_build_are_named():
    found = nvrtc.find()
    assert "NVIDIA arch" in nvrtc.arch_reason(found, "gfx950")
    assert nvrtc.arch_reason(found, ARCH) is None
    with pytest.raises(nvrtc.NvrtcUnavailable, match="cannot compile for sm_10"):
        nvrtc.compile_cubin("", "sm_10")


def test_the_library_search_prefers_wheels_and_names_the_system_last():
    candidates = nvrtc.library_candidates()
    assert candidates[-len(nvrtc.SYSTEM_NAMES):] == list(nvrtc.SYSTEM_NAMES)
    assert nvrtc.find().path in candidates
    wheels = candidates[:-len(nvrtc.SYSTEM_NAMES)]
    assert all("builtins" not in c and ".alt." not in c for c in wheels)


@pytest.fixture
def no_nvrtc(monkeypatch, tmp_path):
    """NVRTC searched where there is only a file that is not a library."""
    fake = tmp_path / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"
    fake.parent.mkdir(parents=True)
    fake.write_bytes(b"not a library")
    monkeypatch.setattr(nvrtc, "library_candidates", lambda: [str(fake), "libnvrtc.so.99"])
    nvrtc.forget()
    yield fake
    nvrtc.forget()  # searched again (with the real candidates) at the next use


def test_nvrtc_missing_is_a_clear_reason(no_nvrtc, tmp_path):
    reason = nvrtc.unavailable_reason()
    assert reason.startswith("NVRTC not found (") and str(no_nvrtc) in reason
    assert "pip install nvidia-cuda-nvrtc-cu12" in reason and "libnvrtc.so.99" not in reason
    with pytest.raises(nvrtc.NvrtcUnavailable, match="NVRTC not found"):
        NativeStore(tmp_path / "jit", ARCH).build(SOURCE, ROWS_256.name, ROWS_256_DEFINES)
    problem = registries.TopkProblem("cuda", 4, 4096, 512, fused=True)
    assert any(r.startswith("NVRTC not found") for r in native_topk_runtime.native_topk_reasons(
        problem, Platform.named(ARCH), None))
    report = warmup(ARCH, root=tmp_path / "jit", matrix=Matrix(kernels=("native_topk",)), progress=False)
    assert report.compiled == {} and report.failed == {}
    assert report.notes == [f"native_topk: not built: {reason}"]


def test_nvrtc_nowhere(monkeypatch):
    monkeypatch.setattr(nvrtc, "library_candidates", lambda: ["libnvrtc.so.99"])
    nvrtc.forget()
    try:
        assert "no libnvrtc.so in site-packages (nvidia/*/lib), torch/lib" in nvrtc.unavailable_reason()
    finally:
        nvrtc.forget()


# ---------------------------------------------------------------------------------------------------------------
# The cache's lifecycle
# ---------------------------------------------------------------------------------------------------------------


def test_key_separates_what_identifies_a_build():
    parts = ("a" * 64, "topk_rows_256", "sm_90", ("-DX",), "nvrtc 12.9")
    key = native_store.native_key(*parts)
    for index, other in enumerate(("b" * 64, "topk_rows_512", "sm_100", ("-DY",), "nvrtc 13.0")):
        changed = list(parts)
        changed[index] = other
        assert native_store.native_key(*changed) != key
    assert native_store.native_entry_id("topk_rows_256", key) == f"topk_rows_256-{key[:20]}"
    store = NativeStore(Path("/nowhere"), ARCH)
    eid, options = store.identify(SOURCE, ROWS_256.name, ROWS_256_DEFINES, nvrtc.compiler())
    assert options == ("--gpu-architecture=sm_90", *nvrtc.BASE_OPTIONS, "-DTOPK_SINGLE", "-DTOPK_KERNEL_topk_rows_256",
                       "-DTOPK_WARP_SIZE=32")
    assert eid != store.identify(SOURCE + "\n", ROWS_256.name, ROWS_256_DEFINES, nvrtc.compiler())[0]


def test_a_second_build_is_a_hit(compiled, tmp_path):
    root = _copy(compiled, tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in (root / "native" / ARCH).iterdir() if p.is_file()}
    store = NativeStore(root, ARCH)
    start = time.perf_counter()
    for variant in nt.VARIANTS:
        built = store.build(SOURCE, variant.name, nt.SPEC.defines(variant, ARCH))
        assert not built.event.compiled and built.entry_id == compiled[1][variant.name]["entry"]
        assert built.binary == store.binary_path(built.entry_id).read_bytes()
    assert time.perf_counter() - start < 2.0
    assert {p.name: p.stat().st_mtime_ns for p in (root / "native" / ARCH).iterdir() if p.is_file()} == before
    assert [e.compiled for e in store.events] == [False] * len(nt.VARIANTS)


def test_corrupt_entries_are_rebuilt_with_a_warning(compiled, tmp_path, caplog):
    root = _copy(compiled, tmp_path)
    store = NativeStore(root, ARCH)
    ids = {name: b["entry"] for name, b in compiled[1].items()}
    truncated = store.binary_path(ids["topk_rows_256"])
    truncated.write_bytes(truncated.read_bytes()[:100])
    altered = store.binary_path(ids["topk_rows_512"])
    data = bytearray(altered.read_bytes())
    data[-1] ^= 0xFF
    altered.write_bytes(bytes(data))
    store.record_path(ids["topk_cluster2_512"]).write_text("{not json")
    store.binary_path(ids["topk_cluster4_512"]).unlink()
    expected = {"topk_rows_256": "has 100 bytes", "topk_rows_512": "does not match its recorded sha256",
                "topk_cluster2_512": "does not parse", "topk_cluster4_512": "is missing"}
    with caplog.at_level(logging.WARNING, logger="qsa_aiter"):
        for name, words in expected.items():
            variant = nt.BY_NAME[name]
            built = store.build(SOURCE, name, nt.SPEC.defines(variant, ARCH))
            assert built.event.compiled and store.problem(built.entry_id, store.read(built.entry_id)) is None
            assert words in caplog.text and "rebuilding it" in caplog.text
    again = NativeStore(root, ARCH)
    assert not any(again.build(SOURCE, name, DEFINES[name]).event.compiled for name in expected)


def test_rebuild_rebuilds_each_entry_once(compiled, tmp_path):
    root = _copy(compiled, tmp_path)
    first, second = NativeStore(root, ARCH, rebuild=True), NativeStore(root, ARCH, rebuild=True)
    assert first.build(SOURCE, ROWS_256.name, ROWS_256_DEFINES).event.compiled
    assert not second.build(SOURCE, ROWS_256.name, ROWS_256_DEFINES).event.compiled, "rebuilt since it opened"
    assert not first.build(SOURCE, ROWS_256.name, ROWS_256_DEFINES).event.compiled
    assert not NativeStore(root, ARCH).build(SOURCE, ROWS_256.name, ROWS_256_DEFINES).event.compiled


_RACE = r"""
import json, sys, time
from pathlib import Path
from qsa_aiter.kernels.platform import Platform
from qsa_aiter.kernels.selection import native_topk as nt
from qsa_aiter.runtime.jit.native_store import NativeStore

root, ready, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
store = NativeStore(Path(root), "sm_90")
variant = nt.BY_NAME["topk_rows_256"]
ready.touch()
while not go.exists():
    time.sleep(0.005)
built = store.build(nt.source(), variant.name, nt.SPEC.defines(variant, "sm_90"))
print("JIT-RESULT " + json.dumps({"compiled": built.event.compiled, "entry": built.entry_id,
                                  "sha256": built.record.sha256}))
"""


def test_two_processes_building_one_entry_compile_it_once(tmp_path):
    root, go = tmp_path / "jit", tmp_path / "go"
    readies = [tmp_path / f"ready{i}" for i in range(2)]
    children = [subprocess.Popen([sys.executable, "-c", _RACE, str(root), str(ready), str(go)], cwd=source_dir(),
                                 env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for ready in readies]
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in readies) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()  # both children are past their imports: they race for the entry
    results = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        results.append(json.loads(next(line for line in out.splitlines()
                                       if line.startswith("JIT-RESULT ")).removeprefix("JIT-RESULT ")))
    assert sorted(r["compiled"] for r in results) == [False, True]
    assert len({r["entry"] for r in results}) == 1 and len({r["sha256"] for r in results}) == 1
    assert [p.suffix for p in sorted((root / "native" / ARCH).glob(f"{results[0]['entry']}.*"))] == [".cubin", ".json"]


def test_a_busy_entry(tmp_path):
    store = NativeStore(tmp_path, ARCH)
    eid, _ = store.identify(SOURCE, ROWS_256.name, ROWS_256_DEFINES, nvrtc.compiler())
    with store.lock(eid):
        with pytest.raises(VariantBusy):
            store.build(SOURCE, ROWS_256.name, ROWS_256_DEFINES, wait=False)


def test_a_read_only_directory_compiles_in_memory(tmp_path, monkeypatch, caplog):
    store = NativeStore(tmp_path, ARCH)
    monkeypatch.setattr(store, "writable", lambda: False)
    with caplog.at_level(logging.WARNING, logger="qsa_aiter"):
        built = store.build(SOURCE, ROWS_256.name, ROWS_256_DEFINES)
    assert built.event.compiled and built.binary[:4] == b"\x7fELF" and not (tmp_path / "native").exists()
    assert "is not writable" in caplog.text


# ---------------------------------------------------------------------------------------------------------------
# Loading and launching through the driver API (a stand-in driver: this machine has none)
# ---------------------------------------------------------------------------------------------------------------


class StandInDriver:
    """Answers the driver calls ``native`` makes, writing through their out-parameters, and records them."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple] = []
        self.current = 0
        self.fail = fail

    def _out(self, ref, value):
        ref._obj.value = value

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            if name == self.fail:
                return 1  # CUDA_ERROR_INVALID_VALUE
            if name == "cuDeviceGet":
                self._out(args[0], args[1])
            elif name == "cuDevicePrimaryCtxRetain":
                self._out(args[0], 0xC0 + args[1])
            elif name == "cuCtxGetCurrent":
                self._out(args[0], self.current)
            elif name == "cuModuleLoadData":
                self._out(args[0], 0xAA)
            elif name == "cuModuleGetFunction":
                self._out(args[0], 0xBB)
            elif name == "cuLaunchKernel":  # read the arguments now: they live as long as the call
                params = args[9]
                self.arguments = [(ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p)).contents.value,
                                   ctypes.cast(params[i], ctypes.POINTER(ctypes.c_int)).contents.value)
                                  for i in range(len(params))]
            elif name == "cuLaunchKernelEx":  # the configuration as the driver reads it
                config = args[0]._obj
                attribute = config.attributes.contents
                self.config = (tuple(config.grid), tuple(config.block), config.shared_bytes, config.stream,
                               config.attribute_count, attribute.id, attribute.value[0])
                self.ex_arguments = args[2]
            elif name == "cuGetErrorName":
                self._out(args[1], b"CUDA_ERROR_INVALID_VALUE")
            elif name == "cuGetErrorString":
                self._out(args[1], b"invalid argument")
            return 0
        return call

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    driver = StandInDriver()
    monkeypatch.setattr(cuda_driver, "_driver", lambda: driver)
    monkeypatch.setattr(cuda_driver, "_primary", {})
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native_store, "_stores", {})
    return driver


def test_a_kernel_loads_once_per_device_from_the_cache(stand_in, compiled, tmp_path, monkeypatch):
    root = _copy(compiled, tmp_path)
    monkeypatch.setenv("QSA_AITER_JIT_DIR", str(root))
    variant = nt.BY_NAME["topk_cluster16_512"]
    kernel = native.kernel_for(SOURCE, variant.name, DEFINES[variant.name], 0, ARCH, non_portable_cluster=True)
    assert (kernel.kernel, kernel.entry_id, kernel.device) == (variant.name, compiled[1][variant.name]["entry"], 0)
    load = next(args for name, args in stand_in.calls if name == "cuModuleLoadData")
    assert load[1][:4] == b"\x7fELF"
    function = next(args for name, args in stand_in.calls if name == "cuModuleGetFunction")
    assert function[2] == variant.name.encode()
    non_portable = cuda_driver.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
    assert ("cuFuncSetAttribute", (kernel.function, non_portable, 1)) in stand_in.calls
    # another context was current: the primary context is pushed around the load, then popped
    assert stand_in.names()[:5] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent",
                                    "cuCtxPushCurrent_v2"]
    assert stand_in.names()[-1] == "cuCtxPopCurrent_v2"
    count = len(stand_in.calls)
    assert native.kernel_for(SOURCE, variant.name, DEFINES[variant.name], 0, ARCH, non_portable_cluster=True) is kernel
    assert len(stand_in.calls) == count, "loaded once per process and device"
    assert native.kernel_for(SOURCE, variant.name, DEFINES[variant.name], 1, ARCH, non_portable_cluster=True) is not kernel


def test_the_settings_choose_the_directory_and_rebuild(stand_in, compiled, tmp_path, monkeypatch):
    """A launch's kernel comes from ``QSA_AITER_JIT_DIR``; with ``QSA_AITER_REBUILD=1`` it is compiled again, once."""
    root = _copy(compiled, tmp_path)
    monkeypatch.setenv("QSA_AITER_JIT_DIR", str(root))
    monkeypatch.setenv("QSA_AITER_REBUILD", "1")
    native.kernel_for(SOURCE, ROWS_256.name, ROWS_256_DEFINES, 0, ARCH)
    native.kernel_for(SOURCE, ROWS_256.name, ROWS_256_DEFINES, 0, ARCH)
    rebuilt = native_store.native_store(root, ARCH, rebuild=True)
    assert [e.compiled for e in rebuilt.events] == [True]
    assert NativeStore(root, ARCH).read(rebuilt.events[0].entry_id).date > rebuilt.opened
    monkeypatch.delenv("QSA_AITER_REBUILD")
    native.kernel_for(SOURCE, ROWS_256.name, ROWS_256_DEFINES, 0, ARCH)
    assert [e.compiled for e in native_store.native_store(root, ARCH).events] == [False]


def test_a_launch_passes_the_arguments_by_address(stand_in):
    stand_in.current = 0xC0  # device 0's primary context is current: nothing pushed
    kernel = cuda_driver.load_cubin(b"\x7fELF", "topk_rows_512", "topk_rows_512-x", 0)
    plan = nt.choose_plan(256, 25088, 512, Platform.named(ARCH))
    call = nt.launch_arguments(plan, 256, 25088, 25088, 512, True)
    names = tuple(name for name, _ in call.pointers)
    addresses = (0x1000, 0x2000, 0x3000, 0, 0, 0, 0, 0)
    stand_in.calls.clear()
    native.PreparedLaunch("native_topk", kernel, call.grid, call.block, call.shared_bytes, names,
                          call.scalars)(*addresses, stream=77)
    assert "cuCtxPushCurrent_v2" not in stand_in.names()
    attribute = next(args for name, args in stand_in.calls if name == "cuFuncSetAttribute")
    assert attribute[1:] == (cuda_driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, plan.shared_bytes)
    args = next(args for name, args in stand_in.calls if name == "cuLaunchKernel")
    assert args[1:8] == (256, 1, 1, 512, 1, 1, plan.shared_bytes) and args[8].value == 77 and args[10] is None
    pointers = [as_pointer or 0 for as_pointer, _ in stand_in.arguments[:len(names)]]
    scalars = [as_int for _, as_int in stand_in.arguments[len(names):]]
    assert pointers == list(addresses) and scalars == [value for _, _, value in call.scalars]
    stand_in.calls.clear()
    native.PreparedLaunch("native_topk", kernel, call.grid, call.block, call.shared_bytes, names,
                          call.scalars)(*addresses, stream=77)
    assert "cuFuncSetAttribute" not in stand_in.names(), "the shared-memory limit is raised once"


def test_a_prepared_launch_fills_in_each_calls_addresses(stand_in, monkeypatch):
    """A replay's launch: the scalars are converted once, each call passes its own addresses (in the kernel's order,
    or reordered by ``taking``) on the current stream, and ``record`` hands it to an open recording as it is."""
    from qsa_aiter.kernels import spec
    from qsa_aiter.runtime import replay

    stand_in.current = 0xC0
    monkeypatch.setattr(native, "current_stream", lambda device: 55)
    kernel = cuda_driver.load_cubin(b"\x7fELF", "topk_rows_256", "topk_rows_256-x", 0)
    scalars = (("rows", "int", 4), ("columns", "int", 9000))
    prepared = native.PreparedLaunch("native_topk", kernel, (4, 1, 1), (256, 1, 1), 1024,
                                     ("logits", "visible", "out"), scalars)
    for addresses in ((0x10, 0x20, 0x30), (0x40, 0x50, 0x60)):
        prepared(*addresses)
        args = next(args for name, args in reversed(stand_in.calls) if name == "cuLaunchKernel")
        assert args[8].value == 55 and args[7] == 1024
        assert [p for p, _ in stand_in.arguments[:3]] == list(addresses)
        assert [i for _, i in stand_in.arguments[3:]] == [4, 9000]
    prepared.taking("out", "logits", "visible")(0x3, 0x1, 0x2)
    assert [p for p, _ in stand_in.arguments[:3]] == [0x1, 0x2, 0x3]
    assert prepared.taking("logits", "visible", "out") is prepared and prepared.taking("logits", "out") is None
    with pytest.raises(ValueError):
        prepared(0x1, 0x2)  # every pointer, no fewer
    with spec.recording() as launches:
        spec.record(prepared)
    assert replay.direct_launches(launches, ("native_topk",)) == (prepared,)
    assert replay.direct_launches(launches, ("native_topk", "expand")) is None


def test_the_launch_config_structs_are_laid_out_as_in_cuda_h():
    """``CUlaunchConfig`` and ``CUlaunchAttribute`` as cuda.h (CUDA 12 and 13) lays them out on 64-bit Linux."""
    config, attribute = cuda_driver.LaunchConfig, cuda_driver.LaunchAttribute
    assert ctypes.sizeof(config) == 56
    assert (config.shared_bytes.offset, config.stream.offset, config.attributes.offset,
            config.attribute_count.offset) == (24, 32, 40, 48)
    assert ctypes.sizeof(attribute) == 72 and attribute.value.offset == 8


def test_a_programmatic_launch_goes_through_cuLaunchKernelEx(stand_in):
    """With ``programmatic`` the launch carries the programmatic-stream-serialization attribute on the call's stream,
    with the same argument array; without it, ``cuLaunchKernel`` as before."""
    stand_in.current = 0xC0
    kernel = cuda_driver.load_cubin(b"\x7fELF", "topk_cluster4_512", "topk_cluster4_512-x", 0)
    prepared = native.PreparedLaunch("native_topk", kernel, (144, 1, 1), (512, 1, 1), 1024,
                                     ("logits", "visible", "out"), (("rows", "int", 36),), programmatic=True)
    assert prepared.programmatic
    for stream in (77, 78):
        stand_in.calls.clear()
        prepared(0x10, 0x20, 0x30, stream=stream)
        assert "cuLaunchKernel" not in stand_in.names()
        assert stand_in.config == ((144, 1, 1), (512, 1, 1), 1024, stream, 1,
                                   cuda_driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
        params = stand_in.ex_arguments
        assert [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p)).contents.value for i in range(3)] == \
            [0x10, 0x20, 0x30]
    plain = native.PreparedLaunch("native_topk", kernel, (144, 1, 1), (512, 1, 1), 1024,
                                  ("logits", "visible", "out"), (("rows", "int", 36),))
    stand_in.calls.clear()
    plain(0x10, 0x20, 0x30, stream=77)
    assert not plain.programmatic and "cuLaunchKernelEx" not in stand_in.names()


def test_a_failing_driver_call_names_the_call_and_the_error(stand_in):
    kernel = cuda_driver.load_cubin(b"\x7fELF", "topk_rows_256", "topk_rows_256-x", 0)
    stand_in.fail = "cuLaunchKernel"
    with pytest.raises(cuda_driver.DriverError, match=r"cuLaunchKernel\(topk_rows_256, grid \(4, 1, 1\), block "
                                                 r"\(256, 1, 1\), 9000 B shared\) failed: CUDA_ERROR_INVALID_VALUE: "
                                                 "invalid argument"):
        native.PreparedLaunch("native_topk", kernel, (4, 1, 1), (256, 1, 1), 9000, ("a", "b", "c"),
                              (("rows", "int", 4),))(1, 2, 3, stream=0)
    assert stand_in.names()[-1] == "cuCtxPopCurrent_v2", "the pushed context is popped after a failure"


def test_the_driver_library_is_named_where_it_does_not_load():
    if cuda_driver.driver_reason() is None:
        pytest.skip("this machine has a CUDA driver")
    assert "libcuda.so.1" in cuda_driver.driver_reason()
    with pytest.raises(cuda_driver.DriverUnavailable, match="libcuda.so.1"):
        cuda_driver.driver()


# ---------------------------------------------------------------------------------------------------------------
# The commands
# ---------------------------------------------------------------------------------------------------------------


def test_jit_list_and_clear_show_native_entries(compiled, tmp_path, capsys, monkeypatch):
    root = _copy(compiled, tmp_path)
    (root / "README.md").write_text("kept")
    assert main(["jit", "list", "--jit-dir", str(root)]) == 0
    listing = capsys.readouterr().out
    assert f"native / {ARCH}: {len(nt.VARIANTS)} entries" in listing and listing.count("  ok\n") == len(nt.VARIANTS)
    assert "topk_cluster8_512 NVRTC " in listing and "0 B spill stores, 0 B spill loads, 0 B stack" in listing
    store = NativeStore(root, ARCH)
    eid = compiled[1]["topk_rows_256"]["entry"]
    store.binary_path(eid).write_bytes(b"x")
    monkeypatch.setitem(inventory.NATIVE_SOURCES, "topk_rows_512", lambda: "another source")
    assert main(["jit", "list", "--jit-dir", str(root)]) == 0
    listing = capsys.readouterr().out
    assert "corrupt: " + f"{eid}.cubin has 1 bytes" in listing and "stale: built from another source" in listing
    assert main(["jit", "clear", "--jit-dir", str(root)]) == 0
    assert "removed" in capsys.readouterr().out
    assert not (root / "native").exists() and (root / "README.md").read_text() == "kept"
    assert main(["jit", "list", "--jit-dir", str(root)]) == 0
    assert "(empty)" in capsys.readouterr().out


def test_warmup_command_for_sm_90(compiled, tmp_path, capsys):
    root = _copy(compiled, tmp_path)
    assert main(["warmup", "--arch", ARCH, "--kernels", "native_topk", "--jit-dir", str(root), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"warm-up sm_90: {len(nt.VARIANTS)} variants, 0 compiled" in out
    assert f"{len(nt.VARIANTS)} already cached, 0 failed" in out

"""Test setup: the Triton interpreter on CPU-only machines, the ``gpu``, ``nvrtc``, ``amd`` and ``slow`` markers and a
clean environment per test.

``TRITON_INTERPRET`` must be set before Triton is imported (``triton.jit`` decides at decoration time whether a kernel
is interpreted), so it is set here before anything imports Triton or ``qsa_aiter``.
"""

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from qsa_aiter.runtime import log, dispatch  # noqa: E402
from qsa_aiter.runtime.jit import nvrtc  # noqa: E402
from qsa_aiter.runtime.jit.triton_compat import install_uniform_interpreter_dots  # noqa: E402
from qsa_aiter.kernels.platform import interpreting  # noqa: E402
from qsa_aiter.runtime.settings import ENV_VARIABLES  # noqa: E402

if interpreting():
    # Interpreted dots sum every element alike, as an MMA does, whatever BLAS kernel this CPU picks (tie tests).
    # The package installs them at its first interpreted launch too; here they are in place for tests that
    # launch kernels directly.
    install_uniform_interpreter_dots()


def pytest_addoption(parser):
    parser.addoption("--require-nvrtc", action="store_true",
                     help="run the tests marked nvrtc even where NVRTC is missing (they fail there) instead of "
                          "skipping them: .ci/run passes it after installing NVRTC")
    parser.addoption("--require-amd", action="store_true",
                     help="run the tests marked amd even where the offline AMD toolchain (clang-22 and the HIP "
                          "headers) is missing (they fail there) instead of skipping them: .ci/run passes it after "
                          ".ci/amd-toolchain.sh")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA/HIP GPU (run with `-m gpu`); skipped without one")
    config.addinivalue_line("markers", "nvrtc: compiles the native CUDA sources with NVRTC; skipped without NVRTC "
                                       "unless --require-nvrtc")
    config.addinivalue_line("markers", "amd: compiles the native sources for gfx942 / gfx950 with clang and the HIP "
                                       "headers; skipped without them unless --require-amd")
    config.addinivalue_line("markers", "slow: the long interpreted matrix beyond the default set's representative "
                                       "cases; deselect with -m 'not slow' (.ci/run runs it)")
    # Triton 3.6's interpreter converts 1-element arrays to scalars, which NumPy >= 1.25 deprecates (many lines).
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    missing = nvrtc.unavailable_reason()
    if missing and not config.getoption("--require-nvrtc"):
        skip_nvrtc = pytest.mark.skip(reason=f"needs NVRTC (pip install nvidia-cuda-nvrtc-cu12; .ci/run installs "
                                             f"it): {missing}")
        for item in items:
            if "nvrtc" in item.keywords:
                item.add_marker(skip_nvrtc)
    amd = [item for item in items if "amd" in item.keywords]
    if amd and not config.getoption("--require-amd"):
        missing = amd_toolchain_missing()
        if missing:
            skip_amd = pytest.mark.skip(reason="needs the offline AMD toolchain (bash .ci/amd-toolchain.sh): "
                                               f"{missing}")
            for item in amd:
                item.add_marker(skip_amd)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/HIP GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def amd_toolchain_missing() -> str | None:
    """Why the tests marked ``amd`` cannot run here (None: they can): a clang, the HIP headers, the device bitcode of
    gfx942 and gfx950 or an llvm-readelf missing (``native_resources.toolchains``)."""
    from qsa_aiter.kernels.native_spec import AMD_ARCHS
    from qsa_aiter.runtime.settings import get_settings
    from qsa_aiter.tools.native_resources import toolchains

    found = toolchains(AMD_ARCHS, get_settings())
    return found if isinstance(found, str) else None


@pytest.fixture(autouse=True)
def _clean_qsa_state(monkeypatch):
    """Every test starts from the default switches, no kernel marked broken and an empty log-once memory."""
    for name in ENV_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    dispatch.clear_broken()
    log.reset_log_once()
    # Make the next log call set the logger's level from the settings again (caplog may have changed it).
    monkeypatch.setattr(log, "_configured_level", None)
    yield
    dispatch.clear_broken()
    log.reset_log_once()


@pytest.fixture
def rng(request) -> torch.Generator:
    """A CPU generator seeded from the test's id: fresh inputs per test, reproducible run to run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def without_shipped_topk_rows(monkeypatch):
    """The tuned tables without the shipped top-k rows (``configs/topk.csv``): tests of the top-k choice's rules
    give their own rows and must not meet the measured ones."""
    from qsa_aiter.runtime import tuned

    monkeypatch.setattr(tuned, "SHIPPED", tuple(name for name in tuned.SHIPPED if name != "topk.csv"))
    tuned.reload()
    yield
    monkeypatch.undo()
    tuned.reload()

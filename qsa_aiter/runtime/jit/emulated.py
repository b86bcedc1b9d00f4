"""The native kernels run on the CPU, through ``cuda_emulator.h`` beside this file: the tests' way to check their
device code on a machine without a GPU.

``build(source_path, kernels)`` compiles a CUDA source with the host's C++ compiler (``g++``, or ``$CXX``) and the
emulator force-included, into a shared library in a temporary directory (once per process and source); ``run(call,
addresses)`` executes one ``NativeLaunch`` (``kernels/selection/native_topk.py``) on CPU memory: every CUDA thread a
cooperative thread, thread-block clusters with their distributed shared memory, bulk copies done when issued
(the header says what it does not model); a cooperative launch (``cooperative=True``) runs every CTA of its grid
together, so CTAs may wait on each other's words (``cuda_emulator_grid.h``). A failure inside the emulated kernel (a
deadlock, a shared-memory address out of range, a divergent warp collective) raises ``EmulationError``.

The emulated warp width is a compile-time parameter of the build, the ``TOPK_WARP_SIZE=<32|64>`` among its defines
(32 where it names none): 32 emulates an NVIDIA target (CUDA's warp collectives, thread-block clusters and bulk
copies), 64 an AMD wave64 target as HIP defines it (HIP's warp collectives, no clusters and no bulk copies: a kernel
the source compiles out there, such as a cluster kernel, is refused at its launch).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

HEADER_PATH = Path(__file__).with_name("cuda_emulator.h")
#: The cooperative-grid primitives (force-included after ``HEADER_PATH``).
GRID_HEADER_PATH = Path(__file__).with_name("cuda_emulator_grid.h")
#: The switches of an emulated build: the emulator's primitives, and at the warp width of 32 the sm_90 paths (clusters,
#: bulk copies) that a CPU build would otherwise leave out.
EMULATION_DEFINES = ("TOPK_EMULATE=1",)
NVIDIA_DEFINES = ("TOPK_CLUSTERS=1", "TOPK_BULK=1")
#: The warp widths the emulator runs: an NVIDIA target's and an AMD wave64 target's.
WARP_SIZES = (32, 64)
MAX_POINTERS, MAX_SCALARS = 16, 32
#: The most threads a cooperative launch may have (every CTA of its grid runs together, each thread with its own
#: stack): the small grids of the tests.
MAX_COOPERATIVE_THREADS = 8192


class EmulationError(RuntimeError):
    """The emulated kernel failed (what the emulator found), or no C++ compiler could build it."""


def compiler() -> str | None:
    """The C++ compiler the emulator builds with (``$CXX``, else ``g++``), or None where there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def unavailable_reason() -> str | None:
    """Why kernels cannot be emulated here (None: they can)."""
    if compiler() is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH"
    return None


def warp_size_of(defines: tuple[str, ...]) -> int:
    """The emulated warp width an emulated build's ``defines`` name (``TOPK_WARP_SIZE=<32|64>``; 32 where none
    does); ``ValueError`` for another width."""
    named = [d.partition("=")[2] for d in defines if d.partition("=")[0] == "TOPK_WARP_SIZE"]
    if not named:
        return 32
    if len(named) > 1 or named[0] not in {str(w) for w in WARP_SIZES}:
        raise ValueError(f"defines: TOPK_WARP_SIZE must be named once, as one of {WARP_SIZES}; got {defines}")
    return int(named[0])


def _wrapper(source_path: Path, kernels: tuple[tuple[str, tuple[str, ...], int], ...]) -> str:
    """C++ that includes ``source_path`` and gives each kernel (name, pointer C types, scalar count) a body the
    emulator runs per thread, and ``emu_launch`` that picks one by name. A kernel the source leaves out of the build
    (the cluster kernels at a warp width of 64) resolves to a placeholder (a template in ``emu_absent``, which overload
    resolution takes only where no kernel of that name exists), and its launch is refused."""
    lines = [f'#include "{source_path}"', "#include <string.h>", "#include <type_traits>", "#include <utility>",
             "struct EmuArgs { void* p[%d]; int s[%d]; };" % (MAX_POINTERS, MAX_SCALARS),
             "namespace emu_absent {", "struct Absent {};"]
    lines += [f"template <class... A> Absent {name}(A...) {{ return {{}}; }}" for name, _, _ in kernels]
    lines += ["}  // namespace emu_absent", "using namespace emu_absent;"]
    dispatch = []
    for name, pointer_types, scalars in kernels:
        args = [f"({ctype})a.p[{i}]" for i, ctype in enumerate(pointer_types)]
        args += [f"a.s[{i}]" for i in range(scalars)]
        probe = ", ".join([f"std::declval<{ctype}>()" for ctype in pointer_types] + ["std::declval<int>()"] * scalars)
        lines.append(f"constexpr bool built_{name} = !std::is_same<decltype({name}({probe})), "
                     "emu_absent::Absent>::value;")
        lines.append(f"static void body_{name}(void* raw) {{\n    EmuArgs& a = *(EmuArgs*)raw;\n"
                     f"    if constexpr (built_{name}) {name}({', '.join(args)});\n}}")
        dispatch.append(f'    if (!strcmp(kernel, "{name}")) {{\n'
                        f'        if (!built_{name}) {{ error = std::string("{name} is compiled out of this build '
                        f'(warp width ") + std::to_string(TOPK_EMULATED_WARP_SIZE) + ")"; return error.c_str(); }}\n'
                        f"        body = body_{name};\n    }}")
    lines += [
        'extern "C" const char* emu_launch(const char* kernel, int grid, int block, int cluster, '
        "unsigned long long smem, void** p, int np, const int* s, int ns, unsigned seed) {",
        "    static thread_local std::string error;",
        "    void (*body)(void*) = nullptr;",
        *dispatch,
        '    if (!body) { error = std::string("no kernel ") + kernel; return error.c_str(); }',
        "    EmuArgs a = {};",
        "    for (int i = 0; i < np; ++i) a.p[i] = p[i];",
        "    for (int i = 0; i < ns; ++i) a.s[i] = s[i];",
        "    error = emu::run(grid, block, cluster, smem, body, &a, seed);",
        "    return error.c_str();",
        "}",
    ]
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=8)
def build(source_path: Path, kernels: tuple[tuple[str, tuple[str, ...], int], ...],
          defines: tuple[str, ...] = (), source: str | None = None) -> ctypes.CDLL:
    """Compile ``source_path``'s ``kernels`` (name, pointer C types, scalar count) for the emulator, with
    ``EMULATION_DEFINES`` and ``defines``, at the warp width they name (``warp_size_of``: 32, with ``NVIDIA_DEFINES``,
    or 64); ``source``: the text to compile instead of the file's (a spec's source with its headers spliced in, the
    text NVRTC compiles). The library is built once per process and argument set."""
    warp = warp_size_of(defines)
    reason = unavailable_reason()
    if reason:
        raise EmulationError(f"cannot emulate native kernels: {reason}")
    directory = Path(tempfile.mkdtemp(prefix="qsa_emulated_"))
    if source is not None:
        source_path = directory / source_path.name
        source_path.write_text(source)
    text = _wrapper(source_path.resolve(), kernels)
    digest = hashlib.sha256((text + source_path.read_text() + HEADER_PATH.read_text() + GRID_HEADER_PATH.read_text()
                             + repr(defines)).encode())
    wrapper = directory / "launch.cpp"
    wrapper.write_text(text)
    library = directory / f"emulated_{digest.hexdigest()[:16]}.so"
    # _FORTIFY_SOURCE's longjmp check refuses a jump to another stack, which is how the emulator switches threads.
    command = [compiler(), "-std=c++17", "-O2", "-fPIC", "-shared", "-w", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=0",
               "-include", str(HEADER_PATH), "-include", str(GRID_HEADER_PATH),
               *[f"-D{d}" for d in (*EMULATION_DEFINES, *(NVIDIA_DEFINES if warp == 32 else ()),
                                    *(() if any(d.startswith("TOPK_WARP_SIZE=") for d in defines) else
                                      (f"TOPK_WARP_SIZE={warp}",)), *defines)],
               str(wrapper), "-o", str(library)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise EmulationError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    lib = ctypes.CDLL(str(library))
    lib.emu_launch.restype = ctypes.c_char_p
    lib.emu_launch.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_ulonglong,
                               ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.POINTER(ctypes.c_int),
                               ctypes.c_int, ctypes.c_uint]
    return lib


def run(lib: ctypes.CDLL, call, addresses: list[int], cluster: int, order_seed: int = 0, *,
        cooperative: bool = False) -> None:
    """Execute ``call`` (a ``NativeLaunch``: kernel, grid, block, shared bytes, pointers, scalars) with the pointer
    ``addresses`` (host memory) in ``lib`` (``build``), ``cluster`` CTAs a cluster. ``order_seed``: 0 resumes
    waiting threads in thread order, another value in a shuffled order (other interleavings of the same launch).
    ``cooperative``: a cooperative launch (the whole grid co-resident, as ``CU_LAUNCH_ATTRIBUTE_COOPERATIVE``
    promises): every CTA runs together, as one cluster of the grid (``cluster`` is then ignored), so a CTA may wait
    on another's words (``cuda_emulator_grid.h``); at most ``MAX_COOPERATIVE_THREADS`` threads."""
    if len(addresses) != len(call.pointers):
        raise ValueError(f"{call.kernel} takes {len(call.pointers)} pointers, got {len(addresses)}")
    if cooperative:
        threads = call.grid[0] * call.block[0]
        if threads > MAX_COOPERATIVE_THREADS:
            raise EmulationError(f"{call.kernel}: a cooperative grid of {threads} threads is more than the emulator "
                                 f"runs together ({MAX_COOPERATIVE_THREADS})")
        cluster = call.grid[0]
    pointers = (ctypes.c_void_p * MAX_POINTERS)(*[ctypes.c_void_p(a or None) for a in addresses])
    scalars = (ctypes.c_int * MAX_SCALARS)(*[value for _, _, value in call.scalars])
    error = lib.emu_launch(call.kernel.encode(), call.grid[0], call.block[0], cluster, call.shared_bytes, pointers,
                           len(addresses), scalars, len(call.scalars), order_seed)
    if error:
        raise EmulationError(f"{call.kernel} (grid {call.grid}, block {call.block}): {error.decode()}")

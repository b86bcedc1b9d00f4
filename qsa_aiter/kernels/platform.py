"""What the kernels need to know about where they run, worked out once: ``Platform.of(device)`` for a live device
(CPU tensors under ``TRITON_INTERPRET=1`` included), ``Platform.named("sm_90")`` for a build target without that
GPU (ahead-of-time builds, warm-up for another arch).

Every device-dependent choice of a launch plan reads it: the arch whose tuned rows apply, how many programs fill
the device, whether quantised keys use the PTX decoders, whether e4m3 tensor cores exist, whether 16-bit operands
are upcast (the interpreter computes bf16 on raw bits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def triton_runs_on(device_type: str) -> bool:
    """Whether the Triton kernels can run on tensors of ``device_type``: GPU tensors, or CPU tensors under the
    interpreter."""
    return device_type == "cuda" or (device_type == "cpu" and interpreting())


#: The named build targets: (backend, NVIDIA compute capability or (0, 0), multiprocessors, shared memory (LDS) a
#: block may use and shared memory per multiprocessor in bytes) of the part the tuned rows were measured on: H200
#: (227 KB opt-in per block of 228 KB per SM), MI300X (64 KB LDS per CU), MI355X (160 KB LDS per CU).
NAMED = {
    "sm_90": ("cuda", (9, 0), 132, 227 * 1024, 228 * 1024),
    "gfx942": ("hip", (0, 0), 304, 64 * 1024, 64 * 1024),
    "gfx950": ("hip", (0, 0), 256, 160 * 1024, 160 * 1024),
}
#: Programs a launch aims at under the interpreter (it runs them one after another).
INTERPRETER_PROGRAMS = 64
#: The e4m3 flavours whose bytes the matrix instructions multiply as stored: OCP e4m3fn on NVIDIA compute
#: capability 8.9+ and on gfx950 (``v_mfma_f32_*_f8f6f4``), e4m3fnuz on gfx942 (``v_mfma_f32_*_fp8_fp8``, which
#: takes only the fnuz flavour). The interpreter emulates either with exact fp32 dots of the same operands.
E4M3_FN, E4M3_FNUZ = "e4m3fn", "e4m3fnuz"
AMD_E4M3_MMA = {"gfx942": (E4M3_FNUZ,), "gfx950": (E4M3_FN,)}
#: AMD targets with block-scaled MFMAs (``v_mfma_scale_f32_*_f8f6f4``: MXFP4 with its e8m0 exponents, one
#: instruction per 128-element K step; ``tl.dot_scaled`` lowers to them).
AMD_BLOCK_SCALED_MMA = ("gfx950",)


def matrix_formats(backend: str, arch: str, capability: tuple[int, int], interpreter: bool) -> tuple[tuple, bool]:
    """``(e4m3 flavours, block-scaled MXFP4)`` of the matrix instructions of a device (``Platform.e4m3_mma``,
    ``Platform.block_scaled_mma``). The interpreter emulates both e4m3 flavours; it takes the MXFP4 keys the NVIDIA
    way (nibbles as e4m3 bytes): the block-scaled path is chosen per platform, and tests run it under the
    interpreter with a platform that has it."""
    if interpreter:
        return (E4M3_FN, E4M3_FNUZ), False
    if backend == "hip":
        return AMD_E4M3_MMA.get(arch, ()), arch in AMD_BLOCK_SCALED_MMA
    return ((E4M3_FN,) if capability >= (8, 9) else ()), False


@dataclass(frozen=True)
class Platform:
    """Facts of one device (or build target) that launch plans depend on."""

    arch: str  # ``sm_90``, ``gfx942`` ...; ``cpu`` for the interpreter
    backend: str  # ``cuda``, ``hip`` or ``cpu``
    capability: tuple[int, int]  # NVIDIA compute capability; (0, 0) for anything else
    multiprocessors: int  # SMs or CUs; 0 under the interpreter
    interpreter: bool
    #: Bytes of shared memory one block may use, with the opt-in above 48 KB on NVIDIA (0: none, the CPU).
    shared_memory_per_block: int = 0
    #: Bytes of shared memory of one multiprocessor (what co-resident blocks share; 0: none, the CPU).
    shared_memory_per_multiprocessor: int = 0
    #: The e4m3 flavours (``E4M3_FN``, ``E4M3_FNUZ``) the matrix instructions multiply as stored (``matrix_formats``).
    e4m3_mma: tuple[str, ...] = ()
    #: MXFP4 keys go to block-scaled matrix instructions with their e8m0 exponents (``tl.dot_scaled``).
    block_scaled_mma: bool = False

    @classmethod
    def of(cls, device: torch.device) -> "Platform":
        """The platform of a live ``device`` (memoised per device and interpreter state)."""
        index = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
        return _live(device.type, index, interpreting())

    @classmethod
    def named(cls, arch: str) -> "Platform":
        """The platform of build target ``arch`` (one of ``NAMED``), without its GPU."""
        if arch not in NAMED:
            raise ValueError(f"arch must be one of {', '.join(NAMED)}; got {arch!r}")
        backend, capability, units, per_block, per_multiprocessor = NAMED[arch]
        return cls(arch, backend, capability, units, False, per_block, per_multiprocessor,
                   *matrix_formats(backend, arch, capability, False))

    @property
    def upcast(self) -> bool:
        """16-bit dot operands go in as fp32: under the interpreter only (it computes bf16 on raw bits)."""
        return self.interpreter

    @property
    def fast_decode(self) -> bool:
        """Quantised keys are decoded with the PTX decoders (``quant.dequant``): NVIDIA compute capability 9.0+
        (they use ``max.u16x2``), never under the interpreter."""
        return not self.interpreter and self.capability >= (9, 0)

    def programs(self, per_multiprocessor: int) -> int:
        """Programs that fill the device ``per_multiprocessor`` times (a fixed count under the interpreter)."""
        if self.interpreter or not self.multiprocessors:
            return INTERPRETER_PROGRAMS
        return self.multiprocessors * per_multiprocessor


@functools.lru_cache(maxsize=None)
def _live(device_type: str, index: int | None, interpreter: bool) -> Platform:
    if device_type != "cuda":
        return Platform("cpu", "cpu", (0, 0), 0, interpreter, 0, 0, *matrix_formats("cpu", "cpu", (0, 0), interpreter))
    props = torch.cuda.get_device_properties(index)
    # Older torch builds lack these two properties: 0 then (a plan that needs them does not serve).
    per_block = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    per_multiprocessor = int(getattr(props, "shared_memory_per_multiprocessor", 0) or 0)
    if torch.version.hip is not None:
        arch = props.gcnArchName.split(":")[0]
        return Platform(arch, "hip", (0, 0), props.multi_processor_count, interpreter, per_block, per_multiprocessor,
                        *matrix_formats("hip", arch, (0, 0), interpreter))
    capability = (props.major, props.minor)
    return Platform(f"sm_{props.major}{props.minor}", "cuda", capability, props.multi_processor_count, interpreter,
                    per_block, per_multiprocessor, *matrix_formats("cuda", "", capability, interpreter))

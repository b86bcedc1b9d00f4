"""The native tensor-core scorer (``native_scorer.cu`` beside this file, with ``native_mma.h``): what its kernels
serve and how they are launched, declared once (``SPEC``, a ``native_spec.NativeKernelSpec``), in pure Python (no
compiler, no driver: ``runtime/jit`` compiles, caches, loads and launches, ``runtime/native_scorer.py`` marshals a
call into a launch and ``runtime/registries.py`` makes it the ``native`` scoring candidate).

The kernels compute what the Triton scorers compute (``qsa_paged_mqa_logits``) for 16-bit, fp8 (e4m3fn) and MXFP4
key caches, 4 heads and head_dim 128, with ``mma.sync`` m16n8k16 on NVIDIA tensor cores (compute capability 8.0+): a
CTA of 4 warps scores one row group (up to 4 rows of a request: rows x heads are the MMA's 16 rows) over one contiguous
share of its column tiles, the keys staged through a 4-stage ``cp.async`` pipeline (quantised keys as stored, decoded
to bf16 or fp16 in registers). The design and its time model are at the top of the
``.cu`` file and in docs/kernels.md.

- ``VARIANTS``: one kernel per cache format (``FORMATS``: bf16, fp16, fp8 with bf16 or fp16 queries, MXFP4 with
  bf16 queries) and page size (16, 64), each one program
  (``-DQSA_NATIVE_SINGLE -DQSA_NATIVE_KERNEL_<name>``) and one JIT-cache entry per arch.
- ``PARAMS``: the kernels' parameters, the one declaration of them (the source's ``QSA_SCORER_PARAMS``).
- ``choose_plan(problem, platform)``: the variant, the rows per group and the column splits (``Plan``).
- ``launch_arguments(plan, ...)``: the launch (a ``NativeLaunch``), scalars in the declared order.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..native_spec import NativeKernelSpec, Param, params, spliced_source
from ..platform import Platform
from ..selection.native_topk import COMPAT_PATH, NativeLaunch
from ..spec import cdiv
from .problem import MAX_DECODE_ROWS

#: The CUDA source of the kernels, and the headers spliced into it (the vendor facts, the matrix primitives).
SOURCE_PATH = Path(__file__).with_name("native_scorer.cu")
MMA_HEADER_PATH = Path(__file__).with_name("native_mma.h")
HEADERS = (COMPAT_PATH, MMA_HEADER_PATH)

#: The model's index heads and head_dim, the only ones the kernels are built for (``QSA_HEADS``, ``QSA_HEAD_DIM``).
HEADS, HEAD_DIM = 4, 128
#: Rows x heads of one MMA (m16n8k16): at most ``MMA_ROWS // HEADS`` query rows per group.
MMA_ROWS = 16
MAX_GROUP_ROWS = MMA_ROWS // HEADS
#: Columns per tile, pipeline stages, threads per CTA and the CTAs per SM its launch bounds promise (the source's
#: ``QSA_TILE``, ``QSA_STAGES``, ``QSA_THREADS``, ``QSA_CTAS_PER_SM``).
TILE_COLUMNS, STAGES, THREADS, CTAS_PER_SM = 64, 4, 128, 3
#: Bytes of one 16-bit key, and the dynamic shared memory of a CTA: the stages' key tiles, each stage's per-column
#: page flags, the group's request ids and visible counts (``QSA_SHARED_BYTES``).
KEY_BYTES = 2 * HEAD_DIM
SHARED_BYTES = STAGES * TILE_COLUMNS * KEY_BYTES + STAGES * TILE_COLUMNS + 2 * MAX_GROUP_ROWS * 4
#: Page sizes with a kernel.
PAGE_SIZES = (16, 64)
#: Key (and query) dtypes with a kernel, by the name in the kernel's.
KEY_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
#: The cache formats with a kernel, as ``(kv, query dtype name)``: ``kv`` the registry's axis (``bf16``: a 16-bit
#: cache of q's dtype; ``fp8``: e4m3fn keys with one fp32 scale a key; ``fp4``: MXFP4, dequantised to bf16, so bf16
#: queries only: MXFP4 values leave fp16's range). The one declaration of the variants (``VARIANTS``).
FORMATS = (("bf16", "bf16"), ("bf16", "fp16"), ("fp8", "bf16"), ("fp8", "fp16"), ("fp4", "bf16"))
#: The cache dtype of each quantised ``kv``.
QUANT_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp4": torch.float4_e2m1fn_x2}
#: Bytes a key reads from HBM, by ``kv``: the key, plus its scale (fp8: one fp32; MXFP4: 4 e8m0 exponents).
KEY_READ_BYTES = {"bf16": KEY_BYTES, "fp8": HEAD_DIM + 4, "fp4": HEAD_DIM // 2 + HEAD_DIM // 32}
#: A CTA gets at least this many column tiles where the columns allow (its q load and pipeline fill amortised).
MIN_TILES_PER_CTA = 2
#: Every scalar argument is a C ``int`` (the emulator's binding passes ints; ``scale_bits`` holds an fp32's bits).
INT_LIMIT = 2**31
#: The compute capability the kernels need: ``cp.async``, bf16 ``mma.sync`` and ``ldmatrix`` (sm_80+).
MIN_CAPABILITY = (8, 0)

#: The ``wide`` argument's bits: which metadata tensors are int64 (the others int32; ``QSA_WIDE_*``).
WIDE_PAGES, WIDE_REQUESTS, WIDE_POSITIONS, WIDE_CONTEXTS = 1, 2, 4, 8

#: The kernels' parameters, in order: the one declaration of them (the source's ``QSA_SCORER_PARAMS`` macro is
#: tested against it). ``q`` is 16-bit elements, ``keys`` the cache (16-bit elements, or bytes of fp8 and MXFP4),
#: ``k_scale`` the quantised caches' per-key scales (4 bytes a key; the cache itself for 16-bit caches, unread); the
#: metadata pointers int32 or int64 (``wide``).
PARAMS = params(
    ("q", "const unsigned short*"), ("keys", "const unsigned short*"), ("k_scale", "const void*"),
    ("page_table", "const void*"),
    ("token_to_request", "const void*"), ("query_positions", "const void*"), ("context_lens", "const void*"),
    ("logits", "float*"), ("visible", "int*"),
    *((name, "int") for name in ("num_tokens", "num_requests", "num_pages", "num_columns", "table_width",
                                 "table_stride", "logits_stride", "page_stride", "slot_stride", "group_rows",
                                 "splits", "ratio")),
    ("scale_bits", "int"), ("wide", "int"), ("aligned", "int"),
)
POINTERS = tuple((p.name, p.ctype) for p in PARAMS if p.pointer)
SCALARS = tuple((p.name, p.ctype) for p in PARAMS if not p.pointer)


def source() -> str:
    """The kernels' source with its headers spliced in (``NativeScorerSpec.source``)."""
    return spliced_source(SOURCE_PATH, HEADERS)


@dataclass(frozen=True)
class Variant:
    """One kernel of the source: its ``extern "C"`` name, key dtype (``bf16`` or ``fp16``: the query's, and the
    MMA's), page size and cache format ``kv`` (``bf16``: 16-bit keys of ``key_dtype``; ``fp8``; ``fp4``)."""

    name: str
    key_dtype: str
    page_size: int
    kv: str = "bf16"
    threads: int = THREADS
    blocks_per_multiprocessor: int = CTAS_PER_SM
    cluster: int = 1
    non_portable_cluster: bool = False

    @property
    def defines(self) -> tuple[str, ...]:
        """The ``-D`` macros of its program: build this kernel only."""
        return ("QSA_NATIVE_SINGLE", f"QSA_NATIVE_KERNEL_{self.name}")

    @property
    def max_registers(self) -> int:
        """Registers per thread its launch bounds allow (a 64K-register file shared by the promised CTAs)."""
        return 65536 // (self.threads * self.blocks_per_multiprocessor)


def variant_name(kv: str, dtype: str, page_size: int) -> str:
    """The kernel name of a format and page size: ``qsa_score_<dtype>_page<P>`` for 16-bit caches,
    ``qsa_score_<kv>_<query dtype>_page<P>`` for quantised ones."""
    return f"qsa_score_{dtype}_page{page_size}" if kv == "bf16" else f"qsa_score_{kv}_{dtype}_page{page_size}"


VARIANTS = tuple(Variant(variant_name(kv, dtype, page), dtype, page, kv)
                 for kv, dtype in FORMATS for page in PAGE_SIZES)
BY_NAME = {variant.name: variant for variant in VARIANTS}


def variant_for(key_dtype: torch.dtype, page_size: int, q_dtype: torch.dtype | None = None) -> Variant:
    """The kernel of a cache of ``key_dtype`` (bf16, fp16; or ``float8_e4m3fn`` / ``float4_e2m1fn_x2`` with queries
    of ``q_dtype``) in pages of ``page_size``; ``ValueError`` where none is."""
    kv = next((name for name, dtype in QUANT_CACHE_DTYPES.items() if dtype == key_dtype), "bf16")
    name = KEY_DTYPES.get(key_dtype if kv == "bf16" else q_dtype)
    found = BY_NAME.get(variant_name(kv, name, page_size)) if name is not None else None
    if found is None:
        with_q = "" if kv == "bf16" else f" with {q_dtype} queries"
        formats = ", ".join(dtype if kv == "bf16" else f"{kv} ({dtype} q)" for kv, dtype in FORMATS)
        raise ValueError(f"no native scorer kernel for {key_dtype} keys{with_q} in pages of {page_size} (kernels: "
                         f"{formats} keys, pages of {', '.join(map(str, PAGE_SIZES))})")
    return found


def variants_for(platform: Platform) -> tuple[Variant, ...]:
    """The variants that exist for ``platform``: all of them on NVIDIA compute capability ``MIN_CAPABILITY``+; none
    elsewhere (no AMD version of the matrix primitives yet)."""
    if platform.backend == "cuda" and platform.capability >= MIN_CAPABILITY:
        return VARIANTS
    return ()


def group_rows_of(problem) -> int:
    """Query rows per CTA: one request's rows where the host knows them (``max_query_len``, else rows per request on
    average), at most ``MAX_GROUP_ROWS``; one for draft and decode. Groups of uneven requests are walked per request
    by the kernel (correct for any count; fastest when a group is one request)."""
    if problem.phase in ("draft", "decode"):
        return 1
    rows = problem.max_query_len or max(1, problem.num_tokens // max(problem.num_requests, 1))
    return max(1, min(rows, MAX_GROUP_ROWS))


@dataclass(frozen=True)
class Plan:
    """One launch: ``variant``, ``group_rows`` rows per group, ``row_groups`` groups, each served by ``splits`` CTAs
    (contiguous shares of its column tiles)."""

    variant: Variant
    group_rows: int
    row_groups: int
    splits: int

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.row_groups * self.splits, 1, 1)

    @property
    def shared_bytes(self) -> int:
        return SHARED_BYTES

    def describe(self) -> str:
        return (f"{self.variant.name}: {self.row_groups} row groups of {self.group_rows} rows x {self.splits} column "
                f"splits ({self.row_groups * self.splits} CTAs of {THREADS} threads), {TILE_COLUMNS}-column tiles "
                f"through {STAGES} cp.async stages, {SHARED_BYTES} B shared memory per CTA")


@lru_cache(maxsize=512)  # a launch asks for it every call; it depends on these arguments only
def choose_plan(problem, platform: Platform, splits: int | None = None) -> Plan:
    """The plan of ``problem`` (a ``ScoreProblem``) on ``platform``: the variant of its cache dtype and page size, its
    row groups (``group_rows_of``), and ``splits`` column splits per group (default: as many as fill the platform
    ``CTAS_PER_SM`` times in one wave, ``Platform.programs``, at most one per ``MIN_TILES_PER_CTA`` tiles of the
    widest row)."""
    variant = variant_for(problem.cache_dtype, problem.block_size, problem.q_dtype)
    group_rows = group_rows_of(problem)
    row_groups = cdiv(max(problem.num_tokens, 1), group_rows)
    if splits is None:
        tiles = cdiv(max(problem.num_columns, 1), TILE_COLUMNS)
        splits = max(1, min(cdiv(tiles, MIN_TILES_PER_CTA), platform.programs(CTAS_PER_SM) // row_groups))
    return Plan(variant, group_rows, row_groups, splits)


def float_bits(value: float) -> int:
    """The bits of ``value`` as an fp32, read as a C ``int`` (the kernels' ``scale_bits``)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def launch_arguments(plan: Plan, values: dict[str, int]) -> NativeLaunch:
    """The launch of ``plan`` with the scalar arguments ``values`` (by name; ``group_rows`` and ``splits`` come from
    the plan): ``ValueError`` naming a missing one or one past its C type."""
    values = dict(values, group_rows=plan.group_rows, splits=plan.splits)
    missing = [name for name, _ in SCALARS if name not in values]
    if missing:
        raise ValueError(f"values: missing scalar argument(s) {', '.join(missing)}")
    for name, ctype in SCALARS:
        if not -INT_LIMIT <= values[name] < INT_LIMIT:
            raise ValueError(f"{name} must fit a C {ctype} (the kernel's 32-bit argument); got {values[name]}")
    if plan.grid[0] >= INT_LIMIT:
        raise ValueError(f"row groups x splits must be below 2**31; got {plan.grid[0]}")
    return NativeLaunch(plan.variant.name, plan.grid, (THREADS, 1, 1), plan.shared_bytes, POINTERS,
                        tuple((name, ctype, values[name]) for name, ctype in SCALARS))


def shape_reasons(problem) -> list[str]:
    """Why the kernels cannot take ``problem`` (a ``ScoreProblem``), whatever the platform."""
    found = []
    if problem.cache_dtype == torch.float8_e4m3fnuz:
        found.append("a float8_e4m3fnuz cache (gfx942's fp8): the kernels decode e4m3fn (NVIDIA's fp8)")
    elif problem.kv_dtype == "fp4" and problem.q_dtype != torch.bfloat16:
        found.append(f"MXFP4 keys with {str(problem.q_dtype).removeprefix('torch.')} queries: the keys are "
                     "dequantised to bf16 (their values leave fp16's range), so bf16 queries only")
    if problem.kv_dtype == "fp4" and not problem.scale_aligned:
        found.append("an MXFP4 scale tensor not 4-byte aligned (a key's 4 exponents are one 4-byte cp.async)")
    if problem.num_heads != HEADS:
        found.append(f"needs {HEADS} heads (got {problem.num_heads}): rows x heads fill the MMA's {MMA_ROWS} rows")
    if problem.head_dim != HEAD_DIM:
        found.append(f"needs head_dim {HEAD_DIM} (got {problem.head_dim})")
    if problem.block_size not in PAGE_SIZES:
        found.append(f"needs pages of {' or '.join(map(str, PAGE_SIZES))} groups (got {problem.block_size})")
    if problem.phase == "prefill" and problem.num_tokens > MAX_DECODE_ROWS:
        found.append(f"prefill of {problem.num_tokens} rows: it reads a request's keys once per {MAX_GROUP_ROWS} "
                     "rows (the tiled kernel serves prefill)")
    strides = problem.key_strides or ()
    if any(stride >= INT_LIMIT for stride in strides):
        found.append(f"cache page or slot strides {strides} past 2**31 elements")
    return found


@dataclass(frozen=True)
class NativeScorerConfig:
    """The native scorer's tile settings in a tuned row: none yet (its tile, stages and CTAs per SM are the source's
    constants). Its tuned rows carry measured times (``us``, ``measured``) that measured dispatch compares with the
    Triton scorers' at the same bucket (``registry.measured_choice``): where they time it faster, it is chosen."""


class NativeScorerSpec(NativeKernelSpec):
    """The native tensor-core scorer, declared once: its variants, source (``native_scorer.cu`` with
    ``native_compat.h`` and ``native_mma.h`` spliced in), parameters (``PARAMS``), reasons and plans. A problem is a
    ``ScoreProblem``."""

    name = "native_scorer"
    family = "scoring"
    description = ("native tensor-core scorer (CUDA C++ compiled at run time by NVRTC: mma.sync over rows x heads, "
                   "keys staged by cp.async; bf16, fp16, fp8 and MXFP4 caches, 4 heads, head_dim 128)")
    source_path = SOURCE_PATH
    variants = VARIANTS
    Config = NativeScorerConfig

    def params_of(self, variant: Variant) -> tuple[Param, ...]:
        return PARAMS

    def source(self) -> str:
        return source()

    def variants_for(self, platform: Platform) -> tuple[Variant, ...]:
        return variants_for(platform)

    def reasons(self, problem, platform: Platform) -> list[str]:
        """The platform's (NVIDIA, compute capability ``MIN_CAPABILITY``+) and the shape's (``shape_reasons``)."""
        found = []
        if platform.backend == "hip":
            found.append(f"no AMD version yet ({platform.arch}: the matrix primitives of native_mma.h are NVIDIA's "
                         "mma.sync, ldmatrix and cp.async)")
        elif platform.backend != "cuda":
            found.append(f"needs an NVIDIA GPU (the platform is {platform.arch})")
        elif platform.capability < MIN_CAPABILITY:
            found.append(f"needs an NVIDIA GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
                         f"(cp.async and bf16 mma.sync; the device is {platform.arch})")
        return found + shape_reasons(problem)

    def plan(self, problem, platform: Platform) -> Plan:
        return choose_plan(problem, platform)

    def describe_plan(self, problem, platform: Platform) -> str:
        """The plan ``explain`` prints (``none``, with the reasons, where there is none)."""
        reasons = self.reasons(problem, platform)
        if reasons:
            return f"none ({'; '.join(reasons)})"
        return self.plan(problem, platform).describe()


SPEC = NativeScorerSpec()

"""The fused selection (``fused_select.cu`` beside this file): scoring on the tensor cores, the exact block top-k and
the expansion of ``qsa_select_paged_tokens`` in one launch, with no logits in HBM and no cooperative launch;
declared once (``SPEC``, a ``native_spec.NativeKernelSpec``), in pure Python (``runtime/fused_select.py`` launches it
and ``runtime/registries.py`` makes it the ``native_fused`` selection candidate).

Its device code is the native scorer's (``kernels/scoring/native_scorer.cu``: the tile loader, the MMAs, the head
sum and the epilogue, writing into shared memory) with its own selection: each CTA offers the candidates of its
chunk above a gate it learns from the row's merged histogram, and the last CTA of a row group to arrive (with a
selector CTA for each further row of the group) selects them exactly (the grid select's keys, scans and expansion
pieces, ``grid_topk.cu``). The design, the time model and
the workspace are at the top of the ``.cu`` file and in docs/selection.md.

- ``VARIANTS``: one kernel per cache format of the scorer (``scorer.FORMATS``: bf16, fp16, fp8 with bf16 or fp16
  queries, MXFP4 with bf16 queries) and page size (16, 64), each one program
  (``-DQSA_FUSED_SINGLE -DQSA_FUSED_KERNEL_<name>``), named as the scorer's (``qsa_fused_`` for ``qsa_score_``).
- ``PARAMS``: the kernels' parameters, the one declaration of them (the source's ``QSA_FUSED_PARAMS``).
- ``choose_plan(problem, platform)`` / ``split_plan(...)``: row groups, the split (CTAs a group) and the scores' room
  a CTA (``Plan``).
- ``launch_arguments(plan, values)``: the launch (a ``NativeLaunch``), scalars in the declared order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..native_spec import NativeKernelSpec, Param, params, spliced_source
from ..platform import Platform
from ..scoring import native_scorer as scorer
from ..spec import cdiv
from . import grid_topk as grid
from .native_topk import COMPAT_PATH, NativeLaunch

#: The CUDA source, and what is spliced into it: the scorer's source and headers, then the grid select's.
SOURCE_PATH = Path(__file__).with_name("fused_select.cu")
HEADERS = (scorer.SOURCE_PATH, COMPAT_PATH, scorer.MMA_HEADER_PATH, grid.SOURCE_PATH, COMPAT_PATH)
#: Threads per CTA (the scorer's 4 warps; the selection runs at the same width) and the CTAs per multiprocessor its
#: launch bounds promise (``QSA_FUSED_THREADS``, ``QSA_FUSED_CTAS_PER_SM``): the scorer's.
THREADS, CTAS_PER_SM = scorer.THREADS, scorer.CTAS_PER_SM
#: Shared memory a CTA needs besides the scores: the scorer's stages, flags and rows and the tail's words
#: (``FUSED_TAIL_WORDS``; the histograms, offsets and candidates' cache reuse the stages once a group is
#: scored). The same for every cache format: a quantised stage holds its keys and their scales within a 16-bit
#: stage's bytes (static-asserted in the source).
TAIL_WORDS = 64
BASE_SHARED_BYTES = scorer.SHARED_BYTES + 4 * TAIL_WORDS
#: The most CTAs a row group is split across (``FUSED_MAX_SPLIT``: the last arriver's offsets of the parts), and in
#: a cluster plan (``FUSED_MAX_CLUSTER``: the non-portable cluster size of sm_90).
MAX_SPLIT, MAX_CLUSTER = 1024, 16
#: Workspace words a row (``FUSED_ROW_HEAD``, ``GRID_BINS``): its head (the gate; in a group's first row also the
#: arrival counter and the selectors' release word and counter), its histogram.
ROW_HEAD_WORDS, BINS = 32, 2048
ROW_CLEAN_WORDS = ROW_HEAD_WORDS + BINS
#: The most workspace a call may take (bytes): the candidates' room is 8 bytes a row and column.
MAX_WORKSPACE_BYTES = 2**30
#: C ``int`` arguments.
INT_LIMIT = 2**31

#: The kernels' parameters, in order (the source's ``QSA_FUSED_PARAMS``): the scorer's inputs (``k_scale`` after
#: ``keys`` as in the scorer's: the quantised caches' per-key scales, unread for 16-bit caches), ``out`` (the block
#: indices, a workspace ``[rows, K]``), ``tokens`` (the expansion), ``scores`` (the debug scores, null in
#: production), ``stamps`` (the debug phase stamps, ``STAMP_COUNT`` timer words a CTA, null in production),
#: ``workspace`` (the rows' counters, gates and histograms: zeroed once, left clean), ``candidates`` (the rows' counts
#: and candidates: never zeroed), then the scalars (C ``int``).
PARAMS = params(
    ("q", "const unsigned short*"), ("keys", "const unsigned short*"), ("k_scale", "const void*"),
    ("page_table", "const void*"), ("token_to_request", "const void*"), ("query_positions", "const void*"),
    ("context_lens", "const void*"),
    ("out", "int*"), ("tokens", "int*"), ("scores", "float*"), ("stamps", "unsigned long long*"),
    ("workspace", "unsigned*"), ("candidates", "unsigned*"),
    *((name, "int") for name in ("num_tokens", "num_requests", "num_pages", "num_columns", "table_width",
                                 "table_stride", "page_stride", "slot_stride", "group_rows", "row_groups", "split",
                                 "cluster", "cap", "K", "ratio", "scale_bits", "wide", "aligned", "width", "tok_ld",
                                 "scores_ld")),
)
POINTERS = tuple((p.name, p.ctype) for p in PARAMS if p.pointer)
#: The debug stamps (the source's ``QSA_STAMP_COUNT``, native_compat.h): the timer words of a CTA's record, at the
#: phase boundaries start, then the ends of ``PHASES`` (the start to the query's end is "query", ...; "merge": the
#: keys, histograms, returning atomics and gates, "offer": the candidates' stores; the finish's "gather", "select" and
#: "output": a row's candidates gathered with the threshold's first digit, the radix select, the ordered output with
#: the ties and the expansion, written by each group's last arriver and by the selectors, whose
#: "arrive" is their wait; ``FINISH_PHASES``).
STAMP_COUNT = 9
PHASES = ("query", "score", "merge", "offer", "arrive", "gather", "select", "output")
FINISH_PHASES = ("gather", "select", "output")
SCALARS = tuple(p.name for p in PARAMS if not p.pointer)


def source() -> str:
    """The kernels' source with the scorer's and the grid select's spliced in (``FusedSelectSpec.source``)."""
    return spliced_source(SOURCE_PATH, HEADERS)


@dataclass(frozen=True)
class Variant:
    """One kernel: its ``extern "C"`` name, key dtype (``bf16``, ``fp16``: the query's and the MMA's), page size and
    cache format ``kv`` (the scorer's: ``bf16`` for 16-bit keys, ``fp8``, ``fp4``)."""

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
        return ("QSA_FUSED_SINGLE", f"QSA_FUSED_KERNEL_{self.name}")

    @property
    def max_registers(self) -> int:
        return 65536 // (self.threads * self.blocks_per_multiprocessor)


def fused_name(scorer_variant: scorer.Variant) -> str:
    """The fused kernel of a scorer kernel's format and page size: ``qsa_fused_`` for its ``qsa_score_``."""
    return scorer_variant.name.replace("qsa_score_", "qsa_fused_", 1)


VARIANTS = tuple(Variant(fused_name(v), v.key_dtype, v.page_size, v.kv) for v in scorer.VARIANTS)
BY_NAME = {variant.name: variant for variant in VARIANTS}


def variant_for(key_dtype, page_size: int, q_dtype=None) -> Variant:
    """The kernel of ``key_dtype`` keys (bf16, fp16; ``float8_e4m3fn`` or ``float4_e2m1fn_x2`` with queries of
    ``q_dtype``) in pages of ``page_size``, as the scorer chooses its own (``scorer.variant_for``; ``ValueError``
    where none is)."""
    return BY_NAME[fused_name(scorer.variant_for(key_dtype, page_size, q_dtype))]


def variants_for(platform: Platform) -> tuple[Variant, ...]:
    """All of them on NVIDIA compute capability 8.0+ (the scorer's floor), none elsewhere."""
    return VARIANTS if scorer.variants_for(platform) else ()


@dataclass(frozen=True)
class Plan:
    """One launch: ``variant``; ``row_groups`` groups of ``group_rows`` rows; ``split`` CTAs a group (the grid is
    ``row_groups * split`` CTAs and the ``selectors``, not necessarily resident at once); ``cap``: the scores a CTA
    holds per row and the candidates' room a CTA and row in the workspace (a multiple of ``grid.TILE``; 0 where no
    row is wider than the budget); ``cluster``: 0 for the last arriver's design (a group's CTAs meet through L2:
    candidates above a gate, the last to arrive and the selectors select), else ``split``: each group's CTAs are one
    thread-block cluster that merges, exchanges and selects in distributed shared memory (sm_90+, at most
    ``MAX_CLUSTER`` CTAs and at least one a row, no selectors; the source's ``fused_cluster_tail``)."""

    variant: Variant
    group_rows: int
    row_groups: int
    split: int
    cap: int
    cluster: int = 0

    @property
    def shared_bytes(self) -> int:
        return BASE_SHARED_BYTES + 4 * self.group_rows * self.cap

    @property
    def selectors(self) -> int:
        """The selector CTAs after the scoring ones: ``group_rows - 1`` a group where rows are scored (the group's
        last arriving CTA selects row 0, a selector each other row, at the same time); none for one-row groups."""
        return self.row_groups * (self.group_rows - 1) if self.cap and not self.cluster else 0

    @property
    def grid(self) -> int:
        return self.row_groups * self.split + self.selectors

    @property
    def stamp_words(self) -> int:
        """The debug stamps' words: ``STAMP_COUNT`` a CTA."""
        return self.grid * STAMP_COUNT

    @property
    def workspace_words(self) -> int:
        """The rows' counters, gates and histograms (``ROW_CLEAN_WORDS`` a row at the row's index, the same for
        every plan: zeroed once, left clean by every launch)."""
        return self.row_groups * self.group_rows * ROW_CLEAN_WORDS

    @property
    def scratch_row_words(self) -> int:
        """A row's counts and candidates: a count a CTA, then ``cap`` (key, column) pairs a CTA (the source's
        ``FusedGroup.scratch_row_words``)."""
        return -(-self.split // 4) * 4 + 2 * self.split * self.cap

    @property
    def candidate_words(self) -> int:
        """The rows' counts and candidates (never zeroed: every launch writes them before it reads them)."""
        return self.row_groups * self.group_rows * self.scratch_row_words

    def describe(self) -> str:
        shape = (f"split {self.split} CTAs a group, one cluster each" if self.cluster else
                 f"split {self.split} CTAs a group and {self.selectors} selectors")
        return (f"{self.variant.name}: {self.row_groups} row groups of {self.group_rows} rows, {shape} "
                f"(grid {self.grid} of {THREADS} threads), "
                f"{self.shared_bytes} B shared memory per CTA, workspace {4 * self.workspace_words} B, candidates "
                f"{4 * self.candidate_words} B")


def max_cap(group_rows: int, platform: Platform, per_multiprocessor: int = 1) -> int:
    """The most scores a CTA holds per row of a ``group_rows``-row group on ``platform`` with ``per_multiprocessor``
    CTAs resident on a multiprocessor (a multiple of ``grid.TILE``)."""
    per_cta = min(platform.shared_memory_per_block,
                  platform.shared_memory_per_multiprocessor // per_multiprocessor - grid.RESERVED_PER_CTA)
    room = (per_cta - BASE_SHARED_BYTES) // (4 * group_rows) // grid.TILE * grid.TILE
    return max(room, 0)


def split_plan(split: int, variant: Variant, group_rows: int, row_groups: int, columns: int,
               platform: Platform, cluster: bool = False) -> Plan:
    """The plan of ``split`` CTAs a group, each group one thread-block cluster where ``cluster``; ``ValueError``
    where it does not fit (``MAX_SPLIT``, the scores' room in shared memory, the workspace; for a cluster: sm_90+,
    ``MAX_CLUSTER`` CTAs, one CTA a row at least)."""
    if not 1 <= split <= MAX_SPLIT:
        raise ValueError(f"split must be in [1, {MAX_SPLIT}]; got {split}")
    if cluster:
        if platform.backend != "cuda" or platform.capability < (9, 0):
            raise ValueError(f"thread-block clusters need an NVIDIA GPU of compute capability 9.0+ "
                             f"({platform.arch} has none)")
        if not max(2, group_rows) <= split <= MAX_CLUSTER:
            raise ValueError(f"a cluster plan needs {max(2, group_rows)} to {MAX_CLUSTER} CTAs a group (one a row "
                             f"at least); got {split}")
    cap = -(-cdiv(columns, split) // grid.TILE) * grid.TILE
    if cap > max_cap(group_rows, platform):
        raise ValueError(f"a split of {split} leaves {cap} scores a row and CTA; {platform.arch} holds at most "
                         f"{max_cap(group_rows, platform)} for {group_rows} rows")
    plan = Plan(variant, group_rows, row_groups, split, cap, split if cluster else 0)
    if 4 * (plan.workspace_words + plan.candidate_words) > MAX_WORKSPACE_BYTES:
        raise ValueError(f"a split of {split} needs {4 * (plan.workspace_words + plan.candidate_words)} B of "
                         f"workspace, more than {MAX_WORKSPACE_BYTES}")
    return plan


def _shape(problem) -> tuple[Variant, int, int, int, int]:
    score = problem.score
    group_rows = scorer.group_rows_of(score)
    return (variant_for(score.cache_dtype, score.block_size, score.q_dtype), group_rows,
            cdiv(max(score.num_tokens, 1), group_rows), score.num_columns, problem.block_topk)


def problem_split_plan(problem, split: int, platform: Platform, cluster: bool = False) -> Plan:
    """``split_plan`` of ``split`` CTAs a group (one cluster each where ``cluster``) for the selection problem
    ``problem`` (its variant, row groups and columns); ``ValueError`` where it does not fit."""
    variant, group_rows, row_groups, columns, _ = _shape(problem)
    return split_plan(split, variant, group_rows, row_groups, columns, platform, cluster)


def plan_reason(problem, platform: Platform) -> str | None:
    """Why no plan serves ``problem`` (a selection problem: ``score``, ``block_topk``) on ``platform``: the budget's
    rank field, the C ``int`` arguments, a row group's scores that shared memory cannot hold across ``MAX_SPLIT``
    CTAs, a workspace past ``MAX_WORKSPACE_BYTES``. None: one does."""
    variant, group_rows, row_groups, columns, block_topk = _shape(problem)
    if block_topk > grid.MAX_BLOCK_TOPK:
        return f"needs block_topk <= {grid.MAX_BLOCK_TOPK} (got {block_topk})"
    if columns >= INT_LIMIT or problem.score.num_tokens >= INT_LIMIT:
        return f"needs rows and columns below 2**31 (got {problem.score.num_tokens}, {columns})"
    if columns <= block_topk:
        return None
    room = max_cap(group_rows, platform)
    least = cdiv(columns, room) if room else MAX_SPLIT + 1
    if least > MAX_SPLIT:
        return (f"the scores of a group of {group_rows} rows x {columns} columns exceed shared memory across "
                f"{MAX_SPLIT} CTAs ({room} a row and CTA on {platform.arch})")
    try:
        split_plan(least, variant, group_rows, row_groups, columns, platform)
    except ValueError as err:
        return f"the candidates' workspace is too large ({err})"
    return None


@lru_cache(maxsize=512)
def choose_plan(problem, platform: Platform) -> Plan:
    """The plan of ``problem`` on ``platform``: the scorer's row groups (``native_scorer.group_rows_of``); where no
    row is wider than the budget one CTA a group and no scores; else the scorer's split (as many CTAs a group as fill
    the multiprocessors ``CTAS_PER_SM`` times, at most one per ``native_scorer.MIN_TILES_PER_CTA`` tiles), at least
    what the scores' room needs with ``CTAS_PER_SM`` CTAs a multiprocessor (else with fewer), in the last arriver's
    design (cluster plans, ``split_plan(..., cluster=True)``, measured slower: docs/selection.md). ``ValueError``
    (``plan_reason``) where none fits."""
    reason = plan_reason(problem, platform)
    if reason:
        raise ValueError(reason)
    variant, group_rows, row_groups, columns, block_topk = _shape(problem)
    if columns <= block_topk:
        return Plan(variant, group_rows, row_groups, 1, 0)
    tiles = cdiv(columns, scorer.TILE_COLUMNS)
    wanted = max(1, min(cdiv(tiles, scorer.MIN_TILES_PER_CTA), platform.programs(CTAS_PER_SM) // row_groups))
    room = max_cap(group_rows, platform, CTAS_PER_SM)
    least = cdiv(columns, room) if room else MAX_SPLIT + 1
    if least > MAX_SPLIT:
        least = cdiv(columns, max_cap(group_rows, platform))
    for split in range(min(MAX_SPLIT, max(wanted, least)), least - 1, -1):
        try:
            return split_plan(split, variant, group_rows, row_groups, columns, platform)
        except ValueError:
            continue
    return split_plan(least, variant, group_rows, row_groups, columns, platform)  # fits: plan_reason said so


def launch_arguments(plan: Plan, values: dict[str, int]) -> NativeLaunch:
    """The launch of ``plan`` with the scalar arguments ``values`` by name (the plan's own come from it):
    ``ValueError`` naming a missing one or one past a C ``int``."""
    values = dict(values, group_rows=plan.group_rows, row_groups=plan.row_groups, split=plan.split,
                  cluster=plan.cluster, cap=plan.cap)
    missing = [name for name in SCALARS if name not in values]
    if missing:
        raise ValueError(f"values: missing scalar argument(s) {', '.join(missing)}")
    for name in SCALARS:
        if not -INT_LIMIT <= values[name] < INT_LIMIT:
            raise ValueError(f"{name} must fit a C int (the kernel's 32-bit argument); got {values[name]}")
    return NativeLaunch(plan.variant.name, (plan.grid, 1, 1), (THREADS, 1, 1), plan.shared_bytes, POINTERS,
                        tuple((name, "int", values[name]) for name in SCALARS), max(plan.cluster, 1))


@dataclass(frozen=True)
class FusedSelectConfig:
    """The fused selection's settings in a tuned row: none (its tile, stages and CTA shape are the source's
    constants). Its rows in the scoring table (``kernel`` = ``fused_select``, at (rows, context) buckets) carry the
    whole call's measured time, which measured dispatch compares with the composite path's (its scoring's measured
    row plus its top-k's) at the same bucket: where they time it faster, ``native_fused`` is chosen."""


class FusedSelectSpec(NativeKernelSpec):
    """The fused selection, declared once: its variants, source, parameters (``PARAMS``), reasons and plans. A
    problem is a selection problem (``runtime.registries.SelectionProblem``: ``score``, ``block_topk``)."""

    name = "fused_select"
    family = "selection"
    description = ("native fused selection (the tensor-core scorer's tiles, candidates above a gate and the last "
                   "CTA's exact select with the expansion in one launch, no logits in HBM; compiled at run time by "
                   "NVRTC)")
    source_path = SOURCE_PATH
    variants = VARIANTS
    Config = FusedSelectConfig

    def params_of(self, variant: Variant) -> tuple[Param, ...]:
        return PARAMS

    def source(self) -> str:
        return source()

    def variants_for(self, platform: Platform) -> tuple[Variant, ...]:
        return variants_for(platform)

    def reasons(self, problem, platform: Platform) -> list[str]:
        """The scorer's (``native_scorer.SPEC.reasons``: an NVIDIA GPU of compute capability 8.0+, a cache it serves
        -- bf16, fp16, fp8 e4m3fn with bf16 or fp16 queries, MXFP4 with bf16 queries; not fp8 e4m3fnuz, nor MXFP4
        with fp16 queries --, 4 heads, head_dim 128, pages of 16 or 64, no prefill beyond 256 rows, strides), then
        the shape's (``plan_reason``) where the scorer serves it: the fused kernels are the scorer's formats'."""
        found = scorer.SPEC.reasons(problem.score, platform)
        if not found:
            shape = plan_reason(problem, platform)
            found += [shape] if shape else []
        return found

    def plan(self, problem, platform: Platform) -> Plan:
        return choose_plan(problem, platform)

    def describe_plan(self, problem, platform: Platform) -> str:
        reasons = self.reasons(problem, platform)
        return f"none ({'; '.join(reasons)})" if reasons else self.plan(problem, platform).describe()


SPEC = FusedSelectSpec()

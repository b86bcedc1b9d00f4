"""Tuned tile configurations: CSV tables in ``configs/`` (plus ``QSA_AITER_TUNED_CONFIG`` files), validated rows, and
the lookup a kernel launch makes.

A row is keyed by GPU arch (``sm_90``, ``gfx942``, ``gfx950``, ... ; ``cpu`` for the interpreter), kernel, kv dtype,
page size, heads, head_dim, and two buckets: query rows per call and context capacity in tokens (page-table width x
page size x R). Its values are fields of the kernel's config dataclass (``StackedConfig`` ...); an empty cell keeps
the kernel's default. A lookup takes the rows of the call's exact key and picks the nearest bucket (distance in
powers of two over rows and context); a key with no row keeps the kernel's ``default_config``
(``KernelSpec.plan`` applies the row).
Files given in ``QSA_AITER_TUNED_CONFIG`` are read after the shipped ones, and their rows replace shipped rows with
the same key and buckets.

The block top-k has a table of its own (``topk.csv``, ``TopkRow``): a row is what one top-k candidate (and, for the
native one, one of its plans) measured at a (rows, columns) bucket keeping ``block_topk`` groups per row on an arch.
A file is read as the top-k's when its header names ``candidate`` (``TableKind``), so ``QSA_AITER_TUNED_CONFIG``
lists files of either kind. Only measured rows decide anything there: the measured choice among the candidates and
the native top-k's plan (``runtime/registries.py``, ``runtime/native_topk.py``).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, create_model, field_validator

from ..kernels.catalog import timed_native_specs, tunable_specs
from .settings import ConfigurationError

#: The shipped tables: the package's ``configs`` (in a source checkout a link to the top-level ``configs/``, their
#: source; a wheel carries the files themselves). Read only: tuned rows of one's own go to files of one's own.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = ("scoring.csv", "topk.csv")


def _tile_columns() -> dict:
    """One optional int column per field of the tunable kernels' configs (first spec first), with the bounds the
    field's metadata gives (``spec.FLAG``, ``spec.COUNT_OR_ZERO``; positive otherwise)."""
    columns = {}
    for spec in tunable_specs():
        for item in dataclasses.fields(spec.Config):
            if item.name not in columns:
                bounds = dict(item.metadata) or {"gt": 0}
                columns[item.name] = (Optional[int], Field(None, **bounds))
    return columns


class _RowChecks(BaseModel):
    """The checks of a row whatever its columns (``TunedRow`` adds one column per tile-config field)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("kernel", check_fields=False)
    @classmethod
    def _known_kernel(cls, value: str) -> str:
        if value not in _config_classes():
            raise ValueError(f"unknown kernel {value!r} (known: {', '.join(_config_classes())})")
        return value

    @field_validator("kv_dtype", check_fields=False)
    @classmethod
    def _known_kv(cls, value: str) -> str:
        if value not in ("bf16", "fp8", "fp4"):
            raise ValueError(f"unknown kv_dtype {value!r} (known: bf16, fp8, fp4)")
        return value

    def key(self) -> tuple:
        return tuple(getattr(self, name) for name in KEY_FIELDS)

    def tile(self) -> dict[str, int]:
        """The config fields this row sets."""
        return {name: getattr(self, name) for name in _config_fields(self.kernel)
                if getattr(self, name, None) is not None}


#: One CSV row: its key, its buckets, one column per tile-config field of the tunable kernels (empty keeps the
#: kernel's default), and what the tuner measured.
TunedRow = create_model(
    "TunedRow",
    __base__=_RowChecks,
    arch=(str, Field(min_length=2)),
    kernel=(str, ...),
    kv_dtype=(str, ...),
    page_size=(int, Field(gt=0)),
    heads=(int, Field(gt=0)),
    head_dim=(int, Field(gt=0)),
    rows=(int, Field(gt=0, description="bucket: query rows per call")),
    context=(int, Field(gt=0, description="bucket: context capacity in tokens")),
    **_tile_columns(),
    us=(Optional[float], Field(None, gt=0, description="measured time of the config, microseconds")),
    default_us=(Optional[float], Field(None, gt=0, description="the kernel's default config, same run")),
    measured=(bool, Field(description="1: measured by the tuner on this arch; 0: a starting point from elsewhere")),
    source=(str, ""),
)


@functools.lru_cache(maxsize=None)
def _config_fields(kernel: str) -> tuple[str, ...]:
    """The field names of ``kernel``'s tile config (a row's ``tile()`` reads them for every row of a table)."""
    return tuple(f.name for f in dataclasses.fields(_config_classes()[kernel]))


def _config_classes() -> dict[str, type]:
    """Tile-config dataclass of every kernel with tuned rows, by name (from the kernels' specs; a native kernel
    family's rows carry measured times, its config no fields yet)."""
    return {spec.name: spec.Config for spec in (*tunable_specs(), *timed_native_specs())}


#: The exact key of a row, then its two buckets (a row replaces another with the same key and buckets).
KEY_FIELDS = ("arch", "kernel", "kv_dtype", "page_size", "heads", "head_dim")
BUCKET_FIELDS = ("rows", "context")


def problem_key(arch: str, kernel: str, problem) -> tuple:
    """``TunedRow.key()`` of the rows that serve ``problem`` on ``arch``."""
    return (arch, kernel, problem.kv_dtype, problem.block_size, problem.num_heads, problem.head_dim)


def buckets(problem) -> tuple[int, int]:
    """``problem``'s (rows, context) buckets: query rows, and context capacity in tokens (columns x R)."""
    return problem.num_tokens, problem.num_columns * problem.compress_ratio


def bucket_distance(rows: int, context: int, problem) -> tuple[float, int, int]:
    """How far the (``rows``, ``context``) bucket is from ``problem``'s: the sum of the log2 ratios, then the bucket
    itself (equal distances: the smaller bucket, deterministically)."""
    want_rows, want_context = (max(b, 1) for b in buckets(problem))
    return abs(math.log2(rows / want_rows)) + abs(math.log2(context / want_context)), rows, context


#: The tile-config columns (every field of a tunable kernel's config).
TILE_FIELDS = tuple(_tile_columns())


#: The columns every table's header names (a row must fill them); the others (tile fields, times, ``source``) may be
#: left out of a header.
REQUIRED_COLUMNS = tuple(name for name, item in TunedRow.model_fields.items() if item.is_required())


# ---------------------------------------------------------------------------------------------------------------
# The block top-k's table
# ---------------------------------------------------------------------------------------------------------------


def topk_candidate_plans() -> dict[str, tuple[str, ...]]:
    """The top-k candidates a tuned row may name (those of ``registries.TOPK`` with tuned rows: a ``measurement``),
    each with the plan names its rows give (empty: one plan, the ``plan`` cell left empty)."""
    from .registries import TOPK  # the registry is built over this module: read when a row is validated

    return {name: c.plan_names for name, c in TOPK.candidates.items() if c.measurement is not None}


class TopkRow(BaseModel):
    """One row of a tuned top-k table: what ``candidate`` (with ``plan``, for a candidate that has several) took at
    ``rows`` rows of ``columns`` fp32 logits keeping ``block_topk`` groups per row on ``arch``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    arch: str = Field(min_length=2, description="`sm_90`, `gfx942`, `gfx950`, ... as in the scoring table "
                      "(part of the exact key)")
    block_topk: int = Field(gt=0, description="groups kept per row (part of the exact key)")
    rows: int = Field(gt=0, description="bucket: rows of logits per top-k launch (one chunk of "
                      "`qsa_select_paged_tokens`)")
    columns: int = Field(gt=0, description="bucket: the logits' width (`max_seq_len // R`, else the page table's "
                         "capacity)")
    candidate: str = Field(description="the top-k candidate timed, part of the exact key")
    plan: str = Field("", validate_default=True, description="which of the candidate's plans was timed (part of "
                      "the exact key); empty for a candidate with one")
    us: Optional[float] = Field(None, gt=0, description="the measured time in µs, the expansion fused (as "
                                "`qsa_select_paged_tokens` runs the step); required where `measured` is 1")
    measured: bool = Field(description="1: measured by the tuner on that arch, and only then does the row decide "
                           "anything; 0: a report from elsewhere, read and validated but unused")
    source: str = Field("", description="where the row comes from (the tuner writes its command and work points)")

    @field_validator("candidate")
    @classmethod
    def _known_candidate(cls, value: str) -> str:
        known = topk_candidate_plans()
        if value not in known:
            raise ValueError(f"unknown top-k candidate {value!r} (candidates with tuned rows: {', '.join(known)})")
        return value

    @field_validator("plan")
    @classmethod
    def _plan_of_the_candidate(cls, value: str, info: ValidationInfo) -> str:
        candidate = info.data.get("candidate")
        if candidate is None:  # the candidate's own error is reported
            return value
        plans = topk_candidate_plans()[candidate]
        if not plans and value:
            raise ValueError(f"the {candidate} top-k has one plan: leave the cell empty (got {value!r})")
        if plans and value not in plans:
            raise ValueError((f"{value!r} is not a plan of the {candidate} top-k" if value else
                              f"a {candidate} row names its plan") + f" (plans: {', '.join(plans)})")
        return value

    @field_validator("measured")
    @classmethod
    def _measured_rows_have_a_time(cls, value: bool, info: ValidationInfo) -> bool:
        if value and "us" in info.data and info.data["us"] is None:  # (a bad us cell is reported as such)
            raise ValueError("a measured row (measured=1) gives its time in the us column")
        return value

    def key(self) -> tuple:
        """What rows are grouped by for a lookup: arch, block_topk, candidate."""
        return self.arch, self.block_topk, self.candidate


def topk_columns_table() -> str:
    """Markdown rows of the top-k table's columns, from ``TopkRow`` (with the candidates and their plans that a row
    may name): docs/jit_and_configs.md shows it (tests/runtime/test_tuned.py checks that it is there, as generated)."""
    plans = topk_candidate_plans()
    named = {
        "candidate": ": " + ", ".join(f"`{name}`" for name in plans),
        "plan": " (" + "; ".join(f"{name}: " + (", ".join(f"`{p}`" for p in names) if names else "empty")
                                 for name, names in plans.items()) + ")",
    }
    rows = ["| column | meaning |", "|---|---|"]
    for name, item in TopkRow.model_fields.items():
        rows.append(f"| `{name}` | {item.description}{named.get(name, '')} |")
    return "\n".join(rows)


@dataclass(frozen=True)
class TableKind:
    """One kind of tuned table: its row model, the columns that identify a row (a later row with the same ones
    replaces it) and, of those, its buckets; ``extra``: the optional columns, as an error message lists them."""

    name: str
    model: type[BaseModel]
    key_fields: tuple[str, ...]
    bucket_fields: tuple[str, ...]
    extra: str

    @property
    def required(self) -> tuple[str, ...]:
        """The columns a header must name."""
        return tuple(name for name, item in self.model.model_fields.items() if item.is_required())

    def identity(self, row) -> tuple:
        """The identifying columns' values of ``row`` (a model or a dict of cells, read as text)."""
        if isinstance(row, dict):
            return tuple(str(row.get(name, "")) for name in self.key_fields + self.bucket_fields)
        return tuple(getattr(row, name) for name in self.key_fields + self.bucket_fields)


SCORING_TABLE = TableKind("scoring", TunedRow, KEY_FIELDS, BUCKET_FIELDS, "any of the tile fields, us, default_us, "
                          "source")
TOPK_TABLE = TableKind("top-k", TopkRow, ("arch", "block_topk", "candidate", "plan"), ("rows", "columns"),
                       "any of plan, us, source")
#: The column that makes a file a top-k table.
TOPK_MARK = "candidate"


def topk_bucket_distance(rows: int, columns: int, problem) -> tuple[float, int, int]:
    """How far the (``rows``, ``columns``) bucket is from a top-k ``problem``'s (``rows``, ``columns``): the sum of the
    log2 ratios, then the bucket itself (equal distances: the smaller bucket)."""
    want_rows, want_columns = max(problem.rows, 1), max(problem.columns, 1)
    return abs(math.log2(rows / want_rows)) + abs(math.log2(columns / want_columns)), rows, columns


def check_header(path: Path, columns: list[str] | None) -> TableKind:
    """The kind of table whose header ``columns`` is (None for an empty file): a top-k table where it names
    ``TOPK_MARK``, else a scoring table; ``ValueError`` naming ``path`` unless it names every required column of its
    kind and no column that kind's rows lack. A file that is not such a CSV at all (a one-line text file reads as a
    header without rows) is refused here rather than read as an empty table."""
    if not columns:
        raise ValueError(f"{path}: empty; a tuned table starts with a header line naming its columns "
                         f"({', '.join(REQUIRED_COLUMNS)}, ...; a top-k table's: {', '.join(TOPK_TABLE.required)}, "
                         "...)")
    names = [name.strip() for name in columns]
    kind = TOPK_TABLE if TOPK_MARK in names else SCORING_TABLE
    unknown = [name for name in names if name not in kind.model.model_fields]
    missing = [name for name in kind.required if name not in names]
    if unknown or missing:
        found = (f"unknown column(s) {', '.join(repr(n) for n in unknown)}" if unknown else "") + (
            "; " if unknown and missing else "") + (f"missing column(s) {', '.join(missing)}" if missing else "")
        if kind is TOPK_TABLE:
            raise ValueError(f"{path}:1: not a top-k tuned-table header: {found} (a top-k table's header names "
                             f"{', '.join(kind.required)} and {kind.extra})")
        raise ValueError(f"{path}:1: not a tuned-table header: {found} (a header names {', '.join(REQUIRED_COLUMNS)} "
                         f"and {kind.extra}; a top-k table's names {', '.join(TOPK_TABLE.required)} and "
                         f"{TOPK_TABLE.extra})")
    return kind


def read_table(path: Path) -> list:
    """The rows of one CSV file (``TunedRow``s, or ``TopkRow``s for a top-k table: ``check_header``). A file whose
    first line is not a tuned table's header, or a malformed row, raises ``ValueError`` naming the file and line
    (and the column)."""
    rows = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(line for line in handle)
        kind = check_header(path, reader.fieldnames)
        for record in reader:
            line = reader.line_num
            values = {k.strip(): (v.strip() if isinstance(v, str) else v) for k, v in record.items() if k is not None}
            if None in record:
                raise ValueError(f"{path}:{line}: more cells than the header has columns")
            values = {k: v for k, v in values.items() if v not in ("", None)}
            try:
                row = kind.model(**values)
            except ValidationError as err:
                problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'row'}: {e['msg']}"
                                     for e in err.errors())
                raise ValueError(f"{path}:{line}: {problems}") from None
            if kind is SCORING_TABLE:
                _check_tile(path, line, row)
            rows.append(row)
    return rows


def _check_tile(path: Path, line: int, row) -> None:
    """A scoring row's tile: only settings of its kernel, and a register cap only on NVIDIA archs."""
    tile = row.tile()
    misplaced = [name for name in TILE_FIELDS if getattr(row, name) is not None and name not in tile]
    if misplaced:
        raise ValueError(f"{path}:{line}: {', '.join(misplaced)} is not a setting of the {row.kernel} kernel")
    if tile.get("max_registers") and not row.arch.startswith("sm_"):
        raise ValueError(f"{path}:{line}: max_registers (ptxas's register cap) applies to NVIDIA archs "
                         f"(sm_*) only, not {row.arch}")


class TunedTable:
    """The merged rows of the shipped tables and the files ``files``, by key: the scoring rows (``rows``) and the
    top-k rows (``topk``, by ``TopkRow.key()``). ``KernelSpec.plan``, which looks scoring rows up, is memoised, and so
    are the top-k decisions made from these: a lookup is made once per new problem."""

    def __init__(self, files: tuple[str, ...], rows: dict[tuple, list[TunedRow]],
                 topk: dict[tuple, list[TopkRow]] | None = None):
        self.files = files
        self.rows = rows
        self.topk = topk or {}

    def lookup(self, arch: str, kernel: str, problem) -> TunedRow | None:
        """The row for ``problem`` on ``arch``: exact key, nearest (rows, context) bucket; None when the key has
        none."""
        rows = self.rows.get(problem_key(arch, kernel, problem))
        if not rows:
            return None
        return min(rows, key=lambda row: bucket_distance(row.rows, row.context, problem))

    def get(self, key: tuple, default=None):
        return self.rows.get(key, default)

    def measured_topk(self, arch: str, candidate: str, problem) -> list[TopkRow]:
        """The measured rows (``measured=1``) of top-k ``candidate`` on ``arch`` for ``problem`` (anything with
        ``rows``, ``columns`` and ``block_topk``): those at the (rows, columns) bucket nearest the problem's among
        them, one per plan, fastest first (equal times: by plan name); empty where the
        candidate has none for that arch and ``block_topk``."""
        rows = [row for row in self.topk.get((arch, problem.block_topk, candidate), ()) if row.measured]
        if not rows:
            return []
        nearest = min(((row.rows, row.columns) for row in rows),
                      key=lambda bucket: topk_bucket_distance(*bucket, problem))
        return sorted((row for row in rows if (row.rows, row.columns) == nearest), key=lambda row: (row.us, row.plan))


@functools.lru_cache(maxsize=8)
def load_tables(extra: tuple[str, ...]) -> TunedTable:
    """Shipped rows, then the rows of ``extra`` files (same key and buckets: the later row wins), by key; each file
    is a scoring or a top-k table by its header (``check_header``)."""
    merged: dict[tuple, TunedRow] = {}
    merged_topk: dict[tuple, TopkRow] = {}
    shipped = [CONFIG_DIR / name for name in SHIPPED]
    for path in shipped + [Path(p) for p in extra]:
        # Errors name the variable (or the shipped file) and are ConfigurationErrors: never a kernel failure.
        where = ("shipped tuned table" if path in shipped
                 else f"environment variable QSA_AITER_TUNED_CONFIG={':'.join(extra)!r} is invalid:")
        if not path.is_file():
            if path in shipped:
                continue  # a source checkout without configs/: nothing shipped
            raise ConfigurationError(f"{where} {path} is not a file")
        try:
            rows = read_table(path)
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise ConfigurationError(f"{where} {err}") from None
        for row in rows:
            if isinstance(row, TopkRow):
                merged_topk[TOPK_TABLE.identity(row)] = row
            else:
                merged[row.key() + (row.rows, row.context)] = row
    table: dict[tuple, list[TunedRow]] = {}
    for row in merged.values():
        table.setdefault(row.key(), []).append(row)
    topk: dict[tuple, list[TopkRow]] = {}
    for row in merged_topk.values():
        topk.setdefault(row.key(), []).append(row)
    return TunedTable(extra, table, topk)


def reload() -> None:
    """Forget the tables read and the lookups made from them (after a table file was rewritten), and the dispatch
    decisions and call plans made with them (a measured row may choose another candidate or plan)."""
    from . import dispatch  # the dispatcher is built over this module: its memo is cleared, not imported at load

    load_tables.cache_clear()
    dispatch.clear_decisions()  # the call plans (replay) with them

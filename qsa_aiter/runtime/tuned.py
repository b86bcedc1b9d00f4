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
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from . import replay
from ..kernels.catalog import timed_native_specs, tunable_specs
from .settings import ConfigurationError

#: The shipped tables: the package's ``configs`` (in a source checkout a link to the top-level ``configs/``, their
#: source; a wheel carries the files themselves). Read only: tuned rows of one's own go to files of one's own.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = ("scoring.csv",)


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


def check_header(path: Path, columns: list[str] | None) -> None:
    """``ValueError`` naming ``path`` unless ``columns`` (its header, None for an empty file) is a tuned table's: every
    ``REQUIRED_COLUMNS`` name and no name that is not a ``TunedRow`` column. A file that is not such a CSV at all (a
    one-line text file reads as a header without rows) is refused here rather than read as an empty table."""
    if not columns:
        raise ValueError(f"{path}: empty; a tuned table starts with a header line naming its columns "
                         f"({', '.join(REQUIRED_COLUMNS)}, ...)")
    names = [name.strip() for name in columns]
    unknown = [name for name in names if name not in TunedRow.model_fields]
    missing = [name for name in REQUIRED_COLUMNS if name not in names]
    if unknown or missing:
        found = (f"unknown column(s) {', '.join(repr(n) for n in unknown)}" if unknown else "") + (
            "; " if unknown and missing else "") + (f"missing column(s) {', '.join(missing)}" if missing else "")
        raise ValueError(f"{path}:1: not a tuned-table header: {found} (a header names {', '.join(REQUIRED_COLUMNS)} "
                         "and any of the tile fields, us, default_us, source)")


def read_table(path: Path) -> list[TunedRow]:
    """The rows of one CSV file. A file whose first line is not a tuned table's header, or a malformed row, raises
    ``ValueError`` naming the file and line."""
    rows = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(line for line in handle)
        check_header(path, reader.fieldnames)
        for record in reader:
            line = reader.line_num
            values = {k.strip(): (v.strip() if isinstance(v, str) else v) for k, v in record.items() if k is not None}
            if None in record:
                raise ValueError(f"{path}:{line}: more cells than the header has columns")
            values = {k: v for k, v in values.items() if v not in ("", None)}
            try:
                row = TunedRow(**values)
            except ValidationError as err:
                problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'row'}: {e['msg']}"
                                     for e in err.errors())
                raise ValueError(f"{path}:{line}: {problems}") from None
            tile = row.tile()
            misplaced = [name for name in TILE_FIELDS if getattr(row, name) is not None and name not in tile]
            if misplaced:
                raise ValueError(f"{path}:{line}: {', '.join(misplaced)} is not a setting of the {row.kernel} kernel")
            if tile.get("max_registers") and not row.arch.startswith("sm_"):
                raise ValueError(f"{path}:{line}: max_registers (ptxas's register cap) applies to NVIDIA archs "
                                 f"(sm_*) only, not {row.arch}")
            rows.append(row)
    return rows


class TunedTable:
    """The merged rows of the shipped tables and the files ``files``, by key (``KernelSpec.plan``, which looks rows
    up, is memoised: a lookup is made once per new problem)."""

    def __init__(self, files: tuple[str, ...], rows: dict[tuple, list[TunedRow]]):
        self.files = files
        self.rows = rows

    def lookup(self, arch: str, kernel: str, problem) -> TunedRow | None:
        """The row for ``problem`` on ``arch``: exact key, nearest (rows, context) bucket; None when the key has
        none."""
        rows = self.rows.get(problem_key(arch, kernel, problem))
        if not rows:
            return None
        return min(rows, key=lambda row: bucket_distance(row.rows, row.context, problem))

    def get(self, key: tuple, default=None):
        return self.rows.get(key, default)


@functools.lru_cache(maxsize=8)
def load_tables(extra: tuple[str, ...]) -> TunedTable:
    """Shipped rows, then the rows of ``extra`` files (same key and buckets: the later row wins), by key."""
    merged: dict[tuple, TunedRow] = {}
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
            merged[row.key() + (row.rows, row.context)] = row
    table: dict[tuple, list[TunedRow]] = {}
    for row in merged.values():
        table.setdefault(row.key(), []).append(row)
    return TunedTable(extra, table)


def reload() -> None:
    """Forget the tables read and the lookups made from them (after a table file was rewritten), and the call plans
    made with them."""
    load_tables.cache_clear()
    replay.clear()

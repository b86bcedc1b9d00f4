"""Writing rows into a tuned table (``configs/*.csv`` format, ``runtime/tuned.py``): what the tuner (both its
scoring and its top-k mode) and the static model share."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from ..runtime import tuned


def row_key(row: dict, kind: tuned.TableKind = tuned.SCORING_TABLE) -> tuple:
    """What identifies a row of a tuned table of ``kind`` (its key and bucket columns, as text): a row with the same
    one replaces it."""
    return kind.identity(row)


def check_kind(path: Path, kind: tuned.TableKind) -> None:
    """``ValueError`` naming ``path`` where it is a table of another kind than ``kind`` (by its header:
    ``tuned.check_header``'s rule); a missing or empty file takes any rows."""
    if not path.is_file():
        return
    with open(path, newline="") as handle:
        header = next(csv.reader(handle), None)
    if header and (tuned.TOPK_MARK in [name.strip() for name in header]) != (kind is tuned.TOPK_TABLE):
        raise ValueError(f"{path} is not a {kind.name} table: {kind.name} rows cannot go there")


def merge_rows(path: Path, rows: list[dict], kind: tuned.TableKind = tuned.SCORING_TABLE) -> None:
    """Write ``rows`` into the table of ``kind`` at ``path``: a row with the same key and buckets as an existing one
    replaces it, the others are appended; the file is written whole (header, then rows; the file's column order is
    kept, with the columns it lacked that ``rows`` fill after them), so a re-tune changes only the rows it measured.
    An existing file of another kind is refused (``check_kind``)."""
    check_kind(path, kind)
    fields = list(kind.model.model_fields)
    existing = []
    if path.exists():
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            existing = [{k: v for k, v in r.items() if k in fields} for r in reader]
            header = [k for k in reader.fieldnames or () if k in fields]
        fields = header + [k for k in fields if k not in header and any(r.get(k) not in (None, "") for r in rows)]

    replaced = {row_key(r, kind): r for r in rows}
    out = [replaced.pop(row_key(r, kind), r) for r in existing] + list(replaced.values())
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, lineterminator="\n")  # the shipped tables' endings
        writer.writeheader()
        for r in out:
            writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in fields})
    os.replace(tmp, path)
    tuned.reload()

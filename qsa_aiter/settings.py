"""Environment switches of qsa_aiter, validated with pydantic-settings.

This module is the only reader of the library's environment variables. Values are parsed at first use (never at
import) and re-parsed whenever one of the variables changes, so a test or an engine that flips a variable sees the new
behaviour on the next call. A bad value raises ``ValueError`` naming the variable, the value and what is allowed.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_WORDS = _TRUE + _FALSE

#: Kernel names that ``QSA_AITER_BACKEND`` may force (besides ``auto``). Kept here, not imported from the registry,
#: so that reading settings never imports Triton.
BACKEND_NAMES = ("rowwise", "stacked", "tiled", "torch")


def _parse_bool(value: object) -> object:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"allowed: {'/'.join(BOOL_WORDS)} (any case)")


class QsaSettings(BaseSettings):
    """Every environment variable qsa_aiter reads. Field aliases are the variable names."""

    model_config = SettingsConfigDict(frozen=True, extra="ignore", populate_by_name=True, case_sensitive=True)

    stacked_decode_scorer: bool = Field(
        True,
        alias="ATOM_QSA_STACKED_DECODE_SCORER",
        description="0 sends MTP verify and draft rows to the row-wise CUDA-core scorer instead of the stacked one.",
    )
    backend: str = Field(
        "auto",
        alias="QSA_AITER_BACKEND",
        description="`auto`, or one kernel name (" + ", ".join(BACKEND_NAMES) + ") forced for every phase.",
    )
    strict: bool = Field(
        False,
        alias="QSA_AITER_STRICT",
        description="1 raises a kernel's compile or launch error instead of falling back to the next candidate.",
    )
    fp8_mma: bool = Field(
        True,
        alias="QSA_AITER_FP8_MMA",
        description="1 lets the stacked scorer read an e4m3fn cache with e4m3 tensor-core MMAs (bf16 q split into two "
        "exact e4m3 terms; the tensor cores round inside their sums: up to 3.2e-4 of sum(|q||k|)/divisor measured "
        "on the H200); 0 decodes the keys to bf16 in registers (exact fp32 sums, slower).",
    )
    tuned_config: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        alias="QSA_AITER_TUNED_CONFIG",
        description="`:`-separated CSV files of tuned tile configs, read after the shipped `configs/` tables; their "
        "rows replace shipped rows with the same key and buckets (docs/jit_and_configs.md).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "warning",
        alias="QSA_AITER_LOG_LEVEL",
        description="Level of the `qsa_aiter` logger; `info` logs each new dispatch decision once.",
    )

    @field_validator("stacked_decode_scorer", "strict", "fp8_mma", mode="before")
    @classmethod
    def _strict_bool(cls, value: object) -> object:
        return _parse_bool(value)

    @field_validator("backend", mode="before")
    @classmethod
    def _known_backend(cls, value: object) -> object:
        text = str(value).strip().lower()
        if text != "auto" and text not in BACKEND_NAMES:
            raise ValueError("allowed: auto, " + ", ".join(BACKEND_NAMES))
        return text

    @field_validator("tuned_config", mode="before")
    @classmethod
    def _split_paths(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part for part in value.split(":") if part.strip())
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_level(cls, value: object) -> object:
        return str(value).strip().lower()


ENV_NAMES = tuple(field.alias for field in QsaSettings.model_fields.values())

_cache: tuple[tuple[str | None, ...], QsaSettings] | None = None


def get_settings() -> QsaSettings:
    """The current settings; re-parsed only when one of the variables changed (a dict lookup per variable)."""
    global _cache
    snapshot = tuple(os.environ.get(name) for name in ENV_NAMES)
    if _cache is not None and _cache[0] == snapshot:
        return _cache[1]
    try:
        settings = QsaSettings()
    except ValidationError as err:
        raise ValueError(_explain_error(err)) from None
    _cache = (snapshot, settings)
    return settings


def _explain_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        name = item["loc"][0] if item["loc"] else "?"
        field = QsaSettings.model_fields.get(str(name))
        var = field.alias if field is not None else str(name)
        raw = os.environ.get(var, item.get("input"))
        msg = item["msg"].removeprefix("Value error, ")
        lines.append(f"environment variable {var}={raw!r} is invalid: {msg}")
    return "; ".join(lines)


def environment_table() -> str:
    """Markdown rows (variable, default, meaning) generated from the settings model, for the docs."""
    rows = ["| variable | default | effect |", "|---|---|---|"]
    for field in QsaSettings.model_fields.values():
        default = field.default
        if isinstance(default, bool):
            default = int(default)
        elif isinstance(default, tuple):
            default = ":".join(default)
        shown = f"`{default}`" if default != "" else "(none)"
        rows.append(f"| `{field.alias}` | {shown} | {field.description} |")
    return "\n".join(rows)

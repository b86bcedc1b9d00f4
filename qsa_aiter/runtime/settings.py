"""Environment switches of qsa_aiter, validated with pydantic-settings.

This module is the only reader of the library's environment variables. Values are parsed at first use (never at
import) and re-parsed whenever one of the variables changes, so a test or an engine that flips a variable sees the new
behaviour on the next call. A bad value raises ``ConfigurationError`` (a ``ValueError``) naming the variable, the
value and what is allowed.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
BOOL_WORDS = _TRUE + _FALSE

LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigurationError(ValueError):
    """A bad environment variable or tuned-config file. Raised at the first call that reads it, on every path, and
    never absorbed by the registry's fallback: the fallback is for kernels that fail to compile or launch."""


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

    model_config = SettingsConfigDict(frozen=True, extra="ignore", case_sensitive=True)

    stacked_decode_scorer: bool = Field(
        True,
        alias="ATOM_QSA_STACKED_DECODE_SCORER",
        description="0 sends MTP verify and draft rows to the row-wise CUDA-core scorer instead of the stacked ones "
        "(`stacked`, `keys_major`).",
    )
    rocm_qsa_flydsl: bool = Field(
        False,
        alias="ROCM_QSA_FLYDSL",
        validation_alias=AliasChoices("ROCM_QSA_FLYDSL", "VLLM_ROCM_QSA_FLYDSL"),  # the name vLLM uses
        description="1 lets the FlyDSL prefill scorer and AITER's FlyDSL fused selection (`flydsl_k1`: scores and "
        "selects block ids in one pass, our expansion turns them into tokens) serve on gfx942/gfx950 where their "
        "modules import and the shape is served (docs/integration.md, docs/selection.md).",
    )
    backend: str = Field(
        "auto",
        alias="QSA_AITER_BACKEND",
        description="`auto`, or the name of one registry candidate (a scoring kernel, `torch`, `aiter`, `flydsl`; "
        "`python -m qsa_aiter explain` lists them) forced for every phase. The registry checks the name at the first "
        "scoring call (reading settings imports no kernels).",
    )
    topk_backend: str = Field(
        "auto",
        alias="QSA_AITER_TOPK_BACKEND",
        description="`auto`, or the name of one top-k candidate (`triton`, `native`, `native_grid`, `aiter`, "
        "`torch`; `qsa_aiter.explain_selection` lists them) forced for the top-k step of selection, whatever the "
        "tuned top-k table measured. `native` is the CUDA top-k compiled at run time by NVRTC, which `auto` takes on "
        "NVIDIA GPUs where no measured row says otherwise; `native_grid` the grid select (a row split across the CTAs "
        "of one cooperative grid). Checked at the first top-k call; forcing a candidate that cannot serve the call is "
        "an error naming its reasons.",
    )
    select_backend: str = Field(
        "auto",
        alias="QSA_AITER_SELECT_BACKEND",
        description="`auto`, or the name of one selection candidate (`composite`: scoring, then the top-k, then the "
        "expansion, each chosen by its own registry; `flydsl_k1`: AITER's FlyDSL fused selection, which needs "
        "`ROCM_QSA_FLYDSL=1`; `native_fused`: the native fused selection, one launch on NVIDIA GPUs) "
        "forced for `qsa_select_paged_tokens`. Checked at the first selection call; forcing a "
        "candidate that cannot serve the call is an error naming its reasons.",
    )
    topk_pdl: bool = Field(
        False,
        alias="QSA_AITER_TOPK_PDL",
        description="1 launches the native top-k (compute capability 9.0+) as a programmatic dependent of the kernel "
        "before it on the stream (in `qsa_select_paged_tokens`, the scorer): its CTAs may start while that kernel "
        "finishes, and wait for it before their first global read (docs/selection.md).",
    )
    strict: bool = Field(
        False,
        alias="QSA_AITER_STRICT",
        description="1 raises a kernel's compile or launch error instead of falling back to the next candidate.",
    )
    e4m3_mma: bool = Field(
        True,
        alias="QSA_AITER_E4M3_MMA",
        validation_alias=AliasChoices("QSA_AITER_E4M3_MMA", "QSA_AITER_FP8_MMA"),  # its former name (FORMER_NAMES)
        description="1 lets the MFMA/tensor-core scorers (`stacked`, `keys_major`, `tiled`'s keys-major tiles) read "
        "quantised caches with the GPU's low-precision matrix instructions as stored: e4m3fn on NVIDIA 8.9+ and "
        "gfx950, e4m3fnuz on gfx942, MXFP4 as exact e4m3 bytes one MMA step per 32-element block (NVIDIA) or with "
        "gfx950's block-scaled MFMAs (bf16 q split into two exact e4m3 terms; the instructions round inside their "
        "sums: up to 3.2e-4 of sum(|q||k|)/divisor measured on the H200 for fp8); 0 decodes the keys to bf16 in "
        "registers (exact fp32 sums, slower).",
    )
    tuned_config: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        alias="QSA_AITER_TUNED_CONFIG",
        description="`:`-separated CSV files of tuned tile configs, or of top-k rows (a header naming `candidate`), "
        "read after the shipped `configs/` tables; their rows replace shipped rows with the same key and buckets, "
        "and their measured times take part in choosing the kernel, the top-k and the native top-k's plan "
        "(docs/jit_and_configs.md).",
    )
    log_level: Literal[LOG_LEVELS] = Field(
        "warning",
        alias="QSA_AITER_LOG_LEVEL",
        description="Level of the `qsa_aiter` logger; `info` logs each new dispatch decision once.",
    )
    jit_dir: str = Field(
        "",
        alias="QSA_AITER_JIT_DIR",
        description="Directory of the compiled-kernel cache, Triton and native (NVRTC) entries alike "
        "(docs/jit_and_configs.md); empty: `jit/` of a source checkout where it is writable, else "
        "`~/.cache/qsa_aiter/jit`.",
    )
    rebuild: bool = Field(
        False,
        alias="QSA_AITER_REBUILD",
        description="1 ignores the compiled kernels cached in the JIT directory (Triton and native entries): each "
        "variant is compiled again when next launched or warmed up, and its entry replaced (once, however many "
        "processes ask for it).",
    )
    hip_clang: str = Field(
        "",
        alias="QSA_AITER_HIP_CLANG",
        description="The clang that builds AMD code objects of the native kernels offline (`warmup --arch gfx942` / "
        "`gfx950`, `native-resources`, on a machine without the GPU); empty: `clang` in `llvm-config-22 --bindir`, else `clang-22` or "
        "`clang` on the PATH.",
    )
    hip_sdk: str = Field(
        "",
        alias="QSA_AITER_HIP_SDK",
        description="The directory with the HIP headers (`include/hip/hip_runtime.h`) and the AMDGPU device bitcode "
        "(`amdgcn/bitcode`) that offline clang builds use; empty: `${HIP_COMPILE_HOME:-${TMPDIR:-/tmp}/hip-compile}"
        "/sdk` (where the project's `.ci/amd-toolchain.sh` unpacks them), else `$ROCM_PATH`, else `/opt/rocm`.",
    )
    logits_workspace_mb: int = Field(
        0,
        alias="QSA_AITER_LOGITS_WORKSPACE_MB",
        description="Bound, in MiB (2**20 bytes), on the fp32 logits one chunk of rows of `qsa_select_paged_tokens` "
        "may hold when the call gives no `logits_workspace_bytes`; 0: sized from the device (on a GPU min(total "
        "memory / 16, 2 GiB), else 128 MiB; docs/selection.md). The argument, when given, wins.",
    )

    @field_validator("stacked_decode_scorer", "strict", "e4m3_mma", "rocm_qsa_flydsl", "rebuild", "topk_pdl",
                     mode="before")
    @classmethod
    def _strict_bool(cls, value: object) -> object:
        return _parse_bool(value)

    @field_validator("backend", "topk_backend", "select_backend", mode="before")
    @classmethod
    def _backend_name(cls, value: object) -> object:
        text = str(value).strip().lower()
        if not text.replace("_", "").isalnum():
            raise ValueError("allowed: auto, or one candidate name (python -m qsa_aiter explain lists them)")
        return text

    @field_validator("tuned_config", mode="before")
    @classmethod
    def _split_paths(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part for part in value.split(":") if part.strip())
        return value

    @field_validator("logits_workspace_mb", mode="before")
    @classmethod
    def _mebibytes(cls, value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        text = str(value).strip()
        if not text.isdigit() or not text.isascii():
            raise ValueError("allowed: 0 (sized from the device) or a whole number of MiB, such as 2048")
        return int(text)

    @field_validator("log_level", mode="before")
    @classmethod
    def _known_level(cls, value: object) -> object:
        text = str(value).strip().lower()
        if text not in LOG_LEVELS:
            raise ValueError("allowed: " + ", ".join(LOG_LEVELS) + " (any case)")
        return text

    @field_validator("jit_dir", mode="before")
    @classmethod
    def _directory(cls, value: object) -> object:
        text = str(value).strip()
        if not text:
            return text
        path = os.path.expanduser(text)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError("allowed: a directory, or a path where one can be created (this names a file)")
        if not os.path.exists(path):
            # An existing directory serves its cached kernels even when read-only; a missing one must be creatable.
            blocker = _uncreatable_because(path)
            if blocker:
                raise ValueError(f"allowed: a directory, or a path where one can be created ({blocker})")
        return text


def _uncreatable_because(path: str) -> str:
    """Why directory ``path`` (which does not exist) cannot be created ('' when it can): its nearest existing ancestor
    is a file, or no file can be made in it. A real probe, as permission bits say nothing for root, on a read-only
    mount or under ``/proc``."""
    ancestor = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return f"{ancestor} is a file"
    try:
        with tempfile.NamedTemporaryFile(dir=ancestor, prefix=".qsa_aiter_probe"):
            return ""
    except OSError as err:
        return f"it does not exist, and no file can be created in {ancestor}: {err.strerror or err}"


ENV_NAMES = tuple(field.alias for field in QsaSettings.model_fields.values())
#: Second names a variable is also read under (alias -> the field's variable), from the fields' validation aliases.
ENV_ALIASES = {choice: field.alias for field in QsaSettings.model_fields.values()
               if isinstance(field.validation_alias, AliasChoices)
               for choice in field.validation_alias.choices if choice != field.alias}
#: Every variable read: the fields' names and their aliases.
ENV_VARIABLES = ENV_NAMES + tuple(ENV_ALIASES)
#: Former names of renamed variables (former name -> current name): still read, as aliases of the current name (an
#: ``AliasChoices`` entry of the field), with a ``FutureWarning`` that says to set the current name instead.
FORMER_NAMES = {"QSA_AITER_FP8_MMA": "QSA_AITER_E4M3_MMA"}

_cache: tuple[tuple, QsaSettings] | None = None


def _environment_snapshot():
    """A function returning the variables' current raw values, as cheaply as this platform allows: ``os.environ``
    keeps them in a plain dict of encoded keys (``_data``, updated by every ``os.environ`` write, ``setenv`` and
    ``patch.dict`` included), read directly where it exists, since ``os.environ.get`` encodes and decodes every
    name on every call and the ops read the settings on every call."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and callable(encode):
        keys = tuple(encode(name) for name in ENV_VARIABLES)
        return lambda: tuple(map(data.get, keys))
    return lambda: tuple(map(os.environ.get, ENV_VARIABLES))


_snapshot = _environment_snapshot()


def get_settings() -> QsaSettings:
    """The current settings; re-parsed only when one of the variables changed (a dict lookup per variable)."""
    global _cache
    snapshot = _snapshot()
    if _cache is not None and _cache[0] == snapshot:
        return _cache[1]
    _check_aliases()
    _warn_former_names()
    try:
        settings = QsaSettings()
    except ValidationError as err:
        raise ConfigurationError(_explain_error(err)) from None
    _cache = (snapshot, settings)
    return settings


def _check_aliases() -> None:
    """A variable set under both of its names must say the same thing; otherwise which one wins would be a guess."""
    for alias, name in ENV_ALIASES.items():
        if alias in os.environ and name in os.environ:
            values = {}
            for var in (name, alias):
                try:
                    values[var] = _parse_bool(os.environ[var])
                except ValueError as err:
                    raise ConfigurationError(
                        f"environment variable {var}={os.environ[var]!r} is invalid: {err}") from None
            if values[name] != values[alias]:
                raise ConfigurationError(f"environment variables {name}={os.environ[name]!r} and "
                                         f"{alias}={os.environ[alias]!r} disagree; set one of them")


def _warn_former_names() -> None:
    """A ``FutureWarning`` for each former variable name that is set. The text names no value, so Python's default
    filter shows it once per process however often the settings are parsed again."""
    for former, name in FORMER_NAMES.items():
        if former in os.environ:
            warnings.warn(f"environment variable {former} was renamed {name}; {former} is still read as {name}, "
                          f"set {name} instead", FutureWarning, stacklevel=1)


def _explain_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        name = item["loc"][0] if item["loc"] else "?"
        field = QsaSettings.model_fields.get(str(name))
        var = field.alias if field is not None else str(name)
        if var not in os.environ:  # the value came from an alias: name the variable that holds it
            var = next((a for a, n in ENV_ALIASES.items() if n == var and a in os.environ), var)
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
        names = " or ".join([f"`{field.alias}`"] + [f"`{a}`" for a, n in ENV_ALIASES.items()
                                                   if n == field.alias and a not in FORMER_NAMES])
        former = [f"`{a}`" for a, n in FORMER_NAMES.items() if n == field.alias]
        if former:
            names += f" (formerly {' or '.join(former)})"
        rows.append(f"| {names} | {shown} | {field.description} |")
    return "\n".join(rows)

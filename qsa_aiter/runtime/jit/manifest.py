"""The manifest of one ``triton-<version>/<arch>/`` directory of the JIT cache (pydantic models, validated on read).

One entry per variant: kernel, constexprs, Triton's keys, the files of its Triton cache group with size and sha256,
compile seconds, date. A variant is one Triton specialisation of one of this library's kernels: the kernel, its
constexprs, what Triton derives from the other arguments (pointer dtypes and 16-byte alignment; integers equal to 1,
divisible by 16 or neither), the launch options (warps, stages), the GPU arch and the Triton version.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

FORMAT = 1


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class FileRecord(BaseModel):
    """One file of an entry's Triton cache group."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Entry(BaseModel):
    """One compiled variant."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kernel: str = Field(description="kernel module: rowwise, stacked, keys_major, tiled, cache_writer, topk, expand")
    function: str = Field(description="module-qualified name of the @triton.jit function")
    constexprs: dict[str, Any] = Field(description="constexpr (and value-specialised) arguments by name")
    options: dict[str, Any] = Field(description="launch options: num_warps, num_stages, and maxnreg where a config "
                                                 "caps registers")
    arguments: dict[str, str] = Field(description="the other arguments as Triton specialised them: type, `%16` for an "
                                                  "integer divisible by 16, `unaligned` for a pointer that is not "
                                                  "16-byte aligned")
    runtime_key: str = Field(description="Triton's in-memory key of the specialisation (argument kinds, options)")
    specialization: str = Field(description="Triton's specialisation data (JSON): signature, constants, attributes, "
                                            "options; enough to rebuild the variant")
    group: str = Field(description="Triton's cache group: the directory under triton/ holding the files")
    metadata: str = Field(description="file name of Triton's metadata of the build")
    binary: str = Field(description="file name of the binary (cubin, hsaco)")
    files: dict[str, FileRecord]
    sources: str = Field(description="kernel_sources_hash() of the sources it was built from")
    triton_env: dict[str, str] = Field(description="Triton's cache-invalidating environment variables at build")
    built_by: Literal["launch", "target"] = Field(description="compiled at a launch on the GPU, or for a named arch")
    compile_seconds: float = Field(ge=0)
    date: datetime

    def summary(self) -> str:
        """``K=V`` of its constexprs and options, and its integer arguments specialised as multiples of 16."""
        parts = [f"{k}={v}" for k, v in self.constexprs.items()]
        parts += [f"{k}={v}" for k, v in self.options.items()]
        parts += [f"{k}%16" for k, v in self.arguments.items() if v.endswith("%16") and not v.startswith("*")]
        return " ".join(parts)

    def argument_types(self) -> str:
        """``name:type`` of every other argument as Triton specialised it (``*bf16``, ``*i64 unaligned``, ``i32%16``
        ...): what tells apart two variants whose constexprs and options are the same (a bf16 and an fp16 cache,
        int32 and int64 metadata)."""
        return " ".join(f"{k}:{v.replace(' ', '-')}" for k, v in self.arguments.items())


class Manifest(BaseModel):
    """What one ``triton-<version>/<arch>/`` directory holds."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = FORMAT
    arch: str
    triton_version: str
    entries: dict[str, Entry] = Field(default_factory=dict)


class EntryUnusable(Exception):
    """An entry that cannot be used as it is (corrupt or stale); the message says why."""


"""One declaration per native kernel family, in the spirit of ``KernelSpec`` (``spec.py``): what its kernels are,
where their source is, how each is compiled for each target, its parameters (one list, from which the launch
arguments, the pointer names and the emulator's binding are derived), why it does not serve a problem and how it
plans a launch. Pure Python: no compiler, no driver (``runtime/jit`` compiles, caches, loads and launches).

Targets (``target_of``): NVIDIA ``sm_XY`` archs, compiled at run time by NVRTC (warp width 32), and the AMD
Instinct archs ``gfx942`` (MI300X / MI325X) and ``gfx950`` (MI355X), compiled by hipRTC on a ROCm machine or
offline by clang (warp width 64). The warp width is passed to the source as ``-DTOPK_WARP_SIZE=<width>``, so the
source checks it against the target's at compile time rather than assume one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar

from .platform import Platform


@dataclass(frozen=True)
class Param:
    """One parameter of a native kernel: its name and C type (a pointer type ends with ``*``)."""

    name: str
    ctype: str

    @property
    def pointer(self) -> bool:
        return self.ctype.endswith("*")


def params(*pairs: tuple[str, str]) -> tuple[Param, ...]:
    """``Param``s of ``(name, C type)`` pairs, in order; ``ValueError`` naming a repeated name."""
    names = [name for name, _ in pairs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"pairs: parameter names repeat ({', '.join(repeated)})")
    return tuple(Param(name, ctype) for name, ctype in pairs)


@dataclass(frozen=True)
class Target:
    """How the native kernels are compiled for one arch: ``vendor`` (``cuda`` or ``hip``), the compiler a launch
    there uses (``nvrtc`` or ``hiprtc``), the warp width of the arch and the ``-D`` macros every kernel gets."""

    arch: str
    vendor: str
    runtime_compiler: str
    warp_size: int

    @property
    def defines(self) -> tuple[str, ...]:
        return (f"TOPK_WARP_SIZE={self.warp_size}",)

    @property
    def binary_suffix(self) -> str:
        """The file suffix of a compiled kernel: a CUBIN on NVIDIA, an AMDGPU code object (HSACO) on AMD."""
        return ".cubin" if self.vendor == "cuda" else ".hsaco"


#: The AMD archs the native kernels are built for (wave64 CDNA3 / CDNA4).
AMD_ARCHS = ("gfx942", "gfx950")
_SM = re.compile(r"^sm_(\d+)(\d)a?$")


def target_of(arch: str) -> Target:
    """The ``Target`` of ``arch`` (``sm_XY``, ``gfx942``, ``gfx950``); ``ValueError`` naming it otherwise."""
    if _SM.match(arch):
        return Target(arch, "cuda", "nvrtc", 32)
    if arch in AMD_ARCHS:
        return Target(arch, "hip", "hiprtc", 64)
    raise ValueError(f"arch must be an NVIDIA sm_XY or one of {', '.join(AMD_ARCHS)}; got {arch!r}")


class NativeKernelSpec:
    """The declaration of one native kernel family. Subclasses set the class attributes and implement
    ``params_of``, ``variants_for``, ``reasons`` and ``plan``.

    ``name`` names the family (the catalog's and warm-up's name); ``variants`` its kernels, each with a ``name`` (its
    ``extern "C"`` name) and ``defines`` (the ``-D`` macros that build it alone); ``source_path`` the one source
    every variant is built from."""

    name: ClassVar[str]
    family: ClassVar[str]
    description: ClassVar[str]
    source_path: ClassVar[Path]
    variants: ClassVar[tuple[Any, ...]]

    def params_of(self, variant) -> tuple[Param, ...]:
        """``variant``'s parameters, in the kernel's order."""
        raise NotImplementedError

    def variants_for(self, platform: Platform) -> tuple[Any, ...]:
        """The variants that exist for ``platform`` (none for a platform the family is not built for)."""
        raise NotImplementedError

    def reasons(self, problem, platform: Platform) -> list[str]:
        """Why the family does not serve ``problem`` on ``platform``, from the kernels' own limits (the compilers
        and drivers a process has are the runtime's to say)."""
        raise NotImplementedError

    def plan(self, problem, platform: Platform):
        """The launch plan of ``problem`` on ``platform``."""
        raise NotImplementedError

    def source(self) -> str:
        """The source text (read once per process)."""
        return _read(self.source_path)

    def pointers(self, variant) -> tuple[tuple[str, str], ...]:
        """``(name, C type)`` of ``variant``'s pointer parameters, in order (they come first)."""
        return tuple((p.name, p.ctype) for p in self.params_of(variant) if p.pointer)

    def scalars(self, variant) -> tuple[str, ...]:
        """The names of ``variant``'s scalar parameters, in order (after the pointers)."""
        return tuple(p.name for p in self.params_of(variant) if not p.pointer)

    def defines(self, variant, arch: str) -> tuple[str, ...]:
        """The ``-D`` macros of ``variant``'s program for ``arch``: the variant's own, then the target's."""
        return (*variant.defines, *target_of(arch).defines)

    def emulator_kernels(self) -> tuple[tuple[str, tuple[str, ...], int], ...]:
        """The binding the CPU emulator builds (``runtime/jit/emulated.py``): per variant, its name, its pointers' C
        types and its scalar count."""
        return tuple((v.name, tuple(ctype for _, ctype in self.pointers(v)), len(self.scalars(v)))
                     for v in self.variants)

    def kernel_names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants)

    def __repr__(self) -> str:
        return f"<NativeKernelSpec {self.family}/{self.name}>"


@lru_cache(maxsize=8)
def _read(path: Path) -> str:
    return Path(path).read_text()


@lru_cache(maxsize=8)
def spliced_source(source_path: Path, headers: tuple[Path, ...]) -> str:
    """The text of ``source_path`` with each of ``headers``, in order, spliced in where it is included (``#include
    "<file name>"`` on a line of its own, in the source or in a header spliced before it), framed by ``#line``
    directives so that compile errors name the right file and line: NVRTC and hipRTC compile one text with no include
    path, and its hash (the JIT key's) covers every file. ``ValueError`` naming a header nobody includes."""
    text = Path(source_path).read_text()
    for header in map(Path, headers):
        include = f'#include "{header.name}"\n'
        at = text.find(include)
        if at < 0:
            raise ValueError(f"headers: {header.name} is not included by {Path(source_path).name}")
        # Where the include is: after the last #line directive before it (a spliced header's end), or in the source.
        mark = text.rfind("#line ", 0, at)
        if mark < 0:
            host, line = Path(source_path).name, text.count("\n", 0, at) + 1
        else:
            words = text[mark:text.index("\n", mark)].split()
            host = words[2].strip('"')
            line = int(words[1]) + text.count("\n", text.index("\n", mark) + 1, at)
        text = (f'{text[:at]}#line 1 "{header.name}"\n{header.read_text()}#line {line + 1} "{host}"\n'
                f"{text[at + len(include):]}")
    return text


_MACRO_LINE = re.compile(r"#define\s+(\w+)((?:[^\n]*\\\n)*[^\n]*)")


def macro_params(source: str, macro: str) -> tuple[Param, ...]:
    """The parameter list a ``#define <macro>`` of ``source`` spells (``const float *__restrict__ logits, int
    rows, ...``), as ``Param``s with ``__restrict__`` dropped and ``*`` joined to the type: what a test compares a
    spec's declaration with. ``ValueError`` where ``source`` does not define ``macro``."""
    for match in _MACRO_LINE.finditer(source):
        if match.group(1) == macro:
            body = match.group(2).replace("\\\n", " ").replace("__restrict__", " ")
            found = []
            for part in body.split(","):
                words = part.replace("*", " * ").split()
                if not words:
                    continue
                stars = words.count("*")
                type_words = [w for w in words[:-1] if w != "*"]
                found.append((words[-1], " ".join(type_words) + "*" * stars))
            return params(*found)
    raise ValueError(f"macro: the source does not define {macro}")

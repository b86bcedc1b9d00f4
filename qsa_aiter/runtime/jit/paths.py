"""Where the JIT cache lives, and what names and identifies a build in it.

``<root>`` is ``QSA_AITER_JIT_DIR``; else ``jit/`` of a source checkout where it is writable; else
``~/.cache/qsa_aiter/jit`` (an installed package directory is never written).

A build is identified by the kernel sources it was compiled from (``kernel_sources_hash``), Triton's
cache-invalidating environment (``triton_env``) and, within one ``triton-<version>/<arch>/`` directory, its entry
id: the kernel's module name and a hash of its function and Triton's launch key (``entry_id``).
"""

from __future__ import annotations

import hashlib
import tempfile
from functools import lru_cache
from pathlib import Path

from ..settings import ConfigurationError, QsaSettings, get_settings
from .triton_compat import get_cache_invalidating_env_vars

#: ``jit/`` of a source checkout (it holds the README that marks it); a wheel has none.
CHECKOUT_JIT_DIR = Path(__file__).resolve().parents[3] / "jit"
#: The kernel layer (``qsa_aiter/kernels``), and its subpackages holding ``@triton.jit`` code, whose sources every
#: entry hashes: a change to any of them makes every entry stale.
KERNEL_SOURCES = Path(__file__).resolve().parents[2] / "kernels"
KERNEL_PACKAGES = ("scoring", "quant", "selection", "cache")


def user_cache_dir() -> Path:
    """The per-user cache: ``~/.cache/qsa_aiter/jit``."""
    return Path.home() / ".cache" / "qsa_aiter" / "jit"


def writable(path: Path) -> bool:
    """Whether files can be created in ``path`` (or, where it does not exist yet, in its nearest existing parent).
    A real probe: permission bits say nothing for root or on a read-only mount."""
    probe = Path(path)
    while not probe.exists():
        if probe.parent == probe:
            return False
        probe = probe.parent
    if not probe.is_dir():
        return False
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".qsa_aiter_probe"):
            return True
    except OSError:
        return False


def jit_root(settings: QsaSettings | None = None) -> Path:
    """The cache root: ``QSA_AITER_JIT_DIR``; else a source checkout's ``jit/`` if writable; else the user cache."""
    settings = settings or get_settings()
    if settings.jit_dir:
        path = Path(settings.jit_dir).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigurationError(f"environment variable QSA_AITER_JIT_DIR={settings.jit_dir!r} is invalid: {path} "
                                     "is not a directory")
        return path
    if (CHECKOUT_JIT_DIR / "README.md").is_file() and writable(CHECKOUT_JIT_DIR):
        return CHECKOUT_JIT_DIR
    return user_cache_dir()


@lru_cache(maxsize=1)
def kernel_sources_hash() -> str:
    """sha256 over the kernel packages' Python files (package, name and bytes): what an entry was built from."""
    digest = hashlib.sha256()
    for package in KERNEL_PACKAGES:
        for path in sorted((KERNEL_SOURCES / package).glob("*.py")):
            digest.update(f"{package}/{path.name}".encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def triton_env() -> dict[str, str]:
    """Triton's cache-invalidating environment variables (its own file cache keys builds by them too)."""
    return {str(k): str(v) for k, v in get_cache_invalidating_env_vars().items()}


def full_name(fn) -> str:
    """Module-qualified name of a ``@triton.jit`` function (Triton's own name for it)."""
    return f"{fn.fn.__module__}.{fn.fn.__qualname__}"


def entry_id(function: str, runtime_key: str) -> str:
    """The manifest key of a variant: the kernel's module name and a hash of its function and Triton launch key."""
    kernel = function.rsplit(".", 2)[-2]
    return f"{kernel}-{hashlib.sha256(f'{function}|{runtime_key}'.encode()).hexdigest()[:20]}"

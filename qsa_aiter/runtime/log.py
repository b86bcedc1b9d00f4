"""The ``qsa_aiter`` logger, with a log-once helper for dispatch decisions and fallbacks."""

from __future__ import annotations

import logging
from typing import Callable

from .settings import get_settings

logger = logging.getLogger("qsa_aiter")
_seen: set[tuple] = set()
_configured_level: str | None = None


def _sync_level() -> None:
    global _configured_level
    level = get_settings().log_level
    if level != _configured_level:
        logger.setLevel(level.upper())
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[qsa_aiter %(levelname)s] %(message)s"))
            logger.addHandler(handler)
        _configured_level = level


def log_once(level: int, key: tuple, message: str | Callable[[], str]) -> None:
    """Log ``message`` at ``level`` the first time ``key`` is logged in this process.

    A key counts as logged only once the logger emits it at ``level``, so raising the verbosity later still shows
    decisions made earlier. ``message`` may be a callable, built only when the line is emitted.
    """
    _sync_level()
    if key in _seen or not logger.isEnabledFor(level):
        return
    _seen.add(key)
    logger.log(level, message() if callable(message) else message)


def reset_log_once() -> None:
    """Forget which messages were logged (tests use it to observe a decision again)."""
    _seen.clear()

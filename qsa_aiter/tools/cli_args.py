"""argparse argument types shared by the command-line entry points (``__main__``, demo, bench, tune, fuzz)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1; anything else is an argparse error that quotes the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value

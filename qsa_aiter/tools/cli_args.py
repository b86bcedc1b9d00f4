"""argparse argument types, actions and options shared by the command-line entry points (``__main__``, demo, bench,
tune, fuzz, quality, warmup, explain, isa, native-resources, model-configs) and the scripts in ``benchmarks/``.

One vocabulary: a concept has one spelling in every command (``--page-size`` for one page size, ``--page-sizes``
for several, ``--cache`` / ``--caches`` with the library's format names), and every multi-value option is a comma
list (``--caches bf16,fp8``); a former spelling still parses as a ``RenamedOption``, with a note on stderr."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Callable

from ..kernels.quant.formats import CACHE_FORMATS, canonical_format
from .work_points import SELECTION_POINTS, WorkPoint, points_named

#: What a page size is, for every option that asks for one: this library counts compressed key groups per page of
#: the index cache, where vLLM and SGLang count tokens per KV block (ATOM's 64-token block is a page of 16 groups).
PAGE_SIZE_MEANING = ("a page holds page_size compressed key groups of the index cache, i.e. page_size x "
                     "compress_ratio tokens (an engine's block_size counts tokens)")


def positive_int(text: str) -> int:
    """An integer >= 1; anything else is an argparse error that quotes the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def _format_name(text: str) -> str:
    """``canonical_format`` of ``text`` as an argparse type: an unknown spelling is an argparse error, a former one a
    note on stderr that names its new spelling."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeprecationWarning)
        try:
            name = canonical_format(text.strip())
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    for warning in caught:
        print(f"note: {warning.message}", file=sys.stderr)
    return name


def cache_format(text: str) -> str | None:
    """A ``--cache`` value: one index-cache format name (``CACHE_FORMATS``, docs/cache_formats.md). The former
    ``16bit`` (a cache of the queries' dtype) gives None, the options' default that means the same, with a note."""
    if text.strip() == "16bit":
        print("note: index-cache format '16bit' is now spelled 'bf16' or 'fp16' (left out: a 16-bit cache of the "
              "queries' dtype)", file=sys.stderr)
        return None
    return _format_name(text)


def cache_formats(text: str) -> tuple[str, ...]:
    """A ``--caches`` value: comma-separated index-cache format names, at least one (duplicates dropped); former
    spellings are accepted with a note."""
    names = tuple(dict.fromkeys(_format_name(v) for v in text.split(",") if v.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated index-cache formats among "
                                         f"{', '.join(CACHE_FORMATS)}; got {text!r}")
    return names


class RenamedOption(argparse.Action):
    """An option's former name (``renamed_to`` names the new one): stores its value as the new option does and
    notes the new name on stderr. Hidden from ``--help``."""

    def __init__(self, option_strings, dest, renamed_to: str, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.renamed_to = renamed_to

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"note: {option_string} is now {self.renamed_to}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def comma_subset(allowed: tuple[str, ...]):
    """argparse type: a comma-separated, non-empty subset of ``allowed``."""

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v.strip() for v in text.split(",") if v.strip())
        bad = [v for v in values if v not in allowed]
        if not values or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}; got {text!r}")
        return values

    return parse


def positive_ints(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers (page sizes, ...), at least one."""
    values = tuple(positive_int(v) for v in text.split(",") if v.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers; got {text!r}")
    return values


def work_point_list(text: str) -> list[WorkPoint]:
    """Comma-separated timed work-point names as an argparse type: the points, in work-point order; an unknown name
    is an argparse error that names it."""
    try:
        return points_named(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_page_size(parser: argparse.ArgumentParser, default: int = 64) -> None:
    """``--page-size N`` (stored as ``page``; the former ``--page`` still parses, with a note)."""
    parser.add_argument("--page-size", dest="page", type=positive_int, default=default,
                        help=f"{PAGE_SIZE_MEANING} (default {default})")
    parser.add_argument("--page", dest="page", type=positive_int, action=RenamedOption, renamed_to="--page-size")


def add_page_sizes(parser: argparse.ArgumentParser, default: tuple[int, ...] = (64, 16)) -> None:
    """``--page-sizes A,B`` (stored as ``page_sizes``, a tuple; the former ``--pages`` still parses, with a note)."""
    parser.add_argument("--page-sizes", type=positive_ints, default=default,
                        help=f"page sizes, comma-separated (default {','.join(map(str, default))}); "
                             f"{PAGE_SIZE_MEANING}")
    parser.add_argument("--pages", dest="page_sizes", type=positive_ints, action=RenamedOption,
                        renamed_to="--page-sizes")


def add_selection_point_options(parser: argparse.ArgumentParser, replays: bool = True,
                                many_caches: bool = False) -> None:
    """The options of the selection benchmarks (``benchmarks/selection.py`` and its kin): ``--points`` (default the
    selection targets' points), ``--page-size`` (default 64), ``--cache`` (default bf16; with ``many_caches``
    ``--caches``, a comma-separated list stored as a tuple, ``--cache`` its one-format spelling) and ``--replays``
    (default 30)."""
    parser.add_argument("--points", type=work_point_list, default=",".join(SELECTION_POINTS),
                        help="comma-separated work points (default the selection targets')")
    add_page_size(parser)
    if many_caches:
        parser.add_argument("--caches", type=cache_formats, default=("bf16",),
                            help="index-cache formats, comma-separated (default bf16; docs/cache_formats.md)")
        parser.add_argument("--cache", dest="caches", type=cache_formats, help=argparse.SUPPRESS)
    else:
        parser.add_argument("--cache", type=cache_format, default="bf16",
                            help="index-cache format (docs/cache_formats.md)")
    if replays:
        parser.add_argument("--replays", type=positive_int, default=30, help="CUDA-graph replays per median")


def check_environment() -> str:
    """Why this process's configuration is bad ('' where it is fine): every environment variable the library reads
    (``get_settings``), the tuned-config files, and the name each family's forcing variable gives
    (``QSA_AITER_BACKEND``, ``QSA_AITER_TOPK_BACKEND``)."""
    from ..runtime import registries
    from ..runtime.dispatch import Registry
    from ..runtime.settings import ConfigurationError, get_settings
    from ..runtime.tuned import load_tables

    try:
        settings = get_settings()
        load_tables(tuple(settings.tuned_config))
        for registry in vars(registries).values():
            if isinstance(registry, Registry):
                registry.forced(settings)
    except ConfigurationError as err:
        return str(err)
    return ""


def run_command(run: Callable[[list[str]], int], argv: list[str]) -> int:
    """``run(argv)``'s exit status, as every command line of the package runs (``python -m qsa_aiter ...`` and
    ``python -m qsa_aiter.tools.<command>``): the environment is checked before any work (``check_environment``; not
    for ``--help``, which works whatever it holds), so a bad value is one line naming the variable and status 2, and
    a ``ConfigurationError`` met later is reported the same way; output cut short by a closed pipe (``jit list |
    head``) ends the command quietly with status 141, as a command killed by SIGPIPE."""
    from ..runtime.settings import ConfigurationError

    try:
        if not any(arg in ("-h", "--help") for arg in argv):
            bad = check_environment()
            if bad:
                print(f"error: {bad}", file=sys.stderr)
                return 2
        try:
            status = run(argv)
        except ConfigurationError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        sys.stdout.flush()  # a closed pipe is met here, not at the interpreter's exit
        return status
    except BrokenPipeError:
        # The reader is gone: stdout goes to /dev/null so that the interpreter's last flush does not complain.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141

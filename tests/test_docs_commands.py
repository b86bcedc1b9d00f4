"""Every command the README and docs/ write (``python -m qsa_aiter ...``, ``qsa-aiter ...``, ``python -m
qsa_aiter.tools.<x> ...``, ``python benchmarks/<x>.py ...``) parses with that command's own argparse parser: no
unknown, abbreviated or renamed option, no bad choice, no missing script. The ones that need no GPU and are cheap
(``--help``, ``explain``, ``jit list``) run, and must exit 0."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

import benchmark_scripts
from qsa_aiter.tools import cli

ROOT = Path(__file__).resolve().parents[1]
#: The documents whose commands a reader runs: README.md and docs/, less docs/bench/ (raw output) and
#: docs/design-log/ (the history of experiments, which names commands as they were then).
DOCS = (ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md")
                                    if "bench" not in p.parts and "design-log" not in p.parts))

#: ``python -m qsa_aiter <command>`` commands that take their own arguments, and the module whose ``build_parser``
#: parses them (``cli.main`` hands them the rest of the line unparsed).
OWN_PARSERS = {"demo": "demo", "bench": "bench", "tune": "tuner", "fuzz": "fuzz", "quality": "quality", "isa": "isa",
               "model-configs": "static_model"}

_ENV = r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
#: The start of a command this test knows: the package's CLI, a tool module, or a benchmark script.
_COMMAND = re.compile(_ENV + r"(?:python3? -m qsa_aiter(?:\.tools\.\w+)?(?=\s|$)|qsa-aiter(?=\s|$)"
                      r"|python3? benchmarks/\w+\.py(?=\s|$)|benchmarks/\w+\.py(?=\s+-))")
#: A script named alone (a file reference, or a command without options): it must exist.
_SCRIPT = re.compile(r"\bbenchmarks/\w+\.py\b")


@dataclass(frozen=True)
class Command:
    where: str  # path:line
    text: str

    @property
    def synopsis(self) -> bool:
        """Written with a ``...`` for "and so on" (the rest of the line, or an option's value)."""
        return "..." in shlex.split(self.text)

    def words(self) -> tuple[dict[str, str], list[str]]:
        """(the environment it sets, its words), cut at a ``...`` that stands for "and so on"."""
        words = shlex.split(self.text)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if "..." in words:
            words = words[:words.index("...")]
        return env, words


def _pieces(where: str, line: str) -> list[Command]:
    """The commands of one shell line: its ``&&``/``;``/``|`` pieces that start as a known command."""
    line = re.sub(r"\s#\s.*$", "", line)  # a trailing comment
    return [Command(where, piece.strip()) for piece in re.split(r"&&|\|\||;|\|", line)
            if _COMMAND.fullmatch(piece.strip()) or _COMMAND.match(piece.strip() + " ")]


def doc_commands() -> list[Command]:
    """Every command of the README and docs/: the lines of their shell blocks (``$`` prompts and ``\\``
    continuations read as a shell does) and their inline code spans (a span may wrap over a line break)."""
    found = []
    for path in DOCS:
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        fences = list(re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M))
        for fence in fences:
            if fence.group(1) not in ("", "bash", "sh", "shell", "console", "text"):
                continue
            first = text[: fence.start(2)].count("\n") + 1
            pending = ""
            for offset, raw in enumerate(fence.group(2).split("\n")):
                pending += raw.removeprefix("$ ").removesuffix("\\") + " "
                if not raw.endswith("\\"):
                    found += _pieces(f"{name}:{first + offset}", " ".join(pending.split()))
                    pending = ""
        outside = text
        for fence in fences:  # blank the blocks out (keeping line numbers) before reading the inline spans
            outside = outside.replace(fence.group(0), "\n" * fence.group(0).count("\n"), 1)
        for span in re.finditer(r"(?<!`)`([^`]+)`(?!`)", outside):
            line = outside[: span.start()].count("\n") + 1
            found += _pieces(f"{name}:{line}", " ".join(span.group(1).split()))
    return found


COMMANDS = doc_commands()


def _all_options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of a parser and of its subcommands' parsers."""
    options = set()
    for action in parser._actions:
        options |= set(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _all_options(sub)
    return options


def parser_for(words: list[str]) -> tuple[argparse.ArgumentParser, list[str], str]:
    """(the parser that reads the command's arguments, those arguments, how the command is run)."""
    if words[:3] == ["python", "-m", "qsa_aiter"] or words[:1] == ["qsa-aiter"]:
        args = words[3:] if words[0] == "python" else words[1:]
        if args and args[0] in OWN_PARSERS:
            module = importlib.import_module(f"qsa_aiter.tools.{OWN_PARSERS[args[0]]}")
            return module.build_parser(), args[1:], "cli"
        return cli._build_parser(), args, "cli"
    if words[:2] == ["python", "-m"] or words[:2] == ["python3", "-m"]:
        module = importlib.import_module(words[2])
        assert hasattr(module, "build_parser"), f"{words[2]} has no build_parser()"
        return module.build_parser(), words[3:], "module"
    script = next(w for w in words if w.startswith("benchmarks/"))
    assert (ROOT / script).is_file(), f"{script} is not in the repository"
    module = benchmark_scripts.load(Path(script).stem)
    assert hasattr(module, "build_parser"), f"{script} has no build_parser()"
    return module.build_parser(), words[words.index(script) + 1:], "script"


def parse_failure(command: Command) -> str | None:
    """Why the command's own parser refuses its arguments, or None."""
    _, words = command.words()
    try:
        parser, args, _ = parser_for(words)
    except (AssertionError, ImportError) as err:
        return str(err)
    known = _all_options(parser)
    for word in args:  # argparse takes a prefix of an option for the option: the docs spell each one out
        option = word.split("=")[0]
        if option.startswith("--") and option not in known:
            return f"{option} is not an option of this command (a prefix of one, or none)"
    if command.synopsis:  # what follows the ``...`` (a value, a subcommand) is the reader's: only the names count
        return None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as exit_info:
        if exit_info.code:
            return err.getvalue().strip().splitlines()[-1]
    if " is now " in err.getvalue():  # a RenamedOption: the former name still works, the docs use the new one
        return err.getvalue().strip()
    return None


def test_the_docs_have_commands():
    """The reader finds commands in every one of these forms (a broken reader would find none and pass)."""
    texts = " ".join(c.text for c in COMMANDS)
    assert len(COMMANDS) >= 40, len(COMMANDS)
    for form in ("python -m qsa_aiter bench", "python -m qsa_aiter tune", "python -m qsa_aiter explain",
                 "python -m qsa_aiter warmup", "python -m qsa_aiter jit list", "python benchmarks/"):
        assert form in texts, form


def test_each_own_parser_is_the_one_cli_main_hands_the_command():
    """``OWN_PARSERS`` is the dispatcher's: its pass-through commands, each parsed by a parser named for it."""
    for action in cli._build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            passed = {name for name, sub in action.choices.items() if not sub.add_help}
    assert passed == set(OWN_PARSERS)
    for command, module in OWN_PARSERS.items():
        parser = importlib.import_module(f"qsa_aiter.tools.{module}").build_parser()
        assert parser.prog == f"python -m qsa_aiter {command}", (command, parser.prog)


def test_the_reader_finds_and_checks_what_a_reader_copies():
    """The extraction and the check themselves, on made-up lines: a wrapped span, a prompt, an env prefix, a
    continuation, a renamed option, a prefix of an option, a bad choice, a missing script."""
    assert [c.text for c in _pieces("x:1", "pip install -e . && QSA_AITER_BACKEND=torch python -m qsa_aiter demo")] \
        == ["QSA_AITER_BACKEND=torch python -m qsa_aiter demo"]
    assert not _pieces("x:1", "python -m qsa_aiter_other") and not _pieces("x:1", "benchmarks/x.pyc")
    assert not _pieces("x:1", "benchmarks/selection.py") and _pieces("x:1", "benchmarks/selection.py --replays 3")
    good = Command("x:1", "python -m qsa_aiter bench --page-sizes 64 --caches bf16,fp8 --quick")
    assert parse_failure(good) is None
    assert "is now --caches" in parse_failure(Command("x:1", "python -m qsa_aiter bench --kv bf16"))
    assert "not an option" in parse_failure(Command("x:1", "python -m qsa_aiter bench --page-size 6"))
    assert "invalid choice" in parse_failure(Command("x:1", "python -m qsa_aiter explain --phase nope"))
    assert "not in the repository" in parse_failure(Command("x:1", "python benchmarks/no_such_script.py"))
    assert parse_failure(Command("x:1", "python benchmarks/selection.py --replays 30")) is None
    assert Command("x:1", "python -m qsa_aiter tune --csv a.csv ...").words()[1][-1] == "a.csv"
    assert parse_failure(Command("x:1", "python -m qsa_aiter tune --csv ...")) is None  # a synopsis
    assert "not an option" in parse_failure(Command("x:1", "python -m qsa_aiter tune --cvs ..."))


def test_every_script_the_docs_name_is_in_the_repository():
    missing = [f"{path.relative_to(ROOT)}: {script}" for path in DOCS
               for script in _SCRIPT.findall(path.read_text()) if not (ROOT / script).is_file()]
    assert not missing, missing


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.where} {c.text}"[:120])
def test_every_doc_command_parses(command):
    assert parse_failure(command) is None, f"{command.where}: `{command.text}`: {parse_failure(command)}"


def _cheap(words: list[str]) -> bool:
    """Runs in a second or so without a GPU: a help text, ``explain`` (a plan, nothing launched), ``jit list``."""
    args = words[3:] if words[0] == "python" else words[1:]
    return "--help" in words or args[:1] == ["explain"] or args[:2] == ["jit", "list"]


CHEAP = [c for c in COMMANDS if _cheap(c.words()[1])]


def test_some_doc_commands_are_cheap():
    assert {" ".join(c.words()[1][:4]) for c in CHEAP} >= {"python -m qsa_aiter explain", "python -m qsa_aiter jit"}


@pytest.mark.parametrize("command", CHEAP, ids=lambda c: f"{c.where} {c.text}"[:120])
def test_the_cheap_doc_commands_run(command, monkeypatch, capsys):
    """As a user runs them: ``cli.main`` for the package's commands, the script's or module's ``main``."""
    env, words = command.words()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, args, how = parser_for(words)
    if how == "cli":
        main, argv = cli.main, (words[3:] if words[0] == "python" else words[1:])
    elif how == "module":
        main, argv = importlib.import_module(words[2]).main, args
    else:
        script = next(w for w in words if w.startswith("benchmarks/"))
        main, argv = benchmark_scripts.load(Path(script).stem).main, args
        monkeypatch.setattr("sys.argv", [script, *argv])
    try:
        code = main(argv) if how != "script" else main()
    except SystemExit as exit_info:  # --help
        code = exit_info.code
    out = capsys.readouterr()
    assert not code, f"{command.where}: `{command.text}` exited {code}: {out.err[-500:]}"
    assert out.out.strip(), f"{command.where}: `{command.text}` printed nothing"

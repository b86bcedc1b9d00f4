"""The README's examples marked as running as written do run, on this machine, in order, in one namespace; and the
README and docs/ agree with the code: their Python blocks parse, the kernel orders they write are the registry's,
the generated tables are current, and they cite nothing outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from qsa_aiter.kernels.scoring.problem import PHASES
from qsa_aiter.runtime import registries
from qsa_aiter.runtime.dispatch import ANY_PHASE

README = Path(__file__).resolve().parents[1] / "README.md"


def runnable_blocks() -> list[str]:
    """The ``python`` blocks that follow a ``<!-- runs as written ... -->`` line."""
    text = README.read_text()
    return re.findall(r"<!-- runs as written[^\n]*-->\n```python\n(.*?)```", text, flags=re.S)


def test_the_readme_examples_run_as_written(capsys):
    blocks = runnable_blocks()
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert capsys.readouterr().out.strip() == "[374, 375, 511, 512]"
    assert tuple(namespace["indices"].shape) == (4, 2048 + 3)
    assert tuple(namespace["tokens"].shape) == (4, 2048 + 3)


# ---------------------------------------------------------------------------------------------------------------
# The docs agree with the code
# ---------------------------------------------------------------------------------------------------------------

ROOT = README.parent
#: The documents a reader is sent to: the README and docs/, its design log included (docs/bench/ holds raw
#: measurement output).
DOCS = (README, *sorted(p for p in (ROOT / "docs").rglob("*.md")
                         if "bench" not in p.relative_to(ROOT).parts))


def test_every_python_block_of_the_docs_is_python():
    """A block tagged ``python`` parses (a signature written as Python with a bare ``*`` does not: it says
    "keyword-only from here on" in a comment instead)."""
    broken = []
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
            try:
                ast.parse(match.group(1))
            except SyntaxError as err:
                line = text[: match.start()].count("\n") + 1 + (err.lineno or 0)
                broken.append(f"{path.relative_to(ROOT)}:{line}: {err.msg}")
    assert not broken, broken


def _registry_orders() -> set[tuple[str, ...]]:
    """Every candidate order the registries give: scoring per phase and for page sizes outside its table, the top-k,
    expansion and writer families."""
    orders = {registries.SCORING.ranked(phase) for phase in PHASES} | {registries.SCORING_FALLBACK_ORDER}
    orders |= set(registries.SCORING_TABLE.values())
    for family in (registries.TOPK, registries.EXPAND, registries.WRITER):
        orders.add(family.ranked(ANY_PHASE))
    return orders


def test_the_readme_kernel_table_is_the_registry_order():
    rows = dict(re.findall(r"^\| `(\w+)` \|[^|]*\|[^|]*\| ([^|]+) \|$", README.read_text(), flags=re.MULTILINE))
    assert set(rows) == set(PHASES), rows
    for phase, cell in rows.items():
        written = tuple(re.findall(r"`(\w+)`", cell))
        assert written == registries.SCORING.ranked(phase), (phase, written)
        # One order per phase, whatever the cache format and page size of the registry's rows.
        assert {order for (_, _, p), order in registries.SCORING_TABLE.items() if p == phase} == {written}


def test_every_order_written_in_the_docs_is_a_registry_order():
    """``a > b > c`` of candidate names anywhere in the README and docs/ is one of the registries' orders, whole
    (an order that leaves out a kernel, as the verify row once left out ``keys_major``, fails)."""
    names = {name for family in (registries.SCORING, registries.TOPK, registries.EXPAND, registries.WRITER)
             for name in family.candidates}
    orders = _registry_orders()
    stale = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for chain in re.findall(r"`?\w+`?(?: > `?\w+`?)+", line):
                written = tuple(re.findall(r"\w+", chain))
                if set(written) & names and written not in orders:
                    stale.append(f"{path.relative_to(ROOT)}:{number}: {' > '.join(written)}")
    assert not stale, f"orders that are not the registry's: {stale}"


def test_the_architecture_rank_table_is_generated_from_the_registry():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert registries.scoring_rank_table() in doc, "regenerate the rank table in docs/architecture.md"


#: Citations of documents that are not in the repository (a specification's sections, an issue tracker's threads):
#: the docs and the package say the thing itself or point to a document here instead.
OUTSIDE_CITATION = re.compile(r"SPEC sections?\b|SPEC's\b|\bthe issue\b|\bissue \d+|project's issue")
#: Files that still cite them, each with how many times; they belong to work under way elsewhere. A file fixed is
#: taken out of this list (the test fails until it is).
KNOWN_CITATIONS: dict[str, int] = {}


def test_nothing_cites_a_document_outside_the_repository():
    sources = [*DOCS, *sorted((ROOT / "qsa_aiter").rglob("*.py"))]
    found = {}
    for path in sources:
        count = len(OUTSIDE_CITATION.findall(path.read_text()))
        if count:
            found[str(path.relative_to(ROOT))] = count
    assert found == KNOWN_CITATIONS


#: A Markdown document named in prose (``KINDS.md``, ``docs/selection.md``) or a link's target.
MARKDOWN_NAME = re.compile(r"(?<![\w/.-])([\w./-]*\w\.md)\b")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
#: Where the repository keeps documents (not its virtual environment or build outputs).
REPOSITORY_DOCS = {p.name for p in ROOT.rglob("*.md")
                   if not {".venv", ".git", "build", "node_modules"} & set(p.relative_to(ROOT).parts)}


def _outside_documents(path: Path) -> list[str]:
    """The documents and link targets ``path`` names that are not in the repository: a Markdown name that is no
    file's here, a path that resolves neither from the file's folder nor from the root, a relative link that does
    not resolve from the file's folder."""
    text = path.read_text()
    missing = []
    for name in MARKDOWN_NAME.findall(text):
        if "/" in name:
            if not ((path.parent / name).exists() or (ROOT / name).exists() or (ROOT / "docs" / name).exists()):
                missing.append(name)
        elif name not in REPOSITORY_DOCS:
            missing.append(name)
    if path.suffix == ".md":
        missing += [target for target in LINK.findall(text)
                    if "://" not in target and not (path.parent / target).exists()]
    return list(dict.fromkeys(missing))


def test_every_document_named_is_in_the_repository():
    """A page may send the reader only to a document they have: one of the repository's (KINDS.md, the device
    tool's notes, once was cited in docs/benchmarks.md)."""
    missing = {}
    for path in [*DOCS, *sorted((ROOT / "qsa_aiter").rglob("*.py"))]:
        if found := _outside_documents(path):
            missing[str(path.relative_to(ROOT))] = found
    assert not missing, missing


def test_the_document_check_catches_a_missing_one(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See KINDS.md of the device tool, [the log](log/2026.md) and docs/kernels.md.\n")
    assert _outside_documents(page) == ["KINDS.md", "log/2026.md"]

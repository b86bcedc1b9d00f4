"""The README's examples marked as running as written do run, on this machine, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

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

"""The code blocks of README.md and docs/: every Python block parses, and complete programs run as written.

A block is run (in a scratch directory, in a fresh interpreter) when it is a whole program: the README's quick start.
The other blocks are excerpts of the examples (``self.``, ``...`` where the rest of a script goes); they must still
parse, so a renamed argument or a typo in a page fails here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            out.append((f"{page.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}", m.group(1)))
    return out


BLOCKS = _blocks()


def test_the_pages_have_python_blocks() -> None:
    assert len(BLOCKS) >= 15


@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_every_python_block_parses(where: str, code: str) -> None:
    try:
        ast.parse(code)
    except SyntaxError as err:
        pytest.fail(f"{where}: {err}")


def test_the_readme_quick_start_runs_as_written(tmp_path: Path) -> None:
    (quick,) = [code for where, code in BLOCKS if where.startswith("README.md") and "DistributedCheckpoint(" in code]
    proc = subprocess.run(
        [sys.executable, "-c", quick], cwd=tmp_path, capture_output=True, text=True, timeout=180,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpts" / "step-100" / "manifest.json").is_file()

"""The code blocks of README.md and docs/: every Python block parses, and every block runs as written.

Each block runs in a fresh interpreter in a scratch directory (what a reader who pastes it into a file gets). Two
markers, on the line before a block's fence, change that:

- ``<!-- continues -->``: the block runs after the blocks of the same page it continues (a page that builds an
  example step by step);
- ``<!-- not run: why -->``: a sketch (``...`` for arguments), an excerpt of an example script, or a block that
  needs what a test machine lacks (an S3 bucket); the reason is required and must name what runs instead.
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
BLOCK = re.compile(r"(?:<!-- (continues|not run: [^\n]*?) -->\n)?```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, str, str]]:
    """``(where, code, marker)`` of every Python block, ``marker`` "" when unmarked."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text[: m.start(2)].count(chr(10))
            out.append((f"{page.relative_to(ROOT)}:{line}", m.group(2), m.group(1) or ""))
    return out


def _programs() -> list[tuple[str, str]]:
    """What runs: each unmarked block, and each ``continues`` block after the blocks it continues."""
    out: list[tuple[str, str]] = []
    page_code: dict[str, str] = {}
    for where, code, marker in _blocks():
        page = where.split(":")[0]
        if marker.startswith("not run"):
            continue
        program = (page_code.get(page, "") + "\n" + code) if marker == "continues" else code
        page_code[page] = program
        out.append((where, program))
    return out


BLOCKS = [(w, c) for w, c, _ in _blocks()]
PROGRAMS = _programs()
ENV = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}


def test_the_pages_have_python_blocks() -> None:
    assert len(BLOCKS) >= 15


@pytest.mark.parametrize("where, code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_every_python_block_parses(where: str, code: str) -> None:
    try:
        ast.parse(code)
    except SyntaxError as err:
        pytest.fail(f"{where}: {err}")


EXCERPT = re.compile(r"not run: an excerpt of ([\w/.]+\.py)")


def _code_lines(code: str) -> list[str]:
    lines = (line.split("  #")[0].split(" # ")[0].strip() for line in code.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize("where, code, marker", [b for b in _blocks() if EXCERPT.match(b[2])])
def test_an_excerpt_is_what_its_script_holds(where: str, code: str, marker: str) -> None:
    """A block marked as an excerpt of a script quotes it: every code line is a line of that script."""
    script = ROOT / EXCERPT.match(marker).group(1)
    source = set(_code_lines(script.read_text()))
    missing = [line for line in _code_lines(code) if line not in source]
    assert not missing, f"{where}: lines {script.name} does not hold: {missing}"


def test_blocks_not_run_say_why() -> None:
    skipped = [(w, m) for w, _, m in _blocks() if m.startswith("not run")]
    assert all(len(m.removeprefix("not run:").strip()) >= 20 for _, m in skipped), skipped
    assert len(skipped) <= len(BLOCKS) // 3, f"most blocks must run: {skipped}"


@pytest.mark.parametrize("where, program", PROGRAMS, ids=[w for w, _ in PROGRAMS])
def test_every_block_runs_as_written(tmp_path: Path, where: str, program: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**ENV, "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, f"{where}:\n{proc.stderr[-3000:]}"


def test_the_readme_quick_start_writes_its_checkpoint(tmp_path: Path) -> None:
    (quick,) = [code for where, code in BLOCKS if where.startswith("README.md") and "DistributedCheckpoint(" in code]
    proc = subprocess.run(
        [sys.executable, "-c", quick], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**ENV, "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpts" / "step-100" / "manifest.json").is_file()

"""The TDCP_* environment variables: all declared in torchrl_dcp.settings, checked, and documented in one table."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from torchrl_dcp.settings import SETTINGS, markdown_table, setting

PACKAGE = Path(tdcp.__file__).parent
DOCS = PACKAGE.parent / "docs" / "api.md"


def test_every_variable_the_library_reads_is_declared() -> None:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "examples":  # the example scripts' own switches (TDCP_DUMP) are not library knobs
            continue
        found |= set(re.findall(r"[\"'](TDCP_[A-Z0-9_]+)[\"']", path.read_text()))
    assert found and found <= set(SETTINGS), f"read but not declared: {found - set(SETTINGS)}"


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("TDCP_READ_THREADS", "many", "not an integer"),
        ("TDCP_STORE_PART_SIZE", "1024", "out of range"),
        ("TDCP_READ_PREFAULT", "yes", "use 0 or 1"),
        ("TDCP_CRC32", "crc", "use one of isal, zlib"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, name: str, text: str, message: str
) -> None:
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=rf"{name}=.*{message}"):
        setting(name)


def test_defaults_and_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TDCP_STORE_CONCURRENCY", raising=False)
    assert setting("TDCP_STORE_CONCURRENCY") == 8
    monkeypatch.setenv("TDCP_STORE_CONCURRENCY", "3")
    assert setting("TDCP_STORE_CONCURRENCY") == 3
    monkeypatch.setenv("TDCP_READ_HUGEPAGES", "0")
    assert setting("TDCP_READ_HUGEPAGES") == "0"
    monkeypatch.delenv("TDCP_READ_HUGEPAGES")
    assert setting("TDCP_READ_HUGEPAGES") == "auto"


def test_the_docs_table_is_the_declared_one() -> None:
    assert markdown_table() in DOCS.read_text(), "update docs/api.md's table from settings.markdown_table()"


@pytest.mark.parametrize("name, value", [("TDCP_READ_HUGEPAGES", "2"), ("TDCP_LOG_ALL_RANKS", "true")])
def test_a_bad_value_fails_a_save_or_load_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """A variable read only on some paths (large loads' huge pages, the log filter once INFO is on) was accepted by
    the saves and loads that never read it, and failed others midway (an async save "failed" for a logging
    switch): every save and load checks every variable set, first."""
    import torch

    path = tdcp.DistributedCheckpoint(x=torch.ones(2)).save(tmp_path / "good")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        tdcp.DistributedCheckpoint(x=torch.ones(2)).save(tmp_path / "c")
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=name):
        tdcp.DistributedCheckpoint(x=torch.zeros(2)).load(path)
    monkeypatch.setenv(name, "1")
    dest = torch.zeros(2)
    tdcp.DistributedCheckpoint(x=dest).load(path)
    assert dest.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(("name", "bad"), [("TDCP_CRC32", "crc"), ("TDCP_READ_AHEAD", "-1"), ("TDCP_CHUNK_BYTES", "0")])
def test_a_bad_value_read_at_import_fails_the_call_not_the_import(tmp_path: Path, name: str, bad: str) -> None:
    """Module constants read their variable at import: a bad value made ``import torchrl_dcp`` itself raise, so a
    CLI command died with a traceback. The import takes the default; the CLI says one ``error:`` line naming the
    variable, and a save raises the ``ValueError`` that names it before anything is written."""
    import subprocess
    import sys

    env = {**os.environ, name: bad}
    code = (
        "import torch, torchrl_dcp as tdcp\n"
        "try:\n"
        f"    tdcp.DistributedCheckpoint(p=torch.nn.Linear(2, 2)).save({str(tmp_path / 'c')!r})\n"
        "except ValueError as err:\n"
        "    print('refused', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith(f"refused {name}="), done.stderr[-1500:]
    assert not (tmp_path / "c").exists()
    cli = subprocess.run(
        [sys.executable, "-m", "torchrl_dcp", "inspect", str(tmp_path / "none")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert cli.returncode == 1 and cli.stderr.startswith(f"error: {name}=") and "Traceback" not in cli.stderr

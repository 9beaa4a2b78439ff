"""The TDCP_* environment variables: all declared in torchrl_dcp.settings, checked, and documented in one table."""

from __future__ import annotations

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

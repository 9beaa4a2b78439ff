"""docs/components/conformance.md is the conformance suites' own tables, rendered (tests/conformance_table.py)."""

from __future__ import annotations

from conformance_table import PAGE, render


def test_the_conformance_page_is_generated_from_the_suites() -> None:
    assert PAGE.read_text() == render(), "run `python tests/conformance_table.py` and commit the page"

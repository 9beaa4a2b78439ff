"""Every docstring example (``>>>``) in the library runs and shows what it says (a docstring is documentation: a
stale example is a bug, as a stale page of docs/ is)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import warnings

import pytest

import torchrl_dcp

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(torchrl_dcp.__path__, "torchrl_dcp.") if "__main__" not in m.name
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str, tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # (examples that write relative paths write here)
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    with warnings.catch_warnings():  # (an example setting a filter, "error" for our warnings, sets it here only)
        for test in finder.find(module, name):
            runner.run(test)
    failed, _ = runner.summarize(verbose=False)
    assert failed == 0, f"{failed} docstring example(s) of {name} fail (run: python -m doctest -v on it)"

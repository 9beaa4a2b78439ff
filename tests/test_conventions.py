"""Conventions every module follows, checked over the source (by construction, not per case)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

import torchrl_dcp as tdcp
import torchrl_dcp.errors as errors

PACKAGE = Path(tdcp.__file__).parent


def _warn_calls() -> list[tuple[str, ast.Call]]:
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "warn":
                if isinstance(node.func.value, ast.Name) and node.func.value.id == "warnings":
                    calls.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", node))
    return calls


def _category(call: ast.Call) -> str | None:
    for kw in call.keywords:
        if kw.arg == "category" and isinstance(kw.value, ast.Name):
            return kw.value.id
    if len(call.args) >= 2 and isinstance(call.args[1], ast.Name):
        return call.args[1].id
    first = call.args[0] if call.args else None
    if isinstance(first, ast.Call) and isinstance(first.func, ast.Name):  # warnings.warn(SomeWarning("..."))
        return first.func.id
    return None


def test_every_warning_the_package_emits_is_a_torchrl_dcp_warning() -> None:
    calls = _warn_calls()
    assert len(calls) >= 8  # (the scan finds them)
    for where, call in calls:
        name = _category(call)
        klass = getattr(errors, name, None) if name else None
        assert isinstance(klass, type) and issubclass(klass, tdcp.TorchrlDcpWarning), f"{where}: category {name}"
    for name in ("InexactResumeWarning", "UnrestoredComponentWarning", "StaleCheckpointWarning", "PartialLoadWarning"):
        assert issubclass(getattr(tdcp, name), tdcp.TorchrlDcpWarning)


def test_every_module_logs_through_its_own_rank_filtered_logger() -> None:
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        assert 'getLogger("torchrl_dcp")' not in text or path.name == "_log.py", path
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("torchrl_dcp").handlers)


@pytest.mark.parametrize("rank, all_ranks, kept", [("0", "", True), ("1", "", False), ("1", "1", True)])
def test_info_lines_come_from_rank_zero_unless_asked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, rank: str, all_ranks: str, kept: bool
) -> None:
    from torchrl_dcp._log import get_logger

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("TDCP_LOG_ALL_RANKS", all_ranks)
    logger = get_logger("torchrl_dcp.test_conventions")
    with caplog.at_level(logging.INFO, logger="torchrl_dcp"):
        logger.info("progress")
        logger.warning("trouble")
    assert ("progress" in caplog.text) is kept and "trouble" in caplog.text  # warnings from every rank


def test_every_json_the_package_reads_is_decoded_by_loads_json() -> None:
    """``json.loads`` raises ``RecursionError`` on deeply nested text (a few kilobytes of ``[``), which callers
    catching ``ValueError`` let out raw (a local tier's commit record did): every decode of bytes read from a file,
    a store or a peer goes through :func:`torchrl_dcp.json_bytes.loads_json` (a ``ValueError`` always)."""
    raw = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "json_bytes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr in ("loads", "load") and getattr(node.func.value, "id", None) == "json":
                arg = node.args[0] if node.args else None
                of_our_own = isinstance(arg, ast.Call) and getattr(arg.func, "attr", None) == "dumps"
                if not of_our_own:  # (json.loads(json.dumps(x)): a value of our own, normalised)
                    raw.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    allowed = {"checkpoint_diff.py"}  # (decodes a key that checkpoint_diff itself encoded with json.dumps)
    assert [r for r in raw if r.split(":")[0] not in allowed] == []


def test_an_adapter_whose_state_is_not_the_state_dict_says_so() -> None:
    """An import of a torchrl checkpoint runs an adapter's checks on the ``state_dict()`` torchrl saved where
    ``state_is_state_dict``: a subclass that inherits ``True`` and overrides ``state`` must say again what it is."""
    import torchrl_dcp.adapters.defaults  # noqa: F401 - every adapter class of the library imported
    from torchrl_dcp.adapters.base import Adapter

    def subclasses(cls: type) -> list[type]:
        return [c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))]

    unsaid = [
        c.__qualname__
        for c in subclasses(Adapter)
        if c.__module__.startswith("torchrl_dcp.")
        and c.state_is_state_dict
        and "state" in vars(c)
        and "state_is_state_dict" not in vars(c)
    ]
    assert not unsaid, f"override state() and inherit state_is_state_dict=True: {unsaid}"

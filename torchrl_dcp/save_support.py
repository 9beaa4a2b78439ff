"""Helpers of the save and load steps: a failure as a :class:`CheckpointError` that says what to do, DCP's
single-process quiet mode, and DCP's collective exception summarised.

Example:
    >>> from torchrl_dcp.save_support import save_failure
    >>> str(save_failure(OSError(28, "No space left"), "writing", None)).startswith("writing failed")
    True
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from torchrl_dcp.errors import CheckpointError, os_error_hint


def save_failure(err: BaseException, phase: str, path: Any) -> BaseException:
    """A save step's failure as a :class:`CheckpointError` saying what to do (a full disk says so)."""
    if isinstance(err, CheckpointError) or not isinstance(err, Exception):
        return err
    hint = "nothing was committed; the previous checkpoint at this path, if any, is intact"
    if isinstance(err, OSError) and os_error_hint(err):  # a full disk, a file size limit...: what to do
        hint = f"{os_error_hint(err)}; {hint}"
    wrapped = CheckpointError(f"{phase} failed: {type(err).__name__}: {err}; {hint}", path=path)
    wrapped.__cause__ = err
    return wrapped


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; a world of one is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def failure_inside(err: BaseException) -> CheckpointError | None:
    """The first :class:`CheckpointError` among the failures DCP's ``CheckpointException`` gathered (a record our
    reader refused, naming its file), or ``None``: what a load or a tool raises instead of DCP's wrapper."""
    for failure in (getattr(err, "failures", None) or {}).values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, CheckpointError):
            return exc
    return None


def summarize(err: CheckpointException) -> str:
    """DCP's collective exception as one line per failed rank."""
    failures = getattr(err, "failures", {}) or {}
    parts = []
    for r, exc in sorted(failures.items()):
        exc = exc[0] if isinstance(exc, tuple) else exc
        text = str(exc).strip().splitlines()
        parts.append(f"rank {r}: {type(exc).__name__}{': ' + text[-1] if text else ''}")
    return "; ".join(parts) or str(err)

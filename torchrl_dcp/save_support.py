"""Helpers of the save steps: a failure as a :class:`CheckpointError` that says what to do, the destination's
lock, whether a path may be replaced, and DCP's single-process quiet mode.

Example:
    >>> from torchrl_dcp.save_support import save_failure
    >>> str(save_failure(OSError(28, "No space left"), "writing", None)).startswith("writing failed")
    True
"""

from __future__ import annotations

import contextlib
import errno
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.storage.commit import sweep_stale_locks
from torchrl_dcp.storage.container import DirectoryContainer


def release_lock(job: Any) -> None:
    if job.lock is not None:
        job.lock.release()
        job.lock = None
        sweep_stale_locks(job.destination.parent)  # left by saves killed before they released theirs


def failing(fn: Any, job: Any) -> Any:
    def wrapped() -> Any:
        try:
            return fn()
        except Exception as err:
            raise save_failure(err, "preparing the staging directory", job.destination) from err

    return wrapped


def is_replaceable(destination: Path) -> bool:
    """Whether ``destination`` may be replaced by a save: an empty directory or a committed checkpoint."""
    if not destination.is_dir() or destination.is_symlink():
        return False
    if not any(destination.iterdir()):
        return True
    try:
        DirectoryContainer(destination).manifest()
        return True
    except CheckpointError:
        return False


def save_failure(err: BaseException, phase: str, path: Path | None) -> BaseException:
    """A save step's failure as a :class:`CheckpointError` saying what to do (a full disk says so)."""
    if isinstance(err, CheckpointError) or not isinstance(err, Exception):
        return err
    hint = "nothing was committed; the previous checkpoint at this path, if any, is intact"
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "the file system is full (or over quota): free space or save elsewhere; " + hint
    wrapped = CheckpointError(f"{phase} failed: {type(err).__name__}: {err}; {hint}", path=path)
    wrapped.__cause__ = err
    return wrapped


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; a world of one is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def summarize(err: CheckpointException) -> str:
    """DCP's collective exception as one line per failed rank."""
    failures = getattr(err, "failures", {}) or {}
    parts = []
    for r, exc in sorted(failures.items()):
        exc = exc[0] if isinstance(exc, tuple) else exc
        text = str(exc).strip().splitlines()
        parts.append(f"rank {r}: {type(exc).__name__}{': ' + text[-1] if text else ''}")
    return "; ".join(parts) or str(err)

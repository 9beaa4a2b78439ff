"""Staging directories and the atomic publication of a finished checkpoint.

Ranks write into ``<parent>/.<name>.tdcp-staging-<id>``; once every rank has
finished and the manifest is written, :func:`publish` swaps the staging directory
into place (``renameat2(RENAME_EXCHANGE)`` on Linux: an existing checkpoint at the
destination is replaced in one step) and fsyncs the parent.

Example:
    >>> from pathlib import Path
    >>> from torchrl_dcp.storage.commit import staging_path
    >>> staging_path(Path("/ckpts/step-100"), "abc").name
    '.step-100.tdcp-staging-abc'
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import uuid
from pathlib import Path

STAGING_TAG = ".tdcp-staging-"
TRASH_TAG = ".tdcp-trash-"

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_path(destination: Path, token: str | None = None) -> Path:
    return destination.parent / f".{destination.name}{STAGING_TAG}{token or uuid.uuid4().hex}"


def trash_path(destination: Path) -> Path:
    return destination.parent / f".{destination.name}{TRASH_TAG}{uuid.uuid4().hex}"


def stale_entries(destination: Path) -> list[Path]:
    """Staging and trash directories left behind by failed or killed saves to ``destination``."""
    prefixes = (f".{destination.name}{STAGING_TAG}", f".{destination.name}{TRASH_TAG}")
    try:
        return [p for p in destination.parent.iterdir() if p.name.startswith(prefixes)]
    except FileNotFoundError:
        return []


def remove_tree(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary name, fsync it and rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False when the platform or file system cannot."""
    libc_name = ctypes.util.find_library("c")
    if not libc_name:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    res = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if res == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish(staging: Path, destination: Path) -> None:
    """Move a complete staging directory to ``destination``, replacing what is there atomically.

    With no checkpoint at ``destination`` this is one ``rename``. Over an existing
    one the two are exchanged in one step and the old one is removed afterwards;
    where the file system cannot exchange, the old one is first renamed aside, so a
    crash leaves either the old or the new checkpoint, plus a trash directory that
    the next save removes.
    """
    fsync_path(staging)
    if destination.exists() or destination.is_symlink():
        if _exchange(staging, destination):
            fsync_path(destination.parent)
            remove_tree(staging)  # now holds the old checkpoint
            return
        trash = trash_path(destination)
        os.rename(destination, trash)
        os.rename(staging, destination)
        fsync_path(destination.parent)
        remove_tree(trash)
        return
    os.rename(staging, destination)
    fsync_path(destination.parent)

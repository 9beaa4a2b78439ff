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
import errno
import fcntl
import os
import shutil
import socket
import time
import uuid
from pathlib import Path

from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.storage.libc import libc

STAGING_TAG = ".tdcp-staging-"
TRASH_TAG = ".tdcp-trash-"
LOCK_TAG = ".tdcp-lock"

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


def lock_path(destination: Path) -> Path:
    return destination.parent / f".{destination.name}{LOCK_TAG}"


class DestinationLock:
    """Exclusive, non-blocking lock on one checkpoint path, held by rank 0 from staging to publish.

    ``flock`` on ``.<name>.tdcp-lock`` beside the destination: a second job saving to
    the same path gets a :class:`CheckpointError` at once instead of interleaving its
    files or deleting the first job's staging directory. The kernel drops the lock
    when its holder dies (SIGKILL included), so a killed save never blocks the next.
    The lock file is removed while still locked; a waiter that locked a removed file
    notices (inode check) and retries on the new one.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from torchrl_dcp.storage.commit import DestinationLock
        >>> with DestinationLock(Path(tempfile.mkdtemp()) / "step-1"):
        ...     pass
    """

    def __init__(self, destination: Path, wait: float = 2.0) -> None:
        self.destination = destination
        self.path = lock_path(destination)
        self.wait = wait  # seconds to retry a held lock before failing (rides over a brief sweep)
        self._fd: int | None = None

    def acquire(self) -> DestinationLock:
        deadline = time.monotonic() + self.wait
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _read_holder(fd)
                os.close(fd)
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise CheckpointError(
                    f"another save to this path is in progress (lock {self.path.name} held by {holder}); "
                    "two jobs must not save to the same checkpoint: wait for it to finish or choose another path",
                    path=self.destination,
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the previous holder removed the file between our open and flock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
            self._fd = fd
            return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> DestinationLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def sweep_stale_locks(directory: Path) -> None:
    """Remove lock files left by killed saves in ``directory`` (a lock held by a live save is left alone)."""
    try:
        names = [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(LOCK_TAG)]
    except OSError:
        return
    for path in names:
        lock = DestinationLock(path.parent / path.name[1 : -len(LOCK_TAG)], wait=0.0)
        try:
            lock.acquire()
        except (CheckpointError, OSError):
            continue
        lock.release()


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace") or "another process"
    except OSError:
        return "another process"


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
    renameat2 = getattr(libc(), "renameat2", None)
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

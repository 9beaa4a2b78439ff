"""Opening files found in a checkpoint location, which is hostile ground: no link followed, no FIFO waited on.

Every read of a checkpoint file goes through :func:`open_regular` (``O_NOFOLLOW |
O_NONBLOCK``, then ``fstat``: a symlink, FIFO, device or directory planted where a file
is expected is refused before a byte is read); :func:`read_whole` bounds a small
file's size before reading it.

Example:
    >>> import os, tempfile
    >>> from torchrl_dcp.storage.files import read_whole
    >>> path = os.path.join(tempfile.mkdtemp(), "f")
    >>> with open(path, "wb") as f:
    ...     _ = f.write(b"abc")
    >>> read_whole(path, limit=10)
    b'abc'
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str | os.PathLike, where: Any = None) -> int:
    """Open ``path`` for reading without following a symlink; refuse anything but a regular file.

    ``O_NONBLOCK`` makes opening a FIFO return at once (instead of waiting for a
    writer), so it is refused rather than hanging the job.

    Raises:
        CheckpointIntegrityError: missing, a symlink, or not a regular file (naming ``where``).
    """
    where = path if where is None else where
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointIntegrityError("file listed in the manifest is missing", path=where) from None
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise CheckpointIntegrityError(
                "is a symbolic link; checkpoints never hold links: refused", path=where
            ) from None
        raise CheckpointIntegrityError(f"cannot be opened ({err.strerror})", path=where) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointIntegrityError("is not a regular file (a FIFO, device or directory): refused", path=where)
    return fd


def read_whole(path: str | os.PathLike, limit: int, where: Any = None, expected_size: int | None = None) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (and exactly ``expected_size`` when given)."""
    fd = open_regular(path, where)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointFormatError(
                f"is implausibly large ({size} bytes, at most {limit} expected)", path=where or path
            )
        if expected_size is not None and size != expected_size:
            raise CheckpointIntegrityError(
                f"size is {size} bytes, the manifest says {expected_size}: truncated or altered", path=where or path
            )
        chunks, done = [], 0
        while done < size:
            chunk = os.pread(fd, size - done, done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)

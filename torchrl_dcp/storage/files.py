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

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import Any

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError, from_os_error

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def absent_because(path: str | os.PathLike) -> str:
    """Why nothing is found at ``path``, said as a user can act on it: it does not exist, or it is a symbolic link
    whose target does not exist, or that loops.

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); os.symlink(d + "/b", d + "/a"); os.symlink(d + "/a", d + "/b")
        >>> absent_because(d + "/a"), absent_because(d + "/missing")
        ('the path is a symbolic link that loops (too many levels of symbolic links)', 'the path does not exist')
    """
    try:
        target = os.readlink(path)
    except OSError:
        return "the path does not exist"
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "the path is a symbolic link that loops (too many levels of symbolic links)"
        return f"the path is a symbolic link to {target}, which does not exist"
    return "the path does not exist"  # (made since it was looked at)


def is_real_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory itself: not a link to one (never followed), not a file, not absent."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(path: str | os.PathLike, where: Any = None) -> int:
    """Open ``path`` for reading without following a symlink; refuse anything but a regular file.

    ``O_NONBLOCK`` makes opening a FIFO return at once (instead of waiting for a
    writer), so it is refused rather than hanging the job.

    Raises:
        CheckpointIntegrityError: missing, a symlink, or not a regular file (naming ``where``).
        CheckpointError: it cannot be opened now (a permission, an I/O error), naming ``where`` and what to do.
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
        if err.errno == errno.ENOTDIR:  # (a file where a directory of the path should be: nothing is here)
            raise CheckpointIntegrityError("file listed in the manifest is missing", path=where) from None
        # not a judgement on the checkpoint (a permission, an I/O error): a read that failed now, said as such (a
        # rotation then raises it instead of taking the entry for damaged and resuming an older one)
        raise from_os_error(OSError(err.errno, err.strerror), "opening it for reading", where) from None
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


class DirHandle:
    """A directory opened once (``O_DIRECTORY | O_NOFOLLOW``): every file in it is created, opened, renamed and
    checked relative to that descriptor, never through a path an attacker could swap for a link.

    Example:
        >>> import os, tempfile
        >>> d = DirHandle.open(tempfile.mkdtemp())
        >>> fd = d.create("f"); _ = os.write(fd, b"abc"); os.close(fd)
        >>> d.names(), d.lstat("f").st_size
        (['f'], 3)
        >>> d.close()
    """

    def __init__(self, path: Any, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def open(cls, path: Any) -> DirHandle:
        """Open the directory ``path`` itself (a symlink there is refused)."""
        try:
            fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CheckpointIntegrityError(
                    "is not a directory (a symbolic link or a file was put in its place): refused", path=path
                ) from None
            raise
        return cls(path, fd)

    @property
    def name(self) -> str:
        """The directory's own name."""
        return self.path.name

    def __truediv__(self, name: str) -> Any:
        """The path of ``name`` inside (for messages; files are reached through the descriptor)."""
        return self.path / name

    def create(self, name: str, mode: int = 0o644, flags: int = os.O_WRONLY) -> int:
        """Create ``name`` as a new file (``O_EXCL | O_NOFOLLOW``: nothing planted there is opened)."""
        return os.open(name, flags | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=self.fd)

    def open_file(self, name: str, flags: int = os.O_RDONLY) -> int:
        """Open the regular file ``name`` (no link followed, no FIFO waited on)."""
        try:
            fd = os.open(name, flags | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, dir_fd=self.fd)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise CheckpointIntegrityError("is a symbolic link: refused", path=self / name) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointIntegrityError("is not a regular file: refused", path=self / name)
        return fd

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str, missing_ok: bool = False) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def link(self, source: Any, name: str) -> None:
        """Hard-link ``source`` (a path, not followed if a link) as ``name`` inside."""
        os.link(source, name, dst_dir_fd=self.fd, follow_symlinks=False)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def fsync(self) -> None:
        os.fsync(self.fd)

    def inode(self) -> tuple[int, int]:
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def check_tree(self, expected: dict[str, int]) -> None:
        """Exactly ``expected`` (``{name: size}``) is inside: regular files of those sizes, nothing else, no link.

        Raises:
            CheckpointIntegrityError: naming the first file that differs.
        """
        found = set(self.names())
        for name in sorted(found - set(expected)):
            raise CheckpointIntegrityError(
                "appeared in the staging directory, which no save writes: another process tampered with it; "
                "nothing was committed",
                path=self / name,
            )
        for name, size in sorted(expected.items()):
            try:
                st = self.lstat(name)
            except FileNotFoundError:
                raise CheckpointIntegrityError(
                    "is missing from the staging directory (written elsewhere, or removed): nothing was committed",
                    path=self / name,
                ) from None
            if not stat.S_ISREG(st.st_mode) or st.st_nlink < 1 or st.st_size != size:
                raise CheckpointIntegrityError(
                    f"is not the regular file of {size} bytes this save wrote: another process tampered with the "
                    "staging directory; nothing was committed",
                    path=self / name,
                )


@contextlib.contextmanager
def naming(path: Any) -> Iterator[None]:
    """An ``OSError`` raised inside names ``path`` when it names no file (a ``pwrite`` on a descriptor names none):
    the error a save reports then says which file failed."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = str(path)
        raise

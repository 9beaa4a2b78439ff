"""The one error family of torchrl_dcp.

Every refusal (a foreign or damaged checkpoint, an unencodable value, an
incompatible component, a world-size change) raises a :class:`CheckpointError`
or one of its subclasses, so ``except tdcp.CheckpointError`` catches them all.

Example:
    >>> from torchrl_dcp import CheckpointError
    >>> try:
    ...     raise CheckpointError("no manifest.json", path="/tmp/x")
    ... except CheckpointError as err:
    ...     print(err)
    /tmp/x: no manifest.json
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import PurePath
from typing import Any


class _CheckpointErrorBase(RuntimeError):
    """Where :class:`CheckpointError` derives from ``RuntimeError`` until :func:`adopt_torchrl_base` makes it derive
    from ``torchrl.checkpoint.CheckpointError`` (a class of the same layout)."""


class CheckpointError(_CheckpointErrorBase):
    """A checkpoint could not be saved, read or restored.

    Once torchrl is imported by this library (any save or load does) it is also a
    ``torchrl.checkpoint.CheckpointError``, so code written for torchrl's checkpoints
    catches ours too.

    Args:
        message: what was expected and what was found, and what to do next.
        path: the checkpoint, file or member concerned (prefixed to the message).
        result: the partial :class:`~torchrl_dcp.LoadResult` when a load failed.
    """

    def __init__(self, message: str, *, path: Any = None, result: Any = None) -> None:
        where = None if path is None else str(path)
        super().__init__(_text(where, message))  # (torchrl's base sets its own ``result``: ours is set after)
        self.path = where
        self.result = result
        self.message = message

    def extend(self, note: str) -> None:
        """Append ``note`` (``"; "``-separated) to the message, e.g. what a failed rollback left behind."""
        self.reword(f"{self.message}; {note}")

    def reword(self, message: str) -> None:
        """Replace the message (the path kept), e.g. to name the rank an error of a world of one happened on."""
        self.message = message
        self.args = (_text(self.path, self.message),)

    def place(self, path: Any) -> None:
        """Name ``path`` where the error names no file yet (an adapter's check, which never knows the checkpoint)."""
        if self.path is None and path is not None:
            self.path = str(path)
            self.args = (_text(self.path, self.message),)

    def relocate(self, old: str, new: str) -> None:
        """Say ``new`` where the path and the message say ``old`` (a local copy's path, replaced by what it copies:
        an archive in a store a conversion read through this machine's disk)."""
        if self.path is not None and str(self.path).startswith(old):
            self.path = new + str(self.path)[len(old) :]
        self.message = self.message.replace(old, new)
        self.args = (_text(self.path, self.message),)

    def __reduce__(self):  # keep the keyword arguments when sent between ranks
        return (_rebuild, (type(self), self.message, self.path))


def _text(path: str | None, message: str) -> str:
    """``message`` after ``path``, whose unprintable characters are escaped (a NUL or a newline in a forged member
    name would otherwise reach the terminal as they are)."""
    if not path:
        return message
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in path)
    return f"{shown}: {message}"


def _rebuild(cls: type, message: str, path: str | None) -> CheckpointError:
    return cls(message, path=path)


def adopt_torchrl_base() -> None:
    """Make :class:`CheckpointError` (and so every error of this library) a ``torchrl.checkpoint.CheckpointError``.

    Called when the library first imports torchrl (errors stay torch-free until then, for the CLI's
    torch-free tools); a torchrl without ``torchrl.checkpoint`` leaves the errors as they are.
    """
    if CheckpointError.__bases__ != (_CheckpointErrorBase,):
        return
    try:
        from torchrl.checkpoint import CheckpointError as TorchrlCheckpointError
    except ImportError:
        return
    CheckpointError.__bases__ = (TorchrlCheckpointError,)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing committed exists at the given path."""


class CheckpointReplacedError(CheckpointNotFoundError):
    """The checkpoint a load was reading was replaced or removed meanwhile (another process saved over it, or a
    rotation pruned it): nothing was restored, and nothing is damaged; load again (a rotation's resume lists its
    entries again itself)."""


class CheckpointFormatError(CheckpointError):
    """The path is not a torchrl_dcp checkpoint, or its manifest is malformed."""


class CheckpointVersionError(CheckpointFormatError):
    """The checkpoint was written by a newer format than this library reads."""


class CheckpointIntegrityError(CheckpointError):
    """A data file is missing, has the wrong size, or fails its checksum."""


class UnsafeCheckpointError(CheckpointIntegrityError):
    """A file asked to run code on load (pickle globals outside the allow-list)."""


class EncodingError(CheckpointError, TypeError):
    """A value cannot be stored without pickle; raised at save time."""


class IncompatibleComponentError(CheckpointError):
    """A saved component cannot be restored into the registered object."""


class WorldSizeMismatchError(CheckpointError):
    """Per-rank state was saved with another number of ranks."""


class CollectiveError(CheckpointError):
    """Another rank failed during a collective save or load."""


_OS_HINTS = {
    errno.ENAMETOOLONG: "a file name is too long for this file system (torchrl_dcp adds up to 47 characters for its "
    "temporary names): choose a shorter name",
    errno.ENOSPC: "the file system is full: free space or write elsewhere",
    errno.EDQUOT: "the disk quota is exceeded: free space or write elsewhere",
    errno.EFBIG: "a file would pass the largest size allowed (this process's file size limit, `ulimit -f`, or the "
    "file system's): raise the limit or write elsewhere",
    errno.EACCES: "permission denied: check the permissions of the path and its directory",
    errno.EPERM: "operation not permitted: check the permissions and the owner of the path",
    errno.EROFS: "the file system is read-only: write elsewhere",
    errno.ELOOP: "a symbolic link is in the way; torchrl_dcp never follows links it finds in a checkpoint "
    "directory: remove the link",
    errno.ENOENT: "a file or directory disappeared or does not exist (another process may have removed it)",
    errno.ENOTDIR: "a path component is not a directory",
    errno.EISDIR: "a directory is where a file was expected",
    errno.EEXIST: "something already exists at this path (a file where a directory is needed, or one left by another "
    "process): choose another path, or move it",
}


class TorchrlDcpWarning(UserWarning):
    """The base of every warning torchrl_dcp emits: filter them all by this category, or each by its own.

    Example:
        >>> import warnings, torchrl_dcp as tdcp
        >>> warnings.simplefilter("error", tdcp.TorchrlDcpWarning)  # every torchrl_dcp warning becomes an error
    """


class InexactResumeWarning(TorchrlDcpWarning):
    """A component holds state that its checkpoint does not restore, so training after a restore will not continue
    exactly as it would have (the message names the component, the object and what differs). Emitted at save and
    at load; filter it by category, or make it an error to refuse inexact resumes.

    Example:
        >>> import warnings, torchrl_dcp as tdcp
        >>> warnings.simplefilter("error", tdcp.InexactResumeWarning)  # refuse inexact resumes
    """


class UnrestoredComponentWarning(TorchrlDcpWarning):
    """A load restores fewer components than the checkpoint holds: saved components that no object is registered
    for are skipped (a component a job registers lazily, after its first save, would otherwise resume silently
    from nothing). Not raised when the load names its ``components=`` itself.

    Example:
        >>> import warnings, torchrl_dcp as tdcp
        >>> warnings.simplefilter("error", tdcp.UnrestoredComponentWarning)  # make it fatal
    """


class PartialLoadWarning(TorchrlDcpWarning):
    """A load with ``strict="warn"`` skipped components it could not restore (missing, incompatible, or failing in
    their adapter); ``LoadResult.missing`` / ``incompatible`` say which, and why."""


class LocalTierWarning(TorchrlDcpWarning):
    """A save to the local tier (:class:`~torchrl_dcp.LocalTier`) failed: the job goes on, the shared tier's saves
    are made as scheduled, and a resume falls back to the newest step either tier holds."""


class StaleCheckpointWarning(TorchrlDcpWarning):
    """A rotation directory holds higher steps committed before the checkpoint just saved."""


def os_error_hint(err: OSError) -> str:
    """What to do about ``err`` (a full disk, a permission, a file size limit...), or ``""``.

    Example:
        >>> import errno
        >>> os_error_hint(OSError(errno.EROFS, "Read-only file system"))
        'the file system is read-only: write elsewhere'
    """
    if err.errno == errno.ENOTDIR and isinstance(err.filename, (str, os.PathLike)):
        blocking = _file_on_the_way(os.fsdecode(err.filename))
        if blocking is not None:
            return f"{blocking} is a file where a directory is needed: choose another path, or move that file"
    if err.errno == errno.EEXIST and isinstance(err.filename, (str, os.PathLike)):
        dangling = _dangling_link(os.fsdecode(err.filename))
        if dangling is not None:
            link, target = dangling
            return f"{link} is a link to {target}, which does not exist: create that directory, or pass another path"
    return _OS_HINTS.get(err.errno or 0, "")


def _dangling_link(path: str) -> tuple[str, str] | None:
    """``(link, its target)`` where ``path`` or one of its parents is a link to nothing (``None``: none is)."""
    for p in (PurePath(path), *PurePath(path).parents):
        try:
            if stat.S_ISLNK(os.lstat(p).st_mode) and not os.path.exists(p):
                return str(p), os.readlink(p)
        except OSError:
            continue
    return None


def _file_on_the_way(path: str) -> str | None:
    """The first parent of ``path`` that exists and is not a directory (``None``: none)."""
    for p in reversed(PurePath(path).parents):
        try:
            if not stat.S_ISDIR(os.stat(p).st_mode):
                return str(p)
        except OSError:
            return None
    return None


def from_os_error(err: OSError, action: str, path: Any = None, *, after: str = "") -> CheckpointError:
    """An ``OSError`` as a :class:`CheckpointError` naming the path, what failed and what to do.

    ``path`` is named when the error names no file; ``after`` is appended (e.g. what was left unchanged).

    Example:
        >>> import errno
        >>> print(from_os_error(OSError(errno.ENOSPC, "No space left on device"), "writing", "/c.zip"))
        /c.zip: writing failed: No space left on device [ENOSPC]; the file system is full: free space or write elsewhere
    """
    if isinstance(err, CheckpointError):
        return err
    where = err.filename if err.filename is not None else path
    code = errno.errorcode.get(err.errno or 0, str(err.errno))
    reason = err.strerror or str(err) or type(err).__name__
    hint = os_error_hint(err)
    message = f"{action} failed: {reason} [{code}]" + (f"; {hint}" if hint else "") + (f"; {after}" if after else "")
    wrapped = CheckpointError(
        message, path=os.fsdecode(where) if isinstance(where, (str, bytes, os.PathLike)) else where
    )
    wrapped.__cause__ = err
    return wrapped

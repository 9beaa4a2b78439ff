"""Staging directories and the atomic publication of a finished checkpoint.

Ranks write into ``<parent>/.<name>.tdcp-staging-<id>``; once every rank has
finished and the manifest is written, :func:`publish` swaps the staging directory
into place (``renameat2(RENAME_EXCHANGE)`` on Linux: an existing checkpoint at the
destination is replaced in one step) and fsyncs the parent.

The directory is shared ground: nothing here follows a symlink or opens a
non-regular file it finds there. Lock files and temporary files are opened with
``O_NOFOLLOW`` (and created with ``O_EXCL``), lock files must be regular files
with one link, and removals never descend through a link.

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
import re
import socket
import stat
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrl_dcp._log import get_logger
from torchrl_dcp.errors import CheckpointError, from_os_error
from torchrl_dcp.format.layout import MANIFEST, is_library_file
from torchrl_dcp.storage import proven
from torchrl_dcp.storage.files import DirHandle
from torchrl_dcp.storage.libc import libc

if TYPE_CHECKING:
    from typing_extensions import Self

logger = get_logger(__name__)

STAGING_TAG = ".tdcp-staging-"
TRASH_TAG = ".tdcp-trash-"
TMP_TAG = ".tdcp-tmp-"  # temporary files of conversions (``storage/archive.py``)
LOCK_TAG = ".tdcp-lock"

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # never block on a FIFO planted where a file is expected
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

_HOLDER = re.compile(rb"pid [0-9]{1,10} on [^\n]{0,200}")  # what a lock file holds (its holder), once written
_LOCK_ATTEMPTS = 100  # a lock file that vanished between creation and open this often is not a race
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_RENAME_NOREPLACE = 1


def staging_path(destination: Path, token: str | None = None) -> Path:
    return destination.parent / f".{destination.name}{STAGING_TAG}{token or uuid.uuid4().hex}"


def trash_path(destination: Path) -> Path:
    return destination.parent / f".{destination.name}{TRASH_TAG}{uuid.uuid4().hex}"


#: the staging, trash and temporary names a save or conversion makes: the tag, then a 32-digit hex token
_LEFTOVER_NAME = re.compile(
    r"^\.(.+)(?:" + "|".join(re.escape(t) for t in (STAGING_TAG, TRASH_TAG, TMP_TAG)) + r")[0-9a-f]{32}$", re.DOTALL
)


def leftover_owner(name: str) -> str | None:
    """The entry a staging, trash or temporary name of ours was made for, or ``None``: a name no save or conversion
    makes (a user's ``.step-1.tdcp-tmp-mine``) is never taken for one of ours.

    Example:
        >>> leftover_owner(".step-1.zip.tdcp-tmp-" + "0" * 32), leftover_owner(".step-1.tdcp-tmp-mine")
        ('step-1.zip', None)
    """
    m = _LEFTOVER_NAME.match(name)
    return None if m is None else m.group(1)


def stale_entries(destination: Path) -> list[Path]:
    """Staging, trash and temporary entries left behind by failed or killed saves/conversions to ``destination``.

    Only call this while holding :class:`DestinationLock` on ``destination``: every
    writer of these names holds it, so what is found then belongs to a dead writer.
    """
    try:
        return [p for p in destination.parent.iterdir() if leftover_owner(p.name) == destination.name]
    except (FileNotFoundError, NotADirectoryError):
        return []


def sweep_leftovers(destination: Path, remove: Callable[[Path], Any] | None = None) -> None:
    """Remove what failed or killed saves and conversions to ``destination`` left (:func:`stale_entries`; hold its
    :class:`DestinationLock`), with ``remove`` (:func:`remove_tree`). One that cannot be removed (a read-only
    checkpoint a commit replaced, left beside it) is kept with a warning naming it: it never fails the save or
    conversion, which writes beside it under a name of its own."""
    import warnings

    from torchrl_dcp.errors import TorchrlDcpWarning

    for stale in stale_entries(destination):
        try:
            (remove or remove_tree)(stale)
        except OSError as err:
            warnings.warn(
                f"{destination}: {stale.name}, left by an earlier save or conversion to this path, could not be removed "
                f"({type(err).__name__}: {err}); it is left as it is: remove it by hand (check its permissions)",
                TorchrlDcpWarning,
                stacklevel=3,
            )


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
        """Take the lock (retrying a held one for ``wait`` seconds).

        Raises:
            CheckpointError: the lock is held by another save, or the lock path is a
                symlink or not a regular file (never written through), or cannot be created.
        """
        deadline = time.monotonic() + self.wait
        vanished = 0
        while True:
            fd = open_lock_file(self.path, self.destination)
            if fd is None:  # removed between our attempts: try again, a bounded number of times
                vanished += 1
                if vanished > _LOCK_ATTEMPTS and time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"the lock file {self.path.name} cannot be created here (it vanishes as soon as it is made: "
                        "not a regular directory, e.g. under /proc?); choose a checkpoint path on a real file system",
                        path=self.destination,
                    )
                time.sleep(0.001 * min(vanished, 10))
                continue
            try:
                locked = _try_flock(fd)
            except OSError as err:  # flock unsupported here (some network file systems)
                os.close(fd)
                raise from_os_error(err, "locking the lock file", self.path) from None
            if not locked:
                holder = _read_holder(fd)
                os.close(fd)
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise CheckpointError(
                    f"another save to this path is in progress (lock {self.path.name} held by {holder}); "
                    "two jobs must not save to the same checkpoint: wait for it to finish or choose another path",
                    path=self.destination,
                )
            if not _still_linked(fd, self.path):  # the previous holder removed the file between our open and flock
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()[:200]}".encode(), 0)
            except OSError as err:
                os.close(fd)
                raise from_os_error(err, "writing the lock file", self.path) from None
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

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def sweep_stale_locks(directory: Path) -> None:
    """Remove lock files left by killed saves in ``directory`` (a lock held by a live save is left alone).

    Only regular files with one link are removed, each after taking its ``flock``;
    a symlink, FIFO, directory or hard link named like a lock is never opened
    through, written or removed (it is logged and left for its owner).
    """
    try:
        paths = [p for p in directory.iterdir() if p.name.startswith(".") and p.name.endswith(LOCK_TAG)]
    except OSError:
        return
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            logger.warning("left %s alone: named like a lock file but not a regular file with one link", path)
            continue
        try:
            fd = open_lock_file(path, path)
        except CheckpointError as err:
            logger.warning("left %s alone: %s", path, err.message)
            continue
        if fd is None:
            continue
        try:
            if _try_flock(fd) and _still_linked(fd, path):
                path.unlink(missing_ok=True)  # unlink never follows; the file was checked regular above
        except OSError:
            pass
        finally:
            os.close(fd)


def open_lock_file(path: Path, destination: Path) -> int | None:
    """Open (creating if absent) the lock file ``path`` without following links; ``None`` if it vanished.

    Raises:
        CheckpointError: ``path`` is a symlink, not a regular file, has other hard
            links, or cannot be opened (naming ``path`` and what to do).
    """
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
        except FileExistsError:
            fd = os.open(path, os.O_RDWR | _NOFOLLOW | _CLOEXEC | _NONBLOCK)
    except FileNotFoundError:
        if path.parent.is_dir():
            return None  # removed by its holder between the two opens
        raise CheckpointError("the directory of this lock file does not exist", path=path) from None
    except OSError as err:
        if err.errno == errno.ELOOP or path.is_symlink():
            raise CheckpointError(
                f"lock file {path.name} is a symbolic link; torchrl_dcp never writes through a link in a checkpoint "
                f"directory: remove {path} (check who planted it) and save again",
                path=destination,
            ) from None
        if err.errno in (errno.EISDIR, errno.ENXIO):
            raise _not_regular(path, destination) from None
        raise from_os_error(err, "opening the lock file", path) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        raise _not_regular(path, destination)
    if st.st_size and not _HOLDER.fullmatch(os.pread(fd, 512, 0)):  # (a lock file holds its holder, or nothing yet)
        os.close(fd)
        raise CheckpointError(
            f"{path.name} is named like this path's lock file but holds what a save never writes there (a file of "
            f"yours?); it is left as it is: move or rename it, and save again",
            path=destination,
        )
    return fd


def _not_regular(path: Path, destination: Path) -> CheckpointError:
    return CheckpointError(
        f"lock file {path.name} is not a regular file with a single link (a FIFO, device, directory or hard link "
        f"planted there); it is never written: remove {path} and save again",
        path=destination,
    )


def _try_flock(fd: int) -> bool:
    """Take an exclusive ``flock`` without waiting: False when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _still_linked(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the open file ``fd`` (not removed or replaced since it was opened)."""
    try:
        return os.lstat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace") or "another process"
    except OSError:
        return "another process"


def remove_tree(path: Path) -> list[str]:
    """Remove what this library wrote at ``path``: a file or link (itself, never what it points to), or a directory
    with the files a save or conversion writes there (:func:`is_ours`, the manifest first), in the staging and trash
    directories of ours it holds too, and each directory left empty (a user's subdirectory is kept whole, whatever
    its files are named). Anything else (a user's file, put into a checkpoint, its staging or its
    trash at any moment, or left there by a killed prune) is kept, with the directories holding it: returns their
    paths relative to ``path`` (``[]``: all removed), and logs them. Links are never followed (directory file
    descriptors opened ``O_NOFOLLOW``)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # (a file where a parent directory should be: nothing here)
        return []
    if not stat.S_ISDIR(st.st_mode):
        path.unlink(missing_ok=True)
        return []
    _unlink_proven_files(path)
    parent = os.open(path.parent, os.O_RDONLY | _DIRECTORY | _CLOEXEC)  # (the caller's directory: may be a link)
    try:
        kept = _remove_ours(parent, path.name, "")
    finally:
        os.close(parent)
    if kept:
        logger.warning("%s: kept %s, which this library never writes (everything of its own was removed)", path,
                       kept[:5])  # fmt: skip
    return kept


def is_ours(name: str) -> bool:
    """Whether ``name`` is a file a save or conversion writes into a checkpoint or its staging area: data, chunk,
    metadata, manifest and shard files (:func:`~torchrl_dcp.format.layout.is_library_file`) and their temporary
    files (``.manifest.json.tmp-<hex>``, DCP's ``.metadata.tmp``), or a leftover of ours inside one."""
    if is_library_file(name):
        return True
    m = _TEMPORARY.match(name)
    if m is not None:  # (``.metadata.tmp``: the dot is the name's; ``.manifest.json.tmp-<hex>``: a hidden temporary)
        base = m.group(1)
        if is_library_file(base) or (base.startswith(".") and is_library_file(base[1:])):
            return True
    return leftover_owner(name) is not None


#: leftovers of ours nest no deeper than this (a staging directory inside a trash directory inside ...)
_MAX_NESTED_LEFTOVERS = 4
_TEMPORARY = re.compile(r"^(.+?)\.tmp(?:-[0-9a-f]{32})?$")


def _library_entry(rel: str, is_dir: bool) -> bool:
    """What :func:`remove_tree` removes: names of ours (:func:`is_ours`); a directory only as a leftover of ours (a
    staging or trash directory of a save that replaced one inside this tree), never deeper than any save nests them:
    a user's directory is kept whole, whatever its files are named (a save never writes into a subdirectory), and
    whatever its own name (a directory named like one of our files, ``manifest-3.json/``, is never ours)."""
    name = rel.rpartition("/")[2]
    if is_dir:
        return leftover_owner(name) is not None and rel.count("/") < _MAX_NESTED_LEFTOVERS
    return is_ours(name)


def _remove_ours(
    parent_fd: int, name: str, prefix: str, take: Callable[[str, bool], bool] = _library_entry
) -> list[str]:
    """Remove from the directory ``name`` in the directory ``parent_fd`` what ``take(relative path, is a
    directory)`` accepts (``prefix``: its path in the tree), every step through directory file descriptors (no path
    re-resolved, no link followed), then the directory if left empty; returns what was kept."""
    try:
        fd = os.open(name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent_fd)
    except OSError:
        return [prefix or "."]
    kept: list[str] = []
    try:
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name != MANIFEST)  # (the manifest first: no longer a checkpoint)
        for entry in entries:
            rel = f"{prefix}{entry.name}"
            try:
                if entry.is_dir(follow_symlinks=False):
                    if take(rel, True):
                        kept += _remove_ours(fd, entry.name, f"{rel}/", take)
                    else:
                        kept.append(f"{rel}/")
                elif take(rel, False):  # (a link of such a name, planted: itself, never its target)
                    os.unlink(entry.name, dir_fd=fd)
                else:
                    kept.append(rel)
            except FileNotFoundError:
                continue
    finally:
        os.close(fd)
    if not kept:
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except FileNotFoundError:
            pass
        except OSError:  # (something made there meanwhile: kept, as it is)
            kept.append(prefix or ".")
    return kept


def remove_listed(path: Path, listed: Collection[str]) -> list[str]:
    """Remove the files ``listed`` (``/``-separated paths relative to ``path``: what another writer, e.g.
    ``torchrl.checkpoint``, wrote there) and the directories they leave empty, through directory file descriptors
    as :func:`remove_tree` does; ``path`` itself when it is a file or a link. Returns what was kept.

    Example:
        >>> import tempfile; from pathlib import Path
        >>> d = Path(tempfile.mkdtemp()) / "export"; (d / "a").mkdir(parents=True)
        >>> _ = (d / "a" / "x.pt").write_bytes(b"1"); _ = (d / "notes.txt").write_text("mine")
        >>> remove_listed(d, {"a/x.pt"}), sorted(p.name for p in d.iterdir())
        (['notes.txt'], ['notes.txt'])
    """
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    if not stat.S_ISDIR(st.st_mode):
        path.unlink(missing_ok=True)
        return []
    parents = {name.rpartition("/")[0] for name in listed}
    parents |= {p[:i] for p in parents for i in range(len(p)) if p[i] == "/"}
    parent = os.open(path.parent, os.O_RDONLY | _DIRECTORY | _CLOEXEC)  # (the caller's directory: may be a link)
    try:
        return _remove_ours(parent, path.name, "", lambda rel, is_dir: rel in (parents if is_dir else listed))
    finally:
        os.close(parent)


def _unlink_proven_files(path: Path) -> None:
    """Unlink the files of the directory ``path`` that :mod:`~torchrl_dcp.storage.proven` vouches for, keeping
    their proof (a pruned checkpoint's chunk files are often still linked by a newer one: their ``ctime`` moves).
    Only names this library writes (:func:`is_ours`): a user's name for one of them (a hard link into the entry) is
    the user's file, kept as every other."""
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
    except OSError:
        return
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                    if is_ours(entry.name) and stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and proven.knows(st):
                        proven.unlink_keeping_proof(fd, entry.name)
                except OSError:
                    continue  # rmtree removes (or reports nothing about) what is left
    finally:
        os.close(fd)


def remove_entry(path: Path) -> bool:
    """Delete an entry: renamed aside first, so a crash never leaves a half-deleted committed entry, then what this
    library wrote there removed (:func:`remove_tree`). A user's files in it are kept: the directory is renamed back
    holding only them (no longer a checkpoint), or, when its name was taken meanwhile, left where it is, named in
    the log. False when the entry was already gone (another process pruned it)."""
    if path.name.startswith("."):
        remove_tree(path)
        return True
    trash = trash_path(path)
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    if remove_tree(trash):
        try:
            os.rename(trash, path)
        except OSError:
            logger.warning("%s: what a user put there was kept at %s (the name was taken meanwhile)", path, trash)
    return True


def fsync_path(path: Path, *, follow: bool = False) -> None:
    """fsync a regular file or a directory we created; ``follow=True`` for a parent directory the user chose.

    Without ``follow``, ``path`` is opened with ``O_NOFOLLOW`` (a symlink fails) and
    must be a regular file or a directory. A parent directory given by the user
    (``ckpts -> /scratch/ckpts``) may legitimately be a link: it is opened with
    ``O_DIRECTORY``, so it is a directory or an error.
    """
    flags = os.O_RDONLY | _CLOEXEC | _NONBLOCK | (_DIRECTORY if follow else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as err:
        raise from_os_error(err, "opening for fsync", path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CheckpointError("expected a regular file or a directory, found another kind of file", path=path)
        os.fsync(fd)
    finally:
        os.close(fd)


def open_flags_nofollow() -> int:
    """Flags for opening a file found in a checkpoint directory: no link followed, no FIFO waited on."""
    return _NOFOLLOW | _NONBLOCK | _CLOEXEC


def create_exclusive(path: Path, mode: int = 0o644, flags: int = os.O_WRONLY) -> int:
    """Create ``path`` as a new file (``O_CREAT | O_EXCL | O_NOFOLLOW``) and return its descriptor.

    Nothing that already exists at ``path`` (a file, a planted symlink) is opened.

    Example:
        >>> import os, tempfile
        >>> from pathlib import Path
        >>> fd = create_exclusive(Path(tempfile.mkdtemp()) / "f"); os.close(fd)
    """
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)


def write_file_durably(path: Path, data: bytes, within: DirHandle | None = None) -> None:
    """Write ``data`` to ``path`` through a new temporary name (``O_EXCL``), fsync it and rename it into place.

    ``within``: the directory of ``path`` opened once; the temporary file is created and
    renamed through its descriptor (nothing resolves ``path``'s directory again).
    """
    tmp = f".{path.name}.tmp-{uuid.uuid4().hex}"
    fd = within.create(tmp) if within is not None else create_exclusive(path.with_name(tmp))
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if within is not None:
            within.replace(tmp, path.name)
        else:
            os.replace(path.with_name(tmp), path)  # rename replaces a link at ``path`` itself, never its target
    except BaseException:
        if within is not None:
            within.unlink(tmp, missing_ok=True)
        else:
            path.with_name(tmp).unlink(missing_ok=True)
        raise


def _renameat2(a: Path, b: Path, flags: int) -> int | None:
    """``renameat2(a, b, flags)``: 0, or the error number; ``None`` where the platform or file system has no such
    rename (no ``renameat2``, or the flag refused)."""
    renameat2 = getattr(libc(), "renameat2", None)
    if renameat2 is None:
        return None
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return 0
    err = ctypes.get_errno()
    return None if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP) else err


def _rename_new(a: Path, b: Path) -> bool:
    """Rename ``a`` to ``b`` where nothing is at ``b`` (``RENAME_NOREPLACE``); False when something is there now
    (made since it was looked at: the caller replaces it as it replaces what was there, checking it first). Where
    the file system cannot refuse to replace, a plain rename (which never replaces a non-empty directory)."""
    err = _renameat2(a, b, _RENAME_NOREPLACE)
    if err is None:
        os.rename(a, b)
        return True
    if err == errno.EEXIST:
        return False
    if err:
        raise OSError(err, os.strerror(err), str(b))
    return True


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False when the platform or file system cannot."""
    err = _renameat2(a, b, _RENAME_EXCHANGE)
    if err:
        raise OSError(err, os.strerror(err), str(b))
    return err == 0


def publish(
    staging: Path,
    destination: Path,
    expect: tuple[int, int] | None = None,
    replaceable: Callable[[Path], bool] | None = None,
    remove: Callable[[Path], list[str]] | None = None,
) -> None:
    """Move a complete staging directory to ``destination``, replacing what is there atomically.

    With no checkpoint at ``destination`` this is one ``rename``. Over an existing
    one the two are exchanged in one step and the old one is removed afterwards;
    where the file system cannot exchange, the old one is first renamed aside, so a
    crash leaves either the old or the new checkpoint, plus a trash directory that
    the next save removes. ``expect``: ``(st_dev, st_ino)`` of the staging directory the
    save wrote through; a staging path that names anything else now is refused.
    ``replaceable(old)``: whether what was at ``destination`` may be removed, asked once it is out of the way
    (what the caller checked before may have changed while it wrote: a user's file put into the old checkpoint,
    a directory made where there was none); if not, it is put back and nothing is committed.
    ``remove(old)``: deletes what was replaced, returning what it kept (default :func:`remove_tree`: our files only;
    an export replacing a ``torchrl.checkpoint`` one passes the remover of the files torchrl lists).
    """
    if expect is not None:
        st = os.lstat(staging)
        if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != expect:
            raise CheckpointError(
                "the staging directory was replaced while the save ran (another process tampered with it); "
                "nothing was committed",
                path=staging,
            )
    fsync_path(staging)
    if not (destination.exists() or destination.is_symlink()) and _rename_new(staging, destination):
        fsync_path(destination.parent, follow=True)
        return
    if _exchange(staging, destination):
        if replaceable is not None and not replaceable(staging):  # (staging now holds what was there)
            _exchange(staging, destination)
            raise _appeared(destination)
        fsync_path(destination.parent, follow=True)
        _remove_replaced(staging, destination, remove)  # now holds the old checkpoint (a user's file put there: kept)
        return
    trash = trash_path(destination)
    os.rename(destination, trash)
    if replaceable is not None and not replaceable(trash):
        os.rename(trash, destination)
        raise _appeared(destination)
    try:
        os.rename(staging, destination)
    except OSError as err:  # (something made at the path meanwhile): the previous checkpoint goes back
        try:
            os.rename(trash, destination)
        except OSError:
            kept = destination.with_name(f"{destination.name}.previous-{uuid.uuid4().hex[:8]}")  # (never swept)
            os.rename(trash, kept)
            raise CheckpointError(
                f"committing failed ({err.strerror}: something was made at this path while the save ran) and the "
                f"previous checkpoint could not be put back: it is at {kept}; move it back by hand",
                path=destination,
            ) from None
        raise _appeared(destination) from None
    fsync_path(destination.parent, follow=True)
    _remove_replaced(trash, destination, remove)


def _remove_replaced(old: Path, destination: Path, remove: Callable[[Path], list[str]] | None = None) -> None:
    """Remove the checkpoint a commit replaced (now at ``old``). The new one is committed already: a failure here
    (a read-only old checkpoint, an I/O error) is a warning naming where the old one is, never the save's failure
    (the save would be reported as failed, and retried, while it is committed)."""
    try:
        (remove or remove_tree)(old)
    except OSError as err:
        import warnings

        from torchrl_dcp.errors import TorchrlDcpWarning

        warnings.warn(
            f"{destination}: the save is committed, but the checkpoint it replaced could not be removed "
            f"({type(err).__name__}: {err}); it is left at {old}: remove it by hand (check its permissions; the next "
            "save to this directory tries again)",
            TorchrlDcpWarning,
            stacklevel=2,
        )


def _appeared(destination: Path) -> CheckpointError:
    return CheckpointError(
        "what is at this path changed while the save or conversion ran (a file put into the checkpoint, a directory "
        "made where there was none) and is not a checkpoint a save replaces: it was left as it is and nothing was "
        "committed; move it, or save elsewhere",
        path=destination,
    )

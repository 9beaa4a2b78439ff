"""Checkpoints as local directories (a shared file system too): the directory backend of :mod:`~.base`.

- Reading: :class:`DirectoryContainer` (every listed file opened without following
  links, sizes and checksums against the manifest, nothing unlisted).
- Saving: ranks write into ``<parent>/.<name>.tdcp-staging-<id>`` while rank 0 holds
  the destination's lock (:class:`~torchrl_dcp.storage.commit.DestinationLock`);
  ``.metadata`` and ``manifest.json`` are written last, then the staging directory is
  published atomically (:func:`~torchrl_dcp.storage.commit.publish`).
- Listing: the entries of a rotation directory (links, FIFOs and other kinds are
  ``other``), removal renamed aside first, leftovers of killed saves under their lock.
- Incremental saves: a kept chunk file is hard-linked (else copied) once it is proven
  to be the file recorded (size, regular file, identity trailer).

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp.storage.directory import DirectoryLocation
    >>> d = tempfile.mkdtemp()
    >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(d + "/c")
    >>> loc = DirectoryLocation(path)
    >>> sorted(loc.open_source().manifest()["files"]), loc.size() > 0
    (['.metadata', '__0_shared.distcp'], True)
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchrl_dcp._log import get_logger
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from torchrl_dcp.format import manifest as schema
from torchrl_dcp.format.checksums import checksum_mismatch
from torchrl_dcp.format.layout import (
    DCP_METADATA,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    TRAILER_SIZE,
    identity_trailer,
    is_data_file,
    is_library_file,
    read_identity,
)
from torchrl_dcp.storage.archive import ArchiveLocation
from torchrl_dcp.storage.base import (
    ByteRange,
    Entry,
    EntryKind,
    Leftover,
    Location,
    ManifestParts,
    SaveTarget,
    ShareWrite,
    WriteOutcome,
    check_listing,
    files_to_check,
    no_manifest,
)
from torchrl_dcp.storage.commit import (
    DestinationLock,
    leftover_owner,
    publish,
    remove_entry,
    remove_tree,
    staging_path,
    stale_entries,
    sweep_leftovers,
    sweep_stale_locks,
    write_file_durably,
)
from torchrl_dcp.storage.files import DirHandle, absent_because, open_regular, read_whole
from torchrl_dcp.storage.filesums import fds_checksums

if TYPE_CHECKING:
    from torchrl_dcp.storage.chunk_writer import KeptChunk
    from torchrl_dcp.storage.source import CheckpointSource

logger = get_logger(__name__)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class DirectoryContainer(ManifestParts):
    """A committed checkpoint directory (the :class:`~torchrl_dcp.storage.base.Container` protocol)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._manifest: dict[str, Any] | None = None

    def root(self) -> dict[str, Any]:
        if self._manifest is None:
            if not self.path.exists():  # (nothing, or a link to nothing: said which)
                raise CheckpointNotFoundError(f"no checkpoint here: {absent_because(self.path)}", path=self.path)
            if not self.path.is_dir():  # a link to a checkpoint directory is how users point at one: followed
                raise CheckpointFormatError("not a checkpoint directory", path=self.path)
            file = self.path / MANIFEST
            try:
                data = read_whole(file, MAX_MANIFEST_BYTES, file)
            except CheckpointIntegrityError as err:
                why = "" if not os.path.lexists(file) else f" ({MANIFEST} {err.message})"
                dcp_metadata = os.path.isfile(self.path / DCP_METADATA)
                raise CheckpointFormatError(no_manifest(dcp_metadata) + why, path=self.path) from None
            self._root_bytes, self._root_read = data, True  # (kept before the parse: a damaged one is told apart)
            self._manifest = schema.loads_manifest(data, file)
        return self._manifest

    def _listed(self, name: str) -> dict[str, Any] | None:
        return self.listed().get(name)

    def check(
        self,
        checksum: Iterable[str] | bool,
        progress: Callable[[int], None] | None = None,
        *,
        only: Collection[str] | None = None,
    ) -> None:
        files = self.listed()
        wanted = set(files) if checksum is True else set() if checksum is False else set(checksum)
        checked = files_to_check(files, wanted, only)
        fds: list[tuple[str, int]] = []
        try:
            for name, rec in checked.items():
                path = self.path / name
                fd = open_regular(path)
                size = os.fstat(fd).st_size
                if size != rec["size"]:
                    os.close(fd)
                    raise CheckpointIntegrityError(
                        f"size is {size} bytes, the manifest says {rec['size']}: truncated or altered", path=path
                    )
                if name in wanted:
                    fds.append((name, fd))
                else:
                    os.close(fd)
            for (name, _), actual in zip(
                fds, fds_checksums([(fd, 0, files[n]["size"], str(self.path / n)) for n, fd in fds], progress=progress)
            ):
                if actual != files[name]["checksum"]:
                    raise checksum_mismatch(actual, files[name]["checksum"], self.path / name)
        finally:
            for _, fd in fds:
                os.close(fd)
        if only is not None:
            return  # (the listing is rank 0's: one scan of the directory per load, not one per rank)
        check_listing(self._listing(files), self, lambda name: self.path / name)

    def _listing(self, files: Mapping[str, Any]) -> Iterator[tuple[str, int | None]]:
        """``(name, size)`` of what is here but the listed files (sized already); the size is ``None`` for anything but
        a regular file."""
        with os.scandir(self.path) as entries:  # (closed when the check stops early, at an unlisted file)
            for entry in entries:
                if entry.name not in files:
                    regular = entry.is_file(follow_symlinks=False)
                    yield entry.name, entry.stat(follow_symlinks=False).st_size if regular else None

    def read_member(self, name: str, limit: int) -> bytes | None:
        rec = self._listed(name)
        if rec is None:
            return None
        return read_whole(self.path / name, limit, self.path / name, expected_size=rec["size"])

    def byte_range(self, name: str) -> ByteRange:
        rec = self._listed(name)
        if rec is None:
            raise CheckpointIntegrityError("data file is not listed in the manifest: refused", path=self.path / name)
        return ByteRange(str(self.path / name), 0, rec["size"], str(self.path / name))


def refuse_working_directory(destination: Path) -> None:
    """Refuse to replace the process's working directory, or a directory holding it: a save or conversion replaces
    its destination whole, and the process would be left in a removed directory (where ``load(".")`` finds
    nothing)."""
    try:
        resolved, cwd = destination.resolve(), Path.cwd().resolve()
    except (OSError, RuntimeError):  # (a link loop, a removed working directory: left to the checks that open it)
        return
    if resolved == cwd or resolved in cwd.parents:
        raise CheckpointError(
            f"is {'the' if resolved == cwd else 'a directory holding the'} working directory of this process ({cwd}): "
            "a save or conversion replaces its destination whole and would leave the process in a removed "
            "directory; choose a path inside it (e.g. ./ckpt)",
            path=destination,
        )


def refuse_inside_checkpoint(destination: Path) -> None:
    """Refuse a destination inside a checkpoint directory: whatever a save or conversion writes there (its lock and
    staging entries first) is an entry the checkpoint's manifest does not list, and that checkpoint would no longer
    load. Only the ancestors holding a ``manifest.json`` are read (none, usually)."""
    try:
        resolved = destination.resolve()
    except (OSError, RuntimeError):  # (a link loop: left to the checks that open it)
        return
    for parent in resolved.parents:
        if not (parent / MANIFEST).is_file():
            continue
        try:
            DirectoryContainer(parent).manifest()
        except CheckpointError:
            continue  # a manifest.json that is not a checkpoint's: nothing of ours to damage
        raise CheckpointError(
            f"is inside the checkpoint {parent}: anything written there is an entry its manifest does not list, "
            "and it would no longer load; choose a path outside it",
            path=destination,
        )


def is_replaceable(destination: Path) -> bool:
    """Whether ``destination`` may be replaced by a save: an empty directory or a committed checkpoint holding
    nothing a save does not write (a file of the user's inside it is not deleted with it), or a damaged one of ours
    (:func:`damaged_checkpoint`: a resume skipped it with a warning, and the job saves that step again)."""
    if not destination.is_dir() or destination.is_symlink():
        return False
    if not any(destination.iterdir()):
        return True
    container = DirectoryContainer(destination)
    try:
        listed = container.manifest()["files"]
    except CheckpointError as err:
        return damaged_checkpoint(destination, container, err)
    return not foreign_entries(destination, listed)


def damaged_checkpoint(destination: Path, container: DirectoryContainer, err: CheckpointError) -> bool:
    """Whether ``destination``, whose manifest failed with ``err``, is a checkpoint of ours that is damaged and holds
    nothing else: its manifest is there and is ours (:meth:`~torchrl_dcp.storage.base.ManifestParts.root_damaged`),
    every entry is a file a save writes, and it holds data files, each ending with a save identity trailer (a plain
    DCP checkpoint's files carry none, a user's own ``manifest.json`` and ``.metadata`` are none: never replaced)."""
    return container.root_damaged(err) and _not_ours_because(destination) is None


def _not_ours_because(destination: Path) -> str | None:
    """Why a directory whose manifest is a damaged one of ours is not replaced (``None``: it is)."""
    foreign = foreign_entries(destination)
    if foreign:
        return f"it holds entries a checkpoint never holds ({foreign[:5]}): move them, or save elsewhere"
    names = sorted(name for name in os.listdir(destination) if is_data_file(name))
    if not names:  # (no evidence a save wrote it: a user's own manifest.json and .metadata)
        return "it holds no data file a save wrote: remove it yourself if it is a checkpoint, or save elsewhere"
    for name in names:
        try:
            fd = open_regular(destination / name, destination / name)
        except CheckpointError:
            return f"{name} is not a regular file: remove the directory yourself, or save elsewhere"
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, TRAILER_SIZE, size - TRAILER_SIZE) if size >= TRAILER_SIZE else b""
        finally:
            os.close(fd)
        if read_identity(tail) is None:
            return (
                f"{name} ends with no save identity (truncated, or not written by a save): remove the directory "
                "yourself if it is a damaged checkpoint, or save elsewhere"
            )
    return None


def _not_replaced(destination: Path) -> str:
    """Why a save refuses to replace ``destination`` (:func:`is_replaceable` said no)."""
    if _kind(destination) == "checkpoint" and any(destination.iterdir()):
        container = DirectoryContainer(destination)
        try:
            listed = container.manifest()["files"]
        except CheckpointVersionError as err:  # (a newer library's checkpoint: not damaged, never replaced)
            return f"holds a checkpoint this version cannot read ({err.message}); refusing to replace it"
        except CheckpointError as err:
            if container.root_damaged(err):
                return f"is a damaged checkpoint ({err}); refusing to replace it: {_not_ours_because(destination)}"
            if os.path.lexists(destination / MANIFEST) and not isinstance(err, CheckpointFormatError):
                return f"holds a checkpoint that cannot be read ({err.message}); refusing to replace it"
        else:
            return (
                f"holds entries a checkpoint never holds ({foreign_entries(destination, listed)[:5]}); refusing to "
                "replace it: move them, or save elsewhere"
            )
    if destination.is_symlink():
        return (
            "is a symbolic link: a save never writes through a link, refusing to replace it; move it elsewhere, then "
            "save again (a rotation saves each step at its own path: move that step's)"
        )
    if _kind(destination) == "checkpoint" and not os.path.lexists(destination / MANIFEST):
        return (
            f"is not a torchrl_dcp checkpoint (it holds no {MANIFEST}: a directory of yours, or a checkpoint that lost "
            "it); refusing to replace it: move it elsewhere, then save again (a rotation saves each step at its own "
            "path: move that step's)"
        )
    if _kind(destination) == "archive":
        try:
            ArchiveLocation(destination).manifest()
        except (CheckpointError, OSError):
            pass
        else:
            return (
                "is a checkpoint archive (one file, as to_archive writes it): a save writes a directory and never "
                "replaces an archive; save to another path, or unpack it first with to_directory"
            )
        return "is a file, not a checkpoint directory; refusing to replace it (choose another path)"
    return "exists and is not a torchrl_dcp checkpoint; refusing to replace it (choose another path)"


def foreign_entries(destination: Path, listed: Container[str] | None = None) -> list[str]:
    """What a committed checkpoint directory holds that no save writes there: other names, links, folders (the
    rule object stores apply to a prefix, :func:`~torchrl_dcp.storage.objectstore_save.foreign_objects`) and, given
    the files its manifest lists (``listed``, its shards' included), files named like ours that it does not list (a
    save leaves none: a user's ``__7_0.distcp`` is theirs)."""

    def ours(name: str) -> bool:
        if not is_library_file(name) or _kind(destination / name) != "archive":
            return False
        return listed is None or name == MANIFEST or name in listed

    return sorted(n for n in os.listdir(destination) if not ours(n))


def _kind(path: Path) -> EntryKind | None:
    """What ``path`` is, without following a link (``None``: nothing there)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISDIR(mode):
        return "checkpoint"
    if stat.S_ISREG(mode):
        return "archive"
    return "other"  # a symlink, a FIFO, a device: never ours


def tree_size(path: Path) -> int | None:
    """Bytes of a file, or of the regular files directly in a directory (links not followed); ``None``: gone."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            return st.st_size
        total = 0
        with os.scandir(path) as it:
            for f in it:
                try:
                    if f.is_file(follow_symlinks=False):
                        total += f.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
        return total
    except (FileNotFoundError, NotADirectoryError):
        return None


class DirectorySaveTarget(SaveTarget):
    """A staging directory beside the destination, opened once: every file is written through its descriptor and
    the staged tree is checked (names, kinds, sizes) before it is published; rank 0's holds the destination's lock."""

    def __init__(self, destination: Path, staging: Path, lock: DestinationLock | None = None) -> None:
        self.destination, self.staging, self.lock = destination, staging, lock
        self.token, self.where, self.checkpoint_id = str(staging), staging, staging
        self._dir: DirHandle | None = None

    @property
    def dir(self) -> DirHandle:
        """The staging directory, opened on first use (a rank that cannot open it fails in its write step, which
        every rank hears of at commit)."""
        if self._dir is None:
            self._dir = DirHandle.open(self.staging)
        return self._dir

    def write(self, share: ShareWrite) -> WriteOutcome:
        from torchrl_dcp.storage.chunk_writer import write_chunks
        from torchrl_dcp.storage.copying import default_threads
        from torchrl_dcp.storage.writer import write_share

        out = WriteOutcome()
        for name, tensors in share.data_files():
            keys = [k for k, _ in tensors]
            out.merge(write_share(dict(tensors), keys, self.dir, share.rank, save_id=share.save_id, name=name))
        write_chunks(share.chunks, self.dir, share.save_id, share.rank, default_threads())
        out.add_chunks(share.chunks)
        return out

    def dcp_writer(self) -> Any:
        from torchrl_dcp.storage.filesystem import make_writer

        return make_writer(self.staging)

    def seal_dcp_files(self, rank: int, save_id: str) -> WriteOutcome:
        out = WriteOutcome()
        for name in self.dir.names():
            mine = name.startswith(f"__{rank}_")
            if not (mine or (rank == 0 and name == DCP_METADATA)):
                continue
            fd = self.dir.open_file(name, os.O_RDWR | os.O_APPEND if mine else os.O_RDONLY)
            try:
                if mine:  # DCP addresses records by offset: the trailer after them is never read
                    os.write(fd, identity_trailer(save_id, rank))
                    os.fsync(fd)
                size = os.fstat(fd).st_size
                out.files[name] = {
                    "size": size,
                    "checksum": fds_checksums([(fd, 0, size, str(self.staging / name))])[0],
                }
            finally:
                os.close(fd)
            out.bytes_written += out.files[name]["size"]
        return out

    def read_dcp_metadata(self) -> Any:
        from torchrl_dcp.format.dcp_metadata import parse_metadata

        if DCP_METADATA not in self.dir.names():
            return None
        fd = self.dir.open_file(DCP_METADATA)
        try:
            size = os.fstat(fd).st_size
            if size > MAX_MANIFEST_BYTES:
                raise CheckpointFormatError(f"is implausibly large ({size} bytes)", path=self.staging / DCP_METADATA)
            data = os.pread(fd, size, 0)
        finally:
            os.close(fd)
        return parse_metadata(data, self.staging / DCP_METADATA)

    def write_member(self, name: str, data: bytes) -> dict[str, Any]:
        from torchrl_dcp.storage.writer import write_member

        return write_member(self.dir, name, data)

    def commit(self, manifest: bytes, files: Mapping[str, Mapping[str, Any]]) -> None:
        write_file_durably(self.staging / MANIFEST, manifest, within=self.dir)
        self.dir.check_tree({**{n: int(r["size"]) for n, r in files.items()}, MANIFEST: len(manifest)})
        publish(self.staging, self.destination, expect=self.dir.inode(), replaceable=is_replaceable)

    def abandon(self) -> None:
        remove_tree(self.staging)

    def release(self) -> None:
        if self._dir is not None:
            self._dir.close()
            self._dir = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None
            sweep_stale_locks(self.destination.parent)  # left by saves killed before they released theirs


class DirectoryLocation(Location):
    """A local (or shared) directory: one checkpoint, or a rotation directory holding many."""

    kind = "directory"

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(Path(path))

    def container(self) -> DirectoryContainer:
        return DirectoryContainer(self.path)

    def open_source(self, *, whole: bool = True) -> CheckpointSource:
        from torchrl_dcp.storage.source import CheckpointSource  # torch: only where tensors are read

        return CheckpointSource(self.container())

    # ------------------------------------------------------------------ saving
    def prepare_save(self, save_id: str, kept_from: Collection[str] = ()) -> SaveTarget:
        destination = self.path
        refuse_inside_checkpoint(destination)  # before the lock and staging entries beside it are made
        refuse_working_directory(destination)
        destination.parent.mkdir(parents=True, exist_ok=True)
        lock = DestinationLock(destination).acquire()
        try:
            if (destination.exists() or destination.is_symlink()) and not is_replaceable(destination):
                raise CheckpointError(_not_replaced(destination), path=destination)
            sweep_leftovers(destination)
            staging = staging_path(destination)
            staging.mkdir(mode=0o755)
            target = DirectorySaveTarget(destination, staging, lock)
            st = os.fstat(target.dir.fd)
            if st.st_uid != os.geteuid() or target.dir.names():  # not the directory just made: someone swapped it
                target.dir.close()
                raise CheckpointError(
                    "the staging directory just created was replaced by another one (another process tampered with "
                    "the parent directory); nothing was written",
                    path=staging,
                )
        except BaseException:
            lock.release()
            raise
        return target

    def sweep_before_save(self) -> None:
        refuse_inside_checkpoint(self.path)  # (as prepare_save: nothing removed inside a checkpoint, whatever is named
        refuse_working_directory(self.path)  # there)
        if not stale_entries(self.path):  # (nothing made beside the destination when there is nothing to remove)
            return
        try:
            lock = DestinationLock(self.path).acquire()
        except CheckpointError:
            return  # another save of this path runs: its leftovers are its own (prepare_save refuses this one)
        try:
            sweep_leftovers(self.path)
        finally:
            lock.release()

    def attach_save(self, token: str) -> SaveTarget:
        return DirectorySaveTarget(self.path, Path(token))

    # ------------------------------------------------------------------ listing and removing
    def child(self, name: str) -> Location:
        path = self.path / name
        return ArchiveLocation(path) if _kind(path) == "archive" else DirectoryLocation(path)

    def children(self) -> list[Entry]:
        try:
            names = sorted(p.name for p in self.path.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for name in names:
            kind = _kind(self.path / name)
            if kind is not None:
                out.append(Entry(name, kind, self.child(name)))
        return out

    def entry_kind(self) -> EntryKind | None:
        return _kind(self.path)

    def size(self) -> int | None:
        return tree_size(self.path)

    def remove(self) -> bool:
        return remove_entry(self.path)  # (a user's files put into it are kept: remove_tree)

    def leftovers(self) -> list[Leftover]:
        try:
            names = os.listdir(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [Leftover(n, owner) for n in sorted(names) if (owner := leftover_owner(n)) is not None]

    def remove_leftover(self, leftover: Leftover) -> bool:
        lock = DestinationLock(self.path / leftover.owner, wait=0.0)
        try:
            lock.acquire()
        except CheckpointError:
            return False  # a save (or conversion) of that entry is running: its leftovers are its own
        try:
            return remove_entry(self.path / leftover.name)
        finally:
            lock.release()

    # ------------------------------------------------------------------ incremental saves
    def keeps_files(self) -> bool:
        return True

    def can_keep_from(self, base: Location) -> bool:
        return base.is_local  # hard links, else copies, within this machine's file systems

    def keepable(self, keeps: Mapping[str, KeptChunk], rows: Mapping[str, Any]) -> dict[str, KeptChunk]:
        from torchrl_dcp.storage.chunk_writer import prove_kept
        from torchrl_dcp.storage.copying import default_threads, run_split

        names = sorted(keeps)
        proved: dict[str, KeptChunk] = {}

        def work(part: list[str]) -> None:  # a stat each when this process wrote them, else a read
            for name in part:
                if prove_kept(keeps[name], rows[name]):
                    proved[name] = keeps[name]

        if names:
            run_split(names, [keeps[n].size for n in names], max(1, min(default_threads(), len(names))), work)
        return proved

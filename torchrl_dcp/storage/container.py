"""The container layer: a committed checkpoint as a directory or a single-file ZIP archive (no torch needed).

A container knows files, not tensors or components: it reads and validates the
manifest, lists and checks the files the manifest names (sizes, checksums, nothing
unlisted), reads a small member whole (DCP's ``.metadata``) and says where a data
file's bytes are (:class:`ByteRange`) for the readers above it. Every file is opened
without following symlinks and must be a regular file (a FIFO or a device planted in
a shared directory is refused before it is read); sizes are bounded by what the
manifest records. :func:`open_container` picks the kind: a regular file is an
archive, anything else a directory.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp.storage.container import open_container
    >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(tempfile.mkdtemp() + "/c")
    >>> c = open_container(path)
    >>> c.manifest()["format"], sorted(c.manifest()["files"])
    ('torchrl_dcp', ['.metadata', '__0_0.distcp'])
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from torchrl_dcp import manifest as schema
from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError, CheckpointNotFoundError
from torchrl_dcp.storage.checksums import checksum_mismatch, fds_checksums
from torchrl_dcp.storage.layout import MANIFEST, MAX_MANIFEST_BYTES

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


@dataclass(frozen=True)
class ByteRange:
    """Where one data file's bytes are: ``[base, base + size)`` of the real file ``path``; ``where`` names it."""

    path: str
    base: int
    size: int
    where: str


class Container(Protocol):
    """What every container offers (see :class:`DirectoryContainer` and ``storage.archive.ArchiveContainer``)."""

    path: Path

    def manifest(self) -> dict[str, Any]:
        """The validated (and migrated) manifest, parsed once."""

    def check(self, checksum: Iterable[str] | bool) -> None:
        """Every listed file's size, nothing unlisted, and the checksums of ``checksum`` (True: all)."""

    def read_member(self, name: str, limit: int) -> bytes | None:
        """A listed file's bytes, size-checked against the manifest (``None`` when the manifest does not list it)."""

    def byte_range(self, name: str) -> ByteRange:
        """Where a listed data file's bytes are."""


class DirectoryContainer:
    """A checkpoint directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._manifest: dict[str, Any] | None = None

    def manifest(self) -> dict[str, Any]:
        if self._manifest is None:
            if not self.path.exists() and not self.path.is_symlink():
                raise CheckpointNotFoundError("no checkpoint here: the path does not exist", path=self.path)
            if not self.path.is_dir():  # a link to a checkpoint directory is how users point at one: followed
                raise CheckpointFormatError("not a checkpoint directory", path=self.path)
            file = self.path / MANIFEST
            try:
                data = read_whole(file, MAX_MANIFEST_BYTES, file)
            except CheckpointIntegrityError as err:
                why = "" if not os.path.lexists(file) else f" ({MANIFEST} {err.message})"
                raise CheckpointFormatError(
                    f"no {MANIFEST}: not a torchrl_dcp checkpoint, or a save that never committed{why}", path=self.path
                ) from None
            self._manifest = schema.loads_manifest(data, file)
        return self._manifest

    def _listed(self, name: str) -> dict[str, Any] | None:
        return self.manifest()["files"].get(name)

    def check(self, checksum: Iterable[str] | bool) -> None:
        files: dict[str, Any] = self.manifest()["files"]
        wanted = set(files) if checksum is True else set() if checksum is False else set(checksum)
        fds: list[tuple[str, int]] = []
        try:
            for name, rec in files.items():
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
                fds, fds_checksums([(fd, 0, files[n]["size"], str(self.path / n)) for n, fd in fds])
            ):
                if actual != files[name]["checksum"]:
                    raise checksum_mismatch(actual, files[name]["checksum"], self.path / name)
        finally:
            for _, fd in fds:
                os.close(fd)
        for entry in os.scandir(self.path):
            if entry.name != MANIFEST and entry.name not in files:
                raise CheckpointIntegrityError(
                    "file not listed in the manifest: the checkpoint was altered", path=self.path / entry.name
                )

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


def open_container(path: str | os.PathLike) -> Container:
    """The container at ``path``: a ZIP archive when it is a regular file, a directory otherwise, an
    object-store prefix for a URL (:mod:`torchrl_dcp.storage.objectstore`)."""
    from torchrl_dcp.storage.urls import is_store, is_url, resolve_path

    if is_url(path) or is_store(path):
        path = resolve_path(path)
        if is_store(path):
            from torchrl_dcp.storage.objectstore import ObjectStoreContainer

            return ObjectStoreContainer(path)  # type: ignore[return-value]
    path = Path(path).expanduser().absolute()
    if path.is_file() and not path.is_symlink():
        from torchrl_dcp.storage.archive import ArchiveContainer

        return ArchiveContainer(path)
    return DirectoryContainer(path)


def read_manifest(root: str | os.PathLike) -> dict[str, Any]:
    """Read, validate and migrate the manifest of the checkpoint (directory or archive) at ``root``.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist.
        CheckpointFormatError: no manifest (a foreign or unfinished directory), or a malformed one.
        CheckpointVersionError: written by a newer torchrl_dcp.

    Example:
        >>> import tempfile, torch, torchrl_dcp as tdcp
        >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(tempfile.mkdtemp() + "/c", step=4)
        >>> tdcp.read_manifest(path)["step"]
        4
    """
    return open_container(root).manifest()

"""A committed checkpoint to read from: a directory or a single-file ZIP archive (``open_source``).

A source validates and hands out what loading needs, without knowing about
components: the manifest, a check of the files, DCP's metadata (read safely) and
a DCP ``StorageReader``.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp.storage.source import open_source
    >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(tempfile.mkdtemp() + "/c")
    >>> open_source(path).manifest()["format"]
    'torchrl_dcp'
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import Metadata

from torchrl_dcp.errors import CheckpointFormatError
from torchrl_dcp.manifest import check_files, read_manifest
from torchrl_dcp.storage.filesystem import (
    DCP_METADATA,
    check_storage_bounds,
    check_storage_files,
    safe_load_metadata,
)
from torchrl_dcp.storage.reader import InPlaceFileSystemReader


class CheckpointSource(Protocol):
    """What :meth:`DistributedCheckpoint.load` and :func:`verify` read through."""

    path: Path

    def manifest(self) -> dict[str, Any]:
        """The validated (and migrated) manifest."""

    def check(self, checksum: Iterable[str] | bool) -> None:
        """Sizes of every listed file; checksums of ``checksum`` (True: all, False: none)."""

    def dcp_metadata(self) -> Metadata | None:
        """DCP's metadata, read without unpickling anything but DCP's own classes."""

    def storage_reader(self, verify: Collection[str] = ()) -> StorageReader:
        """A DCP reader that opens only files the manifest lists, reading tensors in place.

        ``verify``: files to checksum while they are read (only files whose destinations are fresh buffers).
        """


class DirectorySource:
    """A checkpoint directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._manifest: dict[str, Any] | None = None
        self._metadata: Metadata | None = None

    def manifest(self) -> dict[str, Any]:
        if self._manifest is None:
            self._manifest = read_manifest(self.path)
        return self._manifest

    def check(self, checksum: Iterable[str] | bool) -> None:
        check_files(self.path, self.manifest(), checksum=checksum)

    def dcp_metadata(self) -> Metadata | None:
        if self._metadata is None:
            file = self.path / DCP_METADATA
            if not file.exists():
                if self.manifest()["files"]:
                    raise CheckpointFormatError("DCP metadata file .metadata is missing", path=self.path)
                return None
            # checked against the manifest before it is parsed: a damaged .metadata must not be mistaken
            # for a different (valid-looking) layout
            check_files(self.path, {"files": {k: v for k, v in self.manifest()["files"].items() if k == DCP_METADATA}},
                        checksum=True, extra_ok=True)
            metadata = safe_load_metadata(file)
            check_storage_files(metadata, str(file), self.manifest()["files"])
            check_storage_bounds(metadata, str(file), self.manifest()["files"])
            self._metadata = metadata
        return self._metadata

    def storage_reader(self, verify: Collection[str] = ()) -> StorageReader:
        files = self.manifest()["files"]
        return InPlaceFileSystemReader(
            self.path,
            allowed_files=files,
            metadata=self.dcp_metadata(),
            verify={name: files[name]["checksum"] for name in verify},
        )


def open_source(path: str | os.PathLike) -> CheckpointSource:
    """The source for ``path``: a ZIP archive when it is a regular file, a directory otherwise."""
    path = Path(path).expanduser().absolute()
    if path.is_file():
        from torchrl_dcp.storage.archive import ArchiveSource

        return ArchiveSource(path)
    return DirectorySource(path)

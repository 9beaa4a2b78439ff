"""DCP ``StorageReader`` over a ZIP archive: each tensor is read at its offset inside its member.

DCP's ``FileSystemReader`` only needs a seekable stream per data file; here every
data file is a byte range of the archive, opened as a view of that range, so loads
(partial ones included) read just the tensors they need, with no extraction.

Example:
    >>> from torchrl_dcp.storage.archive import ArchiveSource
    >>> reader = ArchiveSource("run.zip").storage_reader()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.utils import _create_file_view

from torchrl_dcp.errors import CheckpointFormatError
from torchrl_dcp.storage.archive import ArchiveSource
from torchrl_dcp.storage.reader import InPlaceFileSystemReader, ReadSource


class _ArchiveFileSystem(FileSystem):
    """Opens a member of the archive as a seekable stream over its byte range."""

    def __init__(self, source: ArchiveSource) -> None:
        self.source = source

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return suffix

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return path

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise CheckpointFormatError("archives are read-only", path=self.source.path)
        m = self.source.member(str(path))
        with open(self.source.path, "rb") as f:
            counted = _CountingReader(f, self.source)
            yield _create_file_view(counted, m.data_offset, m.size)


_COUNT_LOCK = threading.Lock()


class _CountingReader(io.RawIOBase):
    """A pass-through stream that counts the bytes read (``ArchiveSource.bytes_read``)."""

    def __init__(self, f: BinaryIO, source: ArchiveSource) -> None:
        super().__init__()
        self.f, self.source = f, source

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self.f.readinto(b)
        with _COUNT_LOCK:
            self.source.bytes_read += n or 0
        return n

    def close(self) -> None:
        self.f.close()
        super().close()

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        with _COUNT_LOCK:
            self.source.bytes_read += len(data)
        return data


class ArchiveReader(InPlaceFileSystemReader):
    """DCP ``StorageReader`` over a ZIP archive: each tensor is read in place at its offset inside the member.

    Args:
        source: the archive.
        metadata: DCP metadata already read from it.
        verify: ``{member: "crc32:<hex>"}`` checksummed while being read (fresh destinations only).
    """

    def __init__(self, source: ArchiveSource, metadata: Metadata | None, verify: Mapping[str, str] | None = None) -> None:
        super().__init__(source.path, allowed_files=source.manifest()["files"], metadata=metadata, verify=verify)
        self.fs = _ArchiveFileSystem(source)
        self.path = str(source.path)
        self.source = source

    def read_source(self, relative_path: str) -> ReadSource:
        m = self.source.member(relative_path)
        return _MemberSource(self.source, m.data_offset, m.size, f"{self.source.path}::{relative_path}")


class _MemberSource(ReadSource):
    """A member of the archive: reads go through :class:`_CountingReader` (``ArchiveSource.bytes_read``)."""

    def __init__(self, source: ArchiveSource, base: int, size: int, where: str) -> None:
        super().__init__(source.path, base, size, where)
        self.source = source

    def open(self) -> BinaryIO:
        return _CountingReader(super().open(), self.source)  # type: ignore[return-value]

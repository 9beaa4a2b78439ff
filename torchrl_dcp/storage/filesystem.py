"""DCP storage reader/writer for checkpoint directories, without unpickling untrusted data.

DCP's own ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``.
:class:`SafeFileSystemReader` reads it through :func:`safe_load_metadata` (the file
opened without following links, parsed by the format's allow-list unpickler,
:mod:`torchrl_dcp.format.dcp_metadata`) and checks that every data file the metadata
names is a plain file name listed in the manifest.

Example:
    >>> import torch, tempfile
    >>> import torch.distributed.checkpoint as dcp
    >>> from torchrl_dcp.storage.filesystem import SafeFileSystemReader
    >>> d = tempfile.mkdtemp()
    >>> dcp.save({"x": torch.ones(2)}, checkpoint_id=d, no_dist=True)  # doctest: +SKIP
    >>> sorted(SafeFileSystemReader(d).read_metadata().state_dict_metadata)  # doctest: +SKIP
    ['x']
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from torchrl_dcp.format.dcp_metadata import parse_metadata
from torchrl_dcp.format.layout import DCP_METADATA, MAX_MANIFEST_BYTES
from torchrl_dcp.format.metadata_checks import check_storage_files
from torchrl_dcp.storage.files import read_whole


def safe_load_metadata(path: str | os.PathLike, data: bytes | None = None) -> Metadata:
    """Read DCP's ``.metadata`` (a regular file, never a link) with the allow-list unpickler; never runs code from it."""
    if data is None:
        data = read_whole(path, MAX_MANIFEST_BYTES)
    return parse_metadata(data, path)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read without ``pickle.load``.

    Args:
        path: the checkpoint directory.
        allowed_files: data file names the manifest lists; others are refused.
        metadata: metadata already read (avoids a second read).
    """

    def __init__(
        self, path: str | os.PathLike, allowed_files: Collection[str] | None = None, metadata: Metadata | None = None
    ) -> None:
        super().__init__(path)
        self._allowed_files = None if allowed_files is None else frozenset(allowed_files)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        source = os.path.join(str(self.path), DCP_METADATA)
        metadata = self._metadata or safe_load_metadata(source)
        check_storage_files(metadata, source, self._allowed_files)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def make_writer(path: str | os.PathLike, thread_count: int = 1) -> FileSystemWriter:
    """DCP's file writer: one file per rank, files fsynced, never overwriting."""
    return FileSystemWriter(
        path, single_file_per_rank=True, sync_files=True, thread_count=thread_count, overwrite=False
    )

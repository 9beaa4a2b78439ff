"""The one place that decides what a checkpoint path is, and which backend serves it.

A URL (``s3://…``, ``gs://…``, ``memory://…``: any fsspec protocol but ``file://``)
is an object-store prefix; a local path that is a regular file is an archive;
anything else local is a directory (existing or to be created). Nothing else in the
library tests what kind a path is: it asks the :class:`~torchrl_dcp.storage.base.Location`
this module returns.

Example:
    >>> from torchrl_dcp.storage.backends import location_for
    >>> location_for("memory://bucket/run").kind, location_for("/tmp/ckpts").kind
    ('object store', 'directory')
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torchrl_dcp.storage.archive import ArchiveLocation
from torchrl_dcp.storage.base import Location
from torchrl_dcp.storage.directory import DirectoryLocation
from torchrl_dcp.storage.urls import StorePath, resolve_path

PathLike = str | os.PathLike | StorePath


def is_remote(path: Any) -> bool:
    """Whether ``path`` names a location off this machine's file system (an object-store URL or prefix)."""
    return isinstance(resolve_path(path) if isinstance(path, str) else path, StorePath)


def location_for(path: PathLike, storage_options: Mapping[str, Any] | None = None) -> Location:
    """The location at ``path`` as it is now: an object-store prefix, an archive (a regular file), or a directory.

    A link to a file or directory is followed here (users point at checkpoints with links);
    the backends never follow one inside a checkpoint.
    """
    resolved = resolve_path(path, storage_options)
    if isinstance(resolved, StorePath):
        from torchrl_dcp.storage.objectstore_location import ObjectStoreLocation  # fsspec, on first use

        return ObjectStoreLocation(resolved)
    if resolved.is_file():  # (a link to an archive is read as the archive it names: its reads never follow one)
        return ArchiveLocation(resolved.resolve() if resolved.is_symlink() else resolved)
    return DirectoryLocation(resolved)


def save_location(path: PathLike, storage_options: Mapping[str, Any] | None = None) -> Location:
    """Where a save to ``path`` writes: an object-store prefix, else a directory (a save never writes an archive)."""
    resolved = resolve_path(path, storage_options)
    if isinstance(resolved, StorePath):
        return location_for(resolved)
    return DirectoryLocation(resolved)


def open_source(path: PathLike, storage_options: Mapping[str, Any] | None = None, *, whole: bool = True) -> Any:
    """The committed checkpoint at ``path``, to read (see :func:`location_for`; ``whole``:
    :meth:`~torchrl_dcp.storage.base.Location.open_source`)."""
    return location_for(path, storage_options).open_source(whole=whole)


def open_container(path: PathLike, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The files of the committed checkpoint at ``path`` (no torch needed for directories and archives)."""
    return location_for(path, storage_options).container()


def read_manifest(path: PathLike, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Read, validate and migrate the manifest of the checkpoint (directory, archive or prefix) at ``path``.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CheckpointFormatError: no manifest (a foreign or unfinished directory), or a malformed one.
        CheckpointVersionError: written by a newer torchrl_dcp.

    Example:
        >>> import tempfile, torch, torchrl_dcp as tdcp
        >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(tempfile.mkdtemp() + "/c", step=4)
        >>> tdcp.read_manifest(path)["step"]
        4
    """
    return location_for(path, storage_options).manifest()

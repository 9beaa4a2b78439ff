"""DCP's metadata (``.metadata``) as bytes in, values out: parsed without running code, checked against the manifest.

DCP reads ``.metadata`` with ``pickle.load``. :func:`parse_metadata` uses an
unpickler that admits only DCP's metadata classes, torch dtypes/sizes/layouts and
paths; :func:`check_storage_bounds` proves that every record it names lies inside a
file the manifest lists; :func:`record_index` looks records up by key.

Example:
    >>> import pickle
    >>> from torch.distributed.checkpoint.metadata import Metadata
    >>> parse_metadata(pickle.dumps(Metadata(state_dict_metadata={})), "x/.metadata").state_dict_metadata
    {}
"""

from __future__ import annotations

import io
import pickle
import weakref
from collections.abc import Collection, Mapping
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError, UnsafeCheckpointError
from torchrl_dcp.format.layout import is_plain_name

_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"refused to unpickle {module}.{name}: DCP metadata may only hold DCP's metadata classes; "
            "the file was damaged or planted, do not load it",
            path=self.source,
        )


def parse_metadata(data: bytes, where: Any) -> Metadata:
    """DCP's ``Metadata`` from the bytes of a ``.metadata`` file, through the allow-list unpickler only."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), str(where)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise CheckpointIntegrityError(
            f"DCP metadata cannot be read ({type(err).__name__}: {err})", path=where
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointFormatError(f"DCP metadata holds a {type(metadata).__name__}, not a Metadata", path=where)
    return metadata


RecordIndex = dict[str, dict[tuple[int, ...], Any]]
_INDEXES: dict[int, RecordIndex] = {}


def record_index(metadata: Metadata) -> RecordIndex:
    """``{key: {chunk offsets: storage info}}`` of every record DCP's metadata lists, built once per metadata
    object (loads look records up by key many times: a scan of ``storage_data`` per question was 1 ms a scan
    for 5,000 tensors, and every ``MetadataIndex`` hash a Python call).

    Example:
        >>> import tempfile, torch
        >>> from torchrl_dcp.storage.writer import write_state
        >>> from torchrl_dcp.storage.filesystem import safe_load_metadata
        >>> d = tempfile.mkdtemp()
        >>> _ = write_state({"w": torch.zeros(2)}, d)
        >>> list(record_index(safe_load_metadata(d + "/.metadata"))["w"])
        [(0,)]
    """
    found = _INDEXES.get(id(metadata))
    if found is None:
        found = {}
        for index, info in (metadata.storage_data or {}).items():
            found.setdefault(index.fqn, {})[tuple(index.offset or ())] = info
        _INDEXES[id(metadata)] = found
        weakref.finalize(metadata, _INDEXES.pop, id(metadata), None)
    return found


def check_storage_files(metadata: Metadata, source: str, allowed: Collection[str] | None) -> None:
    """Every data file DCP would open must be a plain name (and listed in the manifest)."""
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not is_plain_name(rel):
            raise CheckpointIntegrityError(f"DCP metadata points outside the checkpoint ({rel!r})", path=source)
        if allowed is not None and rel not in allowed:
            raise CheckpointIntegrityError(f"DCP metadata names {rel!r}, which the manifest does not list", path=source)


def check_storage_bounds(metadata: Metadata, source: str, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Every data file DCP would open is a plain file name the manifest lists (``files``), and every byte range
    DCP would read lies inside it (sizes as the manifest records them)."""
    checked: set[str] = set()
    for index, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if type(rel) is not str or rel not in checked:
            if type(rel) is not str or rel not in files or not is_plain_name(rel):
                check_storage_files(metadata, source, files)  # says which, and why
            checked.add(rel)
        rec = files[rel]
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(offset, int) or not isinstance(length, int):
            raise CheckpointIntegrityError(f"DCP metadata entry for {index.fqn!r} is malformed", path=source)
        if offset < 0 or length < 0 or offset + length > rec["size"]:
            raise CheckpointIntegrityError(
                f"DCP metadata puts tensor {index.fqn!r} at bytes {offset}..{offset + length} of "
                f"{info.relative_path}, which has {rec['size']} bytes: the checkpoint is inconsistent or forged",
                path=source,
            )

"""Direct reads: plain tensors read straight from the records DCP's metadata names, without ``dcp.load``.

``dcp.load`` plans every item through runtime-protocol checks, exchanges plans and
resolves each tensor through its planner: about 300 µs of Python per tensor here on
5,000 small tensors, more than reading them. :func:`read_direct` plans the reads of
plain tensors (``torch.Tensor``, ``nn.Parameter``, memory-mapped tensors) itself and
hands them to :class:`~torchrl_dcp.storage.reader.InPlaceFileSystemReader`, which
reads every record in place (batched, threaded, checksummed as it reads):

- a tensor saved whole (one chunk at the origin) is one record read into it;
- a tensor saved as several chunks split along dim 0 (rows ``[o, o + n)`` each) is
  read chunk by chunk into ``dest.narrow(0, o, n)``, whatever file each chunk is in;
- anything else (DTensors, ShardedTensors, chunks split along other dims, byte items)
  is returned to the caller for ``dcp.load``.

Destinations are checked against DCP's metadata (dtype, shape; byte items refused)
exactly as :class:`~torchrl_dcp.planner.SafeLoadPlanner` does.

Example:
    >>> import tempfile, torch
    >>> from torchrl_dcp.storage.writer import write_state
    >>> from torchrl_dcp.storage.reader import InPlaceFileSystemReader
    >>> d = tempfile.mkdtemp()
    >>> _ = write_state({"w": torch.arange(4.0)}, d)
    >>> reader = InPlaceFileSystemReader(d)
    >>> dest = {"w": torch.zeros(4)}
    >>> read_direct(reader, reader.read_metadata(), dest)
    {}
    >>> dest["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from torchrl_dcp.errors import CheckpointIntegrityError, IncompatibleComponentError, UnsafeCheckpointError
from torchrl_dcp.format.metadata_checks import WholeTensor, record_index, whole_tensor
from torchrl_dcp.format.record import is_plain_tensor
from torchrl_dcp.storage.reader import InPlaceFileSystemReader
from torchrl_dcp.storage.readitems import RecordRead, destination_bytes, plan_in_place


class _NoPlanner:
    """Direct reads choose every destination themselves: the reader never needs a planner's lookups."""

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:  # pragma: no cover - never called for planned items
        raise AssertionError("direct reads carry their destinations")

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        return None

    def load_bytes(self, req: ReadItem, value: Any) -> None:
        raise UnsafeCheckpointError(f"entry {req.dest_index.fqn!r} is a byte item, which torchrl_dcp never loads")


def _row_slabs(md: TensorStorageMetadata) -> list[tuple[Any, int, int]] | None:
    """``[(chunk offsets, first row, rows)]`` when the chunks tile the tensor along dim 0 exactly, else ``None``."""
    size = tuple(md.size)
    if not size:
        return None
    slabs = []
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or any(offsets[1:]) or sizes[1:] != size[1:]:
            return None
        slabs.append((chunk.offsets, offsets[0], sizes[0]))
    slabs.sort(key=lambda s: s[1])
    row = 0
    for _, first, rows in slabs:
        if first != row or rows <= 0:
            return None
        row += rows
    return slabs if row == size[0] else None


def _check(key: str, dest: torch.Tensor, md: Any) -> None:
    if md is None:
        raise IncompatibleComponentError(f"tensor {key!r} is not in the checkpoint's DCP metadata")
    if not isinstance(md, TensorStorageMetadata):
        raise UnsafeCheckpointError(f"entry {key!r} is a byte item, which torchrl_dcp never loads")
    if md.properties.dtype != dest.dtype or tuple(md.size) != dest.shape:
        raise IncompatibleComponentError(
            f"tensor {key!r} was saved as {md.properties.dtype} {tuple(md.size)}, "
            f"the destination is {dest.dtype} {tuple(dest.shape)}"
        )


def read_direct(
    reader: InPlaceFileSystemReader, metadata: Metadata, tensors: Mapping[str, torch.Tensor], checked: bool = False
) -> dict[str, torch.Tensor]:
    """Read every plain tensor of ``tensors`` from its records; returns the others (left for ``dcp.load``).

    ``checked``: every destination's dtype and shape were compared with DCP's metadata already (a load's plan
    does it, :func:`~torchrl_dcp.load_plan.check_backed`); they are not compared again.

    Raises:
        IncompatibleComponentError: a destination's dtype or shape differs from DCP's metadata.
        UnsafeCheckpointError: a key is a byte item.
        CheckpointIntegrityError: a file is damaged (checksums of ``reader.verify``) or a chunk has no record.
    """
    if not reader.reads_files:  # an object-store reader plans its own ranged GETs
        return dict(tensors)
    reader.set_up_storage_reader(metadata, is_coordinator=False)
    saved = metadata.state_dict_metadata
    records = record_index(metadata)
    rest: dict[str, torch.Tensor] = {}
    per_file: dict[str, list[RecordRead]] = {}
    saved_get, records_get = saved.get, records.get
    wholes: dict[int, WholeTensor | None] = {}
    for key, dest in tensors.items():
        md = saved_get(key)
        if not checked or md is None:
            _check(key, dest, md)
        if not is_plain_tensor(dest):
            rest[key] = dest
            continue
        if not dest.numel():
            continue  # nothing to read (as DCP: no read item for an empty tensor)
        whole = wholes.get(id(md), False)
        if whole is False:  # tensors of one dtype and shape share their metadata: asked once
            whole = wholes[id(md)] = whole_tensor(md)
        if whole is not None:
            info = (records_get(key) or {}).get(whole.offsets)
            if info is None:
                raise CheckpointIntegrityError(f"DCP metadata lists no record for tensor {key!r} at the origin")
            item = RecordRead((key, whole.offsets, dest.shape), info.offset, info.length, dest, True)
            plan_in_place(item, info)
            files = per_file.get(info.relative_path)
            if files is None:
                files = per_file[info.relative_path] = []
            files.append(item)
            continue
        slabs = _row_slabs(md)
        if slabs is None:
            rest[key] = dest
            continue
        destination_bytes(dest)  # huge pages advised over the whole tensor (per chunk, each edge would lose some)
        for offsets, first, rows in slabs:
            info = (records_get(key) or {}).get(tuple(offsets))
            if info is None:
                raise CheckpointIntegrityError(f"DCP metadata lists no record for tensor {key!r} at {tuple(offsets)}")
            target = dest.narrow(0, first, rows)
            item = RecordRead((key, offsets, target.shape), info.offset, info.length, target, planned=True)
            plan_in_place(item, info)
            per_file.setdefault(info.relative_path, []).append(item)
    reader.read_items(per_file, _NoPlanner())
    return rest

"""Checks of DCP's metadata against the files it points into and the manifest, and the lookups loads make in it.

A load (and ``verify``) runs them on every metadata before reading a byte:
:func:`check_storage_bounds` proves every record lies inside a file the manifest lists,
before the file's save identity; :func:`check_coverage` that each tensor is tiled
exactly by its chunks, each backed by its own record, no two records sharing a byte;
:func:`check_inventoried` that no record is left that no component refers to.
:func:`record_index`, :func:`chunk_specs` and :func:`whole_tensor` answer the questions
loads ask per tensor, built once per metadata object.

Example:
    >>> from torch.distributed.checkpoint.metadata import Metadata
    >>> check_coverage(Metadata(state_dict_metadata={}), "c")  # nothing to say
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchrl_dcp.errors import CheckpointIntegrityError
from torchrl_dcp.format.layout import is_data_file, is_plain_name, own_file_rank

RecordIndex = dict[str, dict[tuple[int, ...], Any]]
_INDEXES: dict[int, RecordIndex] = {}


def chunk_specs(
    metadata: Metadata, keys: Any = None
) -> dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]:
    """``{(key, chunk offsets): (dtype, chunk sizes)}``: what each tensor record must hold, as DCP's metadata says
    (of ``keys`` only, when given). Built once per metadata object (a load asks three times; 5,000 tensors: 3 ms
    each) and shared: never change what it returns."""
    found = _SPECS.get(id(metadata))
    if found is None:
        found = {
            (key, tuple(c.offsets)): (md.properties.dtype, tuple(c.sizes))
            for key, md in metadata.state_dict_metadata.items()
            for c in getattr(md, "chunks", None) or ()
        }
        _SPECS[id(metadata)] = found
        weakref.finalize(metadata, _SPECS.pop, id(metadata), None)
    if keys is None:
        return found
    return {k: v for k, v in found.items() if k[0] in keys}


_SPECS: dict[int, dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]] = {}


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


def check_storage_bounds(
    metadata: Metadata, source: str, files: Mapping[str, Mapping[str, Any]], *, trailer: int = 0
) -> None:
    """Every data file DCP would open is a plain file name the manifest lists (``files``), and every byte range
    DCP would read lies inside it (sizes as the manifest records them), before the ``trailer`` bytes that end
    every data file (its save identity, format 3 and later: never a record's)."""
    checked: set[str] = set()
    ends: dict[str, int] = {}
    for index, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if type(rel) is not str or rel not in checked:
            if type(rel) is not str or rel not in files or not is_plain_name(rel):
                check_storage_files(metadata, source, files)  # says which, and why
            checked.add(rel)
        end = ends.get(rel)
        if end is None:
            end = ends[rel] = files[rel]["size"] - (trailer if is_data_file(rel) else 0)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(offset, int) or not isinstance(length, int):
            raise CheckpointIntegrityError(f"DCP metadata entry for {index.fqn!r} is malformed", path=source)
        if offset < 0 or length < 0 or offset + length > end:
            ahead = f" ({trailer} of them its save identity)" if end != files[rel]["size"] else ""
            raise CheckpointIntegrityError(
                f"DCP metadata puts tensor {index.fqn!r} at bytes {offset}..{offset + length} of "
                f"{info.relative_path}, which has {files[rel]['size']} bytes{ahead}: the checkpoint is inconsistent "
                "or forged",
                path=source,
            )


def check_inventoried(metadata: Metadata, source: Any, components: Mapping[str, Mapping[str, Any]]) -> None:
    """Every tensor DCP's metadata holds is one a component's inventory lists: a save writes no record that no
    saved state refers to, so an extra one is what is left where a forger made a state refer to another tensor.

    Example:
        >>> from torch.distributed.checkpoint.metadata import Metadata
        >>> check_inventoried(Metadata(state_dict_metadata={}), "c", {})  # nothing to say
    """
    listed: set[str] = set()
    for record in components.values():
        listed.update(record.get("inventory") or ())
    extra = sorted(k for k in metadata.state_dict_metadata if k not in listed)
    if extra:
        raise CheckpointIntegrityError(
            f"DCP metadata holds {len(extra)} tensor(s) that no component in the manifest lists ({extra[:3]}): no "
            "save writes those; the checkpoint is inconsistent or forged",
            path=source,
        )


#: the most bytes a record holds beyond its tensor's (``torch.save``'s ZIP framing and pickle: ~1.5 KiB; our layout's
#: head and tail: less): a record claiming more is forged, to make a load read (and hold) what no tensor needs
RECORD_SLACK = 1 << 20
MAX_CHUNKS_PER_TENSOR = 1 << 20  # chunk files of 8 MiB: 8 TiB in one tensor; a forged list is refused first


def _ints(values: Any, ndim: int) -> tuple[int, ...] | None:
    try:
        out = tuple(values)
    except TypeError:
        return None
    if len(out) != ndim or not all(type(v) is int for v in out):
        return None
    return out


def check_coverage(metadata: Metadata, source: Any) -> None:
    """Every tensor's chunks tile it exactly (every element covered once, none outside it) and each chunk's record
    holds at least its bytes, and at most :data:`RECORD_SLACK` more; no two records of a file overlap; no byte items. Run by every load and ``verify``.

    A forger who recomputes every checksum can still hand DCP a chunk list that leaves
    part of a tensor unread (its destination would keep old or uninitialised memory) or
    points two tensors at the same bytes: this proves the structure instead.

    Example:
        >>> import tempfile, torch
        >>> from torchrl_dcp.storage.writer import write_state
        >>> from torchrl_dcp.storage.filesystem import safe_load_metadata
        >>> d = tempfile.mkdtemp()
        >>> _ = write_state({"w": torch.zeros(4, 2)}, d)
        >>> check_coverage(safe_load_metadata(d + "/.metadata"), d)
    """
    records = record_index(metadata)
    shapes: dict[int, WholeTensor | None] = {}  # id(md): whole_tensor(md)
    for key, md in (metadata.state_dict_metadata or {}).items():
        found = records.get(key, {})
        whole = shapes.get(id(md), False)
        if whole is False:  # tensors of one dtype and shape share their metadata (built, or unpickled memoized)
            whole = shapes[id(md)] = whole_tensor(md)
        if whole is not None and len(found) == 1:  # the common case: one lookup (5,000 tensors: 2 ms less a load)
            length = getattr(found.get(whole.offsets), "length", None)
            if type(length) is int and whole.nbytes <= length <= whole.nbytes + RECORD_SLACK:
                continue
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointIntegrityError(
                f"DCP metadata holds {key!r} as a byte item, which torchrl_dcp never writes: refused", path=source
            )
        _check_tensor_chunks(key, md, found, source)
    _check_disjoint_records(metadata, source)


def _check_tensor_chunks(key: str, md: TensorStorageMetadata, records: dict[tuple[int, ...], Any], source: Any) -> None:
    if _whole_tensor_record(md, records):
        return  # the common case, checked in a few operations (5,000 tensors: 9 ms less a load)

    def bad(why: str) -> CheckpointIntegrityError:
        return CheckpointIntegrityError(
            f"DCP metadata of tensor {key!r}: {why}; the checkpoint is damaged or forged, refused", path=source
        )

    size = _ints(md.size, len(md.size))
    chunks = md.chunks
    if size is None or any(n < 0 for n in size) or not isinstance(chunks, list):
        raise bad("malformed size or chunk list")
    if not chunks or len(chunks) > MAX_CHUNKS_PER_TENSOR:
        raise bad(f"{len(chunks) if isinstance(chunks, list) else 0} chunks for a tensor of shape {list(size)}")
    itemsize = md.properties.dtype.itemsize
    backed = sum(int(getattr(info, "length", 0) or 0) for info in records.values())
    if math.prod(size) * itemsize > backed:  # the allocation bound first: what a load would allocate for it
        raise bad(f"it claims {math.prod(size) * itemsize} bytes but its records hold {backed}")
    boxes = []
    for chunk in chunks:
        offsets, sizes = (
            _ints(getattr(chunk, "offsets", None), len(size)),
            _ints(getattr(chunk, "sizes", None), len(size)),
        )
        if offsets is None or sizes is None:
            raise bad("a chunk has malformed offsets or sizes")
        if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, size)):
            raise bad(f"chunk at {list(offsets)} of sizes {list(sizes)} lies outside the shape {list(size)}")
        info = records.get(offsets)
        if info is None:
            raise bad(f"chunk at {list(offsets)} has no record")
        problem = _record_length_problem(info.length, math.prod(sizes) * itemsize)
        if problem:
            raise bad(f"chunk at {list(offsets)} {problem}")
        boxes.append((offsets, sizes))
    filled = sum(1 for _, n in boxes if math.prod(n))  # a DTensor shard of an uneven split may be empty
    if filled > max(1, math.prod(size)):
        raise bad(f"{filled} chunks for a tensor of shape {list(size)}")
    if sum(math.prod(n) for _, n in boxes) != math.prod(size) or not _disjoint(boxes):
        raise bad(f"its {len(boxes)} chunks do not cover the shape {list(size)} exactly once")
    if len(records) != len(boxes):
        raise bad(f"{len(records)} records for {len(boxes)} chunks")


def _record_length_problem(length: int, nbytes: int) -> str | None:
    """What is wrong with a record of ``length`` bytes holding a chunk of ``nbytes`` (``None``: nothing)."""
    if length < nbytes:
        return f"needs {nbytes} bytes, its record holds {length}"
    if length > nbytes + RECORD_SLACK:  # (read whole where it is decoded)
        return (
            f"holds {nbytes} bytes, its record {length}: more than any record of them (at most {RECORD_SLACK} bytes "
            "of framing), which a load would read whole into memory"
        )
    return None


def _whole_tensor_record(md: TensorStorageMetadata, records: dict[tuple[int, ...], Any]) -> bool:
    """One chunk, the whole tensor at the origin, with one record holding at least its bytes: every check of
    :func:`_check_tensor_chunks` passes."""
    whole = whole_tensor(md)
    if whole is None or len(records) != 1:
        return False
    length = getattr(records.get(whole.offsets), "length", None)
    return type(length) is int and whole.nbytes <= length <= whole.nbytes + RECORD_SLACK


class WholeTensor(NamedTuple):
    """A tensor's metadata of one chunk, the whole tensor at the origin: what its record must hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offsets: tuple[int, ...]  # the chunk's (all zeros): its record's key in :func:`record_index`
    nbytes: int


def whole_tensor(md: Any) -> WholeTensor | None:
    """:class:`WholeTensor` of ``md`` when it is a tensor's metadata (exactly) of one chunk, the whole tensor at the
    origin, else ``None`` (``torch.Size`` holds only ints; a negative size is left to the full checks). Tensors of
    one dtype and shape share their metadata (built by our writer, or unpickled memoized): callers ask once per
    object.

    Example:
        >>> import torch
        >>> from torch.distributed.checkpoint.metadata import (
        ...     ChunkStorageMetadata, TensorProperties, TensorStorageMetadata)
        >>> size = torch.Size([2, 3])
        >>> md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
        ...                            [ChunkStorageMetadata(torch.Size([0, 0]), size)])
        >>> whole_tensor(md)
        WholeTensor(dtype=torch.float32, shape=(2, 3), offsets=(0, 0), nbytes=24)
    """
    if type(md) is not TensorStorageMetadata:
        return None
    size, chunks = md.size, md.chunks
    if type(chunks) is not list or len(chunks) != 1 or type(size) is not torch.Size:
        return None
    chunk = chunks[0]
    offsets = getattr(chunk, "offsets", None)
    if type(offsets) is not torch.Size or getattr(chunk, "sizes", None) != size or len(offsets) != len(size):
        return None
    if any(offsets) or (size and min(size) < 0):
        return None
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return None
    return WholeTensor(dtype, tuple(size), tuple(offsets), math.prod(size) * dtype.itemsize)


def _disjoint(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """No two boxes share an element (boxes of volume 0 are ignored). Row chunks (whole rows) are checked in
    ``O(n log n)``; other layouts (DTensor shards: a few per tensor) pairwise."""
    boxes = [b for b in boxes if math.prod(b[1])]
    if len(boxes) < 2:
        return True
    if all(o[1:] == (0,) * (len(o) - 1) for o, _ in boxes) and len({n[1:] for _, n in boxes}) == 1:
        rows = sorted((o[0], n[0]) for o, n in boxes)
        return all(a + m <= b for (a, m), (b, _) in zip(rows, rows[1:]))
    if len(boxes) > 4096:
        return False  # no layout this library writes: refuse rather than spend quadratic time
    for i, (o1, n1) in enumerate(boxes):
        for o2, n2 in boxes[i + 1 :]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(o1, n1, o2, n2)):
                return False
    return True


def _check_disjoint_records(metadata: Metadata, source: Any) -> None:
    """No two records of one data file share a byte (two tensors never read the same bytes), and a rank's per-rank
    tensors (``rank/<r>/...``) are in its own files (``__<r>_<n>.distcp``): a rank reads the shared files and its own,
    never another rank's per-rank bytes (a shard whose entries name another rank's file, resealed, and a root that
    lists that file for it: rank 0 loaded rank 1's values)."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        fqn = index.fqn
        if fqn.startswith("rank/"):
            owner = fqn.split("/", 2)[1]
            if own_file_rank(info.relative_path) != (int(owner) if owner.isdecimal() else None):
                raise CheckpointIntegrityError(
                    f"DCP metadata puts {fqn!r}, a per-rank tensor of rank {owner}, in {info.relative_path}, which is "
                    "not a file of that rank (a save writes each rank's per-rank tensors in its own files): the "
                    "checkpoint is damaged or forged, refused",
                    path=source,
                )
        spans.setdefault(info.relative_path, []).append((info.offset, info.length, fqn))
    for rel, found in spans.items():
        found.sort()
        for (a, n, k1), (b, _, k2) in zip(found, found[1:]):
            if a + n > b:
                raise CheckpointIntegrityError(
                    f"DCP metadata puts records of {k1!r} and {k2!r} on the same bytes of {rel} (from byte {b}): "
                    "the checkpoint is damaged or forged, refused",
                    path=source,
                )


# ---------------------------------------------------------------------- writing it from every rank's part

"""A committed checkpoint to read tensors from: a container plus DCP's metadata, read safely.

:class:`CheckpointSource` adds the torch side to a
:class:`~torchrl_dcp.storage.base.Container` (directory or ZIP archive): DCP's
``.metadata``, checked against the manifest before it is parsed and parsed by the
allow-list unpickler, with every byte range it names bounded by its file; and a DCP
``StorageReader`` that reads tensors in place from the files the manifest lists.
It knows nothing of components.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp.storage.backends import open_source
    >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(1)}).save(tempfile.mkdtemp() + "/c")
    >>> src = open_source(path)
    >>> src.manifest()["format"], sorted(src.dcp_metadata().state_dict_metadata)
    ('torchrl_dcp', ['replicated/w/x'])
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError
from torchrl_dcp.format.checksums import checksum_mismatch, crc32, format_crc
from torchrl_dcp.format.dcp_metadata import parse_metadata
from torchrl_dcp.format.layout import DCP_METADATA, MAX_MANIFEST_BYTES, TRAILER_SIZE, is_data_file
from torchrl_dcp.format.metadata_checks import check_coverage, check_inventoried, check_storage_bounds, chunk_specs
from torchrl_dcp.format.record import (
    STORAGE_NAMES,
    check_bool_bytes,
    decode_record,
    record_data_offset,
    template_tail_size,
)
from torchrl_dcp.storage.base import Container
from torchrl_dcp.storage.files import open_regular
from torchrl_dcp.storage.reader import InPlaceFileSystemReader
from torchrl_dcp.storage.readitems import BATCH, SMALL, small_record
from torchrl_dcp.storage.trailers import check_identities, trailer_identity


class CheckpointSource:
    """What :meth:`DistributedCheckpoint.load`, :func:`torchrl_dcp.verify` and the tools read through."""

    #: whether tensors are read from files this process opens (``storage.direct``); object stores read by GETs
    reads_files = True

    def __init__(self, container: Container) -> None:
        self.container = container
        self.path: Path = container.path
        self._metadata: Metadata | None = None
        self._metadata_read = False
        self.ranks: list[int] | None = None  # the ranks whose manifest shards are read (None: all)
        self.bytes_read = 0  # tensor bytes read through storage readers (diagnostics, tests)

    def manifest(self) -> dict[str, Any]:
        """The validated (and migrated) manifest, with the shards of :attr:`ranks` (every rank's when ``None``)."""
        return self.container.manifest(self.ranks)

    def restrict(self, ranks: Collection[int]) -> None:
        """Read only the manifest shards of ``ranks`` from now on (a load: the ranks it restores), before anything
        was read through this source."""
        if self._metadata_read:
            raise RuntimeError("restrict() after the metadata was read")
        self.ranks = sorted(set(ranks))

    def check(
        self,
        checksum: Iterable[str] | bool,
        progress: Callable[[int], None] | None = None,
        *,
        only: Collection[str] | None = None,
    ) -> None:
        """Sizes of every listed file (nothing unlisted; ``only``: of these files alone, no listing); checksums of
        ``checksum`` (True: all, False: none); ``progress`` is called with the bytes of each piece checksummed
        (from any thread, one at a time)."""
        kwargs: dict[str, Any] = {} if only is None else {"only": only}
        if progress is not None:  # (a container written before progress existed still serves every other caller)
            kwargs["progress"] = progress
        self.container.check(checksum, **kwargs)

    def dcp_metadata(self) -> Metadata | None:
        """DCP's metadata of the tensors this source's manifest holds (``None`` for a checkpoint without tensors).

        Built from the manifest's storage entries (format 5: the root's and the shards read), so a rank's load
        never parses the whole ``.metadata``; read from ``.metadata`` where the manifest has no index
        (:meth:`saved_dcp_metadata`). Either way checked the same: every byte range inside a listed file, every
        tensor tiled by its chunks, every record one the manifest inventories.
        """
        if not self._metadata_read:
            manifest = self.manifest()
            if not self._has_metadata(manifest):
                metadata = None
            elif manifest.get("index") is None:
                metadata = self.saved_dcp_metadata()
            else:
                where = f"{self.path} (the manifest's storage entries)"
                metadata = metadata_from_index(manifest, str(self.path), where)
                check_storage_bounds(metadata, where, manifest["files"], trailer=_trailer(manifest))
                check_coverage(metadata, where)
                check_inventoried(metadata, where, manifest["components"])
            self._metadata = metadata
            self._metadata_read = True
        return self._metadata

    def _has_metadata(self, manifest: dict[str, Any]) -> bool:
        files = manifest["files"]
        if DCP_METADATA in files:
            return True
        if any(is_data_file(n) for n in files):
            raise CheckpointFormatError("the manifest lists data files but no DCP metadata (.metadata)", path=self.path)
        return False

    def saved_dcp_metadata(self) -> Metadata | None:
        """DCP's ``.metadata`` file itself (what a plain ``dcp.load`` reads), never unpickling anything but DCP's
        classes: only a ``.metadata`` the manifest lists, as a regular file of the recorded size, its checksum
        compared before it is parsed; checked like :meth:`dcp_metadata` against the whole manifest."""
        manifest = self.container.manifest() if self.ranks is not None else self.manifest()
        files = manifest["files"]
        if not self._has_metadata(manifest):
            return None
        where = self.container.byte_range(DCP_METADATA).where
        data = self.container.read_member(DCP_METADATA, MAX_MANIFEST_BYTES)
        assert data is not None
        _check_checksum(data, files[DCP_METADATA], where)
        metadata = parse_metadata(data, where)
        save_id = manifest.get("save_id")
        found = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
        if save_id is not None and found != save_id:
            raise CheckpointIntegrityError(
                f"DCP metadata belongs to save {found!r}, the manifest to {save_id!r}: a file from another "
                "checkpoint was copied in; refused",
                path=where,
            )
        check_storage_bounds(metadata, where, files, trailer=_trailer(manifest))  # file names and byte ranges
        check_coverage(metadata, where)  # every tensor tiled by its chunks, no bytes read twice
        check_inventoried(metadata, where, manifest["components"])  # no record left unreferred
        return metadata

    def check_records(self, metadata: Metadata, keys: Collection[str] | None = None) -> None:
        """Every tensor record (of ``keys``; ``None``: all) holds exactly the dtype and shape DCP's metadata gives its
        chunk: laid out as our writer (or ``torch.save``) lays it out (head and tail compared: small records in runs
        read whole, others a few KiB each), else decoded whole to that
        (:func:`~torchrl_dcp.format.record.decode_record`). Loads run it before reading anything into a live object,
        ``verify`` over every record: a forged record is refused before any state changes, naming its file.
        """
        specs = chunk_specs(metadata, keys)
        by_file: dict[str, list[tuple[int, int, Any, Any]]] = {}
        for index, info in metadata.storage_data.items():
            spec = specs.get((index.fqn, tuple(index.offset or ())))
            if spec is not None:  # (a bytes item has none: the metadata checks refuse it)
                by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn, spec))
        for rel, found in sorted(by_file.items()):
            where = self.container.byte_range(rel).where
            items = self._unmatched_small_records(rel, found, where)  # most records: one read per 8 MiB of them
            if not items:
                continue
            heads = [(o, min(n, 4096)) for o, n, _, _ in items]
            tails = [(o + n - t, t) for o, n, _, (dtype, shape) in items if (t := template_tail_size(dtype, shape, n))]
            spans = heads + tails
            cache = dict(zip(spans, self.read_many(rel, spans)))  # one open and batched reads per data file
            for (o, n, key, (dtype, shape)), head_span in zip(items, heads):
                head = cache[head_span]

                def read(
                    at: int, size: int, o: int = o, head: bytes = head, rel: str = rel, cache: dict = cache
                ) -> bytes:
                    if at + size <= len(head):
                        return head[at : at + size]
                    found = cache.get((o + at, size))
                    return found if found is not None else self.read_many(rel, [(o + at, size)])[0]

                at = record_data_offset(read, head, n, dtype, shape)
                if at is None:
                    try:
                        decode_record(read(0, n), dtype, shape, where, key)
                    except CheckpointIntegrityError:
                        self.check([rel])  # a damaged file (its checksum) says more than its record does
                        raise
                elif dtype == torch.bool:
                    size = math.prod(shape)
                    for lo in range(0, size, 8 << 20):  # bounded memory
                        check_bool_bytes(read(at + lo, min(8 << 20, size - lo)), where, key)

    def _unmatched_small_records(
        self, rel: str, items: list[tuple[int, int, Any, Any]], where: Any
    ) -> list[tuple[int, int, Any, Any]]:
        """The records of ``items`` (``(offset, length, key, (dtype, shape))`` in the data file ``rel``) that are not
        small records laid out as our writer lays them out: those are recognized in runs read whole (at most
        ``BATCH`` bytes, gaps of at most 4 KiB; up to 4 runs per :meth:`read_many`, which an object store fetches in
        parallel), by the comparisons the file reader makes before it takes a record's bytes
        (:class:`~torchrl_dcp.storage.readitems.SmallRecord`: the local headers and the central directory), and bool
        records' bytes checked. 5,000 records of 1 KiB: one read instead of 10,000."""
        items = sorted(items, key=lambda it: it[0])
        rest: list[tuple[int, int, Any, Any]] = []
        runs: list[tuple[int, int]] = []  # [i, j) of items, each run contiguous small records of our dtypes
        i = 0
        while i < len(items):
            if items[i][1] >= SMALL or items[i][3][0] not in STORAGE_NAMES:
                rest.append(items[i])
                i += 1
                continue
            j, end = i + 1, items[i][0] + items[i][1]
            while j < len(items):
                o, m, _, (dtype, _) = items[j]
                if (
                    m >= SMALL
                    or dtype not in STORAGE_NAMES
                    or not end <= o <= end + 4096
                    or o + m - items[i][0] > BATCH
                ):
                    break
                end, j = o + m, j + 1
            runs.append((i, j))
            i = j
        for at in range(0, len(runs), 4):  # bounded memory: 4 runs of at most BATCH bytes at a time
            group = runs[at : at + 4]
            spans = [(items[i][0], items[j - 1][0] + items[j - 1][1] - items[i][0]) for i, j in group]
            for (i, j), (start, size), data in zip(group, spans, self.read_many(rel, spans)):
                for item in items[i:j]:
                    o, m, key, (dtype, shape) = item
                    small = small_record(dtype, shape)
                    first = o - start
                    if len(data) < size or m != small.length or not small.matches(data, first):
                        rest.append(item)  # another layout, or damage: checked (and explained) one by one
                    elif dtype == torch.bool:
                        check_bool_bytes(data[first + small.data_at : first + small.data_at + small.nbytes], where, key)
        return rest

    def read_many(self, name: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, size)`` of the listed data file ``name`` (a span past its end: ``b""``)."""
        span = self.container.byte_range(name)
        fd = open_regular(span.path, span.where)
        try:
            return [os.pread(fd, n, span.base + o) if 0 <= o and o + n <= span.size else b"" for o, n in spans]
        finally:
            os.close(fd)

    def check_identity(self, names: Iterable[str]) -> None:
        """Every data file in ``names`` ends with this save's identity trailer (format 3 and later;
        :func:`~torchrl_dcp.storage.trailers.check_identities`)."""
        manifest = self.manifest()
        if manifest.get("save_id") is not None:  # older formats carry no identity (verify says so)
            check_identities(self.container, names, manifest["files"], manifest["save_id"])

    def storage_reader(self, verify: Collection[str] = (), mismatch_note: str | None = None) -> InPlaceFileSystemReader:
        """A DCP reader that opens only files the manifest lists, reading tensors in place.

        ``verify``: files to checksum while they are read (files whose destinations are fresh buffers; or files
        verified before, read into live tensors: ``mismatch_note`` then says what a mismatch left).
        """
        files = self.manifest()["files"]

        def counted(n: int) -> None:
            self.bytes_read += n

        reader = InPlaceFileSystemReader(
            self.container,
            self.dcp_metadata(),
            verify={name: files[name]["checksum"] for name in verify},
            on_read=counted,
        )
        if mismatch_note is not None:
            reader.mismatch_note = mismatch_note
        save_id = self.manifest().get("save_id")
        if save_id is not None:  # each handle the reads open is the file whose identity was checked
            reader.identities = {
                name: trailer_identity(name, rec, save_id, self.path / name)
                for name, rec in files.items()
                if is_data_file(name)
            }
        return reader


def _trailer(manifest: dict[str, Any]) -> int:
    """Bytes that end every data file of ``manifest``'s checkpoint after its records: its save identity (format 3
    and later, where the manifest names the save)."""
    return TRAILER_SIZE if manifest.get("save_id") is not None else 0


def _check_checksum(data: bytes, record: dict[str, Any], where: str) -> None:
    actual = format_crc(crc32(data))
    if actual != record["checksum"]:
        raise checksum_mismatch(actual, record["checksum"], where)


def metadata_from_index(manifest: dict[str, Any], checkpoint_id: Any, where: Any) -> Metadata:
    """DCP's ``Metadata`` of the tensors ``manifest`` inventories, from its storage entries and chunk table (format
    5): what our writer wrote into ``.metadata`` for them, built without reading it."""
    from torchrl_dcp.format.codec import dtype_from_name
    from torchrl_dcp.storage.base import ChunkEntry
    from torchrl_dcp.storage.writer import build_metadata

    dtypes: dict[str, torch.dtype] = {}
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for rec in manifest["components"].values():
        for key, t in rec["inventory"].items():
            dtype = dtypes.get(t["dtype"])
            if dtype is None:
                dtype = dtypes[t["dtype"]] = dtype_from_name(t["dtype"])
            tensors[key] = (dtype, tuple(t["shape"]))
    entries = [tuple(e) for e in manifest["index"]["entries"]]
    chunks = []
    for key, parts in manifest["chunks"].items():
        if key not in tensors:
            raise CheckpointFormatError(f"the chunk table names {key!r}, a tensor no component holds", path=where)
        for c in parts:
            chunks.append(ChunkEntry(key, c["start"], c["rows"], c["file"], c["offset"], c["length"], c["fingerprint"]))
    placed = {e[0] for e in entries} | {c.key for c in chunks}
    missing = [k for k in tensors if k not in placed]
    if missing:
        raise CheckpointIntegrityError(
            f"the manifest places no bytes for tensors {sorted(missing)[:3]}: damaged or forged", path=where
        )
    return build_metadata(tensors, entries, checkpoint_id, manifest.get("save_id"), chunks)  # type: ignore[arg-type]

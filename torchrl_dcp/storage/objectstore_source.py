"""A checkpoint under an object-store prefix as a :class:`~torchrl_dcp.storage.source.CheckpointSource`, and its
in-place DCP reader (ranged GETs planned from DCP's metadata, :mod:`~torchrl_dcp.storage.objectstore_read`).

Example:
    >>> import torch, torchrl_dcp as tdcp
    >>> path = tdcp.DistributedCheckpoint(w={"x": torch.ones(2)}).save("memory://doc/source/c")
    >>> from torchrl_dcp.storage.objectstore_source import open_store_source
    >>> sorted(open_store_source(path).manifest()["components"])
    ['w']
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterable
from typing import Any, BinaryIO

from torchrl_dcp.errors import CheckpointError, CheckpointIntegrityError
from torchrl_dcp.format.layout import TRAILER_SIZE
from torchrl_dcp.storage.objectstore import ObjectStoreContainer, concurrency, map_pieces, range_size, read_range
from torchrl_dcp.storage.objectstore_read import MERGE_GAP, StoreReader
from torchrl_dcp.storage.readitems import RangeFile
from torchrl_dcp.storage.source import CheckpointSource
from torchrl_dcp.storage.trailers import check_trailer, trailer_identity
from torchrl_dcp.storage.urls import StorePath


class ObjectRangeFile(RangeFile):
    """A :class:`~torchrl_dcp.storage.readitems.RangeFile` naming an object (read by :class:`ObjectStoreReader`)."""

    def open(self) -> BinaryIO:
        raise CheckpointError("internal: objects are read by ranged GETs, not opened", path=self.where)


class _AsSeenByDCP:
    """A container whose ``path`` is its URL string (DCP's ``FileSystemReader`` makes a ``Path`` of it)."""

    def __init__(self, container: ObjectStoreContainer) -> None:
        self.container, self.path = container, str(container.path)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.container, name)


class ObjectStoreReader(StoreReader):
    """The in-place DCP reader over objects: planned ranged GETs (:mod:`~torchrl_dcp.storage.objectstore_read`)."""

    reads_files = False  # storage.direct leaves every tensor to this reader (through dcp.load)

    def __init__(
        self,
        container: ObjectStoreContainer,
        *args: Any,
        identity: dict[str, tuple[str, int | None]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(_AsSeenByDCP(container), *args, **kwargs)  # type: ignore[arg-type]
        self.store_fs, self.store_root = container.path.fs, container.path
        self.identity_pending = dict(identity or {})
        self.fetch_limit, self.fetch_threads = range_size(), concurrency()

    def read_source(self, relative_path: str) -> RangeFile:
        assert self.container is not None
        return ObjectRangeFile(self.container.byte_range(relative_path), self.on_read)


class _Prefix(StorePath):
    """A checkpoint prefix (it holds a manifest): never a single object, no request needed to say so."""

    __slots__ = ()

    def is_file(self) -> bool:
        return False


class ObjectStoreSource(CheckpointSource):
    """A :class:`~torchrl_dcp.storage.source.CheckpointSource` under an object-store prefix."""

    reads_files = False  # loads read through ObjectStoreReader (dcp.load), never storage.direct

    def __init__(self, container: Any) -> None:
        super().__init__(container)
        self.path = _Prefix(container.path.url, container.path.storage_options, container.path.fs)  # type: ignore[assignment]
        self._defer = False
        self._identity: dict[str, tuple[str, int | None]] = {}  # {file: (save id, rank)} left to the next reader

    def read_at(self, name: str, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of the listed data file ``name`` (bounded by its recorded size)."""
        span = self.container.byte_range(name)
        if offset < 0 or offset + size > span.size:
            raise CheckpointIntegrityError(f"bytes {offset}..{offset + size} lie outside the file", path=span.where)
        return read_range(self.path / name, offset, size, span.size)

    def read_many(self, name: str, spans: list[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, size)`` of ``name`` (a span past the end: ``b""``): spans close together in one
        ranged GET, the GETs in parallel."""
        total = self.container.byte_range(name).size
        obj = self.path / name
        inside = sorted({(o, n) for o, n in spans if 0 <= o and o + n <= total})
        merged: list[list[int]] = []  # [start, end] of one GET: spans less than MERGE_GAP apart, up to a range
        for o, n in inside:
            if merged and o - merged[-1][1] <= MERGE_GAP and max(merged[-1][1], o + n) - merged[-1][0] <= range_size():
                merged[-1][1] = max(merged[-1][1], o + n)
            else:
                merged.append([o, o + n])
        got = map_pieces([(obj, a, b - a) for a, b in merged], lambda i, data: data, concurrency())
        out: list[bytes] = []
        for o, n in spans:
            if not (0 <= o and o + n <= total):
                out.append(b"")
                continue
            k = bisect.bisect_right(merged, [o, float("inf")]) - 1  # the GET that starts at or before o
            out.append(bytes(memoryview(got[k])[o - merged[k][0] : o - merged[k][0] + n]))
        return out

    def check(
        self,
        checksum: Iterable[str] | bool,
        progress: Callable[[int], None] | None = None,
        *,
        only: Collection[str] | None = None,
    ) -> None:
        """As :meth:`CheckpointSource.check`; the objects checksummed leave their trailers for :meth:`check_identity`."""
        checksum = checksum if isinstance(checksum, bool) else set(checksum)
        super().check(checksum, progress, only=only)
        self._defer = checksum is not False

    def check_identity(self, names: Iterable[str]) -> None:
        """Every data file in ``names`` carries this save's identity (a kept file: its ``origin``'s).

        Checked now from the trailers :meth:`check` fetched, or by one parallel batch of
        64-byte reads; after a :meth:`check` that checksummed the files to be read into live
        objects (a verified load), the others are checked by the next :meth:`storage_reader`
        from the bytes it fetches anyway (before the read returns, so a failure restores nothing).
        """
        manifest = self.manifest()
        if manifest.get("save_id") is None:
            return
        files = manifest["files"]
        tails: dict[str, bytes] = self.container.tails  # type: ignore[attr-defined]
        later: list[str] = []
        for name in sorted(set(names)):
            save_id, rank = trailer_identity(name, files.get(name, {}), manifest["save_id"], self.path / name)
            tail = tails.get(str(self.path / name))
            if tail is not None:
                check_trailer(tail, save_id, self.path / name, kind="an object", rank=rank)
            elif self._defer:
                self._identity[name] = (save_id, rank)
            else:
                later.append(name)
        spans = []
        for name in later:
            size = self.container.byte_range(name).size
            spans.append((self.path / name, max(0, size - TRAILER_SIZE), min(size, TRAILER_SIZE)))
        found = map_pieces(spans, lambda i, data: data, concurrency())
        for name, tail in zip(later, found):
            save_id, rank = trailer_identity(name, files.get(name, {}), manifest["save_id"], self.path / name)
            check_trailer(tail, save_id, self.path / name, kind="an object", rank=rank)

    def storage_reader(self, verify: Collection[str] = (), mismatch_note: str | None = None) -> ObjectStoreReader:
        files = self.manifest()["files"]

        def counted(n: int) -> None:
            self.bytes_read += n

        identity, self._identity = self._identity, {}
        reader = ObjectStoreReader(
            self.container,  # type: ignore[arg-type]
            self.dcp_metadata(),
            verify={name: files[name]["checksum"] for name in verify},
            identity=identity,
            on_read=counted,
        )
        if mismatch_note is not None:
            reader.mismatch_note = mismatch_note
        return reader


def open_store_source(path: StorePath, *, listing: bool = True) -> ObjectStoreSource:
    """The source of the checkpoint under the prefix ``path`` (its first requests sent at once). ``listing=False``:
    one rank of a load, which never lists the prefix (rank 0 does, once for the load)."""
    container = ObjectStoreContainer(path)
    container.prefetch(listing=listing)
    return ObjectStoreSource(container)  # type: ignore[arg-type]

"""Reading tensors from objects with as few requests as possible: byte ranges planned from DCP's metadata.

DCP's metadata already says where every record lies (file, offset, length). The
:class:`StoreReader` plans, per object, the spans to fetch before fetching anything:

- a file to **verify** (its CRC-32 compared with the manifest's) is fetched whole, as
  spans of up to :func:`~torchrl_dcp.storage.objectstore.range_size` bytes cut at
  record boundaries: a chunk file (one record and its trailer) is **one GET**;
- otherwise only the records needed, neighbours less than :data:`MERGE_GAP` apart
  merged into one span (header, data and tail of a record always in the same GET);
- a record larger than a span is fetched as several ranges in parallel once its
  header (in the first range) has been checked.

Every span goes to a pool of ``TDCP_STORE_CONCURRENCY`` threads (memory: that many spans).
Each span is checksummed as it arrives, then each record in it is parsed (never
unpickled: ``storage/record.py``) and its tensor bytes are copied into the destination;
records that are not plain tensors go through DCP's path (``fallback``). A file whose
save identity is still to be checked (:meth:`ObjectStoreSource.check_identity`) is
checked from its last 64 bytes, fetched with its last span. Failures name the object.

Example:
    >>> from torchrl_dcp.storage.objectstore_read import cut
    >>> cut([(0, 10), (10, 50)], 0, 100, limit=40)  # (start, end, [records]) and big records
    ([(0, 10, [0]), (60, 100, [])], [1])
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from torchrl_dcp.errors import CheckpointError, CheckpointIntegrityError
from torchrl_dcp.format.checksums import checksum_mismatch, combined_crc, crc32, format_crc
from torchrl_dcp.format.layout import TRAILER_SIZE
from torchrl_dcp.format.record import check_bool_bytes, record_data_offset
from torchrl_dcp.storage.objectstore import object_checksums, store_error
from torchrl_dcp.storage.reader import InPlaceFileSystemReader
from torchrl_dcp.storage.readitems import HUGEPAGE_MIN, populate
from torchrl_dcp.storage.staging import copy_into
from torchrl_dcp.storage.trailers import check_trailer

MERGE_GAP = 1 << 20  # needed records closer than this are fetched in one span (the gap is read and dropped)


def cut(
    records: list[tuple[int, int]], lo: int, hi: int, limit: int
) -> tuple[list[tuple[int, int, list[int]]], list[int]]:
    """Cut ``[lo, hi)`` into spans of at most ``limit`` bytes, never inside one of ``records`` (sorted ``(offset,
    length)``); returns ``([(start, end, [record indices])], [indices of records larger than limit])``.

    A record larger than ``limit`` is left out of the spans (fetched on its own, in parts).
    """
    spans: list[tuple[int, int, list[int]]] = []
    big: list[int] = []
    pos, i = lo, 0
    while pos < hi:
        while i < len(records) and records[i][0] + records[i][1] <= pos:
            i += 1
        if i < len(records) and records[i][0] <= pos and records[i][1] > limit:  # a big record starts here
            big.append(i)
            pos = records[i][0] + records[i][1]
            continue
        end, j = min(hi, pos + limit), i
        inside: list[int] = []
        while j < len(records) and records[j][0] < end:
            o, n = records[j]
            if o + n > end:  # the cut would split this record: end the span before it
                end = o if o > pos else o + n
                if o > pos:
                    break
            inside.append(j)
            j += 1
        spans.append((pos, end, inside))
        pos = end
    return spans, big


def _populate(views: list[memoryview]) -> None:
    """Map the destinations' pages before the transfers start (``MADV_POPULATE_WRITE``, where available).

    Faulted in while responses arrive, they cost 0.6-0.8 s of CPU per 128 MiB here: every
    response buffer is an ``mmap``/``munmap`` of its own, and page faults wait for those.
    Mapped first, all at once, they cost the zeroing alone (4 KiB pages: advised huge pages
    stalled 0.2-0.4 s in memory compaction on a fragmented heap).
    """
    for view in views:
        if len(view) >= HUGEPAGE_MIN and not populate(view):
            return  # an older kernel: the copies fault the pages


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` without holding the GIL (numpy's copy releases it): the destination's first-touch page
    faults then overlap the other threads' transfers instead of stalling them."""
    np.frombuffer(dst, dtype=np.uint8)[:] = np.frombuffer(src, dtype=np.uint8)


@dataclass
class _Item:
    req: ReadItem
    offset: int
    length: int
    target: torch.Tensor | None = None
    view: memoryview | None = None
    device: torch.Tensor | None = None  # ``target`` off the CPU: its flat bytes (``staging.copy_into``)


@dataclass
class _File:
    name: str
    size: int
    where: str
    key: str
    obj: Any  # its StorePath
    verify: str | None  # the manifest's checksum, when checked while read
    identity: str | None  # the save id its trailer must carry, when not checked yet
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, length, crc) fetched
    rank: int | None = None  # the rank its trailer must name (``storage.trailers.trailer_identity``), when checked


class StoreReader(InPlaceFileSystemReader):
    """The DCP storage reader of :class:`~torchrl_dcp.storage.objectstore.ObjectStoreSource` (see the module)."""

    store_fs: Any
    store_root: Any  # the checkpoint's StorePath
    identity_pending: dict[str, tuple[str, int | None]]  # {file: (save id, rank)} whose trailer is checked while read
    fetch_limit: int
    fetch_threads: int
    hugepages = False  # destinations are mapped before the transfers (4 KiB pages: no compaction stall)

    def fetch(self, f: _File, start: int, end: int) -> bytes:
        """Bytes ``start..end`` of the object (one GET); a short answer is a truncated object."""
        if end <= start:
            return b""
        try:
            data = self.store_fs.cat_file(f.key, start=start, end=end)
        except Exception as err:
            raise store_error(err, f"reading bytes {start}..{end}", f.where) from None
        if len(data) != end - start:
            raise CheckpointIntegrityError(
                f"object ended {end - start - len(data)} bytes early at byte {start + len(data)}: truncated",
                path=f.where,
            )
        if self.on_read is not None:
            self.on_read(len(data))
        return data

    # -- planning
    def _file(self, name: str) -> _File:
        span = self.read_source(name)
        identity, rank = self.identity_pending.pop(name, (None, None))
        return _File(
            name, span.size, span.where, span.path, self.store_root / name, self.verify.get(name), identity, rank=rank
        )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._planner = planner
        per_file: dict[str, list[_Item]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append(_Item(req, info.offset, info.length))
        jobs: list[Callable[[], list[Any]]] = []
        files: list[_File] = []
        for name in sorted(per_file):
            f = self._file(name)
            files.append(f)
            items = sorted(per_file[name], key=lambda it: it.offset)
            for it in items:
                if it.offset < 0 or it.offset + it.length > f.size:
                    raise CheckpointIntegrityError(
                        f"DCP metadata points past the end of the object (bytes {it.offset}..{it.offset + it.length} "
                        f"of {f.size})",
                        path=f.where,
                    )
                found = self._target(it.req, planner)  # the local reader's rule
                if found is not None:
                    it.target, it.view, it.device = found
            jobs += self._plan_file(f, items)
        mapper = threading.Thread(  # maps the destinations while the first requests are in flight
            target=_populate,
            args=([it.view for f_items in per_file.values() for it in f_items if it.view is not None],),
            name="tdcp-populate",
            daemon=True,
        )
        mapper.start()
        for name, (save_id, rank) in sorted(self.identity_pending.items()):  # asked for, but nothing of it read here
            f = self._file(name)
            f.identity, f.rank = save_id, rank
            files.append(f)
            jobs.append(lambda f=f: self._trailer(f))
        try:
            self._run(jobs, files)
        finally:
            mapper.join()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _plan_file(self, f: _File, items: list[_Item]) -> list[Callable[[], list[Any]]]:
        tiled = all(a.offset + a.length <= b.offset for a, b in zip(items, items[1:]))
        if f.verify is not None and not tiled:  # overlapping records (narrowed reads): checksum the object first
            (actual,) = object_checksums([(f.obj, f.size)])
            if actual != f.verify:
                raise checksum_mismatch(actual, f.verify, f.where)
            f.verify = None
        limit = self.fetch_limit
        jobs: list[Callable[[], list[Any]]] = []
        if not tiled:  # each record on its own
            jobs += [lambda it=it: self._span(f, it.offset, it.offset + it.length, [it]) for it in items]
            jobs += [lambda: self._trailer(f)] if f.identity is not None else []
            return jobs
        if f.verify is not None:
            clusters = [(0, f.size, items)]
        else:
            clusters = []
            for it in items:
                if clusters and it.offset - clusters[-1][1] <= MERGE_GAP:
                    lo, hi, members = clusters[-1]
                    clusters[-1] = (lo, max(hi, it.offset + it.length), [*members, it])
                else:
                    clusters.append((it.offset, it.offset + it.length, [it]))
            if f.identity is not None and clusters and f.size - clusters[-1][1] <= MERGE_GAP:
                lo, _, members = clusters[-1]
                clusters[-1] = (lo, f.size, members)  # the trailer comes with the last records
        with_trailer = False  # does a span end with the object's last 64 bytes?
        for lo, hi, members in clusters:
            spans, big = cut([(it.offset, it.length) for it in members], lo, hi, limit)
            jobs += [lambda s=s, e=e, m=[members[k] for k in idx]: self._span(f, s, e, m) for s, e, idx in spans]
            jobs += [lambda it=members[k]: self._big(f, it) for k in big]
            with_trailer |= any(e == f.size and e - s >= TRAILER_SIZE for s, e, _ in spans)
        if f.identity is not None and not with_trailer:
            jobs.append(lambda: self._trailer(f))
        return jobs

    # -- the jobs (each returns follow-up jobs)
    def _check_identity(self, f: _File, tail: bytes) -> None:
        assert f.identity is not None
        check_trailer(tail, f.identity, f.where, kind="an object", rank=f.rank)

    def _trailer(self, f: _File) -> list[Any]:
        if f.size < TRAILER_SIZE:
            self._check_identity(f, b"")
        self._check_identity(f, self.fetch(f, f.size - TRAILER_SIZE, f.size))
        return []

    def _span(self, f: _File, start: int, end: int, items: list[_Item]) -> list[Any]:
        data = memoryview(self.fetch(f, start, end))
        if f.verify is not None:
            crc = crc32(data)
            with self._lock:
                f.pieces.append((start, end - start, crc))
        if f.identity is not None and end == f.size and end - start >= TRAILER_SIZE:
            self._check_identity(f, data[-TRAILER_SIZE:])
        for it in items:
            rel = it.offset - start
            self._place(it, data[rel : rel + it.length], f.where)
        return []

    def _place(self, it: _Item, record: memoryview, where: str) -> None:
        planner = self._planner
        if (it.view is not None or it.device is not None) and it.target is not None:
            shape, dtype = tuple(it.target.shape), it.target.dtype
            at = record_data_offset(lambda o, n: record[o : o + n], record, it.length, dtype, shape)
            if at is not None:
                if dtype == torch.bool:  # fresh or not, a tensor holds only what a save can write
                    n = len(it.view) if it.view is not None else it.device.numel()  # type: ignore[union-attr]
                    check_bool_bytes(record[at : at + n], where, it.req.storage_index.fqn)
                if it.view is not None:
                    copy_bytes(it.view, record[at : at + len(it.view)])
                else:
                    copy_into(it.device, record[at : at + it.device.numel()])  # type: ignore[union-attr]
                with self._lock:
                    self.stats["in_place"] += 1
                    self.stats["staged"] += it.view is None
                    self.stats["bytes"] += it.length
                    planner.commit_tensor(it.req, it.target)
                return
        with self._lock:
            self.stats["bytes"] += it.length
            self.fallback(it.req, planner, bytes(record))

    def _big(self, f: _File, it: _Item) -> list[Any]:
        """A record larger than a span: its first range, then (a plain tensor record) the others in parallel."""
        limit = self.fetch_limit
        first = memoryview(self.fetch(f, it.offset, it.offset + limit))
        at = None
        if (it.view is not None or it.device is not None) and it.target is not None:

            def read(o: int, n: int) -> Any:
                return first[o : o + n] if o + n <= len(first) else self.fetch(f, it.offset + o, it.offset + o + n)

            at = record_data_offset(read, first, it.length, it.target.dtype, tuple(it.target.shape))
        if at is None or (it.view is None and it.device is None) or it.target is None or at > limit:  # DCP's path
            whole = bytes(first) + self.fetch(f, it.offset + limit, it.offset + it.length)
            if f.verify is not None:
                with self._lock:
                    f.pieces.append((it.offset, it.length, crc32(whole)))
            self._place(it, memoryview(whole), f.where)
            return []
        view, device = it.view, it.device
        n = len(view) if view is not None else device.numel()  # type: ignore[union-attr]
        bounds = list(range(it.offset, it.offset + it.length, limit)) + [it.offset + it.length]
        left = [len(bounds) - 1]
        target = it.target

        def put(start: int, data: memoryview) -> list[Any]:
            if f.verify is not None:
                crc = crc32(data)
                with self._lock:
                    f.pieces.append((start, len(data), crc))
            lo, hi = max(start, it.offset + at), min(start + len(data), it.offset + at + n)
            a, b = lo - it.offset - at, hi - it.offset - at  # in the tensor's bytes
            if target.dtype == torch.bool and hi > lo:
                check_bool_bytes(data[lo - start : hi - start], f.where, it.req.storage_index.fqn)
            if hi > lo and view is not None:
                copy_bytes(view[a:b], data[lo - start : hi - start])
            elif hi > lo:
                copy_into(device[a:b], data[lo - start : hi - start])  # type: ignore[index]
            with self._lock:
                left[0] -= 1
                if left[0] == 0:
                    self.stats["in_place"] += 1
                    self.stats["staged"] += view is None
                    self.stats["bytes"] += it.length
                    self._planner.commit_tensor(it.req, target)
            return []

        rest = [lambda a=a, b=b: put(a, memoryview(self.fetch(f, a, b))) for a, b in zip(bounds[1:-1], bounds[2:])]
        put(bounds[0], first)
        return rest

    # -- running them
    def _run(self, jobs: list[Callable[[], list[Any]]], files: list[_File]) -> None:
        errors: list[BaseException] = []
        threads = max(1, min(self.fetch_threads, len(jobs)))
        with ThreadPoolExecutor(threads, thread_name_prefix="tdcp-store-read") as pool:
            pending = {pool.submit(j) for j in jobs}
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    try:
                        more = fut.result()
                    except BaseException as err:  # noqa: BLE001 - reported below, after the running jobs end
                        errors.append(err)
                        more = []
                    if errors:
                        for p in pending:
                            p.cancel()
                    else:
                        pending |= {pool.submit(j) for j in more}
        for f in files:
            if f.verify is not None:
                self._compare_file(f, errors)
        if errors:
            raise errors[0]

    def _compare_file(self, f: _File, errors: list[BaseException]) -> None:
        """The object's CRC-32 from the spans fetched (a mismatch is the error to report, before any other)."""
        value, pos = combined_crc(f.pieces)
        if pos != f.size:
            if not errors:
                raise CheckpointIntegrityError(f"internal: checksummed {pos} of {f.size} bytes", path=f.where)
            if isinstance(errors[0], CheckpointError):
                return
            (actual,) = object_checksums([(f.obj, f.size)])  # what broke the parse: damage?
        else:
            actual = format_crc(value)
        self.stats["verified_files"] += 1
        if actual != f.verify:
            raise CheckpointIntegrityError(
                f"checksum is {actual}, the manifest says {f.verify}: the object is damaged (found while reading it; "
                "nothing was restored)",
                path=f.where,
            )

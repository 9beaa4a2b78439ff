"""DCP storage reader that reads tensor bytes straight into the destination tensors, checksumming on the way.

DCP's ``FileSystemReader.read_data`` ``torch.load``\\ s every record into a fresh
tensor and then copies it: two passes over new memory. Every record DCP (and
:mod:`torchrl_dcp.storage.writer`) writes is a ``torch.save`` ZIP blob whose tensor
bytes are one STORED member, so :class:`InPlaceFileSystemReader` locates that member
(our writer's template, or the blob's central directory) and ``readinto``\\ s the
destination's own memory:

- ``data.pkl`` is never unpickled: its bytes must equal what ``torch.save`` writes
  for the expected dtype and shape, and ``byteorder`` must be ``little``; anything
  else goes through DCP's path (:meth:`InPlaceFileSystemReader.fallback`:
  ``torch.load(weights_only=True)`` + copy), as do narrowed reads (resharded
  DTensors), non-contiguous destinations and transformed records; destinations on
  another device (CUDA) are read through small host windows
  (:mod:`~torchrl_dcp.storage.staging`);
- small records are read in batches (one read per ~8 MiB) and copied out; large ones
  in 4 MiB pieces by up to ``threads`` threads (``TDCP_READ_THREADS``): a record of
  32 MiB or more is split between them, smaller ones are read one per thread;
- files named in ``verify`` are checksummed (CRC32, the manifest's) from the bytes as
  they are read, gaps included; a mismatch raises
  :class:`~torchrl_dcp.errors.CheckpointIntegrityError` after the reads. Only pass
  files whose destinations are fresh buffers: a live object would be overwritten.
- fresh destinations of 4 MiB or more are advised to use transparent huge pages
  (``madvise``), which makes first-touch faults about 3x cheaper here
  (``TDCP_READ_HUGEPAGES=0`` disables it).

Example:
    >>> import tempfile, torch
    >>> import torch.distributed.checkpoint as dcp
    >>> from torchrl_dcp.storage.writer import write_state
    >>> from torchrl_dcp.storage.reader import InPlaceFileSystemReader
    >>> d = tempfile.mkdtemp()
    >>> out = write_state({"w": torch.arange(4.0)}, d)
    >>> dest = {"w": torch.zeros(4)}
    >>> reader = InPlaceFileSystemReader(d, verify={"__0_0.distcp": out.files["__0_0.distcp"]["checksum"]})
    >>> dcp.load(dest, storage_reader=reader, no_dist=True)  # doctest: +SKIP
    >>> dest["w"].tolist(), reader.stats["in_place"]  # doctest: +SKIP
    ([0.0, 1.0, 2.0, 3.0], 1)
"""

from __future__ import annotations

import ctypes
import functools
import io
import os
import threading
from collections.abc import Mapping
from typing import Any, BinaryIO, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from torchrl_dcp.errors import CheckpointIntegrityError
from torchrl_dcp.format.checksums import combined_crc, crc32, format_crc
from torchrl_dcp.format.layout import TRAILER_SIZE, is_plain_name
from torchrl_dcp.format.metadata_checks import chunk_specs
from torchrl_dcp.format.record import decode_record, is_memmap_tensor, record_data_offset
from torchrl_dcp.settings import setting
from torchrl_dcp.storage.base import ByteRange, Container
from torchrl_dcp.storage.copying import ReadAhead, read_threads, run_split
from torchrl_dcp.storage.files import open_regular
from torchrl_dcp.storage.filesystem import SafeFileSystemReader
from torchrl_dcp.storage.readitems import (  # noqa: F401 - RangeFile and the constants are re-exported
    BATCH,
    GAP_PIECE,
    PARALLEL,
    READ_PIECE,
    SMALL,
    RangeFile,
    RecordRead,
    batch_end,
    destination_bytes,
    plan_in_place,
    prefault,
    staged,
    whole_read,
    whole_record_device,
    whole_record_view,
)
from torchrl_dcp.storage.staging import copy_batch, host_window, read_staged
from torchrl_dcp.storage.trailers import check_trailer


class InPlaceFileSystemReader(SafeFileSystemReader):
    """A :class:`SafeFileSystemReader` that reads tensor records into the destinations in place.

    Args:
        location: a :class:`~torchrl_dcp.storage.base.Container` (directory or archive: only the files
            its manifest lists are read), or a plain directory of DCP files.
        metadata: DCP metadata already read (else read safely from ``location``).
        verify: ``{file: "crc32:<hex>"}`` checksummed while being read (fresh destinations only).
        threads: threads per large tensor (default :func:`read_threads`).
        on_read: called with the number of bytes after every read (diagnostics, tests).

    ``stats`` counts records read in place and through the fallback, and bytes read.
    """

    reads_files = True  # storage.direct reads its records from files this process opens

    #: advise huge pages over large destinations (faulted by the reads themselves)
    hugepages = True

    def __init__(
        self,
        location: str | os.PathLike | Container,
        metadata: Metadata | None = None,
        *,
        verify: Mapping[str, str] | None = None,
        threads: int | None = None,
        on_read: Any = None,
    ) -> None:
        self.container: Container | None = None if isinstance(location, (str, os.PathLike)) else location
        if self.container is not None:
            super().__init__(self.container.path, allowed_files=self.container.listed(), metadata=metadata)
        else:
            super().__init__(location, metadata=metadata)  # type: ignore[arg-type]
        self.verify = dict(verify or {})
        self.threads = threads or read_threads()
        self.on_read = on_read
        self.stats = {"in_place": 0, "staged": 0, "fallback": 0, "bytes": 0, "verified_files": 0}
        self.mismatch_note = "found while reading it; nothing was restored"  # what a checksum mismatch means
        self.prefault = setting("TDCP_READ_PREFAULT")  # map fresh pages ahead of large reads
        self._lock = threading.RLock()  # stats and planner calls, from the threads reading records and files
        self._local = threading.local()  # each reading thread's scratch buffer
        self._specs: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}
        #: ``{data file: (save, rank)}`` its identity trailer names (``storage.trailers.trailer_identity``): each handle
        #: opened on it is checked to be that file (:meth:`_check_handle`)
        self.identities: dict[str, tuple[str, int | None]] = {}
        self._inodes: dict[str, tuple[int, int]] = {}
        if metadata is not None:
            self._keep_specs(metadata)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._keep_specs(metadata)

    def _keep_specs(self, metadata: Metadata) -> None:
        self._specs = chunk_specs(metadata)  # what each record must hold, for the fallback's decode

    def record_where(self, relative_path: str) -> Any:
        """The data file ``relative_path`` as errors name it (a path, or ``archive::member``)."""
        if self.container is not None:
            return self.container.byte_range(relative_path).where
        return os.path.join(str(self.path), relative_path)

    def read_source(self, relative_path: str) -> RangeFile:
        """Where a data file's bytes are: in the container, or the whole file of that name in ``path``."""
        if self.container is not None:
            span = self.container.byte_range(relative_path)
            identity = self.identities.get(relative_path)
            check = None if identity is None else functools.partial(self._check_handle, relative_path, span, identity)
            return RangeFile(span, self.on_read, check)
        path = os.path.join(str(self.path), relative_path)
        if not is_plain_name(relative_path):
            raise CheckpointIntegrityError(f"DCP metadata points outside the checkpoint ({relative_path!r})", path=path)
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return RangeFile(ByteRange(path, 0, size, path), self.on_read)

    def _check_handle(self, name: str, span: ByteRange, identity: tuple[str, int | None], fd: int) -> None:
        """Every handle a read opens on the data file ``name`` is the file whose identity trailer was checked: the
        first one's trailer is read through it, the others must be that very file (a file replaced by another save
        between the identity check and the reads, or between two reads, is refused rather than read; with
        ``verify=False`` nothing else would see it)."""
        st = os.fstat(fd)
        inode = (st.st_dev, st.st_ino)
        with self._lock:
            known = self._inodes.get(name)
            if known is None:
                tail = (
                    os.pread(fd, TRAILER_SIZE, span.base + span.size - TRAILER_SIZE)
                    if span.size >= TRAILER_SIZE
                    else b""
                )
                check_trailer(tail, identity[0], span.where, rank=identity[1])
                self._inodes[name] = inode
            elif known != inode:
                raise CheckpointIntegrityError(
                    "was replaced while the load read it (a save over this checkpoint?): nothing was restored; load "
                    "again once the save is done",
                    path=span.where,
                )

    # -- the fallback: DCP's own path for one record
    def fallback(self, req: ReadItem, planner: LoadPlanner, data: bytes, target: torch.Tensor | None = None) -> None:
        """Load one record as DCP does (``torch.load(weights_only=True)`` into a new tensor, then copy).

        ``target``: the destination when the caller chose it (direct reads), else the planner's.
        """
        from torch.distributed._shard._utils import narrow_tensor_by_index  # what DCP uses

        self._count("fallback")
        info = self.storage_data[req.storage_index]
        stream = self.transforms.transform_load_stream(req, info.transform_descriptors or (), io.BytesIO(data))
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return
        raw = stream.read(-1)
        index = req.storage_index
        spec = self._specs.get((index.fqn, tuple(index.offset or ())))
        if spec is None:
            raise CheckpointIntegrityError(
                f"record {index.fqn!r} at {tuple(index.offset or ())} is not a chunk DCP's metadata lists",
                path=self.record_where(info.relative_path),
            )
        tensor = decode_record(raw, spec[0], spec[1], self.record_where(info.relative_path), index.fqn)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = (planner.resolve_tensor(req) if target is None else target).detach()
        if target.size() != tensor.size():
            raise CheckpointIntegrityError(
                f"record {req.storage_index.fqn!r} holds {tuple(tensor.size())}, expected {tuple(target.size())}"
            )
        target.copy_(tensor)
        if planner is not None:
            planner.commit_tensor(req, target)

    def _fallback(self, item: RecordRead, planner: LoadPlanner, data: bytes) -> None:
        if item.planned:
            self.fallback(item.request(), planner, data, item.target)
        else:
            self.fallback(item.req, planner, data)

    def _target(
        self, req: ReadItem, planner: LoadPlanner
    ) -> tuple[torch.Tensor, memoryview | None, torch.Tensor | None] | None:
        """``(target, its bytes, None)`` to read in place, ``(target, None, its device bytes)`` to read through host
        memory (another device), ``None`` for the fallback."""
        target = planner.resolve_tensor(req).detach()
        if not whole_read(req, target):
            return None
        info = self.storage_data[req.storage_index]
        if staged(target):
            device = whole_record_device(info, target)
            return None if device is None else (target, None, device)
        view = whole_record_view(info, target, self.hugepages)
        return None if view is None else (target, view, None)

    def in_place(self, req: ReadItem, target: torch.Tensor) -> memoryview | None:
        """The bytes of ``target`` when ``req``'s record may be read straight into it, else ``None``."""
        info = self.storage_data[req.storage_index]
        return whole_record_view(info, target, self.hugepages) if whole_read(req, target) else None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[RecordRead]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            per_file.setdefault(info.relative_path, []).append(RecordRead(req, info.offset, info.length))
        self.read_items(per_file, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def read_items(self, per_file: Mapping[str, list[RecordRead]], planner: Any) -> None:
        """Read every file's items (``planner``: ``resolve_tensor``/``commit_tensor``, as DCP's).

        Files are read in name order. Files of planned items (direct reads: a tensor saved as ~8 MiB chunk files)
        are read by ``threads`` threads at once, each taking the next file (1 GiB of 128 chunk files: 0.34 s cold,
        0.10 s warm, against 0.42-1.2 s and 0.25 s one at a time). Read by one thread, the next files are announced
        to the kernel ahead of their reads (:class:`~torchrl_dcp.storage.copying.ReadAhead`); with several, two
        files in flight are the read-ahead (announcements made cold loads slower there).
        """
        names = sorted(per_file)
        sources = {n: self.read_source(n) for n in names}
        several = len(names) > 1
        if not (
            several
            and self.threads > 1
            and all(it.planned for n in names for it in per_file[n])  # DCP's planner is not called from threads
        ):
            ahead = ReadAhead([sources[n].size for n in names], lambda k: sources[names[k]].announce())
            for k, name in enumerate(names):
                if several:  # announce the next files: cold chunk files otherwise start with a small read-ahead
                    ahead.reach(k)
                self._read_file(name, per_file[name], planner, sources[name])
            return
        turn = {"next": 0, "failed": False}  # two files in flight are the read-ahead: nothing announced

        def work(_: list[int]) -> None:
            while True:
                with self._lock:
                    k = turn["next"]
                    if k >= len(names) or turn["failed"]:
                        return
                    turn["next"] = k + 1
                try:
                    self._read_file(names[k], per_file[names[k]], planner, sources[names[k]])
                except BaseException:
                    turn["failed"] = True  # the others stop after their current file
                    raise

        run_split(list(range(self.threads)), [1] * self.threads, self.threads, work)

    def _scratch(self, items: list[RecordRead]) -> bytearray:
        """This thread's buffer for batched small records and checksummed gaps, kept for the whole load: as large as
        ``items``' small records together (a batch is at most that), at least ``GAP_PIECE``, at most ``BATCH``."""
        small = sum(it.length for it in items if it.length < SMALL)
        size = min(BATCH, max(small, GAP_PIECE))
        held = getattr(self._local, "scratch", None)
        if held is None or len(held) < size:
            held = self._local.scratch = bytearray(size)
        return held

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _read_file(
        self, relative_path: str, items: list[RecordRead], planner: LoadPlanner, src: RangeFile | None = None
    ) -> None:
        src = src or self.read_source(relative_path)
        expected = self.verify.get(relative_path)
        items.sort(key=lambda it: it.offset)
        for it in items:
            if it.planned:
                continue
            found = self._target(it.req, planner)
            if found is not None:
                it.target, it.view, it.device = found
        pieces: list[tuple[int, int, int]] = []  # (offset, length, crc) of what was read, when verifying
        tiled = expected is not None and all(a.offset + a.length <= b.offset for a, b in zip(items, items[1:]))
        if expected is not None and not tiled:  # overlapping reads (narrowed shards): checksum the file first
            self._check_whole(src, expected)
            expected = None
        crc = expected is not None
        f = src.open()
        try:
            scratch = self._scratch(items)
            pos, i = 0, 0
            while i < len(items):
                it = items[i]
                if crc and it.offset > pos:
                    pieces += self._read_gap(src, f, pos, it.offset, scratch)
                if it.length >= SMALL:  # a run of large records: spread over the threads, one record each at a time
                    j = i + 1
                    while j < len(items) and items[j].length >= SMALL:
                        j += 1
                    pieces += self._read_large_run(src, f, items[i:j], planner, crc, scratch)
                    pos, i = max(pos, max(r.offset + r.length for r in items[i:j])), j
                    continue
                pos, i = self._read_batch(src, f, items, i, scratch, planner, pieces if crc else None)
            if crc and pos < src.size:
                pieces += self._read_gap(src, f, pos, src.size, scratch)
        except CheckpointIntegrityError:
            raise
        except Exception:
            if crc:  # a damaged record fails to parse before the file's checksum is complete: the damage is the cause
                self._check_whole(src, cast(str, expected))
            raise
        finally:
            f.close()
        if crc:
            self._compare(src, pieces, cast(str, expected))

    def _read_large_run(
        self, src: RangeFile, f: BinaryIO, run: list[RecordRead], planner: LoadPlanner, crc: bool, scratch: bytearray
    ) -> list[tuple[int, int, int]]:
        pieces: list[tuple[int, int, int]] = []
        if crc:  # the bytes between them
            for a, b in zip(run, run[1:]):
                if b.offset > a.offset + a.length:
                    pieces += self._read_gap(src, f, a.offset + a.length, b.offset, scratch)
        return pieces + self._read_run(src, f, run, planner, crc)

    def _read_batch(
        self,
        src: RangeFile,
        f: BinaryIO,
        items: list[RecordRead],
        i: int,
        scratch: bytearray,
        planner: LoadPlanner,
        pieces: list[tuple[int, int, int]] | None,
    ) -> tuple[int, int]:
        """Read the small, contiguous records from ``items[i]`` on in one read; returns where the batch ended
        (its end offset, and the index of the first item after it)."""
        j = batch_end(items, i)
        start, end = items[i].offset, items[j - 1].offset + items[j - 1].length
        buf = scratch if end - start <= len(scratch) else bytearray(end - start)
        view = memoryview(buf)[: end - start]
        src.read_at(f, start, view)
        self._count("bytes", end - start)
        if pieces is not None:
            pieces.append((start, end - start, crc32(view)))
        base = ctypes.addressof(ctypes.c_char.from_buffer(view)) if len(view) else 0
        copied = 0
        to_device: list[tuple[torch.Tensor, int, RecordRead]] = []  # (destination's bytes, offset in the batch, item)
        for item in items[i:j]:
            rel = item.offset - start
            small = item.small
            if small is not None and item.length == small.length and small.matches(buf, rel):  # our writer's record
                ctypes.memmove(item.target.data_ptr(), base + rel + small.data_at, small.nbytes)  # type: ignore[union-attr]
                copied += 1
                continue
            self._place_small(item, view[rel : rel + item.length], planner, base + rel, to_device, rel)
        if to_device:
            copy_batch([(dest, at) for dest, at, _ in to_device], view, self._device_window)
            for _, _, item in to_device:  # DCP's planner takes a tensor once its bytes are there
                if not item.planned:
                    planner.commit_tensor(item.req, item.target)
        self._count("in_place", copied)
        return end, j

    def _device_window(self, size: int, device: torch.device) -> torch.Tensor:
        """This thread's page-locked buffer for a batch bound for ``device`` (kept for the whole load, as the scratch)."""
        held = getattr(self._local, "device_window", None)
        if held is None or held.numel() < size:
            held = self._local.device_window = host_window(max(size, GAP_PIECE), device)
        return held

    def _place_small(
        self,
        item: RecordRead,
        record: memoryview,
        planner: LoadPlanner,
        address: int,
        to_device: list[tuple[torch.Tensor, int, RecordRead]],
        rel: int,
    ) -> None:
        """Place one small record of a batch (``record``, at ``rel`` in it); a copy to a device is queued on
        ``to_device`` (made by :func:`~torchrl_dcp.storage.staging.copy_batch` once the batch is placed, then
        committed)."""
        if item.small is not None and item.target is not None:  # direct reads, another layout: copy by address
            shape, dtype = tuple(item.target.shape), item.target.dtype
            at = record_data_offset(lambda o, n: record[o : o + n], record, item.length, dtype, shape)
            if at is not None:
                ctypes.memmove(item.target.data_ptr(), address + at, item.target.numel() * item.target.element_size())
                self._count("in_place")
                return
        if (item.view is not None or item.device is not None) and item.target is not None:
            shape, dtype = tuple(item.target.shape), item.target.dtype
            at = record_data_offset(lambda o, n: record[o : o + n], record, item.length, dtype, shape)
            if at is not None:
                self._count("in_place")
                if item.view is None:
                    to_device.append((cast(torch.Tensor, item.device), rel + at, item))
                    self._count("staged")
                    return
                item.view[:] = record[at : at + len(item.view)]
                if not item.planned:
                    planner.commit_tensor(item.req, item.target)
                return
        self._fallback(item, planner, bytes(record))

    def _read_run(
        self, src: RangeFile, f: BinaryIO, run: list[RecordRead], planner: LoadPlanner, crc: bool
    ) -> list[tuple[int, int, int]]:
        """Read several large records: each split between the threads when huge, else one per thread at once."""
        if self.threads == 1 or len(run) == 1 or any(it.length >= PARALLEL for it in run):
            return [p for it in run for p in self._read_large(src, f, it, planner, crc)]
        out: list[tuple[int, int, int]] = []

        def work(part: list[RecordRead]) -> None:
            own = src.open()  # a handle per thread
            try:
                found = [p for it in part for p in self._read_large(src, own, it, planner, crc, threads=1)]
            finally:
                own.close()
            with self._lock:
                out.extend(found)

        run_split(run, [it.length for it in run], self.threads, work)
        return out

    def _read_large(
        self, src: RangeFile, f: BinaryIO, item: RecordRead, planner: LoadPlanner, crc: bool, threads: int | None = None
    ) -> list[tuple[int, int, int]]:
        at = None
        head = memoryview(bytearray(min(item.length, 4096)))
        if item.target is not None and (item.view is not None or item.device is not None):
            src.read_at(f, item.offset, head)
            cache: dict[tuple[int, int], bytes] = {}

            def read(o: int, n: int) -> Any:
                if o + n <= len(head):
                    return head[o : o + n]
                if (o, n) not in cache:
                    buf = memoryview(bytearray(n))
                    src.read_at(f, item.offset + o, buf)
                    cache[(o, n)] = bytes(buf)
                return cache[(o, n)]

            at = record_data_offset(read, head, item.length, item.target.dtype, tuple(item.target.shape))
        if at is None or (item.view is None and item.device is None):
            data = memoryview(bytearray(item.length))
            src.read_at(f, item.offset, data)
            with self._lock:
                self.stats["bytes"] += item.length
                self._fallback(item, planner, bytes(data))
            return [(item.offset, item.length, crc32(data))] if crc else []
        n = len(item.view) if item.view is not None else cast(torch.Tensor, item.device).numel()
        prefix = read(0, at)  # the record's bytes before the tensor's (already read: checksummed, not re-read)
        pieces = [(item.offset, at, crc32(prefix))] if crc else []
        if item.view is not None:
            anonymous = not is_memmap_tensor(item.target)  # pages of a memory-mapped file are never mapped ahead
            pieces += self._read_into(src, f, item.offset + at, item.view, crc, threads, anonymous)
        else:
            share = (threads or self.threads) if n >= PARALLEL else 1
            pieces += read_staged(lambda o, v: src.read_at(f, o, v), item.offset + at, item.device, crc, share)
            self._count("staged")
        tail = memoryview(bytearray(item.length - at - n))
        src.read_at(f, item.offset + at + n, tail)
        if crc:
            pieces.append((item.offset + at + n, len(tail), crc32(tail)))
        with self._lock:
            self.stats["bytes"] += item.length
            self.stats["in_place"] += 1
            if not item.planned:
                planner.commit_tensor(item.req, item.target)
        return pieces

    def _read_into(
        self,
        src: RangeFile,
        f: BinaryIO,
        offset: int,
        view: memoryview,
        crc: bool,
        threads: int | None = None,
        map_ahead: bool = False,
    ) -> list[tuple[int, int, int]]:
        """Read ``len(view)`` bytes at ``offset`` into ``view``; when large, 4 MiB pieces are dealt to the threads in
        turn, all reading through ``f``: the file is read front to back (one stream for the disk and its read-ahead:
        separate streams per thread were 1.5x slower on cold data here), each thread checksumming what it read."""
        n = len(view)
        threads = (threads or self.threads) if n >= PARALLEL else 1
        starts = list(range(0, n, READ_PIECE))
        results: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]

        def run(part: list[int]) -> None:
            for k in part:
                for a in starts[k::threads]:
                    piece = view[a : min(a + READ_PIECE, n)]
                    src.read_at(f, offset + a, piece)
                    if crc:
                        results[k].append((offset + a, len(piece), crc32(piece)))

        mapper = prefault(view) if n >= PARALLEL and map_ahead and self.prefault else None
        try:
            run_split(list(range(threads)), [1] * threads, threads, run)
        finally:
            if mapper is not None:
                mapper.join()
        return [p for r in results for p in r]

    def _read_gap(
        self, src: RangeFile, f: BinaryIO, start: int, end: int, scratch: bytearray
    ) -> list[tuple[int, int, int]]:
        out = []
        for a in range(start, end, len(scratch)):
            view = memoryview(scratch)[: min(len(scratch), end - a)]
            src.read_at(f, a, view)
            out.append((a, len(view), crc32(view)))
        return out

    def _check_whole(self, src: RangeFile, expected: str) -> None:
        f = src.open()
        try:
            pieces = self._read_gap(src, f, 0, src.size, self._scratch([]))
        finally:
            f.close()
        self._compare(src, pieces, expected)

    def _compare(self, src: RangeFile, pieces: list[tuple[int, int, int]], expected: str) -> None:
        value, pos = combined_crc(pieces)
        if pos != src.size:
            raise CheckpointIntegrityError(f"internal: checksummed {pos} of {src.size} bytes", path=src.where)
        actual = format_crc(value)
        self._count("verified_files")
        if actual != expected:
            raise CheckpointIntegrityError(
                f"checksum is {actual}, the manifest says {expected}: the file is damaged ({self.mismatch_note})",
                path=src.where,
            )

"""Chunk files: rows of a large tensor in a file of their own, written anew or kept from an earlier save.

Each chunk file holds one ``torch.save``-compatible record (the chunk's rows, so a plain
``dcp.load`` reads it through the chunk metadata) followed by the identity trailer of
the save that wrote it. An incremental save keeps an unchanged chunk by giving the
earlier checkpoint's file a second name in the new checkpoint (a hard link: no bytes
written, and deleting the earlier checkpoint later leaves the new one whole); where a
hard link is impossible (another file system, a link limit) the file is copied, and the
outcome counts it. A file is kept only if it provably holds the rows being saved: this
process wrote it (or compared it byte for byte with the live rows) and a ``fstat`` shows it
unchanged since (:mod:`torchrl_dcp.storage.proven`); a file this process knows nothing of is
read once and compared with the rows (:func:`prove_kept`). The manifest's checksums are never
taken on trust: a forger can reseal them. Otherwise the chunk is written anew. A file proved by
reading is linked only if no one else controls its inode (owned by this process's effective uid,
writable by no one else, every name of it in our checkpoints: :func:`_only_ours`); otherwise it
is copied, since a hard link would let its owner rewrite the new checkpoint from outside it.

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from torchrl_dcp.storage.chunk_writer import write_chunk_file
    >>> from torchrl_dcp.storage.files import DirHandle
    >>> d = DirHandle.open(Path(tempfile.mkdtemp()))
    >>> rec = write_chunk_file(d, "__0_1.distcp", torch.arange(6.0).reshape(3, 2), "0" * 32, 0)
    >>> rec.fingerprint  # doctest: +ELLIPSIS
    'crc32:.../adler32:...'
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchrl_dcp._log import get_logger
from torchrl_dcp.format.checksums import adler32, content_fingerprint, crc32, crc32_combine, fingerprint_of, format_crc
from torchrl_dcp.format.layout import MANIFEST, TRAILER_SIZE, identity_trailer, read_identity
from torchrl_dcp.format.record import template, tensor_bytes
from torchrl_dcp.storage import proven
from torchrl_dcp.storage.copying import pwrite_all, run_split
from torchrl_dcp.storage.files import DirHandle
from torchrl_dcp.storage.proven import ChunkIdentity
from torchrl_dcp.storage.stable_bytes import stable_piece
from torchrl_dcp.storage.writeback import Writeback

logger = get_logger(__name__)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_OPEN_KEPT = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0)  # a FIFO planted in the base must not block
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


@dataclass(frozen=True)
class ChunkFile:
    """What the manifest and DCP's metadata record of one chunk file."""

    size: int
    checksum: str
    length: int  # of the record (at offset 0); the identity trailer follows
    fingerprint: str  # of the chunk's data (crc32 + adler32)
    origin: str | None = None  # the save that wrote it, when it was kept from an earlier one
    copied: bool = False  # kept by copying (no hard link possible, or the base's inode is not ours alone)
    foreign: bool = False  # copied because someone else controls the base's inode (:func:`_only_ours`)


@dataclass(frozen=True)
class KeptChunk:
    """A chunk file of an earlier checkpoint that holds exactly the rows to save."""

    source: Any  # a Path, or a StorePath (an object, copied server-side: objectstore_save)
    size: int
    checksum: str
    origin: str  # the save whose identity trailer it carries
    fingerprint: str
    key: str = ""  # the chunk it holds: rows [start, start + rows) of key
    start: int = 0
    rows: int = 0

    def identity(self) -> ChunkIdentity:
        return ChunkIdentity(self.key, self.start, self.rows, self.size, self.checksum, self.fingerprint)


@dataclass
class ChunkJob:
    """One chunk this rank puts into the staging directory: its rows to write, or a file to keep."""

    file: str
    key: str
    start: int
    rows: int
    tensor: torch.Tensor | None = None
    keep: KeptChunk | None = None
    result: ChunkFile | None = field(default=None, repr=False)


CHUNK_PIECE = 1 << 20  # rows copied, checksummed and written 1 MiB at a time (a copy stays in cache)


def chunk_file_parts(
    rows: torch.Tensor, save_id: str, rank: int, *, stable: bool = False
) -> tuple[list[Any], ChunkFile]:
    """The bytes of a chunk file in order (record head, the rows' bytes, record tail + trailer) and its record
    (``stable``: the rows' bytes copied first, for a writer that uploads them later)."""
    data = tensor_bytes(rows)
    if stable:  # (uploaded after this returns: a copy, as the live rows may change meanwhile)
        data = memoryview(bytes(data))
    fingerprint, data_crc = content_fingerprint(data)
    head, tail = template(rows.dtype, tuple(rows.shape)).parts(data_crc)
    end = tail + identity_trailer(save_id, rank)
    crc = crc32_combine(crc32_combine(crc32(head), data_crc, len(data)), crc32(end), len(end))
    size = len(head) + len(data) + len(end)
    return [head, data, end], ChunkFile(size, format_crc(crc), len(head) + len(data) + len(tail), fingerprint)


def write_chunk_file(
    directory: DirHandle,
    name: str,
    rows: torch.Tensor,
    save_id: str,
    rank: int,
    *,
    fsync: bool = True,
    chunk: tuple[str, int] | None = None,
) -> ChunkFile:
    """Write ``rows`` as one record followed by the identity trailer into the new file ``name`` of ``directory``;
    ``chunk`` (key, first row) records it as proven (:mod:`torchrl_dcp.storage.proven`) for later keeps."""
    data = tensor_bytes(rows)
    tpl = template(rows.dtype, tuple(rows.shape))
    fd = directory.create(name)
    try:
        writeback = Writeback(fd) if fsync else None

        def put(part: Any, at: int) -> None:
            pwrite_all(fd, part, at)
            if writeback is not None:
                writeback.written(at, len(part))

        # the rows copied piece by piece, each copy checksummed and written: rows changed meanwhile (a collector's
        # thread, an async save of a memory-mapped buffer) may or may not be in the file, its checksums and
        # fingerprint are those of the bytes it holds; the head (which holds the data's CRC) is written last
        data_crc, data_adler, at = 0, 1, len(tpl.head)
        for lo in range(0, len(data), CHUNK_PIECE):
            piece = stable_piece(data[lo : lo + CHUNK_PIECE])
            data_crc, data_adler = crc32(piece, data_crc), adler32(piece, data_adler)
            put(piece, at + lo)
        head, tail = tpl.parts(data_crc)
        end = tail + identity_trailer(save_id, rank)
        put(head, 0)
        put(end, at + len(data))
        crc = crc32_combine(crc32_combine(crc32(head), data_crc, len(data)), crc32(end), len(end))
        size = len(head) + len(data) + len(end)
        record = ChunkFile(
            size, format_crc(crc), len(head) + len(data) + len(tail), fingerprint_of(data_crc, data_adler)
        )
        if writeback is not None:
            writeback.flush()
            os.fsync(fd)
        if chunk is not None:
            identity = ChunkIdentity(
                chunk[0], chunk[1], rows.shape[0], record.size, record.checksum, record.fingerprint
            )
            proven.record(os.fstat(fd), identity)
    except OSError as err:  # (a pwrite names no file: the failure says which)
        if err.filename is None:
            err.filename = str(directory.path / name)
        raise
    finally:
        os.close(fd)
    return record


def _checked(fd: int, kept: KeptChunk) -> os.stat_result | None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != kept.size or st.st_size < TRAILER_SIZE:
        return None
    found = read_identity(os.pread(fd, TRAILER_SIZE, st.st_size - TRAILER_SIZE))
    return st if found is not None and found[0] == kept.origin else None


def prove_kept(kept: KeptChunk, rows: torch.Tensor) -> bool:
    """Whether ``kept.source`` holds exactly ``rows`` as the file an honest save writes (record, rows, trailer of
    ``kept.origin``) with the recorded checksum and fingerprint: a ``fstat`` when this process wrote or proved it,
    else one read compared byte for byte (then recorded as proven)."""
    try:
        fd = os.open(kept.source, _OPEN_KEPT)
    except OSError:
        return False
    try:
        st = _checked(fd, kept)
        if st is None:
            return False
        if proven.vouches(st, kept.identity()):
            return True
        if not _same_bytes(fd, kept, rows):
            return False
        after = os.fstat(fd)
        if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            return False  # changed while it was read
        proven.record(after, kept.identity(), linkable=_only_ours(after, Path(kept.source)))
        return True
    finally:
        os.close(fd)


def _owned(st: os.stat_result) -> bool:
    """Whether only this user can write the file of ``st``: owned by this process's effective uid, no write
    permission for group or others (nor, through the ACL mask in the group bits, for anyone an ACL names)."""
    geteuid = getattr(os, "geteuid", None)
    return (geteuid is None or st.st_uid == geteuid()) and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _only_ours(st: os.stat_result, source: Path) -> bool:
    """Whether the inode of ``st`` (the base's file ``source``, proved by reading) may be hard-linked into a new
    checkpoint: :func:`_owned`, and every one of its ``st_nlink`` names is ``source`` or the file of the same name
    in a sibling checkpoint (the entries of a rotation share unchanged chunk files). A name elsewhere (a file
    another user linked into the base, a copy by ``cp -l``) is a way to rewrite the new checkpoint from outside
    it, so the file is copied instead. Names that cannot be accounted for count against it."""
    if not _owned(st):
        return False
    if st.st_nlink <= 1:
        return True
    inode = (st.st_dev, st.st_ino)
    try:
        own = os.lstat(source)
    except OSError:
        return False
    if (own.st_dev, own.st_ino) != inode:
        return False
    base, found = source.parent, 1
    try:
        with os.scandir(base.parent) as entries:
            for entry in entries:
                if found >= st.st_nlink:
                    break
                if entry.name == base.name or not entry.is_dir(follow_symlinks=False):
                    continue
                try:
                    other = os.lstat(os.path.join(entry.path, source.name))
                except OSError:
                    continue
                if (other.st_dev, other.st_ino) == inode and _a_checkpoints(entry):
                    found += 1
    except OSError:
        return False
    return found >= st.st_nlink


def _a_checkpoints(entry: os.DirEntry) -> bool:
    """Whether the sibling directory ``entry`` is a checkpoint (it holds a regular ``manifest.json``) or a save's or
    prune's own staging or trash directory: a directory of a user's (``cp -l`` of the base) is a name elsewhere."""
    from torchrl_dcp.storage.commit import is_ours

    if is_ours(entry.name):
        return True
    try:
        return stat.S_ISREG(os.lstat(os.path.join(entry.path, MANIFEST)).st_mode)
    except OSError:
        return False


def _same_bytes(fd: int, kept: KeptChunk, rows: torch.Tensor) -> bool:
    """Whether the file at ``fd`` is byte for byte the chunk file of ``rows`` with ``kept``'s trailer, size,
    checksum and fingerprint."""
    found = read_identity(os.pread(fd, TRAILER_SIZE, kept.size - TRAILER_SIZE))
    if found is None or found[0] != kept.origin or rows.shape[0] != kept.rows:
        return False
    parts, expected = chunk_file_parts(rows, found[0], found[1])
    if (expected.size, expected.checksum, expected.fingerprint) != (kept.size, kept.checksum, kept.fingerprint):
        return False
    at = 0
    for part in parts:
        view = memoryview(part).cast("B")
        for lo in range(0, len(view), 8 << 20):
            piece = view[lo : lo + (8 << 20)]
            if os.pread(fd, len(piece), at) != piece:
                return False
            at += len(piece)
    return True


def keep_chunk_file(kept: KeptChunk, directory: DirHandle, name: str) -> ChunkFile | None:
    """Give ``kept`` the name ``name`` in ``directory`` (hard link, else copy); ``None`` when it is not (still) the
    file proven to hold the chunk (:func:`prove_kept`, :mod:`torchrl_dcp.storage.proven`)."""
    try:
        fd = os.open(kept.source, _OPEN_KEPT)
    except OSError:
        return None
    try:
        st = _checked(fd, kept)
        if st is None or not proven.vouches(st, kept.identity()):
            return None
        foreign = not (proven.linkable(st) and _owned(st))  # a link would let someone else rewrite the new one
        copied = foreign or not _link_same(kept.source, directory, name, st)
        if copied:
            _copy_fd(fd, directory, name, st.st_size, kept.identity())
        else:
            proven.linked(st, os.fstat(fd))
    finally:
        os.close(fd)
    return ChunkFile(kept.size, kept.checksum, kept.size - TRAILER_SIZE, kept.fingerprint, kept.origin, copied, foreign)


def _link_same(source: Path, directory: DirHandle, name: str, st: os.stat_result) -> bool:
    """Hard-link ``source`` as ``name`` if it is still the inode checked (``st``); ``False`` if impossible."""
    try:
        directory.link(source, name)
    except OSError as err:
        if err.errno in _NO_LINK:
            return False
        raise
    linked = directory.lstat(name)
    if (linked.st_dev, linked.st_ino) != (st.st_dev, st.st_ino):  # swapped meanwhile: copy what was checked
        directory.unlink(name)
        return False
    return True


def _copy_fd(src: int, directory: DirHandle, name: str, size: int, identity: ChunkIdentity) -> None:
    fd = directory.create(name)
    try:
        done = 0
        while done < size:
            try:
                n = os.copy_file_range(src, fd, size - done, done, done)
            except OSError as err:
                if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                n = os.pwrite(fd, os.pread(src, min(8 << 20, size - done), done), done)
            if n <= 0:
                raise OSError(f"copying a kept chunk file stopped at {done} of {size} bytes")
            done += n
        os.fsync(fd)
        proven.record(os.fstat(fd), identity)  # a copy of bytes proven: proven as well
    finally:
        os.close(fd)


def write_chunks(jobs: list[ChunkJob], directory: DirHandle, save_id: str, rank: int, threads: int) -> None:
    """Write or keep every chunk of ``jobs`` in ``directory`` (threads split the bytes); fills ``job.result``."""

    def work(part: list[ChunkJob]) -> None:
        for job in part:
            if job.keep is not None:
                job.result = keep_chunk_file(job.keep, directory, job.file)
                if job.result is not None:
                    continue
            if job.tensor is None:  # async save: the rows were not staged, and the file changed since checked
                raise OSError(
                    f"{job.keep.source if job.keep else job.file} changed after the incremental save checked it; "
                    "save again (or without incremental_from)"
                )
            job.result = write_chunk_file(directory, job.file, job.tensor, save_id, rank, chunk=(job.key, job.start))

    if not jobs:
        return
    sizes = [64 if j.keep is not None else _nbytes(j.tensor) for j in jobs]
    run_split(jobs, sizes, max(1, min(threads, len(jobs))), work)
    foreign = [j for j in jobs if j.result is not None and j.result.foreign]
    if foreign:
        logger.warning(
            "copied %d kept chunk files (e.g. %s) instead of hard-linking them: their inode is not this user's "
            "alone (another owner, writable by others, or a name outside the checkpoints), and a link would let "
            "it rewrite the new checkpoint from outside",
            len(foreign),
            foreign[0].keep.source if foreign[0].keep is not None else foreign[0].file,
        )


def _nbytes(tensor: Any) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()

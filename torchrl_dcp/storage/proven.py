"""Chunk files this process wrote or proved: what lets an incremental save keep a file for the cost of a ``stat``.

A chunk file of an earlier checkpoint may be kept (hard-linked into the new one) only if it
provably holds the rows being saved. The manifest cannot prove it: whoever can write the
directory can rewrite a chunk file in place and reseal every checksum. So this process
remembers, in memory, each chunk file it wrote (or compared byte for byte with the live
rows): the inode, its size, ``mtime`` and ``ctime`` then, the chunk it holds (key, first
row, rows) and its checksum and fingerprint. A later save keeps the file when a ``fstat``
still shows that inode with the same size, ``mtime`` and ``ctime`` (any write, rename or
link by someone else moves ``ctime``, which no user can set back) and the base records the
same chunk, checksum and fingerprint. Otherwise the file is proved by reading it
(:func:`torchrl_dcp.storage.chunk_writer.prove_kept`) or the chunk is written anew.

This process's own links and unlinks move ``ctime`` too: :func:`linked` and
:func:`unlink_keeping_proof` carry the record over to the new ``ctime``.

A record also says whether the file may be hard-linked into a new checkpoint
(:func:`linkable`): a file proved by reading whose inode someone else controls (another
owner, writable by others, a name outside our checkpoints) holds the rows, but is copied,
never linked: its other names could rewrite the new checkpoint from outside it. A file this
process created is linkable; no one else can take control of it without moving ``ctime``.

Objects in a store are immutable; an overwrite is a new object with a new version (S3's
ETag, GCS's generation, a memory store's creation time). :func:`record_object` remembers
the version this process uploaded or copied and the chunk it holds; :func:`vouches_object`
accepts a listed object only at that version. A store object this process knows nothing of
is uploaded again rather than copied.

Example:
    >>> import os, tempfile
    >>> fd, name = tempfile.mkstemp()
    >>> chunk = ChunkIdentity("replicated/t", 0, 4, 0, "crc32:00000000", "crc32:0/adler32:1")  # an empty file
    >>> record(os.fstat(fd), chunk)
    >>> vouches(os.fstat(fd), chunk)
    True
    >>> _ = os.write(fd, b"x")  # the size and ctime move: no longer vouched for
    >>> vouches(os.fstat(fd), chunk)
    False
    >>> os.close(fd); os.unlink(name)
"""

from __future__ import annotations

import datetime
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ChunkIdentity",
    "forget_all",
    "linkable",
    "linked",
    "object_version",
    "object_version_of",
    "record",
    "record_object",
    "unlink_keeping_proof",
    "vouches",
    "vouches_object",
]


@dataclass(frozen=True)
class ChunkIdentity:
    """What a chunk file holds: the rows ``[start, start + rows)`` of ``key``, in ``size`` bytes with that checksum."""

    key: str
    start: int
    rows: int
    size: int
    checksum: str
    fingerprint: str


@dataclass(frozen=True)
class _Seen:
    size: int
    mtime_ns: int
    ctime_ns: int
    chunk: ChunkIdentity
    linkable: bool = True  # may be hard-linked into a new checkpoint (else: copied)


_seen: dict[tuple[int, int], _Seen] = {}
_objects: dict[str, tuple[str, ChunkIdentity]] = {}  # {object URL: (version, chunk)}
_lock = threading.Lock()


def record(st: os.stat_result, chunk: ChunkIdentity, *, linkable: bool = True) -> None:
    """Remember that the file of ``st`` (a ``fstat`` of a file this process wrote or proved) holds ``chunk``;
    ``linkable=False``: someone else controls the inode, so it is to be copied rather than linked."""
    if stat.S_ISREG(st.st_mode) and st.st_size == chunk.size:
        with _lock:
            _seen[(st.st_dev, st.st_ino)] = _Seen(st.st_size, st.st_mtime_ns, st.st_ctime_ns, chunk, linkable)


def vouches(st: os.stat_result, chunk: ChunkIdentity) -> bool:
    """Whether the file of ``st`` is, unchanged, one this process recorded as holding exactly ``chunk``."""
    with _lock:
        seen = _seen.get((st.st_dev, st.st_ino))
    return (
        seen is not None
        and stat.S_ISREG(st.st_mode)
        and (seen.size, seen.mtime_ns, seen.ctime_ns) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        and seen.chunk == chunk
    )


def linkable(st: os.stat_result) -> bool:
    """Whether the file of ``st``, unchanged since recorded, may be hard-linked into a new checkpoint (``False``
    also when no record vouches for it)."""
    with _lock:
        seen = _seen.get((st.st_dev, st.st_ino))
    return (
        seen is not None
        and seen.linkable
        and (seen.size, seen.mtime_ns, seen.ctime_ns) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    )


def linked(before: os.stat_result, after: os.stat_result) -> None:
    """This process gave the file another name (``before``/``after``: its ``fstat`` around the link): the record,
    if it vouched for ``before``, moves to the new ``ctime``."""
    _carry(before, after)


def unlink_keeping_proof(dir_fd: int, name: str) -> None:
    """Unlink the regular file ``name`` of the directory ``dir_fd``, carrying a record of it over to the ``ctime``
    the unlink gives its other names (rotation prunes entries whose chunk files newer ones still link)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        os.unlink(name, dir_fd=dir_fd)
        return
    try:
        before = os.fstat(fd)
        os.unlink(name, dir_fd=dir_fd)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if after.st_nlink == 0:
        with _lock:
            _seen.pop((after.st_dev, after.st_ino), None)
    else:
        _carry(before, after)


def knows(st: os.stat_result) -> bool:
    """Whether a record of the file of ``st`` exists (worth carrying over an unlink)."""
    with _lock:
        return (st.st_dev, st.st_ino) in _seen


def forget_all() -> None:
    """Drop every record (tests; a process that wants every kept file proved by reading again)."""
    with _lock:
        _seen.clear()
        _objects.clear()


def object_version(info: dict[str, Any]) -> str | None:
    """The version of a store object from its listing or ``info`` (``None``: the store gives none)."""
    for field in ("ETag", "etag", "generation", "VersionId", "LastModified", "mtime", "created"):
        value = info.get(field)
        if value is not None:
            if isinstance(value, datetime.datetime):
                value = value.timestamp()
            return f"{field}:{value}"
    return None


def record_object(url: str, version: str | None, chunk: ChunkIdentity) -> None:
    """Remember that the object ``url`` at ``version`` (uploaded or copied by this process) holds ``chunk``."""
    with _lock:
        if version is None:
            _objects.pop(url, None)
        else:
            _objects[url] = (version, chunk)


def object_version_of(url: str, chunk: ChunkIdentity) -> str | None:
    """The version recorded for the object ``url`` holding ``chunk`` (``None``: none is)."""
    with _lock:
        seen = _objects.get(url)
    return seen[0] if seen is not None and seen[1] == chunk else None


def vouches_object(url: str, version: str | None, chunk: ChunkIdentity) -> bool:
    """Whether the object ``url``, listed at ``version``, is one this process recorded as holding ``chunk``."""
    with _lock:
        seen = _objects.get(url)
    return version is not None and seen == (version, chunk)


def _carry(before: os.stat_result, after: os.stat_result) -> None:
    with _lock:
        seen = _seen.get((before.st_dev, before.st_ino))
        if seen is None or (seen.size, seen.mtime_ns, seen.ctime_ns) != (
            before.st_size,
            before.st_mtime_ns,
            before.st_ctime_ns,
        ):
            return
        if (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns) == (
            before.st_dev,
            before.st_ino,
            before.st_size,
            before.st_mtime_ns,
        ):
            _seen[(after.st_dev, after.st_ino)] = _Seen(
                after.st_size, after.st_mtime_ns, after.st_ctime_ns, seen.chunk, seen.linkable
            )

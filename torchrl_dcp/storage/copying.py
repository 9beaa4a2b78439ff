"""Copy (or only checksum) byte ranges between open files with several threads, CRC32 on the way.

The work is cut into pieces of at most ``buffer_size / threads`` bytes; each thread
takes a contiguous run of pieces, reads them into its own reused buffer
(``preadv``), computes their CRC32 and writes them at their offset (``pwrite``),
starting the disk writeback of what it wrote as it goes (``storage/writeback.py``).
The CRC32 of each range is combined from its pieces' (``crc32_combine``). Memory
stays bounded by ``buffer_size``; ``zlib.crc32`` and the system calls release the
GIL, so two threads use two CPUs.

Example:
    >>> import os, tempfile, zlib
    >>> from torchrl_dcp.storage.copying import CopyRange, copy_ranges
    >>> src, dst = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    >>> _ = src.write(b"0123456789"); src.flush()
    >>> copy_ranges([CopyRange(src.fileno(), 2, 5, dst.fileno(), 0, "src")]) == [zlib.crc32(b"23456")]
    True
    >>> os.pread(dst.fileno(), 5, 0)
    b'23456'
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from torchrl_dcp.errors import CheckpointIntegrityError
from torchrl_dcp.format.checksums import crc32, crc32_combine
from torchrl_dcp.settings import setting, setting_at_import
from torchrl_dcp.storage.writeback import Writeback

logger = logging.getLogger(__name__)
BUFFER = 4 << 20
T = TypeVar("T")
MIN_PIECE = 1 << 20


def node_cpus_per_rank() -> int:
    """This process's share of the CPUs it may run on: CPUs (affinity) // ranks on this node (at least 1).

    The ranks of one node share its CPUs; ``LOCAL_WORLD_SIZE`` (set by ``torchrun`` per
    node) says how many there are. Neither ``WORLD_SIZE`` (every node) nor another
    node's CPU count enters: on 2 nodes x 8 ranks of 16 CPUs each, every rank gets 2.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        local = 1
    return max(1, cpus // max(1, local))


_LEFT_FREE = threading.local()


@contextlib.contextmanager
def leaving_cpus(n: int) -> Iterator[None]:
    """Within: the default thread counts of this thread's writes, copies and reads leave ``n`` of this rank's CPUs
    free (at least one thread still runs); explicit ``TDCP_WRITE_THREADS`` / ``TDCP_READ_THREADS`` win.

    An async save's background thread leaves the training loop's intra-op threads their CPUs: on 2 CPUs, a 1-thread
    SAC update loop slowed by 20 % while a 512 MiB save wrote with 2 threads, by 7 % with 1
    (``benchmarks/async_training.py``).

    Example:
        >>> with leaving_cpus(10**6):
        ...     default_threads()
        1
    """
    before = getattr(_LEFT_FREE, "n", 0)
    _LEFT_FREE.n = max(0, n)
    try:
        yield
    finally:
        _LEFT_FREE.n = before


def yield_cpus(nice: int) -> None:
    """Raise the calling thread's niceness to ``nice`` (and of the threads it starts later): an async save's
    background thread, so that a training loop on every CPU is slowed less while the save takes longer.

    Linux only (there a thread's priority is its own; elsewhere it would be the whole process's): nothing elsewhere,
    for ``nice`` 0, or when the thread is already that nice (lowering it back needs privileges: kept).

    Example:
        >>> yield_cpus(0)  # the default: unchanged
    """
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as err:  # a sandbox that refuses it: the save runs at the normal priority
        logger.warning("could not lower the async save's priority to nice %d: %s", nice, err)


def _threads(variable: str, cap: int) -> int:
    chosen = setting(variable)
    if chosen is not None:
        return chosen
    return max(1, min(cap, node_cpus_per_rank() - getattr(_LEFT_FREE, "n", 0)))


def default_threads() -> int:
    """Write/copy threads per process: ``TDCP_WRITE_THREADS``, else up to 4 (this rank's share of the node's CPUs)."""
    return _threads("TDCP_WRITE_THREADS", 4)


def read_threads() -> int:
    """Reader threads per process: ``TDCP_READ_THREADS``, else this rank's share of the node's CPUs (at most 2)
    plus one: one read more in flight than there are CPUs to copy and checksum keeps a cold disk busy (1 GiB in
    128 chunk files, cold, on 2 CPUs: 0.30-0.33 s with 3 threads against 0.33-0.39 s with 2; warm unchanged)."""
    if setting("TDCP_READ_THREADS") is not None:
        return _threads("TDCP_READ_THREADS", 2)
    return _threads("TDCP_READ_THREADS", 2) + 1


READ_AHEAD = setting_at_import(
    "TDCP_READ_AHEAD"
)  # bytes asked of the kernel ahead of the reads (``TDCP_READ_AHEAD``; 0: none)


class ReadAhead:
    """Keeps the kernel reading about ``ahead`` bytes ahead of a sequence of spans of ``sizes`` bytes.

    Checkpoints cut into many ~8 MiB chunk files read cold at 0.55 s/GiB file by file
    here against 0.36 s/GiB with the next files announced (``POSIX_FADV_WILLNEED``):
    each new file otherwise starts with a small read-ahead window. ``announce(j)`` gives
    the hint for span ``j``; a hint that fails is ignored (the read reports problems).

    Example:
        >>> told = []
        >>> ahead = ReadAhead([8, 8, 8, 8], told.append, ahead=16)
        >>> ahead.reach(0); ahead.reach(1); told
        [0, 1, 2]
    """

    def __init__(self, sizes: Sequence[int], announce: Callable[[int], None], ahead: int | None = None) -> None:
        self.sizes, self.announce, self.next = sizes, announce, 0
        self.ahead = READ_AHEAD if ahead is None else ahead

    def reach(self, k: int) -> None:
        """Span ``k`` is about to be read: announce the spans that start less than ``ahead`` bytes past it."""
        budget, j = self.ahead, k
        while j < len(self.sizes) and budget > 0:
            if j >= self.next:
                try:
                    self.announce(j)
                except (AttributeError, OSError):  # a hint (no posix_fadvise, a file gone): the read will say
                    pass
                self.next = j + 1
            budget -= self.sizes[j]
            j += 1


def will_need(fd: int, offset: int, size: int) -> None:
    """Ask the kernel to start reading ``size`` bytes at ``offset`` of ``fd`` (``POSIX_FADV_WILLNEED``)."""
    os.posix_fadvise(fd, offset, size, os.POSIX_FADV_WILLNEED)


@dataclass(frozen=True)
class CopyRange:
    """``size`` bytes at ``src_offset`` of the file ``src`` (an fd), copied to ``dst_offset`` of ``dst``.

    ``dst=None`` only checksums; ``name`` is the source named in errors.
    """

    src: int
    src_offset: int
    size: int
    dst: int | None
    dst_offset: int
    name: str


def _read_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    done = 0
    while done < len(view):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [view[done:]], offset + done)
        else:  # pragma: no cover - platforms without preadv
            data = os.pread(fd, len(view) - done, offset + done)
            n = len(data)
            view[done : done + n] = data
        if n <= 0:
            raise CheckpointIntegrityError(f"file ended {len(view) - done} bytes early", path=name)
        done += n


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of ``data`` (any bytes-like object) at ``offset``: one ``pwrite`` may write less."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite wrote {n} bytes")
        done += n


def run_split(items: Sequence[T], sizes: Sequence[int], threads: int, work: Callable[[list[T]], None]) -> None:
    """Cut ``items`` into ``threads`` contiguous runs of about equal total size; run ``work`` on each in its thread.

    The calling thread takes the first run. The first exception raised in any thread is re-raised here.
    """
    parts: list[list[T]] = [[] for _ in range(max(1, threads))]
    share, acc, k = sum(sizes) / len(parts), 0, 0
    for item, size in zip(items, sizes):
        if acc >= share * (k + 1) and k < len(parts) - 1:
            k += 1
        parts[k].append(item)
        acc += size
    errors: list[BaseException] = []

    def guarded(part: list[T]) -> None:
        try:
            work(part)
        except BaseException as err:  # re-raised in the calling thread
            errors.append(err)

    pool = [threading.Thread(target=guarded, args=(p,), daemon=True) for p in parts[1:]]
    for t in pool:
        t.start()
    guarded(parts[0])
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def copy_ranges(
    ranges: Sequence[CopyRange],
    *,
    threads: int | None = None,
    buffer_size: int = BUFFER,
    progress: Callable[[int], None] | None = None,
    writeback: bool = True,
) -> list[int]:
    """Copy every range (several threads); return the CRC32 of each range's bytes, in order.

    Args:
        threads: worker threads (default :func:`default_threads`; fewer for small copies).
        buffer_size: memory for all threads' buffers together.
        progress: called with the number of bytes each time a piece is done (from any thread).
        writeback: start the disk write of copied data at once (the caller fsyncs the destinations).

    Raises:
        CheckpointIntegrityError: a source ended before the range did.
    """
    total = sum(r.size for r in ranges)
    n_threads = max(1, min(threads or default_threads(), total // (4 * MIN_PIECE) or 1))
    piece = max(MIN_PIECE, buffer_size // n_threads)
    pieces = [(i, off, n) for i, r in enumerate(ranges) for off, n in _cut(r.size, piece)]
    crcs: dict[tuple[int, int], int] = {}
    lock = threading.Lock()

    def run(part: list[tuple[int, int, int]]) -> None:
        view = memoryview(bytearray(min(piece, max((p[2] for p in part), default=0))))
        flushers: dict[int, Writeback] = {}
        for i, off, n in part:
            r = ranges[i]
            chunk = view[:n]
            _read_into(r.src, chunk, r.src_offset + off, r.name)
            crcs[(i, off)] = crc32(chunk)
            if r.dst is not None:
                pwrite_all(r.dst, chunk, r.dst_offset + off)
                if writeback:
                    flushers.setdefault(r.dst, Writeback(r.dst)).written(r.dst_offset + off, n)
            if progress is not None:
                with lock:
                    progress(n)
        for f in flushers.values():
            f.flush()

    run_split(pieces, [p[2] for p in pieces], n_threads, run)
    out = []
    for i, r in enumerate(ranges):
        crc = 0
        for off, n in _cut(r.size, piece):
            crc = crc32_combine(crc, crcs[(i, off)], n)
        out.append(crc)
    return out


FIRST_READ = 4096


def _cut(size: int, piece: int) -> list[tuple[int, int]]:
    """``[(offset, length)]`` of a range read front to back: a first read of one page, then pieces.

    The small first read matters on cold data: the kernel then reads ahead as for a
    sequential stream; 128 chunk files of 8 MiB read cold in 0.31 s that way against
    0.56 s with 4 MiB reads from the start (raw ``readinto`` of one 1 GiB file: 0.30 s).
    """
    first = min(FIRST_READ, piece)
    if size <= first:
        return [(0, size)] if size else []
    return [(0, first)] + [(off, min(piece, size - off)) for off in range(first, size, piece)]

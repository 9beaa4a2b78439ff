"""What a read moves bytes between: a data file's byte range, a destination tensor's memory, one record to read.

- :class:`RangeFile` reads inside one data file's
  :class:`~torchrl_dcp.storage.base.ByteRange` (a file, or a ZIP member), never
  following links, looping on short reads;
- :func:`destination_bytes` is a writable view of a contiguous CPU tensor's memory
  (fresh destinations of 4 MiB or more are advised to use transparent huge pages);
  :func:`device_bytes` the flat bytes of one on another device (read through host
  windows: :mod:`~torchrl_dcp.storage.staging`);
- :class:`RecordRead` is one record to read and the tensor it is read into;
  :func:`plan_in_place` decides how (copied by address when small, read into a view
  when large, staged through host memory when on another device, else through
  ``torch.load``).

Example:
    >>> import torch
    >>> view = destination_bytes(torch.zeros(2, dtype=torch.int16))
    >>> len(view)
    4
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from torchrl_dcp.errors import CheckpointIntegrityError
from torchrl_dcp.format.record import STORAGE_NAMES, byte_view, is_memmap_tensor, template
from torchrl_dcp.settings import setting
from torchrl_dcp.storage.base import ByteRange
from torchrl_dcp.storage.files import open_regular
from torchrl_dcp.storage.libc import libc

READ_PIECE = 4 << 20  # read size of large records (and of checksummed gaps)
SMALL = 1 << 20  # records below this are read in batches and copied out
BATCH = 8 << 20  # bytes per batched read of small records
GAP_PIECE = 256 << 10  # least read size of checksummed bytes between (or after) records
PARALLEL = 32 << 20  # tensors at least this large are split between threads
HUGEPAGE_MIN = 4 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


# ---------------------------------------------------------------------- files
class RangeFile:
    """Reads inside one data file's :class:`~torchrl_dcp.storage.base.ByteRange` (a file, or a ZIP member).

    Every handle is opened without following links and must be a regular file;
    ``on_read(n)`` is told of every ``n`` bytes read.
    """

    def __init__(self, byte_range: ByteRange, on_read: Any = None, check_handle: Any = None) -> None:
        self.path, self.base, self.size, self.where = (
            byte_range.path,
            byte_range.base,
            byte_range.size,
            byte_range.where,
        )
        self.on_read = on_read
        self.check_handle = check_handle  # called with each new handle's descriptor before it reads anything

    def open(self) -> BinaryIO:
        """A handle of its own (one per thread)."""
        f = os.fdopen(open_regular(self.path, self.where), "rb", buffering=0)
        if self.check_handle is not None:
            try:
                self.check_handle(f.fileno())
            except BaseException:
                f.close()
                raise
        try:
            os.posix_fadvise(f.fileno(), self.base, self.size, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):  # pragma: no cover - not on every platform
            pass
        return f

    def announce(self) -> None:
        """Ask the kernel to start reading this range (a hint, given ahead of the read)."""
        from torchrl_dcp.storage.copying import will_need

        try:
            fd = open_regular(self.path, self.where)
        except CheckpointIntegrityError:
            return  # not a regular file: its read says so, in its turn
        try:
            will_need(fd, self.base, self.size)
        finally:
            os.close(fd)

    def read_at(self, f: BinaryIO, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the bytes at ``offset`` (looping on short reads; one read moves at most ~2 GiB).

        Positional (``preadv``): safe for threads that share ``f``."""
        if offset < 0 or offset + len(view) > self.size:
            raise CheckpointIntegrityError(
                f"DCP metadata points past the end of the file (bytes {offset}..{offset + len(view)} of {self.size})",
                path=self.where,
            )
        done, fd = 0, f.fileno()
        while done < len(view):  # positional reads: threads may share one handle (and its read-ahead)
            n = os.preadv(fd, [view[done:]], self.base + offset + done)
            if not n:
                raise CheckpointIntegrityError(f"file ended {len(view) - done} bytes early: truncated", path=self.where)
            done += n
        if self.on_read is not None:
            self.on_read(done)


# ---------------------------------------------------------------------- destinations
@functools.lru_cache(maxsize=1)
def _hugepages_wanted() -> bool:
    """Whether large fresh destinations are advised to use transparent huge pages (``TDCP_READ_HUGEPAGES``; where
    the kernel grants them on request). ``auto``: unless this machine reports free memory to its hypervisor
    (:func:`reports_free_pages`): there a huge page is memory the host takes back while it is free and must provide
    again, and a process's first load filled them 2-3x slower than base pages (1 GiB: 1.1-1.9 s against 0.5-0.65 s;
    reused within a process, huge pages were 5x faster)."""
    wanted = setting("TDCP_READ_HUGEPAGES")
    if wanted == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        if "[madvise]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
            return False
    except OSError:
        return False
    return wanted == "1" or not reports_free_pages()


_VIRTIO_BALLOON = 5  # virtio device id
_BALLOON_F_REPORTING = 5  # feature bit: free page reporting


def reports_free_pages(devices: Path = Path("/sys/bus/virtio/devices")) -> bool:
    """Whether a virtio balloon of this machine has free page reporting on: the guest hands free memory back to the
    host in blocks of huge-page size (microVMs such as Firecracker's, some cloud VMs).

    Example:
        >>> import tempfile
        >>> reports_free_pages(Path(tempfile.mkdtemp()))  # no virtio devices
        False
    """
    try:
        entries = list(devices.iterdir())
    except OSError:
        return False
    for dev in entries:
        try:
            if int((dev / "device").read_text().strip(), 16) != _VIRTIO_BALLOON:
                continue
            features = (dev / "features").read_text().strip()  # one character per feature bit, bit 0 first
        except (OSError, ValueError):
            continue
        if len(features) > _BALLOON_F_REPORTING and features[_BALLOON_F_REPORTING] == "1":
            return True
    return False


def _advise_hugepages(ptr: int, nbytes: int) -> None:
    """Ask for transparent huge pages over the 2 MiB-aligned interior of ``[ptr, ptr + nbytes)`` (a hint)."""
    lib = libc()
    if lib is None or not _hugepages_wanted():
        return
    start, end = (ptr + _HUGE - 1) & ~(_HUGE - 1), (ptr + nbytes) & ~(_HUGE - 1)
    if end > start:
        lib.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_HUGEPAGE))


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_POPULATE_STEP = 16 << 20


def _page_range(view: memoryview) -> tuple[int, int]:
    """The whole pages ``[start, end)`` inside ``view``'s memory."""
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(view))
    return (ptr + 4095) & ~4095, (ptr + len(view)) & ~4095


def _map_pages(lib: Any, start: int, end: int) -> bool:
    """``MADV_POPULATE_WRITE`` over ``[start, end)``, ``_POPULATE_STEP`` at a time; ``False``: not supported."""
    for a in range(start, end, _POPULATE_STEP):
        n = min(_POPULATE_STEP, end - a)
        if lib.madvise(ctypes.c_void_p(a), ctypes.c_size_t(n), ctypes.c_int(_MADV_POPULATE_WRITE)) != 0:
            return False  # an older kernel (EINVAL): the reads fault the pages themselves
    return True


def populate(view: memoryview) -> bool:
    """Map ``view``'s whole pages now (``MADV_POPULATE_WRITE``); ``False`` where that is not available."""
    lib = libc()
    if lib is None or not len(view) or not sys.platform.startswith("linux"):
        return False
    return _map_pages(lib, *_page_range(view))


def prefault(view: memoryview) -> threading.Thread | None:
    """Map ``view``'s pages ahead of the reads in a thread of its own (``MADV_POPULATE_WRITE``), so that the page
    faults of fresh memory overlap the disk instead of adding to it; ``None`` where not available. Join it."""
    lib = libc()
    if lib is None or len(view) < _POPULATE_STEP or not sys.platform.startswith("linux"):
        return None
    thread = threading.Thread(target=_map_pages, args=(lib, *_page_range(view)), name="tdcp-prefault", daemon=True)
    thread.start()
    return thread


def destination_bytes(tensor: torch.Tensor, hugepages: bool = True) -> memoryview | None:
    """A writable view of a contiguous CPU tensor's bytes (``None``: not readable in place); ``hugepages``:
    advise transparent huge pages over it when large (fresh memory is then faulted 2 MiB at a time)."""
    if (
        tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or tensor.is_quantized
        or tensor.layout != torch.strided
    ):
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    ptr = tensor.data_ptr()
    if hugepages and nbytes >= HUGEPAGE_MIN and not is_memmap_tensor(tensor):
        _advise_hugepages(ptr, nbytes)
    return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")


def staged(tensor: torch.Tensor) -> bool:
    """Whether reads into ``tensor`` go through host memory (it is on another device than the CPU)."""
    return not tensor.is_cpu and tensor.device.type != "meta"  # ``is_cpu`` first: 0.05 µs against 0.26 µs


def device_bytes(tensor: torch.Tensor) -> torch.Tensor | None:
    """A flat ``uint8`` view of the bytes of a contiguous tensor off the CPU (``None`` otherwise, or empty)."""
    if (
        not staged(tensor)
        or not tensor.is_contiguous()
        or tensor.is_quantized
        or tensor.layout != torch.strided
        or tensor.numel() == 0
    ):
        return None
    return byte_view(tensor.detach())


def _whole_record(info: Any, target: torch.Tensor) -> bool:
    return not info.transform_descriptors and sys.byteorder == "little" and target.dtype in STORAGE_NAMES


def whole_read(req: ReadItem, target: torch.Tensor) -> bool:
    """``req`` (DCP's read item) reads a whole tensor record into all of ``target``: no narrowed read."""
    return (
        req.type == LoadItemType.TENSOR and not any(req.storage_offsets) and tuple(target.shape) == tuple(req.lengths)
    )


def whole_record_view(info: Any, target: torch.Tensor, hugepages: bool = True) -> memoryview | None:
    """The bytes of ``target`` when a whole record (``info``) of its dtype and shape may be read into it."""
    return destination_bytes(target, hugepages) if _whole_record(info, target) else None


def whole_record_device(info: Any, target: torch.Tensor) -> torch.Tensor | None:
    """:func:`device_bytes` of ``target`` when a whole record (``info``) may be read into it through host memory."""
    return device_bytes(target) if _whole_record(info, target) else None


class SmallRecord(NamedTuple):
    """A small record as our writer lays it out for one dtype and shape: only the data member's CRC varies
    (at ``before``'s end in the head, at ``tail_before``'s end in the tail), so a record is recognized by four
    byte comparisons (local headers and central directory), and its tensor bytes are the ``nbytes`` at
    ``data_at``."""

    length: int
    before: bytes
    after_at: int
    after: bytes
    data_at: int
    nbytes: int
    tail_before: bytes
    tail_after_at: int
    tail_after: bytes

    def matches(self, buf: Any, rel: int) -> bool:
        """Whether the record at ``rel`` of ``buf`` is this layout (its data aside)."""
        tail = rel + self.data_at + self.nbytes
        return (
            buf.startswith(self.before, rel)
            and buf.startswith(self.after, rel + self.after_at)
            and buf.startswith(self.tail_before, tail)
            and buf.startswith(self.tail_after, tail + self.tail_after_at)
        )


@functools.lru_cache(maxsize=1024)
def small_record(dtype: torch.dtype, shape: tuple[int, ...]) -> SmallRecord:
    tpl = template(dtype, shape)
    at, t = tpl.head_crc_at, tpl.tail_crc_at
    return SmallRecord(
        tpl.length,
        tpl.head[:at],
        at + 4,
        tpl.head[at + 4 :],
        len(tpl.head),
        tpl.nbytes,
        tpl.tail[:t],
        t + 4,
        tpl.tail[t + 4 :],
    )


def plan_in_place(item: RecordRead, info: Any) -> None:
    """Let ``item`` (a whole record, target set) be read in place when it can: small records are copied into
    the target's memory by address (no view to build), large ones are read into a view of it, and those of a
    target on another device through host windows (``item.device``)."""
    target = item.target
    assert target is not None
    if staged(target):
        item.device = whole_record_device(info, target)
    elif info.length >= SMALL:
        item.view = whole_record_view(info, target)
    elif (
        not info.transform_descriptors
        and sys.byteorder == "little"
        and target.dtype in STORAGE_NAMES
        and target.is_cpu
        and target.layout == torch.strided
        and not target.is_quantized
        and target.is_contiguous()
    ):
        item.small = small_record(target.dtype, target.shape)


# ---------------------------------------------------------------------- reading
class RecordRead:
    """One record to read: where it is, and (once chosen) the tensor it is read into."""

    __slots__ = ("req", "offset", "length", "target", "view", "planned", "small", "device")

    def __init__(
        self, req: ReadItem | Any, offset: int, length: int, target: torch.Tensor | None = None, planned: bool = False
    ) -> None:
        self.req = (
            req  # DCP's read item (direct reads: ``(key, chunk offsets, shape)``, built into one by the fallback only)
        )
        self.offset, self.length = offset, length
        self.target = target  # set when the record may be read in place (direct reads: always)
        self.view: memoryview | None = None  # the target's bytes (None: through the fallback)
        self.planned = planned  # target and view chosen by the caller (direct reads: nothing to commit)
        self.small: SmallRecord | None = None  # a small record copied into ``target`` by address (direct reads)
        self.device: torch.Tensor | None = None  # ``target`` off the CPU: its flat bytes, read through host memory

    def request(self) -> ReadItem:
        """DCP's read item (direct reads carry ``(key, chunk offsets, shape)`` of a record until the fallback needs it)."""
        if not isinstance(self.req, ReadItem):
            key, offsets, shape = self.req
            index = MetadataIndex(key, offsets)
            zeros = torch.Size([0] * len(shape))
            self.req = ReadItem(LoadItemType.TENSOR, index, index.offset, index, zeros, shape)
        return self.req


def batch_end(items: list[RecordRead], i: int) -> int:
    """One past the last small record contiguous with ``items[i]`` that fits in a batch read."""
    j = i + 1
    while (
        j < len(items)
        and items[j].length < SMALL
        and items[j].offset == items[j - 1].offset + items[j - 1].length
        and items[j].offset + items[j].length - items[i].offset <= BATCH
    ):
        j += 1
    return j

"""The ``torch.save`` record format of DCP data files: building records (writer) and locating their bytes (reader).

Every tensor DCP writes is one ``torch.save`` ZIP blob: ``data.pkl`` (a pickle that
rebuilds the tensor from storage ``0``), a few fixed members, the tensor bytes as
the STORED member ``data/0``, and a central directory. Building: a per-(dtype, shape)
:class:`Template` holds every byte but the two CRCs of the data member, so a small
tensor's record costs a few microseconds. Parsing: :func:`record_data_offset` finds
where the tensor bytes start, either by comparing with our template or by walking
the ZIP structure; ``data.pkl`` is compared byte for byte with what ``torch.save``
writes for the expected dtype and shape and is never unpickled.

Example:
    >>> import torch
    >>> from torchrl_dcp.format.record import template, record_data_offset
    >>> tpl = template(torch.float32, (3,))
    >>> record = tpl.head + bytes(12) + tpl.tail
    >>> read = lambda at, n: record[at : at + n]
    >>> record_data_offset(read, tpl.head, tpl.length, torch.float32, (3,)) == len(tpl.head)
    True
"""

from __future__ import annotations

import collections
import functools
import io
import math
import pickle
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchrl_dcp.errors import CheckpointIntegrityError
from torchrl_dcp.format.checksums import crc32
from torchrl_dcp.format.zipformat import central_entry, end_records, local_header

# ---------------------------------------------------------------------- building records
STORAGE_NAMES = torch.storage._dtype_to_storage_type_map()
_FIXED_RECORDS_BEFORE = ((".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little"))
_FIXED_RECORDS_AFTER = (("version", b"3\n"), (".data/serialization_id", b"0" * 40))


class _StorageRef:
    pass


_REF = _StorageRef()


class _Rebuild:
    def __init__(self, shape: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.shape, self.stride = shape, stride

    def __reduce__(self) -> Any:
        return (torch._utils._rebuild_tensor_v2, (_REF, 0, self.shape, self.stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, storage: Any, numel: int) -> None:
        super().__init__(file, protocol=2)
        self._pid = ("storage", storage, "0", "cpu", numel)

    def persistent_id(self, obj: Any) -> Any:
        return self._pid if obj is _REF else None


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def data_pickle(dtype: torch.dtype, shape: tuple[int, ...], numel: int) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, getattr(torch, STORAGE_NAMES[dtype]), numel).dump(_Rebuild(shape, _contiguous_stride(shape)))
    return buf.getvalue()


@dataclass
class Template:
    """A blob is ``head(crc) + data + tail(crc)``; only the data record's CRC varies."""

    head: bytes
    tail: bytes
    head_crc_at: int
    tail_crc_at: int
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.head) + self.nbytes + len(self.tail)

    def parts(self, crc: int) -> tuple[bytes, bytes]:
        head, tail = bytearray(self.head), bytearray(self.tail)
        struct.pack_into("<I", head, self.head_crc_at, crc)
        struct.pack_into("<I", tail, self.tail_crc_at, crc)
        return bytes(head), bytes(tail)


def _buildtemplate(dtype: torch.dtype, shape: tuple[int, ...]) -> Template:
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch._utils._element_size(dtype)
    records: list[tuple[bytes, bytes | None, int]] = []  # (name, data or None for the tensor, size)
    pkl = data_pickle(dtype, shape, numel)
    records.append((b"archive/data.pkl", pkl, len(pkl)))
    for name, data in _FIXED_RECORDS_BEFORE:
        records.append((b"archive/" + name.encode(), data, len(data)))
    records.append((b"archive/data/0", None, nbytes))
    for name, data in _FIXED_RECORDS_AFTER:
        records.append((b"archive/" + name.encode(), data, len(data)))
    head, tail = bytearray(), bytearray()
    offset, central = 0, []
    head_crc_at = tail_crc_at = -1
    out = head
    for name, data, size in records:
        crc = crc32(data) if data is not None else 0
        local = local_header(name, crc, size, offset)
        if data is None:
            head_crc_at = len(head) + 14
        out += local
        central.append((name, crc, size, offset, data is None))
        offset += len(local) + size
        if data is None:
            out = tail
        else:
            out += data
    cd_offset = offset
    cd = bytearray()
    for name, crc, size, off, is_data in central:
        if is_data:
            tail_crc_at = len(tail) + len(cd) + 16
        cd += central_entry(name, crc, size, off)
    tail += cd + end_records(len(central), cd_offset, len(cd))
    return Template(bytes(head), bytes(tail), head_crc_at, tail_crc_at, nbytes)


_TEMPLATES: dict[tuple[torch.dtype, tuple[int, ...]], Template] = {}
_TEMPLATES_LOCK = threading.Lock()


def template(dtype: torch.dtype, shape: tuple[int, ...]) -> Template:
    """The record our writer produces for a tensor of ``dtype`` and ``shape``, CRC fields left to fill in.

    ``shape`` is taken as a plain tuple of ints: a ``torch.Size`` compares and hashes
    like its tuple but pickles differently, so the bytes must not depend on which a
    caller passed first.
    """
    t = _TEMPLATES.get((dtype, shape))  # a torch.Size finds its tuple's entry (equal and same hash): built once
    if t is None:
        shape = tuple(int(s) for s in shape)
        key = (dtype, shape)
        t = _buildtemplate(dtype, shape)
        with _TEMPLATES_LOCK:
            if len(_TEMPLATES) > 4096:
                _TEMPLATES.clear()
            _TEMPLATES[key] = t
    return t


def can_write_fast(tensor: Any) -> bool:
    """Whether ``tensor`` is a plain strided tensor this writer encodes itself (else DCP writes the state)."""
    return (
        (type(tensor) in (torch.Tensor, torch.nn.Parameter) or is_memmap_tensor(tensor))
        and tensor.layout == torch.strided
        and tensor.dtype in STORAGE_NAMES
        and not tensor.is_quantized
        and (sys.byteorder == "little")
    )


def is_memmap_tensor(tensor: Any) -> bool:
    try:
        from tensordict import MemoryMappedTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(tensor, MemoryMappedTensor)


def is_plain_tensor(obj: Any) -> bool:
    """A plain tensor (no DTensor/ShardedTensor/checkpointable protocol): DCP treats it as one chunk, and its
    records are read in place.

    Example:
        >>> import torch
        >>> is_plain_tensor(torch.zeros(2)), is_plain_tensor([0.0])
        (True, False)
    """
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return True
    return (
        is_memmap_tensor(obj) and not hasattr(obj, "__create_chunk_list__") and not hasattr(obj, "__get_tensor_shard__")
    )


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain, contiguous tensor with its conjugate and negative bits resolved, where it is."""
    t = tensor.detach()
    if isinstance(t, torch.nn.Parameter) or type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` as a flat memoryview, without a copy when it is contiguous on CPU."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = plain_tensor(t)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(byte_view(t).numpy())


#: most bytes of small device tensors gathered on their device at once (:func:`host_bytes`)
GATHER_BYTES = 64 << 20


def on_device(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s bytes must be copied to host memory to be written (CUDA and other devices)."""
    return not tensor.is_cpu and tensor.device.type != "meta"  # ``is_cpu`` first: every tensor of a save asks


def host_bytes(tensors: Sequence[torch.Tensor], small: int) -> dict[int, memoryview]:
    """The bytes of the device tensors of ``tensors`` smaller than ``small`` bytes, copied to host memory together.

    A device→host copy of each waits for itself (tens of µs each: a 5,000-tensor model spends a third of a second);
    here the small tensors of each device are gathered on it (one ``torch.cat`` of their bytes) and copied once.
    Returns ``{position in tensors: bytes}`` (devices with one small tensor are left to :func:`tensor_bytes`).

    Example:
        >>> host_bytes([torch.ones(2)], 1 << 20)  # on the CPU: nothing to copy
        {}
    """
    groups: dict[torch.device, list[list[int]]] = {}
    sizes: dict[torch.device, int] = {}
    for i, t in enumerate(tensors):
        n = t.numel() * t.element_size()
        if on_device(t) and 0 < n < small:
            if t.device not in groups or sizes[t.device] + n > GATHER_BYTES:  # the gather's device memory, bounded
                groups.setdefault(t.device, []).append([])
                sizes[t.device] = 0
            groups[t.device][-1].append(i)
            sizes[t.device] += n
    out: dict[int, memoryview] = {}
    for positions in (p for runs in groups.values() for p in runs if len(p) > 1):
        parts = [byte_view(plain_tensor(tensors[i])) for i in positions]
        flat = memoryview(torch.cat(parts).cpu().numpy())
        at = 0
        for i, part in zip(positions, parts):
            out[i] = flat[at : at + part.numel()]
            at += part.numel()
    return out


#: a large device tensor reaches host memory this many bytes at a time, as they are written (:class:`DeviceBytes`)
DEVICE_WINDOW = 8 << 20


def streamed(tensor: torch.Tensor) -> bool:
    """Whether a large ``tensor`` is copied to host memory window by window as it is written (:class:`DeviceBytes`):
    a contiguous device tensor without conjugate or negative bits, whose bytes are a view where it is. Any other
    device tensor is copied whole (its plain copy would otherwise be made again for every window)."""
    return on_device(tensor) and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


class DeviceBytes:
    """The bytes of a :func:`streamed` device tensor, copied to host memory one window at a time when asked, on the
    stream that was current where it was made (so after the work queued before the save, from any thread).

    A sync save writes a data file's large device tensors through it: its host memory holds a window per write
    thread, not every large tensor of the file at once.

    Example:
        >>> b = DeviceBytes(torch.arange(4, dtype=torch.int8))  # any device; on the CPU, a view
        >>> bytes(b.window(1, 2))
        b'\\x01\\x02'
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.flat = byte_view(plain_tensor(tensor))
        self.stream = torch.cuda.current_stream(tensor.device) if tensor.device.type == "cuda" else None

    def window(self, start: int, length: int) -> memoryview:
        """Bytes ``[start, start + length)``, in host memory (a fresh copy, not kept here)."""
        part = self.flat[start : start + length]
        if self.stream is None:
            return memoryview(part.cpu().numpy())
        with torch.cuda.stream(self.stream):
            return memoryview(part.cpu().numpy())


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous ``tensor`` as a flat uint8 tensor sharing its memory (no copy).

    ``is_contiguous()`` ignores the stride of a dimension of size 1, so a one-element tensor may have stride 0
    (``torch.tensor(2.).expand(1)``: TD3's action bounds); its flat view is re-strided to 1 (the same element)
    instead of failing ``view(torch.uint8)``.

    Example:
        >>> byte_view(torch.tensor(1.0).expand(1)).tolist()
        [0, 0, 128, 63]
    """
    flat = tensor.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


# ---------------------------------------------------------------------- locating a record's tensor bytes
def _u16(b: Any, at: int) -> int:
    return struct.unpack_from("<H", b, at)[0]


def _u32(b: Any, at: int) -> int:
    return struct.unpack_from("<I", b, at)[0]


def expected_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """Our writer's ``data.pkl`` for ``(dtype, shape)`` (``shape`` as a plain tuple: see :func:`template`)."""
    return _expected_pickle(dtype, tuple(int(s) for s in shape))


@functools.lru_cache(maxsize=4096)
def _expected_pickle(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    numel = 1
    for s in shape:
        numel *= s
    return data_pickle(dtype, shape, numel)


def template_data_offset(head: Any, length: int, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
    """Where the tensor bytes start when the record is exactly our writer's template for ``(dtype, shape)``.

    ``head`` holds at least the record's first ``len(template.head)`` bytes (fewer: ``None``).

    Example:
        >>> import torch
        >>> from torchrl_dcp.format.record import template
        >>> tpl = template(torch.float32, (3,))
        >>> template_data_offset(tpl.head, tpl.length, torch.float32, (3,)) == len(tpl.head)
        True
    """
    tpl = template(dtype, shape)
    n, at = len(tpl.head), tpl.head_crc_at
    if length != tpl.length or len(head) < n:
        return None
    if head[:at] != tpl.head[:at] or head[at + 4 : n] != tpl.head[at + 4 :]:
        return None
    return n


def _central_directory(read: Any, length: int) -> tuple[int, int, int] | None:
    """``(entries, cd_size, cd_offset)`` from the end records (ZIP64 included), or ``None``."""
    if length < 22:
        return None
    end = read(length - 22, 22)
    if _u32(end, 0) != 0x06054B50 or _u16(end, 20) != 0:
        return None
    entries, cd_size, cd_offset = _u16(end, 10), _u32(end, 12), _u32(end, 16)
    if entries == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_offset):
        if length < 22 + 20 + 56:
            return None
        loc = read(length - 22 - 20, 20)
        if _u32(loc, 0) != 0x07064B50:
            return None
        z64_at = struct.unpack_from("<Q", loc, 8)[0]
        if z64_at + 56 > length:
            return None
        z64 = read(z64_at, 56)
        if _u32(z64, 0) != 0x06064B50:
            return None
        entries, cd_size, cd_offset = struct.unpack_from("<QQQ", z64, 32)
    if entries > 64 or cd_offset + cd_size > length or cd_size > 1 << 16:
        return None
    return entries, cd_size, cd_offset


def _zip64_sizes(extra: Any, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    """The ZIP64 extended information of a central entry replaces its 0xFFFFFFFF fields, in order."""
    x = 0
    while x + 4 <= len(extra):
        tag, size = _u16(extra, x), _u16(extra, x + 2)
        if tag == 1:
            vals = list(struct.unpack_from(f"<{size // 8}Q", extra, x + 4))
            if usize == 0xFFFFFFFF and vals:
                usize = vals.pop(0)
            if csize == 0xFFFFFFFF and vals:
                csize = vals.pop(0)
            if offset == 0xFFFFFFFF and vals:
                offset = vals.pop(0)
        x += 4 + size
    return usize, csize, offset


def _members(cd: Any, entries: int) -> dict[str, tuple[int, int, int]] | None:
    """``{name under the record's folder: (method, size, local header offset)}`` of a central directory, or ``None``:
    every member in one folder (as ``torch.save`` writes them; ``torch.load`` reads that folder's ``data.pkl`` and
    ``data/0``), each name once (a second copy of the bytes, elsewhere, would be read by no one else)."""
    members: dict[str, tuple[int, int, int]] = {}
    folder: str | None = None
    at = 0
    for _ in range(entries):
        if at + 46 > len(cd) or _u32(cd, at) != 0x02014B50:
            return None
        method, csize, usize = _u16(cd, at + 10), _u32(cd, at + 20), _u32(cd, at + 24)
        nlen, xlen, clen, offset = _u16(cd, at + 28), _u16(cd, at + 30), _u16(cd, at + 32), _u32(cd, at + 42)
        name = bytes(cd[at + 46 : at + 46 + nlen]).decode("utf-8", "replace")
        usize, csize, offset = _zip64_sizes(cd[at + 46 + nlen : at + 46 + nlen + xlen], usize, csize, offset)
        if csize != usize:
            return None
        top, _, short = name.partition("/")
        if not short or (folder is not None and top != folder) or short in members:
            return None
        folder = top
        members[short] = (method, usize, offset)
        at += 46 + nlen + xlen + clen
    return members


def zip_data_offset(read: Any, length: int, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
    """Where the tensor bytes start in a ``torch.save`` ZIP record of ``length`` bytes, or ``None``.

    ``read(offset, n)`` returns ``n`` bytes of the record. Parses the central
    directory (ZIP64 included) and the local headers; accepts only a record whose
    members are STORED, whose ``data.pkl`` is byte-for-byte what ``torch.save``
    writes for a contiguous ``dtype`` tensor of ``shape``, whose ``byteorder`` is
    ``little`` and whose one storage ``data/0`` holds exactly the tensor's bytes.
    Nothing is unpickled.
    """
    found = _central_directory(read, length)
    if found is None:
        return None
    entries, cd_size, cd_offset = found
    members = _members(read(cd_offset, cd_size), entries)
    if members is None or {"data.pkl", "byteorder", "data/0"} - set(members):
        return None
    storages = [n for n in members if n.startswith("data/") or n.isdigit()]
    if storages != ["data/0"] or any(m[0] != 0 for m in members.values()):
        return None

    def payload(name: str) -> int | None:
        _, size, offset = members[name]
        if offset + 30 > length:
            return None
        local = read(offset, 30)
        if _u32(local, 0) != 0x04034B50:
            return None
        start = offset + 30 + _u16(local, 26) + _u16(local, 28)
        return start if start + size <= length else None

    expected = expected_pickle(dtype, shape)
    pkl_at, order_at, data_at = payload("data.pkl"), payload("byteorder"), payload("data/0")
    if pkl_at is None or order_at is None or data_at is None or members["data.pkl"][1] != len(expected):
        return None
    if bytes(read(pkl_at, len(expected))) != expected or members["byteorder"][1] != 6:
        return None
    if bytes(read(order_at, 6)) != b"little":
        return None
    if members["data/0"][1] != math.prod(shape) * torch._utils._element_size(dtype):
        return None
    return data_at


def template_tail_size(dtype: torch.dtype, shape: tuple[int, ...], length: int) -> int:
    """How many bytes at the end of a record of ``length`` bytes :func:`record_data_offset` compares with our
    template's tail (0: not our layout's length, nothing to compare), so callers can read them ahead."""
    if dtype not in STORAGE_NAMES:
        return 0
    tpl = template(dtype, shape)
    return len(tpl.tail) if tpl.length == length else 0


def template_tail_matches(end: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    """Whether ``end`` (a record's last ``len(template.tail)`` bytes) is our template's tail (its central
    directory: what ``torch.load`` goes by), the data CRC aside."""
    tpl = template(dtype, shape)
    c = tpl.tail_crc_at
    return len(end) == len(tpl.tail) and end[:c] == tpl.tail[:c] and end[c + 4 :] == tpl.tail[c + 4 :]


def record_data_offset(read: Any, head: Any, length: int, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
    """The tensor's byte offset inside a record of ``dtype`` and ``shape``: our template first (head and tail
    compared: the local headers and the central directory agree), else the ZIP structure; ``None`` when the record
    is neither, or of a dtype our writer does not lay out (it is then decoded whole by :func:`decode_record`, which
    checks what it holds)."""
    if dtype not in STORAGE_NAMES:
        return None
    tpl = template(dtype, shape)  # once (a check of 5,000 records asked for it four times each)
    n, at = len(tpl.head), tpl.head_crc_at
    if (
        length == tpl.length
        and len(head) >= n
        and head[:at] == tpl.head[:at]
        and head[at + 4 : n] == tpl.head[at + 4 :]
    ):
        m, c = len(tpl.tail), tpl.tail_crc_at  # the template's head: its tail too (the central directory)
        end = bytes(read(length - m, m))
        if len(end) == m and end[:c] == tpl.tail[:c] and end[c + 4 :] == tpl.tail[c + 4 :]:
            return n
    try:
        return zip_data_offset(read, length, dtype, shape)
    except (struct.error, ValueError, IndexError):
        return None


def check_bool_bytes(data: Any, where: Any, key: str) -> None:
    """A bool tensor's bytes (``data``: bytes, a buffer or a uint8 tensor) are 0 or 1: ``torch.save`` writes nothing
    else, and other bytes make values that compare neither true nor false consistently.

    Raises:
        CheckpointIntegrityError: naming ``where`` and ``key``.

    Example:
        >>> check_bool_bytes(b"\\x00\\x01", "f", "k")  # fine
    """
    if isinstance(data, torch.Tensor):
        top = int(data.max()) if data.numel() else 0
    else:
        top = int(np.frombuffer(data, dtype=np.uint8).max()) if len(data) else 0
    if top > 1:
        raise CheckpointIntegrityError(
            f"record {key!r} holds a bool byte {top} (only 0 and 1 are bools): the file is damaged or forged",
            path=where,
        )


def decode_record(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...], where: Any, key: str) -> torch.Tensor:
    """A record that is not laid out as our writer (or ``torch.save`` of a contiguous tensor) lays it out, decoded
    as DCP does (``torch.load(weights_only=True)``: no code runs) after :func:`check_stored_record`, and refused
    unless it holds a tensor of exactly ``dtype`` and ``shape`` (what DCP's metadata says): never cast, never
    reinterpreted.

    Raises:
        CheckpointIntegrityError: naming ``where`` (the data file) and ``key``.

    Example:
        >>> import io, torch
        >>> buf = io.BytesIO(); torch.save(torch.ones(2, 3).t(), buf)  # not contiguous: not our layout
        >>> decode_record(buf.getvalue(), torch.float32, (3, 2), "f", "k").shape
        torch.Size([3, 2])
    """
    check_stored_record(raw, where)
    try:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - whatever a damaged pickle raises, said with the file
        # (torch's first line only: its advice to retry with weights_only=False is the one never to take here)
        said = (str(err).strip().splitlines() or [""])[0][:200]
        if not said or isinstance(err, pickle.UnpicklingError) or "weights_only" in said:
            said = type(err).__name__  # (torch's text there advises loading it unsafely)
        else:
            said = f"{type(err).__name__}: {said}"
        raise CheckpointIntegrityError(
            f"record {key!r} cannot be decoded ({said}): the file is damaged or forged; never load it with "
            "torch.load(weights_only=False)",
            path=where,
        ) from None
    if dtype == torch.bool and isinstance(tensor, torch.Tensor) and tensor.dtype == dtype and tensor.numel():
        check_bool_bytes(byte_view(tensor.contiguous()), where, key)
    if type(tensor) is not torch.Tensor or tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
        found = f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        if isinstance(tensor, torch.Tensor) and type(tensor) is not torch.Tensor:  # (a Parameter: no save writes one)
            found = f"a {type(tensor).__name__} ({found}), not a plain tensor"
        raise CheckpointIntegrityError(
            f"record {key!r} holds {found}, the manifest and DCP's metadata say {dtype} {list(shape)}: the file is "
            "damaged or forged",
            path=where,
        )
    return tensor


MAX_RECORD_MEMBERS = 64  # a torch.save record of one tensor holds a handful (data.pkl, byteorder, data/0, version...)


def check_stored_record(data: bytes, where: Any) -> None:
    """Refuse a record the format never produces before ``torch.load`` may see it: every member of its ZIP
    STORED (no compression: nothing expands beyond the record's own bytes), a handful of members, each inside it.

    Example:
        >>> import io, torch
        >>> buf = io.BytesIO(); torch.save(torch.ones(2), buf)
        >>> check_stored_record(buf.getvalue(), "x")
    """
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as err:
        raise CheckpointIntegrityError(f"record is not a torch.save record ({err}): refused", path=where) from None
    if len(members) > MAX_RECORD_MEMBERS:
        raise CheckpointIntegrityError(
            f"record holds {len(members)} members, a tensor record a few: refused", path=where
        )
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size or m.file_size > len(data):
            raise CheckpointIntegrityError(
                f"record member {m.filename!r} is compressed or larger than the record (torch.save never writes "
                "that; a forged or damaged checkpoint): refused",
                path=where,
            )


def stored_record(read: Any, length: int) -> bool:
    """Whether a record of ``length`` bytes is a ZIP whose members are all STORED, each inside it (what
    ``torch.save`` writes); ``read(offset, n)`` returns bytes of the record. Reads its end records and central
    directory only (``verify`` asks this of every record, as loads refuse anything else)."""
    try:
        found = _central_directory(read, length)
        if found is None:
            return False
        entries, cd_size, cd_offset = found
        members = _members(read(cd_offset, cd_size), entries)
    except (struct.error, ValueError, IndexError):
        return False
    return members is not None and all(m[0] == 0 and m[1] + m[2] <= length for m in members.values())

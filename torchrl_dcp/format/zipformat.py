"""ZIP records for STORED members whose data starts on a 64-byte boundary (no torch needed).

Both ZIP files this project writes are built from these records: the
``torch.save``-compatible blobs inside DCP data files (``storage/writer.py``) and
single-file checkpoint archives (``storage/archive.py``). A local header's size
does not depend on the member's CRC, so a writer can lay out a whole archive,
copy the data, and fill the headers in afterwards.

Example:
    >>> import io, zipfile, zlib
    >>> from torchrl_dcp.format.zipformat import central_entry, end_records, local_header
    >>> data = b"hello"
    >>> head = local_header(b"a.txt", zlib.crc32(data), len(data), 0)
    >>> len(head) % 64
    0
    >>> cd = central_entry(b"a.txt", zlib.crc32(data), len(data), 0)
    >>> blob = head + data + cd + end_records(1, len(head) + len(data), len(cd))
    >>> zipfile.ZipFile(io.BytesIO(blob)).read("a.txt")
    b'hello'
"""

from __future__ import annotations

import stat
import struct
from collections.abc import Callable, Iterator
from typing import Any

ALIGN = 64
U32 = 0xFFFFFFFF
ZIP64_LIMIT = U32  # sizes and offsets from here on use ZIP64 records (tests lower it)
DOS_DATE_1980 = 0x21  # 1980-01-01 00:00: identical inputs give identical files
TORCH_PAD = (0x4246, b"Z")  # the padding extra field torch.save writes
ZIPALIGN_PAD = (0xD935, b"\0")  # the alignment extra field of Android's zipalign


def _flags(name: bytes) -> int:
    return 0 if name.isascii() else 0x800  # bit 11: the name is UTF-8


def begins_as_written(head: bytes, names: tuple[bytes, ...]) -> bool:
    """Whether ``head`` (a file's first bytes, 128 suffice) begins with a first member's local header as
    :func:`local_header` writes it with ``ZIPALIGN_PAD`` (an archive of ours): one of ``names``, stored, dated
    1980, no flags but UTF-8, its extra fields (ZIP64, then the alignment field) ending where the data starts at a
    multiple of ``ALIGN``. A user's ZIP of the same first name (compressed, dated, without the field) is not."""
    if len(head) < 30 or head[:4] != b"PK\x03\x04":
        return False
    _, _, flags, method, mtime, mdate, _, _, _, n_name, n_extra = struct.unpack_from("<IHHHHHIIIHH", head)
    if flags & ~0x800 or method != 0 or (mtime, mdate) != (0, DOS_DATE_1980):
        return False
    if head[30 : 30 + n_name] not in names or (30 + n_name + n_extra) % ALIGN:
        return False
    at = 30 + n_name
    if head[at : at + 2] == b"\x01\x00":  # ZIP64 sizes first
        at += 20
    return len(head) >= at + 4 and struct.unpack_from("<HH", head, at) == (
        ZIPALIGN_PAD[0],
        30 + n_name + n_extra - at - 4,
    )


def local_header(
    name: bytes, crc: int, size: int, offset: int, *, pad: tuple[int, bytes] = TORCH_PAD, align: int = ALIGN
) -> bytes:
    """The local header of a member at ``offset``, padded so that its data starts at a multiple of ``align``."""
    zip64 = size >= ZIP64_LIMIT
    extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    base = offset + 30 + len(name) + len(extra)
    n = (-(base + 4)) % align
    extra += struct.pack("<HH", pad[0], n) + pad[1] * n
    sz = U32 if zip64 else size
    head = struct.pack(
        "<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, _flags(name), 0, 0, DOS_DATE_1980, crc, sz, sz, len(name),
        len(extra),
    )  # fmt: skip
    return head + name + extra


_MADE_ON_UNIX = 3  # "version made by", high byte: the external attributes' high 16 bits are a Unix mode


def central_entry(name: bytes, crc: int, size: int, offset: int, *, mode: int | None = None) -> bytes:
    """The central directory entry of a member; ``mode`` (e.g. ``0o644``) records Unix permissions."""
    fields = []
    if size >= ZIP64_LIMIT:
        fields += [size, size]
    if offset >= ZIP64_LIMIT:
        fields.append(offset)
    extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
    version = 45 if fields else 20
    made_by = version if mode is None else (_MADE_ON_UNIX << 8) | version
    attr = 0 if mode is None else (stat.S_IFREG | mode) << 16
    sz = U32 if size >= ZIP64_LIMIT else size
    off = U32 if offset >= ZIP64_LIMIT else offset
    return (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50, made_by, version, _flags(name), 0, 0, DOS_DATE_1980,
            crc, sz, sz, len(name), len(extra), 0, 0, 0, attr, off,
        )
        + name
        + extra
    )  # fmt: skip


def end_records(entries: int, cd_offset: int, cd_size: int) -> bytes:
    """The end of central directory record, preceded by the ZIP64 records where offsets or counts need them."""
    out = b""
    zip64 = cd_offset >= ZIP64_LIMIT or cd_size >= ZIP64_LIMIT or entries >= 0xFFFF
    if zip64:
        z64 = cd_offset + cd_size
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, entries, entries, cd_size, cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, z64, 1)
    n = min(entries, 0xFFFF)
    cd_size, cd_offset = (U32, U32) if zip64 else (cd_size, cd_offset)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_offset, 0)
    return out


# ---------------------------------------------------------------------- reading
_END = struct.Struct("<IHHHHIIH")  # the end of central directory record: 22 bytes
_Z64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_Z64_LOCATOR_SIG = struct.pack("<I", 0x07064B50)
_Z64_END = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes, then name, extra, comment


class ZipError(ValueError):
    """A ZIP structure this module cannot read (the message says what)."""


def central_directory_span(
    read: Callable[[int, int], bytes], size: int, *, comment: bool = False
) -> tuple[int, int, int]:
    """``(offset, size, entries)`` of the central directory of a ZIP of ``size`` bytes that ends with its end record
    (no archive comment, unless ``comment``: then the end record is found as ``zipfile`` finds it, at the end of the
    file without a comment, else the last one in the file's last 64 KiB, whose comment must fill the rest), the
    directory right before the end records (nothing between them: a reader such as Python's ``zipfile`` takes such
    bytes for a prefix and shifts every offset, reading another archive from the same file); ``read(offset, n)``
    returns bytes of the file. ZIP64 records are followed.

    Example:
        >>> blob = central_entry(b"a", 0, 0, 0) + end_records(1, 0, 47)
        >>> central_directory_span(lambda o, n: blob[o : o + n], len(blob))
        (0, 47, 1)
    """
    if size < _END.size:
        raise ZipError("too short for a ZIP end record")
    if comment:
        size = _before_comment(read, size)
    sig, disk, cd_disk, here, entries, cd_size, cd_offset, n_comment = _END.unpack(read(size - _END.size, _END.size))
    if sig != 0x06054B50 or (n_comment and not comment):
        raise ZipError("no ZIP end record at the end of the file")
    end = size - _END.size
    # ZIP64 records are followed where the end record points to them, and wherever their locator precedes it (as
    # Python's zipfile does: torch.save writes them for every file, its end record holding the plain values too)
    located = end >= _Z64_LOCATOR.size and read(end - _Z64_LOCATOR.size, 4) == _Z64_LOCATOR_SIG
    zip64 = entries == 0xFFFF or cd_size == U32 or cd_offset == U32 or located
    # one disk: this disk and the central directory's are disk 0 (0xFFFF: see the ZIP64 end record), every entry on it
    if not ((disk, cd_disk) == (0, 0) or (zip64 and (disk, cd_disk) == (0xFFFF, 0xFFFF))) or here != entries:
        raise ZipError(_multi_disk(disk, cd_disk, here, entries))
    if zip64:
        if end < _Z64_LOCATOR.size:
            raise ZipError("ZIP64 locator missing")
        lsig, z64_disk, z64_at, disks = _Z64_LOCATOR.unpack(read(end - _Z64_LOCATOR.size, _Z64_LOCATOR.size))
        if lsig != 0x07064B50 or z64_at + _Z64_END.size != end - _Z64_LOCATOR.size:
            raise ZipError("ZIP64 locator damaged, or bytes between the ZIP64 end record and its locator")
        if z64_disk != 0 or disks > 1:
            raise ZipError(f"the ZIP64 locator counts {disks} disks, its end record on disk {z64_disk}: " + _SPLIT)
        zsig, _, _, _, disk, cd_disk, here, entries, cd_size, cd_offset = _Z64_END.unpack(read(z64_at, _Z64_END.size))
        if zsig != 0x06064B50:
            raise ZipError("ZIP64 end record damaged")
        if (disk, cd_disk) != (0, 0) or here != entries:
            raise ZipError(_multi_disk(disk, cd_disk, here, entries))
        end = z64_at
    if cd_offset + cd_size > end or entries * _CENTRAL.size > cd_size:
        raise ZipError(f"central directory of {entries} entries at {cd_offset}+{cd_size} does not fit the file")
    if cd_offset + cd_size != end:  # (a reader that takes the gap for a prefix shifts every offset: another archive)
        raise ZipError(f"{end - cd_offset - cd_size} bytes between the central directory and the end record")
    return cd_offset, cd_size, entries


def check_zipfile_agrees(archive: Any, *, comment: bool = False) -> None:
    """Raise :class:`ZipError` unless Python's ``zipfile`` (``archive``, a ``zipfile.ZipFile`` just opened) found
    the central directory :func:`central_directory_span` finds, reading through the same file object: one file is
    then one archive to every reader (``zipfile`` alone takes bytes before the directory for a prefix and shifts
    every offset, so a file built for it could read as one checkpoint to one reader and another to the other)."""
    fp = archive.fp

    def read(offset: int, n: int) -> bytes:
        fp.seek(offset)
        return fp.read(n)

    fp.seek(0, 2)
    cd_offset, _, entries = central_directory_span(read, fp.tell(), comment=comment)
    if archive.start_dir != cd_offset or len(archive.infolist()) != entries:
        raise ZipError(
            f"zipfile finds {len(archive.infolist())} members at {archive.start_dir}, the end record says "
            f"{entries} at {cd_offset}"
        )


def _before_comment(read: Callable[[int, int], bytes], size: int) -> int:
    """Where a ZIP's end record ends, its archive comment (the rest of the file) left out, found as Python's
    ``zipfile`` finds it: the end record at the very end (no comment), else the last one in the last 64 KiB, whose
    comment must reach exactly the end of the file."""
    last = read(size - _END.size, _END.size)  # (zipfile takes an end record with no comment at the end first)
    if last[:4] == b"PK\x05\x06" and _END.unpack(last)[7] == 0:
        return size
    span = min(size, _END.size + 0xFFFF)
    tail = read(size - span, span)
    at = tail.rfind(b"PK\x05\x06")  # (then the last one, as zipfile takes it: one inside a comment is taken too)
    if at < 0 or at + _END.size > len(tail) or at + _END.size + _END.unpack_from(tail, at)[7] != len(tail):
        raise ZipError("no ZIP end record at the end of the file, nor one followed by its archive comment")
    return size - span + at + _END.size


def central_entries(directory: bytes | memoryview) -> Iterator[tuple[str, int, int, int, int, int, int, int, int]]:
    """Every entry of a central directory as ``(name, flags, method, crc, compressed_size, size, header_offset,
    disk, unix_type)`` (``disk``: the disk its local header starts on, 0 in a one-disk archive; ``unix_type``: the
    file type bits of its Unix mode, ``stat.S_IFMT``, when an entry made on Unix records one, else 0), ZIP64 sizes and
    offsets resolved; one tuple at a time, no per-entry objects kept (a million entries cost what the caller keeps
    of them).

    Example:
        >>> list(central_entries(central_entry(b"a.txt", 7, 5, 0)))
        [('a.txt', 0, 0, 7, 5, 5, 0, 0, 0)]
    """
    view = memoryview(directory)
    at, total = 0, len(view)
    while at < total:
        if at + _CENTRAL.size > total:
            raise ZipError("central directory entry truncated")
        fields = _CENTRAL.unpack_from(view, at)
        sig, made_by, _, flags, method, _, _, crc, csize, usize, n_name, n_extra, n_comment, disk, _, attrs, offset = (
            fields
        )
        if sig != 0x02014B50:
            raise ZipError(f"no central directory entry at byte {at}")
        stop = at + _CENTRAL.size + n_name + n_extra + n_comment
        if stop > total:
            raise ZipError("central directory entry truncated")
        raw = bytes(view[at + _CENTRAL.size : at + _CENTRAL.size + n_name])
        name = raw.decode("utf-8" if flags & 0x800 else "cp437")
        if U32 in (usize, csize, offset):
            usize, csize, offset = _zip64_fields(
                view[at + _CENTRAL.size + n_name : stop - n_comment], usize, csize, offset
            )
        unix_type = stat.S_IFMT(attrs >> 16) if made_by >> 8 == _MADE_ON_UNIX else 0
        yield name, flags, method, crc, csize, usize, offset, disk, unix_type
        at = stop


def local_sizes(extra: bytes | memoryview, usize: int, csize: int) -> tuple[int, int]:
    """``(size, compressed_size)`` of a local header whose fields are ``usize`` and ``csize``, ZIP64 ones (``U32``)
    resolved from its extra field ``extra``.

    Example:
        >>> head = local_header(b"a", 0, ZIP64_LIMIT, 0)
        >>> local_sizes(head[31:], U32, U32) == (ZIP64_LIMIT, ZIP64_LIMIT)
        True
    """
    usize, csize, _ = _zip64_fields(memoryview(extra), usize, csize, 0) if U32 in (usize, csize) else (usize, csize, 0)
    return usize, csize


_SPLIT = "a split (multi-disk) archive; torchrl_dcp archives are one file"


def _multi_disk(disk: int, cd_disk: int, here: int, entries: int) -> str:
    return (
        f"the end record puts this file on disk {disk}, the central directory on disk {cd_disk}, {here} of its "
        f"{entries} entries here: " + _SPLIT
    )


def _zip64_fields(extra: memoryview, usize: int, csize: int, offset: int) -> tuple[int, int, int]:
    at = 0
    while at + 4 <= len(extra):
        kind, n = struct.unpack_from("<HH", extra, at)
        body = extra[at + 4 : at + 4 + n]
        if kind == 1:
            values = [v for (v,) in struct.iter_unpack("<Q", body[: len(body) // 8 * 8])]
            out = []
            for field in (usize, csize, offset):
                if field == U32:
                    if not values:
                        raise ZipError("ZIP64 extra field too short")
                    field = values.pop(0)
                out.append(field)
            return out[0], out[1], out[2]
        at += 4 + n
    raise ZipError("sizes or offset marked ZIP64 without a ZIP64 extra field")

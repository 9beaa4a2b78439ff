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

import struct

ALIGN = 64
U32 = 0xFFFFFFFF
ZIP64_LIMIT = U32  # sizes and offsets from here on use ZIP64 records (tests lower it)
DOS_DATE_1980 = 0x21  # 1980-01-01 00:00: identical inputs give identical files
TORCH_PAD = (0x4246, b"Z")  # the padding extra field torch.save writes
ZIPALIGN_PAD = (0xD935, b"\0")  # the alignment extra field of Android's zipalign


def _flags(name: bytes) -> int:
    return 0 if name.isascii() else 0x800  # bit 11: the name is UTF-8


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


def central_entry(name: bytes, crc: int, size: int, offset: int, *, mode: int | None = None) -> bytes:
    """The central directory entry of a member; ``mode`` (e.g. ``0o644``) records Unix permissions."""
    fields = []
    if size >= ZIP64_LIMIT:
        fields += [size, size]
    if offset >= ZIP64_LIMIT:
        fields.append(offset)
    extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
    version = 45 if fields else 20
    made_by = version if mode is None else (3 << 8) | version
    attr = 0 if mode is None else (0o100000 | mode) << 16
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

"""Streaming CRC32 checksums of checkpoint files, in bounded memory.

Example:
    >>> import tempfile, os
    >>> from torchrl_dcp.storage.checksums import file_checksum
    >>> with tempfile.NamedTemporaryFile(delete=False) as f:
    ...     _ = f.write(b"abc")
    >>> file_checksum(f.name)
    'crc32:352441c2'
    >>> os.unlink(f.name)
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

CHUNK = 8 << 20


def file_checksum(path: str | os.PathLike, chunk: int = CHUNK) -> str:
    """``"crc32:<hex>"`` of a file, read in ``chunk``-sized pieces into one reused buffer."""
    crc = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
    return f"crc32:{crc:08x}"


def describe_file(path: Path) -> dict[str, object]:
    """The manifest record of one file: its size and checksum."""
    return {"size": path.stat().st_size, "checksum": file_checksum(path)}

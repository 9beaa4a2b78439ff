"""Checksums of files and byte ranges of open files, computed by several threads in bounded memory.

The arithmetic (one CRC-32 implementation, combining pieces) is the format's
(:mod:`torchrl_dcp.format.checksums`); this module reads the bytes.

Example:
    >>> import tempfile, os
    >>> from torchrl_dcp.storage.filesums import file_checksum
    >>> with tempfile.NamedTemporaryFile(delete=False) as f:
    ...     _ = f.write(b"abc")
    >>> file_checksum(f.name)
    'crc32:352441c2'
    >>> os.unlink(f.name)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from torchrl_dcp.format.checksums import format_crc
from torchrl_dcp.storage.copying import CopyRange, copy_ranges
from torchrl_dcp.storage.files import open_regular

# memory of a checksum pass, all threads together: a module's verify-first pass held 8 MiB (0.12x the state of a
# 64 MiB model on its first load); 2 MiB checksums 1 GiB as fast here (warm 86-99 ms, cold 0.38-0.40 s either way)
CHECKSUM_BUFFER = 2 << 20


def file_checksum(path: str | os.PathLike, chunk: int = CHECKSUM_BUFFER) -> str:
    """``"crc32:<hex>"`` of a file (several threads, memory bounded by ``chunk``)."""
    return files_checksums([path], chunk)[0]


def files_checksums(paths: list[str | os.PathLike], chunk: int = CHECKSUM_BUFFER) -> list[str]:
    """``"crc32:<hex>"`` of each file (opened without following links); the work is split between threads."""
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(open_regular(path))
        return fds_checksums([(fd, 0, os.fstat(fd).st_size, str(p)) for fd, p in zip(fds, paths)], chunk)
    finally:
        for fd in fds:
            os.close(fd)


def fds_checksums(
    ranges: list[tuple[int, int, int, str]],
    chunk: int = CHECKSUM_BUFFER,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """``"crc32:<hex>"`` of each ``(fd, offset, size, name)`` byte range, split between threads (``copying.py``);
    ``progress`` is called with the bytes of each piece done (from any thread, one at a time)."""
    spans = [CopyRange(fd, offset, size, None, 0, name) for fd, offset, size, name in ranges]
    return [format_crc(crc) for crc in copy_ranges(spans, buffer_size=chunk, progress=progress)]


def file_record(path: Path) -> dict[str, object]:
    """The manifest record of one file: its size and checksum."""
    return {"size": path.stat().st_size, "checksum": file_checksum(path)}

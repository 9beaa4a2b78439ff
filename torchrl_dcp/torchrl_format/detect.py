"""Whether a path holds a ``torchrl.checkpoint`` checkpoint (torch-free: the CLI's tools ask it first).

Example:
    >>> import tempfile
    >>> is_torchrl_checkpoint(tempfile.mkdtemp())
    False
"""

from __future__ import annotations

import os
import stat
import struct
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.format.torchrl_listing import FORMAT_NAME, JSON_LIMIT, MANIFEST, written_files
from torchrl_dcp.format.zipformat import ZipError, check_zipfile_agrees
from torchrl_dcp.json_bytes import loads_json
from torchrl_dcp.storage.backends import is_remote
from torchrl_dcp.storage.urls import is_file_url, resolve_path

__all__ = [
    "FORMAT_NAME",
    "JSON_LIMIT",
    "MANIFEST",
    "ZIPFILE_ERRORS",
    "is_torchrl_checkpoint",
    "open_zip",
    "read_torchrl_manifest",
    "written_files",
]

try:
    from lzma import LZMAError
except ImportError:  # pragma: no cover - a Python built without lzma (zipfile then refuses such members itself)
    LZMAError = zlib.error  # type: ignore[assignment,misc]

#: what Python's ``zipfile`` raises on a damaged or unusual archive or member (a damaged deflate or LZMA stream, a
#: bad CRC, a method or encryption it cannot read, a truncated file): every reader of torchrl's ZIPs catches these
ZIPFILE_ERRORS = (
    zipfile.BadZipFile,
    zlib.error,
    LZMAError,
    EOFError,
    NotImplementedError,
    RuntimeError,
    ValueError,
    OSError,
)


def open_zip(path: str | os.PathLike) -> zipfile.ZipFile:
    """``path`` opened with ``zipfile``, where ``zipfile`` and this package's own ZIP reader
    (:func:`~torchrl_dcp.format.zipformat.central_directory_span`) find the same central directory: one file is one
    archive to every reader (``zipfile`` alone takes bytes before the directory for a prefix and shifts every offset,
    so a file built for it could read as one checkpoint here and as another there). Raises
    :class:`zipfile.BadZipFile` otherwise.

    Example:
        >>> import tempfile, zipfile
        >>> path = tempfile.mkdtemp() + "/a.zip"
        >>> with zipfile.ZipFile(path, "w") as z:
        ...     z.writestr("a.txt", "hi")
        >>> open_zip(path).namelist()
        ['a.txt']
    """
    archive = zipfile.ZipFile(path)
    try:  # (tools other than torchrl's may add an archive comment)
        check_zipfile_agrees(archive, comment=True)
    except (ZipError, struct.error, OSError, ValueError) as err:
        archive.close()
        raise zipfile.BadZipFile(f"the archive's layout is ambiguous or damaged ({err})") from None
    return archive


_SIGNATURE = b'"torchrl.checkpoint"'
_BLOCK = 1 << 20


def _read_if_theirs(f: BinaryIO) -> bytes | None:
    """The manifest's bytes when they name torchrl's format, else ``None``. Scanned in 1 MiB blocks first, so telling
    one of our (possibly large) manifests apart costs no parse and little memory."""
    tail = b""
    while block := f.read(_BLOCK):
        if _SIGNATURE in tail + block:
            f.seek(0)
            return f.read()
        tail = block[-len(_SIGNATURE) :]
    return None


def is_torchrl_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory or ZIP file whose ``manifest.json`` says ``torchrl.checkpoint``."""
    return read_torchrl_manifest(path) is not None


def read_torchrl_manifest(path: str | os.PathLike) -> dict | None:
    """The parsed ``manifest.json`` of the torchrl checkpoint at ``path`` (not validated: a load does that), or
    ``None`` when ``path`` holds none (an object-store URL never does: torchrl writes local paths only)."""
    if is_file_url(path):  # a local path spelled as a URL
        try:
            path = resolve_path(path)
        except CheckpointError:
            return None
    if not isinstance(path, (str, os.PathLike)) or is_remote(path):  # the dispatch says what a path names
        return None
    p = Path(path)
    try:
        if p.is_dir():
            # never through a link, never blocking on a FIFO: the directory may be hostile ground
            fd = os.open(p / MANIFEST, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_size > JSON_LIMIT:
                    return None
                raw = _read_if_theirs(f)
        elif p.is_file() and zipfile.is_zipfile(p):  # (a link the user names is read as what it names)
            with open_zip(p) as z:
                info = z.getinfo(MANIFEST)
                if info.file_size > JSON_LIMIT:
                    return None
                with z.open(info) as f:
                    raw = _read_if_theirs(f)
        else:
            return None
        if raw is None:
            return None
        manifest = loads_json(raw)
    except (KeyError, *ZIPFILE_ERRORS):
        return None  # (what zipfile raises on a damaged archive: not torchrl's then; the reader that opens it says)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        return None
    if not isinstance(manifest.get("components"), dict):
        manifest["components"] = {}
    return manifest

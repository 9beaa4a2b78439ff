"""CRC-32 arithmetic of the format: one implementation (:func:`crc32`), fingerprints, and combining CRCs of pieces.

:func:`crc32` is ISA-L's implementation (the ``isal`` package, installed with
torchrl_dcp) where it is available, else ``zlib``'s: the same polynomial and the same
values, about 4x faster here (14.5 vs 3.6 GB/s on one thread, shared/notes/perf.md),
so the format does not depend on which one computed a checksum.

Bytes in, values out: checksums of files (which read them) are in
:mod:`torchrl_dcp.storage.filesums`.

Example:
    >>> from torchrl_dcp.format.checksums import crc32, crc32_combine, format_crc
    >>> format_crc(crc32(b"abc"))
    'crc32:352441c2'
    >>> crc32_combine(crc32(b"a"), crc32(b"bc"), 2) == crc32(b"abc")
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import zlib
from collections.abc import Callable
from typing import Any

from torchrl_dcp.errors import CheckpointIntegrityError
from torchrl_dcp.settings import setting_at_import

_U32 = 0xFFFFFFFF


def _implementation() -> tuple[Callable[..., int], str]:
    if setting_at_import("TDCP_CRC32") != "zlib":
        try:
            from isal import isal_zlib

            return isal_zlib.crc32, "isal"
        except ImportError:  # pragma: no cover - isal is a dependency; zlib is the fallback
            pass
    return zlib.crc32, "zlib"


#: ``crc32(data, value=0)``: CRC-32 of a bytes-like object (ISA-L's where available, else zlib's)
crc32, CRC32_IMPLEMENTATION = _implementation()


def _adler_implementation() -> Callable[..., int]:
    if CRC32_IMPLEMENTATION == "isal":
        from isal import isal_zlib

        return isal_zlib.adler32
    return zlib.adler32


#: ``adler32(data, value=1)``: Adler-32 (ISA-L's where available, else zlib's; the same values)
adler32 = _adler_implementation()


def content_fingerprint(data: Any) -> tuple[str, int]:
    """``("crc32:<hex>/adler32:<hex>", crc32)`` of bytes: two independent 32-bit sums (64 bits) of a chunk's data.

    An incremental save keeps a chunk file only if the live rows have the fingerprint
    recorded for it (when their changes were not tracked exactly); both sums must match.

    Example:
        >>> content_fingerprint(b"abc")[0]
        'crc32:352441c2/adler32:024d0127'
    """
    crc = crc32(data)
    return fingerprint_of(crc, adler32(data)), crc


def fingerprint_of(crc: int, adler: int) -> str:
    """A chunk's fingerprint from its two sums (computed piece by piece: ``crc32(piece, crc)``,
    ``adler32(piece, adler)`` from 0 and 1), as :func:`content_fingerprint` spells it."""
    return f"crc32:{crc:08x}/adler32:{adler:08x}"


def format_crc(crc: int) -> str:
    """The manifest's spelling of a CRC32: ``"crc32:<8 hex digits>"``."""
    return f"crc32:{crc:08x}"


def checksum_mismatch(actual: str, expected: str, path: Any, what: str = "file") -> CheckpointIntegrityError:
    """The error for data whose checksum differs from the manifest's."""
    return CheckpointIntegrityError(
        f"checksum is {actual}, the manifest says {expected}: the {what} is damaged", path=path
    )


def combined_crc(pieces: list[tuple[int, int, int]]) -> tuple[int, int]:
    """CRC-32 of the bytes that ``(offset, length, crc32)`` pieces cover contiguously from offset 0, and how many
    bytes that is (it stops at the first hole)."""
    value, pos = 0, 0
    for offset, length, crc in sorted(pieces):
        if offset != pos:
            break
        value, pos = crc32_combine(value, crc, length), pos + length
    return value, pos


def _load_combine() -> Any:
    name = ctypes.util.find_library("z") or "libz.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    for fn, off in (("crc32_combine64", ctypes.c_int64), ("crc32_combine", ctypes.c_long)):
        f = getattr(lib, fn, None)
        if f is not None:
            f.argtypes = [ctypes.c_ulong, ctypes.c_ulong, off]
            f.restype = ctypes.c_ulong
            return f
    return None


_COMBINE = _load_combine()


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's algorithm)."""
    if len2 <= 0:
        return crc1
    if _COMBINE is not None:
        return int(_COMBINE(crc1, crc2, len2)) & _U32
    odd = [0xEDB88320] + [1 << i for i in range(31)]
    even = [_gf2_times(odd, odd[n]) for n in range(32)]
    odd = [_gf2_times(even, even[n]) for n in range(32)]
    while True:
        even = [_gf2_times(odd, odd[n]) for n in range(32)]
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = [_gf2_times(even, even[n]) for n in range(32)]
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return (crc1 ^ crc2) & _U32

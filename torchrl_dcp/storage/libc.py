"""The C library, loaded once (``renameat2``, ``sync_file_range``, ``madvise`` are not in ``os``).

Example:
    >>> from torchrl_dcp.storage.libc import libc
    >>> lib = libc()  # None where there is no C library to load
    >>> lib is None or hasattr(lib, "getpid")
    True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def libc() -> Any:
    """``ctypes.CDLL`` of the C library (errno kept), or ``None`` where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - no C library (not Linux/macOS)
        return None

"""Bytes that stay put while a writer checksums and writes them, even when other threads change the tensor.

A writer that checksums a piece of live memory and then writes it would write other bytes than it checksummed if a
thread (a collector, the training loop beside an async save of a memory-mapped buffer) changed them in between: the
file would fail its own checksum. :func:`stable_piece` gives the writer bytes that cannot change:

- the piece itself when its memory belongs to a save (declared with :func:`own`: an async save's staging buffers,
  which nothing writes until that save is done);
- otherwise a copy in this thread's reused buffer, made by numpy, which releases the GIL while it copies (a
  ``memoryview`` assignment holds it: 1 MiB at a time, that stalled a training loop beside an async save,
  ``benchmarks.async_training``).

Example:
    >>> import torch
    >>> from torchrl_dcp.storage.stable_bytes import own, stable_piece
    >>> live = torch.arange(4, dtype=torch.uint8)
    >>> piece = stable_piece(memoryview(live.numpy()))
    >>> live[0] = 9; bytes(piece)  # a copy: the change is not in it
    b'\\x00\\x01\\x02\\x03'
    >>> staged = torch.arange(4, dtype=torch.uint8); own(staged)
    >>> piece = stable_piece(memoryview(staged.numpy()))
    >>> staged[0] = 9; bytes(piece)  # the staging buffer itself, not a copy
    b'\\t\\x01\\x02\\x03'
"""

from __future__ import annotations

import bisect
import threading
import weakref
from typing import Any

import numpy
import torch

_LOCK = threading.Lock()
_ENDS: dict[int, int] = {}  # start -> end address of each buffer a save owns
_STARTS: list[int] | None = []  # the starts, sorted; None once _ENDS changed (sorted again at the next lookup)
_COPY = threading.local()


def own(tensor: torch.Tensor) -> None:
    """Declare ``tensor``'s memory a save's own until ``tensor`` is garbage collected: nothing else writes it while
    a save reads it, so writers read it without a copy. Only for buffers the caller allocated and no other code can
    reach (a CPU tensor; a device tensor is ignored). Constant time (an async save stages one buffer per tensor)."""
    global _STARTS
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    with _LOCK:
        _ENDS[start] = end
        _STARTS = None
    weakref.finalize(tensor, _release, start, end)


def _release(start: int, end: int) -> None:
    global _STARTS
    with _LOCK:
        if _ENDS.get(start) == end:  # (not a buffer since allocated at the same address: that one stays owned)
            del _ENDS[start]
            _STARTS = None


def owned(start: int, length: int) -> bool:
    """Whether ``[start, start + length)`` lies in memory declared with :func:`own`."""
    global _STARTS
    with _LOCK:
        if _STARTS is None:
            _STARTS = sorted(_ENDS)
        i = bisect.bisect_right(_STARTS, start) - 1
        return i >= 0 and start + length <= _ENDS[_STARTS[i]]


def stable_piece(view: Any) -> memoryview:
    """``view``'s bytes as a writer may checksum, then write them: ``view`` itself when a save owns its memory
    (:func:`own`), else a copy in this thread's reused buffer, valid until this thread's next call."""
    src = numpy.frombuffer(view, numpy.uint8)
    n = src.size
    if n and owned(src.__array_interface__["data"][0], n):
        return memoryview(src)
    held = getattr(_COPY, "buffer", None)
    if held is None or held.size < n:
        held = _COPY.buffer = numpy.empty(max(n, 1 << 20), numpy.uint8)
    numpy.copyto(held[:n], src)  # numpy releases the GIL while it copies
    return memoryview(held[:n])

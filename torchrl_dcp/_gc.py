"""Pause Python's cyclic garbage collector while a save or load builds many small objects.

Encoding the state, DCP's metadata and the manifest of a model with thousands of
tensors allocate tens of thousands of containers; each allocation burst triggers
collections that walk every tracked object of the training process. Measured on a
5,000-tensor save: DCP's metadata took 64 ms with the collector on, 13 ms with it
paused. Reference counting still frees everything as usual; cycles made meanwhile
are collected once the collector runs again. Nested and concurrent pauses are
counted: the collector is re-enabled (if it was enabled) when the last one ends.

Example:
    >>> import gc
    >>> from torchrl_dcp._gc import gc_paused
    >>> with gc_paused():
    ...     gc.isenabled()
    False
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the duration of the block (re-entrant, thread-safe)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()

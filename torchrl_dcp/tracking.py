"""Which rows of a replay buffer's storage were written since the last committed save.

An incremental save (:mod:`torchrl_dcp.incremental`) keeps a chunk file of the previous
checkpoint only when its rows are proven unchanged. For a ``TensorStorage`` the proof is
exact and free: :func:`track` wraps the storage's ``set`` (through which ``extend``,
``add``, ``rb[idx] = ...`` and ``storage[idx] = ...`` all write) and marks the rows each
call writes, whatever the index (int, slice, tensor, wrap-around, more rows than the
capacity). A write that bypasses ``set`` (an in-place op on a leaf tensor) is caught by
the leaf's version counter, and a write by another process through a copy of the storage
by torchrl's shared mutation counter: the snapshot then says "unknown" and the save falls
back to comparing checksums of the live rows. So does a storage whose tensors other
processes can write without either (shared memory, memory-mapped files): its rows are
always compared by content. A save takes a :class:`Snapshot` while encoding (the rows
written since the last committed save's call) and opens a record of the rows written
from its own call on; once it commits, that record is the one later saves compare with,
and if it fails, the record is dropped. Saves may overlap (an async save in flight while
another checkpoint saves the same buffer): each open record takes every write.

Example:
    >>> import torch
    >>> from torchrl.data import TensorStorage
    >>> from torchrl_dcp.tracking import track
    >>> storage = TensorStorage(torch.zeros(8, 3))
    >>> tracker = track(storage)
    >>> tracker.commit(tracker.begin(), "save-1")   # as if a save had just committed
    >>> storage.set(torch.tensor([5]), torch.ones(1, 3))
    >>> snap = tracker.begin()
    >>> snap.epoch, snap.mask.nonzero().flatten().tolist()
    ('save-1', [5])
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_ATTR = "_tdcp_row_tracker"


@dataclass
class Snapshot:
    """The rows written between the save ``epoch`` and this snapshot (``mask``), or ``None`` when unknown;
    ``epoch_keys``: the DCP keys that save stored the storage under, ``keys``: those this save stores it under (the
    save fills them in)."""

    tracker: RowTracker
    epoch: str | None
    mask: torch.Tensor | None
    token: int = 0  # the record of the rows written from this save's call on (RowTracker.open)
    epoch_keys: frozenset[str] = frozenset()
    keys: set[str] = field(default_factory=set)

    def unchanged(self, base_save_id: str, key: str, start: int, rows: int) -> bool:
        """Whether rows ``[start, start + rows)`` are proven unchanged since the save ``base_save_id``, which
        stored this storage under ``key`` (a storage saved under another component's name there, two buffers that
        swapped names, holds other rows at ``key``)."""
        if self.epoch is None or self.epoch != base_save_id or self.mask is None or key not in self.epoch_keys:
            return False
        if start + rows > self.mask.shape[0]:
            return False
        return not bool(self.mask[start : start + rows].any())


class _TrackedSet:
    """The storage's ``set``, marking the rows it writes; pickles as the storage's own ``set``."""

    def __init__(self, tracker: RowTracker, original: Any) -> None:
        self.tracker, self.original = tracker, original

    def __call__(self, cursor: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        write = self.tracker.mark(cursor)
        try:
            return self.original(cursor, data, *args, **kwargs)
        finally:
            self.tracker.wrote(write)

    def __reduce__(self) -> Any:  # a copied or pickled storage gets its class's plain ``set``
        return getattr, (self.tracker.storage, "set")


class RowTracker:
    """Rows of one storage written since the last committed save's call, and since each open save's (see the module
    docstring)."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.epoch: str | None = None  # the committed save whose call the mask counts from
        self.epoch_keys: frozenset[str] = frozenset()  # the DCP keys that save stored the storage under
        self.mask: torch.Tensor | None = None  # None: unknown
        self.open: dict[int, torch.Tensor | None] = {}  # a save in progress (its snapshot's token): rows since its call
        self.tokens = 0
        self.versions: Any = None  # leaf versions and torchrl's mutation counter after our last write
        self.writing: dict[int, Any] = {}  # the cursors of the writes inside ``set`` now (other threads'), by number
        self.writes = 0
        self.lock = threading.Lock()

    def __reduce__(self) -> Any:  # never travels with a copied storage
        return _none, ()

    def _forget(self) -> None:
        """Rows were written where they cannot be known: every record is unknown."""
        self.mask = None
        self.open = dict.fromkeys(self.open)

    # ------------------------------------------------------------------ writes
    def mark(self, cursor: Any) -> int:
        """Mark the rows a write at ``cursor`` is about to make in every record; returns the write's number, which
        :meth:`wrote` takes once it is done (until then, a save that begins marks its rows too)."""
        with self.lock:
            self.writes += 1
            self.writing[self.writes] = cursor
            masks = [m for m in (self.mask, *self.open.values()) if m is not None]
            if not masks:
                return self.writes
            if _versions(self.storage, _leaves(self.storage)) != self.versions:  # written around ``set``: unknown
                self._forget()
            elif not all(_mark_rows(m, cursor) for m in masks):
                self._forget()
            return self.writes

    def wrote(self, write: int | None = None) -> None:
        with self.lock:
            self.writing.pop(write, None)
            leaves = _leaves(self.storage)
            rows = int(leaves[0].shape[0]) if leaves else -1
            if self.mask is not None and self.mask.shape[0] != rows:
                self.mask = None  # the storage was (re)built
            self.open = {k: m if m is not None and m.shape[0] == rows else None for k, m in self.open.items()}
            self.versions = _versions(self.storage, leaves)

    # ------------------------------------------------------------------ saves
    def begin(self) -> Snapshot:
        """The rows written since the last committed save's call; opens this save's record of the rows written from
        now on."""
        with self.lock:
            leaves = _leaves(self.storage)
            versions = _versions(self.storage, leaves)
            if versions != self.versions:  # written around ``set`` since our last write: no record holds it
                self._forget()
            known = self.epoch is not None and self.mask is not None and not any(_shared(t) for t in leaves)
            self.tokens += 1
            snap = Snapshot(
                self, self.epoch if known else None, self.mask.clone() if known else None, self.tokens, self.epoch_keys
            )
            record = torch.zeros(int(leaves[0].shape[0]), dtype=torch.bool) if leaves else None
            # a write inside ``set`` now (another thread's: torchrl stacks a list before writing) may land after this
            # save copied its rows: the rows are the next save's to write (marked here, or this record is unknown)
            if record is not None and not all(_mark_rows(record, c) for c in self.writing.values()):
                record = None
            self.open[self.tokens] = record
            self.versions = versions
            return snap

    def commit(self, snap: Snapshot, save_id: str) -> None:
        """The save that took ``snap`` committed as ``save_id``: later saves compare with the rows written since its
        call (whichever of overlapping saves commits last: each record holds every write since its own call)."""
        with self.lock:
            self.epoch, self.mask = save_id, self.open.pop(snap.token, None)
            self.epoch_keys = frozenset(snap.keys)

    def abort(self, snap: Snapshot) -> None:
        """The save that took ``snap`` failed: its record is dropped (the committed one was never reset)."""
        with self.lock:
            self.open.pop(snap.token, None)


def track(storage: Any) -> RowTracker:
    """The tracker of ``storage``, installed on first use (idempotent)."""
    tracker = storage.__dict__.get(_ATTR)
    if isinstance(tracker, RowTracker) and isinstance(storage.__dict__.get("set"), _TrackedSet):
        return tracker
    tracker = RowTracker(storage)
    storage.__dict__[_ATTR] = tracker
    original = type(storage).set.__get__(storage)
    storage.__dict__["set"] = _TrackedSet(tracker, original)
    return tracker


def _none() -> None:
    return None


def _leaves(storage: Any) -> list[torch.Tensor]:
    data = getattr(storage, "_storage", None)
    if data is None or not getattr(storage, "initialized", False):
        return []
    if isinstance(data, torch.Tensor):
        return [data]
    try:
        return list(data.values(include_nested=True, leaves_only=True))
    except (AttributeError, TypeError):
        return []


def _versions(storage: Any, leaves: list[torch.Tensor]) -> Any:
    """What changes with every write: each leaf's version counter, and torchrl's cross-process mutation counter."""
    try:
        revision = storage._mutation_revision
    except Exception:  # noqa: BLE001 - older torchrl: the version counters alone
        revision = None
    if isinstance(revision, torch.Tensor):
        revision = int(revision.item())
    # an inference tensor (a storage filled under ``torch.inference_mode()``) keeps no version counter: a marker that
    # never compares equal, so its rows are always unknown (compared by content), never a failed save
    return tuple((id(t), object() if t.is_inference() else t._version) for t in leaves), revision


def _shared(t: torch.Tensor) -> bool:
    """Writable by other processes without our hook or its version counter (shared memory, a mapped file)."""
    if t.device.type != "cpu":
        return False
    try:
        return bool(t.is_shared() or getattr(t.untyped_storage(), "filename", None))
    except (RuntimeError, NotImplementedError):
        return True


def _mark_rows(mask: torch.Tensor, cursor: Any) -> bool:
    """Mark the dim-0 rows ``cursor`` addresses; ``False`` when they cannot be known."""
    if isinstance(cursor, tuple):
        if not cursor:
            return False
        cursor = cursor[0]
    try:
        if isinstance(cursor, (int, np.integer, slice)):
            mask[cursor] = True
            return True
        if isinstance(cursor, range):
            mask[slice(cursor.start, cursor.stop, cursor.step)] = True
            return True
        index = torch.as_tensor(cursor)
        if index.dtype == torch.bool:
            if index.shape[:1] != mask.shape:
                return False
            mask |= index.reshape(mask.shape[0], -1).any(1).cpu()
            return True
        if index.is_floating_point() or index.is_complex():
            return False
        mask[index.reshape(-1).long().cpu()] = True
        return True
    except (IndexError, TypeError, ValueError, RuntimeError):
        return False

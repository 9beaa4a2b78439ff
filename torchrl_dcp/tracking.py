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
always compared by content. A save takes a :class:`Snapshot` while encoding;
the rows marked from then on are relative to that save once it commits, and merged back
if it fails.

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_ATTR = "_tdcp_row_tracker"


@dataclass
class Snapshot:
    """The rows written between the save ``epoch`` and this snapshot (``mask``), or ``None`` when unknown."""

    tracker: RowTracker
    epoch: str | None
    mask: torch.Tensor | None

    def unchanged(self, base_save_id: str, start: int, rows: int) -> bool:
        """Whether rows ``[start, start + rows)`` are proven unchanged since the save ``base_save_id``."""
        if self.epoch is None or self.epoch != base_save_id or self.mask is None:
            return False
        if start + rows > self.mask.shape[0]:
            return False
        return not bool(self.mask[start : start + rows].any())


class _TrackedSet:
    """The storage's ``set``, marking the rows it writes; pickles as the storage's own ``set``."""

    def __init__(self, tracker: RowTracker, original: Any) -> None:
        self.tracker, self.original = tracker, original

    def __call__(self, cursor: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        self.tracker.mark(cursor)
        try:
            return self.original(cursor, data, *args, **kwargs)
        finally:
            self.tracker.wrote()

    def __reduce__(self) -> Any:  # a copied or pickled storage gets its class's plain ``set``
        return getattr, (self.tracker.storage, "set")


class RowTracker:
    """Rows of one storage written since the last committed save (see the module docstring)."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.epoch: str | None = None  # the committed save the mask is relative to
        self.mask: torch.Tensor | None = None  # None: unknown
        self.versions: Any = None  # leaf versions and torchrl's mutation counter after our last write
        self.lock = threading.Lock()

    def __reduce__(self) -> Any:  # never travels with a copied storage
        return _none, ()

    # ------------------------------------------------------------------ writes
    def mark(self, cursor: Any) -> None:
        with self.lock:
            if self.mask is None:
                return
            if _versions(self.storage, _leaves(self.storage)) != self.versions:  # written around ``set``: unknown
                self.mask = None
            elif not _mark_rows(self.mask, cursor):
                self.mask = None

    def wrote(self) -> None:
        with self.lock:
            leaves = _leaves(self.storage)
            if self.mask is not None and (not leaves or int(leaves[0].shape[0]) != self.mask.shape[0]):
                self.mask = None  # the storage was (re)built
            self.versions = _versions(self.storage, leaves)

    # ------------------------------------------------------------------ saves
    def begin(self) -> Snapshot:
        """Take the rows written since the last commit, and start marking anew for this save."""
        with self.lock:
            leaves = _leaves(self.storage)
            versions = _versions(self.storage, leaves)
            known = self.epoch is not None and self.mask is not None and versions == self.versions
            known = known and not any(_shared(t) for t in leaves)
            snap = Snapshot(self, self.epoch if known else None, self.mask if known else None)
            self.epoch = None  # until this save commits
            self.mask = torch.zeros(int(leaves[0].shape[0]), dtype=torch.bool) if leaves else None
            self.versions = versions
            return snap

    def commit(self, snap: Snapshot, save_id: str) -> None:
        """The save that took ``snap`` committed as ``save_id``: rows marked since are relative to it."""
        with self.lock:
            self.epoch = save_id

    def abort(self, snap: Snapshot) -> None:
        """The save that took ``snap`` failed: what it took is marked again (or everything is unknown)."""
        with self.lock:
            if snap.mask is None or self.mask is None or snap.mask.shape != self.mask.shape:
                self.mask, self.epoch = None, None
                return
            self.mask |= snap.mask
            self.epoch = snap.epoch


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

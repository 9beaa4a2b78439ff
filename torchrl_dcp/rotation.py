"""Retention of step-named checkpoints, "latest good one" resolution, and a one-call resume.

``CheckpointRotation(directory, keep_last=N, keep_best=("reward", "max"))`` saves
``<directory>/step-<N, 12 digits>`` (or ``step-<N>.zip`` with ``archive=True``),
commits it before anything older is deleted (rank 0 deletes), and resolves
``latest()`` / ``best()`` from committed manifests only, so a killed save is never
picked. :func:`resume` loads the newest checkpoint that loads, or says to start fresh.

Retention, ``latest()`` and resume follow the **commit order** (the rotation's
commit counter, the manifest's ``sequence``, one more than the largest in the
directory at each save; then ``created_at`` and step for entries written without
one), never the step number nor a node's clock: after a rollback or a
new run in the same directory, the checkpoint just saved is the newest, is never
deleted by its own save, and higher steps left by the earlier run are reported
(a warning) and pruned as they fall out of ``keep_last``. ``entries()`` lists by
step for display; :func:`by_commit` gives the commit order.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> d = tempfile.mkdtemp()
    >>> ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1))
    >>> rotation = tdcp.CheckpointRotation(d, keep_last=2)
    >>> for step in (10, 20, 30):
    ...     _ = rotation.save(ckpt, step=step)
    >>> [e.step for e in rotation.entries()]
    [20, 30]
    >>> tdcp.resume(ckpt, d).step
    30
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import re
import warnings
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointVersionError,
    CollectiveError,
)
from torchrl_dcp.format.layout import DCP_METADATA
from torchrl_dcp.storage.backends import location_for
from torchrl_dcp.storage.base import Location

logger = logging.getLogger("torchrl_dcp")

_ENTRY = re.compile(r"^step-(\d+)(\.zip)?$")
_OWNER = re.compile(r"^step-(\d+)(\.zip)?$")  # the entry a leftover of a killed save or conversion was for
MetricMode = Literal["max", "min"]


@dataclass(frozen=True)
class RotationEntry:
    """One entry of a rotation directory."""

    step: int
    path: Path
    committed: bool
    archive: bool
    size: int
    metric: float | None = None
    created_at: str | None = None
    error: str | None = None
    sequence: int | None = (
        None  # the rotation's commit counter (format 4; absent in older entries)  # why an uncommitted entry is not committed (``include_uncommitted``)
    )

    @property
    def commit_key(self) -> tuple[int, float, int]:
        """Sort key of the commit order: the rotation's commit counter, then ``created_at``, then step.

        The counter (manifest ``sequence``) is one more than the largest in the directory
        when a save starts, so the order holds whatever the clocks of the nodes that
        coordinated each save; ``created_at`` (seconds, UTC; unreadable: oldest) only
        orders entries written before counters existed (counter 0).
        """
        return (self.sequence or 0, _timestamp(self.created_at), self.step)


def _check_committed(location: Location) -> None:
    """The entry just committed passes the checks a load runs before it reads any tensor (its manifest, every file
    present with its size and this save's identity, DCP's metadata: coverage, bounds, inventory), or the rotation
    prunes nothing: a checkpoint damaged between its commit and the prune never replaces the good one before it."""
    try:
        src = location.open_source()
        files = src.manifest()["files"]
        src.check(False)
        src.check_identity([n for n in files if n != DCP_METADATA])
        src.dcp_metadata()
    except CheckpointError as err:
        raise CheckpointIntegrityError(
            f"the checkpoint just committed fails a load's checks ({err.message}); no older entry was pruned: "
            "save again, or resume from the previous one",
            path=err.path or location.path,
        ) from None


@dataclass(frozen=True)
class ResumeInfo:
    """Where a resume came from: the step, the checkpoint path and the :class:`LoadResult`."""

    step: int
    path: Path
    result: Any


class CheckpointRotation:
    """Keep the last ``keep_last`` checkpoints of a run (plus the best one by a metric).

    Args:
        directory: where the ``step-<N>`` entries live (created on first save).
        keep_last: how many of the newest committed entries to keep (>= 1).
        keep_best: ``(metadata_key, "max" | "min")``: also keep the entry whose user
            metadata holds the best value; every save must then pass that metric.
        archive: store each entry as one ZIP file (``step-<N>.zip``), converted after commit.
        incremental: save each entry incrementally from the newest committed one (chunk
            files whose rows are unchanged are hard-linked, :mod:`torchrl_dcp.incremental`);
            every entry still stands alone, so pruning never breaks a kept one. Off with
            ``archive=True`` (an archive's members cannot be linked).
        storage_options: fsspec options when ``directory`` is a URL (``s3://bucket/run``; docs/objectstores.md).

    ``save`` and ``load_latest`` are collective (every rank calls them); ``entries``,
    ``latest`` and ``best`` only read manifests and may be called from any rank.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last: int = 3,
        keep_best: tuple[str, MetricMode] | None = None,
        archive: bool = False,
        incremental: bool = True,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be a positive integer, got {keep_last!r}")
        if keep_best is not None:
            if not (isinstance(keep_best, tuple) and len(keep_best) == 2 and isinstance(keep_best[0], str)):
                raise ValueError(f"keep_best must be (metadata_key, 'max' | 'min'), got {keep_best!r}")
            if keep_best[1] not in ("max", "min"):
                raise ValueError(f"keep_best mode must be 'max' or 'min', got {keep_best[1]!r}")
        self.location: Location = location_for(directory, storage_options)
        self.directory = self.location.path
        if archive and not self.location.holds_archives:
            raise ValueError(
                f"archive=True is for local directories: an {self.location.kind} entry is already one prefix"
            )
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.archive = archive
        self.incremental = incremental

    # ------------------------------------------------------------------ reading
    def path_for(self, step: int) -> Path:
        return self.directory / (f"step-{step:012d}" + (".zip" if self.archive else ""))

    def entries(self, *, include_uncommitted: bool = False) -> list[RotationEntry]:
        """Entries sorted by step (for display); only committed ones unless ``include_uncommitted``.

        Each manifest is read once per call; entries removed while listing (another
        process pruning) are skipped. Use :func:`by_commit` for the commit order.
        """
        return list_entries(self.location, self.keep_best[0] if self.keep_best else None, include_uncommitted)

    def latest(self) -> Path | None:
        """The most recently committed entry (by ``created_at``, not by step; never a half-written one), or ``None``."""
        newest = latest_entry(self.entries())
        return newest.path if newest else None

    def best(self) -> Path | None:
        """The committed entry with the best ``keep_best`` metric, or ``None``."""
        best = self.best_entry(self.entries())
        return best.path if best else None

    def best_entry(self, entries: Iterable[RotationEntry]) -> RotationEntry | None:
        """The entry of ``entries`` (committed ones) with the best metric; equal metrics: the newest commit."""
        if self.keep_best is None:
            return None
        scored = [e for e in entries if e.committed and e.metric is not None]
        if not scored:
            return None
        sign = 1.0 if self.keep_best[1] == "max" else -1.0
        return max(scored, key=lambda e: (sign * e.metric, e.commit_key))  # type: ignore[operator]

    # ------------------------------------------------------------------ saving
    def save(
        self,
        ckpt: Any,
        *,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        components: Collection[str] | None = None,
        **save_kwargs: Any,
    ) -> Path:
        """Save ``step`` (collective), then delete what the policy no longer keeps (rank 0).

        The new checkpoint is committed (and, with ``archive=True``, converted and
        published) before any older entry is removed. Returns the entry's path.
        """
        from torchrl_dcp import _dist
        from torchrl_dcp.collective import run_on_coordinator

        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        metadata = dict(metadata or {})
        if self.keep_best is not None:
            _metric(metadata.get(self.keep_best[0]), self.keep_best[0], required=True)
        directory_path = self.directory / f"step-{step:012d}"
        base, sequence = self._next_commit(getattr(ckpt, "timeout", None))
        save_kwargs.setdefault("commit_sequence", sequence)
        if (
            self.incremental
            and not self.archive
            and self.location.keeps_files()
            and "incremental_from" not in save_kwargs
        ):
            save_kwargs["incremental_from"] = base
        path = ckpt.save(directory_path, step=step, metadata=metadata, components=components, **save_kwargs)
        target = self.path_for(step)

        def rotate() -> None:
            if self.archive:
                from torchrl_dcp.convert import to_archive

                to_archive(path, target, overwrite=True)
                self.location.child(path.name).remove()
            else:
                stale = self.location.child(f"step-{step:012d}.zip")  # same step saved as an archive before
                if stale.entry_kind() == "archive":
                    stale.remove()
            _check_committed(self.location.child(target.name))  # what replaces the pruned entries must load
            self.prune(protect=target)

        group = _dist.checkpoint_group(getattr(ckpt, "timeout", None))
        try:
            run_on_coordinator(group, "rotating checkpoints", rotate)
        except CheckpointError as err:
            if err.path is None:
                err.path = str(target)
                err.args = (f"{err.path}: {err.message}",)
            raise
        return target

    def _next_commit(self, timeout: Any = None) -> tuple[Path | None, int]:
        """The base of the next incremental save (the newest committed directory entry) and its commit counter.

        Rank 0 chooses and every rank receives its choice, so all ranks agree even when
        another process commits or prunes meanwhile. The counter is one more than the
        largest in the directory.
        """
        from torchrl_dcp import _dist
        from torchrl_dcp.collective import broadcast_step

        def choose() -> tuple[str | None, int]:
            entries = self.entries()
            newest = latest_entry(e for e in entries if not e.archive)
            counter = 1 + max((e.sequence or 0 for e in entries), default=0)
            return (None if newest is None else str(newest.path)), counter

        group = _dist.checkpoint_group(timeout)
        chosen, counter = broadcast_step(group, "choosing the incremental base", choose, rank=_dist.rank())
        return (None if chosen is None else self.directory / Path(chosen).name), counter  # a Path, or a StorePath

    def prune(self, *, protect: Path | None = None) -> list[Path]:
        """Delete committed entries outside the policy and leftovers of killed saves (run by one process).

        The policy keeps the ``keep_last`` most recent commits (commit order, not
        step order), the best entry, and ``protect`` (the entry :meth:`save` has just
        committed) whatever its place. Higher steps committed before ``protect`` (left
        by an earlier run, or before a rollback) are reported with a warning.
        Entries removed meanwhile by another process are skipped.
        """
        entries = by_commit(self.entries())
        keep = {e.path for e in entries[-self.keep_last :]}
        best = self.best_entry(entries)
        if best is not None:
            keep.add(best.path)
        if protect is not None:
            keep.add(protect)
            self._warn_stale(entries, protect)
        newest = max((e.step for e in entries), default=-1)
        removed = []
        for e in entries:
            if e.path not in keep and self.location.child(e.path.name).remove():
                removed.append(e.path)
        for left in self.location.leftovers():
            m = _OWNER.match(left.owner)
            if (
                m and int(m.group(1)) < newest and self.location.remove_leftover(left)
            ):  # an older step's, never committed
                removed.append(self.directory / left.name)
        if removed:
            logger.info("rotation %s removed %s", self.directory, [p.name for p in removed])
        return removed

    def _warn_stale(self, entries: list[RotationEntry], protect: Path) -> None:
        current = next((e for e in entries if e.path == protect), None)
        if current is None:
            return
        stale = [e for e in entries if e.step > current.step and e.commit_key < current.commit_key]
        if stale:
            warnings.warn(
                f"rotation {self.directory}: {[e.path.name for e in stale]} hold higher steps than step "
                f"{current.step} just saved but were committed before it (an earlier run, or a rollback): "
                f"latest() and resume now pick step {current.step}; the older ones are pruned as they fall out of "
                "keep_last (delete them, or use another directory, to start a run from scratch)",
                StaleCheckpointWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ loading
    def load_latest(self, ckpt: Any, *, fallback: bool = True, **load_kwargs: Any) -> Any:
        """Load the newest committed entry (collective); ``None`` when there is none.

        With ``fallback``, an entry that turns out damaged (checksum, missing file,
        unreadable manifest) is skipped with a warning and the next older one is tried.
        Rank 0 lists the directory and every rank loads the same entries.
        """
        info = self._resume(ckpt, fallback, load_kwargs)
        return None if info is None else info.result

    def resume(self, ckpt: Any, *, fallback: bool = True, **load_kwargs: Any) -> ResumeInfo | None:
        """Like :meth:`load_latest`, but returns :class:`ResumeInfo` (step, path, result) or ``None``."""
        return self._resume(ckpt, fallback, load_kwargs)

    def _resume(self, ckpt: Any, fallback: bool, load_kwargs: dict[str, Any]) -> ResumeInfo | None:
        from torchrl_dcp import _dist
        from torchrl_dcp.collective import broadcast_step

        group = _dist.checkpoint_group(getattr(ckpt, "timeout", None))
        candidates = broadcast_step(  # rank 0 lists, newest commit first; every rank loads the same entries
            group, "listing checkpoints", lambda: [(e.step, str(e.path)) for e in reversed(by_commit(self.entries()))]
        )
        for step, listed in candidates:
            path = self.directory / listed.rsplit("/", 1)[-1]  # the rotation's own path (and storage options)
            try:
                result = ckpt.load(path, **load_kwargs)
            except CheckpointError as err:
                damaged = isinstance(err, (CheckpointIntegrityError, CheckpointFormatError)) and not isinstance(
                    err, CheckpointVersionError
                )
                own = None if isinstance(err, CollectiveError) else damaged
                votes = _dist.all_gather(own, group)
                if not fallback or any(v is False for v in votes) or not any(votes):
                    raise
                logger.warning("checkpoint %s is damaged (%s); trying the previous one", path, err)
                continue
            logger.info("resumed from step %d (%s)", step, path)
            return ResumeInfo(step, path, result)
        logger.info("no committed checkpoint in %s: starting fresh", self.directory)
        return None


def resume(ckpt: Any, directory: str | os.PathLike, **load_kwargs: Any) -> ResumeInfo | None:
    """Load the latest committed checkpoint under ``directory`` if there is one (collective).

    Returns :class:`ResumeInfo` (``step``, ``path``, ``result``) or ``None`` to start fresh.
    Damaged entries are skipped for the next older one.

    Example:
        >>> info = tdcp.resume(ckpt, "ckpts")  # doctest: +SKIP
        >>> start = 0 if info is None else info.step + 1  # doctest: +SKIP
    """
    return CheckpointRotation(directory).resume(ckpt, **load_kwargs)


class StaleCheckpointWarning(UserWarning):
    """A rotation directory holds higher steps committed before the checkpoint just saved."""


def by_commit(entries: Iterable[RotationEntry]) -> list[RotationEntry]:
    """Committed entries from the oldest commit to the newest (``created_at``, then step).

    Example:
        >>> [e.step for e in by_commit(rotation.entries())]  # doctest: +SKIP
        [300, 10, 20]
    """
    return sorted((e for e in entries if e.committed), key=lambda e: e.commit_key)


def latest_entry(entries: Iterable[RotationEntry]) -> RotationEntry | None:
    """The most recently committed of ``entries`` (see :func:`by_commit`), or ``None``."""
    ordered = by_commit(entries)
    return ordered[-1] if ordered else None


def list_entries(
    directory: Location | str | os.PathLike, metric: str | None = None, include_uncommitted: bool = False
) -> list[RotationEntry]:
    """Step-named entries of ``directory`` sorted by step; committed means a manifest that reads and validates.

    Each manifest is read once. Entries of the wrong kind (a ``step-N`` that is not a
    checkpoint directory or prefix, a ``step-N.zip`` that is not a regular file, any
    symlink) are skipped; so are entries that vanish while they are read.
    """
    location = directory if isinstance(directory, Location) else location_for(directory)
    found: dict[int, RotationEntry] = {}
    for child in location.children():
        m = _ENTRY.match(child.name)
        if not m:
            continue
        is_archive = m.group(2) is not None
        if child.kind != ("archive" if is_archive else "checkpoint"):
            continue  # a symlink, a FIFO, a directory named .zip, an object named step-N: never ours
        error = None
        try:
            manifest = child.location.manifest()
        except Exception as err:  # noqa: BLE001 - one damaged entry must never break a listing
            manifest, error = {}, f"{type(err).__name__}: {err}"
        if error is not None and not include_uncommitted:
            continue
        size = child.location.size()
        if size is None:
            continue  # removed while listed
        created_at = manifest.get("created_at")
        entry = RotationEntry(
            step=int(m.group(1)),
            path=child.location.path,
            committed=error is None,
            archive=is_archive,
            size=size,
            metric=_metric(manifest.get("metadata", {}).get(metric), metric) if metric and error is None else None,
            created_at=created_at if isinstance(created_at, str) else None,
            error=error,
            sequence=entry_sequence(manifest),
        )
        old = found.get(entry.step)
        if old is None or (entry.committed, not entry.archive) > (old.committed, not old.archive):
            found[entry.step] = entry  # one entry per step: committed first, a directory over an archive
    return sorted(found.values(), key=lambda e: e.step)


def entry_sequence(manifest: Mapping[str, Any]) -> int | None:
    """The commit counter a manifest records (``None``: written without one)."""
    value = manifest.get("sequence")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _timestamp(created_at: str | None) -> float:
    """``created_at`` (ISO 8601; UTC when it names no zone) in seconds; unreadable or absent: ``-inf`` (oldest)."""
    if not isinstance(created_at, str):
        return -math.inf
    try:
        when = datetime.datetime.fromisoformat(created_at)
    except ValueError:
        return -math.inf
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    try:
        return when.timestamp()
    except (OverflowError, ValueError, OSError):
        return -math.inf


def _metric(value: Any, key: str | None, required: bool = False) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if required:
        raise ValueError(f"keep_best needs a finite number in metadata[{key!r}], got {value!r}")
    return None

"""Retention of step-named checkpoints, "latest good one" resolution, and a one-call resume.

``CheckpointRotation(directory, keep_last=N, keep_best=("reward", "max"))`` saves
``<directory>/step-<N, 12 digits>`` (or ``step-<N>.zip`` with ``archive=True``),
commits it before anything older is deleted (rank 0 deletes), and resolves
``latest()`` / ``best()`` from committed manifests only, so a killed save is never
picked. :func:`resume` loads the newest checkpoint that loads, or says to start fresh.

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

import logging
import math
import os
import re
from collections.abc import Collection, Mapping
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

logger = logging.getLogger("torchrl_dcp")

_ENTRY = re.compile(r"^step-(\d+)(\.zip)?$")
_LEFTOVER = re.compile(r"^\.step-(\d+)(\.zip)?\.tdcp-(staging|trash|tmp)-")
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
    ) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be a positive integer, got {keep_last!r}")
        if keep_best is not None:
            if not (isinstance(keep_best, tuple) and len(keep_best) == 2 and isinstance(keep_best[0], str)):
                raise ValueError(f"keep_best must be (metadata_key, 'max' | 'min'), got {keep_best!r}")
            if keep_best[1] not in ("max", "min"):
                raise ValueError(f"keep_best mode must be 'max' or 'min', got {keep_best[1]!r}")
        self.directory = Path(directory).expanduser().absolute()
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.archive = archive

    # ------------------------------------------------------------------ reading
    def path_for(self, step: int) -> Path:
        return self.directory / (f"step-{step:012d}" + (".zip" if self.archive else ""))

    def entries(self, *, include_uncommitted: bool = False) -> list[RotationEntry]:
        """Entries sorted by step; only committed ones unless ``include_uncommitted``."""
        return list_entries(self.directory, self.keep_best[0] if self.keep_best else None, include_uncommitted)

    def latest(self) -> Path | None:
        """The newest committed entry (never a half-written one), or ``None``."""
        entries = self.entries()
        return entries[-1].path if entries else None

    def best(self) -> Path | None:
        """The committed entry with the best ``keep_best`` metric, or ``None``."""
        best = self._best(self.entries())
        return best.path if best else None

    def _best(self, entries: list[RotationEntry]) -> RotationEntry | None:
        if self.keep_best is None:
            return None
        scored = [e for e in entries if e.metric is not None]
        if not scored:
            return None
        sign = 1.0 if self.keep_best[1] == "max" else -1.0
        return max(scored, key=lambda e: (sign * e.metric, e.step))  # type: ignore[operator]

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

        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        metadata = dict(metadata or {})
        if self.keep_best is not None:
            _metric(metadata.get(self.keep_best[0]), self.keep_best[0], required=True)
        directory_path = self.directory / f"step-{step:012d}"
        path = ckpt.save(directory_path, step=step, metadata=metadata, components=components, **save_kwargs)
        group = _dist.checkpoint_group(getattr(ckpt, "timeout", None))
        error: BaseException | None = None
        target = self.path_for(step)
        if _dist.rank() == 0:
            try:
                if self.archive:
                    from torchrl_dcp.convert import to_archive

                    to_archive(path, target, overwrite=True)
                    _remove(path)
                else:
                    stale = self.directory / f"step-{step:012d}.zip"  # same step saved as an archive before
                    if stale.is_file():
                        stale.unlink()
                self.prune()
            except BaseException as err:
                error = err
        statuses = _dist.all_gather(None if error is None else f"{type(error).__name__}: {error}", group)
        if error is not None:
            raise error if isinstance(error, CheckpointError) else CheckpointError(str(error), path=target) from error
        if statuses[0] is not None:
            raise CollectiveError(f"rank 0 failed while rotating checkpoints: {statuses[0]}", path=target)
        return target

    def prune(self) -> list[Path]:
        """Delete committed entries outside the policy and leftovers of killed saves (run by one process)."""
        entries = self.entries()
        keep = {e.path for e in entries[-self.keep_last :]}
        best = self._best(entries)
        if best is not None:
            keep.add(best.path)
        newest = entries[-1].step if entries else -1
        removed = []
        for e in entries:
            if e.path not in keep:
                _remove(e.path)
                removed.append(e.path)
        for p in self.directory.iterdir() if self.directory.is_dir() else ():
            m = _LEFTOVER.match(p.name)
            if m and int(m.group(1)) < newest:  # a save of an older step that never committed
                _remove(p)
                removed.append(p)
        if removed:
            logger.info("rotation %s removed %s", self.directory, [p.name for p in removed])
        return removed

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

        group = _dist.checkpoint_group(getattr(ckpt, "timeout", None))
        candidates = [(e.step, str(e.path)) for e in reversed(self.entries())] if _dist.rank() == 0 else None
        candidates = _dist.broadcast_from_0(candidates, group)
        for step, path in candidates:
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
            return ResumeInfo(step, Path(path), result)
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


def list_entries(directory: Path, metric: str | None = None, include_uncommitted: bool = False) -> list[RotationEntry]:
    """Step-named entries of ``directory``; committed means a manifest that reads and validates."""
    from torchrl_dcp.storage.source import open_source

    if not directory.is_dir():
        return []
    found: dict[int, RotationEntry] = {}
    for p in directory.iterdir():
        m = _ENTRY.match(p.name)
        if not m or p.is_symlink():
            continue
        is_archive = m.group(2) is not None
        if is_archive != p.is_file():
            continue
        try:
            manifest = open_source(p).manifest()
            committed = True
        except (CheckpointError, OSError):
            manifest, committed = {}, False
        if not committed and not include_uncommitted:
            continue
        entry = RotationEntry(
            step=int(m.group(1)),
            path=p,
            committed=committed,
            archive=is_archive,
            size=_size(p),
            metric=_metric(manifest.get("metadata", {}).get(metric), metric) if metric and committed else None,
            created_at=manifest.get("created_at"),
        )
        old = found.get(entry.step)
        if old is None or (entry.committed, not entry.archive) > (old.committed, not old.archive):
            found[entry.step] = entry  # one entry per step: committed first, a directory over an archive
    return sorted(found.values(), key=lambda e: e.step)


def _metric(value: Any, key: str | None, required: bool = False) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if required:
        raise ValueError(f"keep_best needs a finite number in metadata[{key!r}], got {value!r}")
    return None


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _remove(path: Path) -> None:
    """Delete an entry: renamed aside first, so a crash never leaves a half-deleted committed entry."""
    from torchrl_dcp.storage.commit import remove_tree, trash_path

    if path.name.startswith("."):
        remove_tree(path)
        return
    trash = trash_path(path)
    os.rename(path, trash)
    remove_tree(trash)

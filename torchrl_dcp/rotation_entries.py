"""What a rotation directory holds: its step-named entries, which of them are committed, and their commit order.

:func:`list_entries` reads each ``step-<N>`` (directory or ``.zip``) once through the storage
dispatch: committed means a manifest that reads and validates; anything of the wrong kind (a link,
a FIFO, a directory named ``.zip``) is skipped. :func:`by_commit` orders committed entries by the
rotation's commit counter (the manifest's ``sequence``), then ``created_at``, then step; never by a
node's clock alone. :class:`~torchrl_dcp.CheckpointRotation` builds its retention, ``latest()``,
``best()`` and resume on these.

Example:
    >>> import tempfile
    >>> list_entries(tempfile.mkdtemp())
    []
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    CheckpointVersionError,
)
from torchrl_dcp.format.zipformat import begins_as_written
from torchrl_dcp.storage.backends import location_for
from torchrl_dcp.storage.base import Location
from torchrl_dcp.storage.files import open_regular

_ENTRY = re.compile(r"step-([0-9]{12,})(\.zip)?")


def entry_name_step(name: str) -> tuple[int, bool] | None:
    """``(step, is_archive)`` of a name a rotation gives its entries (``step-<12 digits>``, ``.zip`` for an archive;
    more digits only for steps that need them), else ``None``: another name (``step-5``, ``step-0…06`` with a
    newline, other digits) is never taken for an entry, so never pruned.

    Example:
        >>> entry_name_step("step-000000000042.zip"), entry_name_step("step-42")
        ((42, True), None)
    """
    m = _ENTRY.fullmatch(name)
    if m is None or f"{int(m.group(1)):012d}" != m.group(1):
        return None
    return int(m.group(1)), m.group(2) is not None


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
    error: str | None = None  # why an uncommitted entry is not committed (``include_uncommitted``)
    sequence: int | None = None  # the rotation's commit counter (format 4; absent in older entries)
    #: its manifest is there but damaged (truncated, altered): what a save never leaves (publishing is atomic)
    damaged: bool = False
    #: a checkpoint of a newer format than this library reads (written by a newer torchrl_dcp): never replaced
    newer_format: bool = False
    #: an entry without a counter (a plain ``ckpt.save`` into the directory, or an old one): the largest counter among
    #: the entries listed with it that were created no later than it (``created_at``), the commit it follows
    placed_after: int = 0

    @property
    def commit_key(self) -> tuple[int, float, int]:
        """Sort key of the commit order: the rotation's commit counter, then ``created_at``, then step.

        The counter (manifest ``sequence``) is one more than the largest in the directory
        when a save starts, so the order holds whatever the clocks of the nodes that
        coordinated each save. An entry without one (saved by ``DistributedCheckpoint.save`` rather than the
        rotation, or before counters existed) follows the newest commit created no later than it
        (``placed_after``, :func:`list_entries`); ``created_at`` (seconds, UTC; unreadable: oldest) orders it there.
        """
        return (
            self.sequence if self.sequence is not None else self.placed_after,
            _timestamp(self.created_at),
            self.step,
        )


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


def damaged_entry(location: Location, container: Any, err: BaseException, is_archive: bool) -> bool:
    """Whether the entry at ``location``, whose manifest failed with ``err``, is a checkpoint of ours damaged (its
    manifest there and ours: :meth:`~torchrl_dcp.storage.base.ManifestParts.root_damaged`), or an archive of ours
    that cannot be opened (:func:`_damaged_archive`); an absent manifest (a killed save's prefix, a user's
    directory) or another tool's is not."""
    if container is not None and container.root_damaged(err):
        return True
    return is_archive and location.is_local and _damaged_archive(location.path)


def archive_of_ours(location: Location) -> bool:
    """Whether the archive entry at ``location`` (a ``step-<N>.zip`` regular file) is one of ours, committed or
    damaged: what a save of its step may replace (a user's file of that name is kept)."""
    container = None
    try:
        container = location.container()
        container.root()
    except CheckpointError as err:
        return damaged_entry(location, container, err, True)
    return True


def _damaged_archive(path: Any) -> bool:
    """Whether ``path`` (an entry ``step-<N>.zip`` that could not be opened as an archive) is an archive of ours cut
    short or damaged: a ZIP whose first member is what ``to_archive`` writes first, with the header it writes
    (``zipformat.begins_as_written``: a user's ZIP holding a checkpoint is not)."""
    try:  # (never through a link, never blocking on a FIFO swapped in since it was listed)
        fd = open_regular(path)
    except (CheckpointError, TypeError):
        return False
    try:
        head = os.pread(fd, 128, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return begins_as_written(head, (b".metadata", b"manifest.json"))


def list_entries(
    directory: Location | str | os.PathLike,
    metric: str | None = None,
    include_uncommitted: bool = False,
    *,
    include_damaged: bool = False,
) -> list[RotationEntry]:
    """Step-named entries of ``directory`` sorted by step; committed means a manifest that reads and validates and
    records the step of the entry's name (or none). ``include_damaged``: also the entries whose manifest is there
    but damaged (``damaged``; what a resume tries and warns about) and those of a newer format (``newer_format``;
    what a resume tries and refuses: passed over, the job would train to that step again and fail to save it).

    Each manifest is read once. Entries of the wrong kind (a ``step-N`` that is not a
    checkpoint directory or prefix, a ``step-N.zip`` that is not a regular file, any
    symlink) are skipped; so are entries that vanish while they are read.
    """
    location = directory if isinstance(directory, Location) else location_for(directory)
    found: dict[int, RotationEntry] = {}
    for child in location.children():
        parsed = entry_name_step(child.name)
        if parsed is None:
            continue
        step, is_archive = parsed
        if child.kind != ("archive" if is_archive else "checkpoint"):
            continue  # a symlink, a FIFO, a directory named .zip, an object named step-N: never ours
        error, damaged, newer, container = None, False, False, None
        try:
            container = child.location.container()
            manifest = container.root()  # (its shards are checked when it is loaded: a damaged one falls back)
        except CheckpointVersionError as err:
            manifest, error, newer = {}, f"{type(err).__name__}: {err}", True
        except (CheckpointNotFoundError, CheckpointFormatError, CheckpointIntegrityError) as err:
            manifest, error = {}, f"{type(err).__name__}: {err}"  # absent, damaged: never committed (or broken)
            damaged = damaged_entry(child.location, container, err, is_archive)
        except Exception as err:  # noqa: BLE001 - reading failed (a store's 503, EIO): not a judgement on the entry
            if not include_uncommitted:  # resume, latest, prune: an entry not read is not skipped as damaged
                raise
            manifest, error = {}, f"{type(err).__name__}: {err}"  # (a listing for display shows it)
        recorded = manifest.get("step")
        if error is None and recorded is not None and recorded != step:
            # renamed (or another run's): its name would make resume report, and keep_last rank, another step
            error = f"its manifest records step {recorded}, not {step}: renamed, not this rotation's entry"
        if error is not None and not include_uncommitted and not (include_damaged and (damaged or newer)):
            continue
        size = child.location.size()
        if size is None:
            continue  # removed while listed
        created_at = manifest.get("created_at")
        entry = RotationEntry(
            step=step,
            path=child.location.path,
            committed=error is None,
            archive=is_archive,
            size=size,
            metric=metric_value(manifest.get("metadata", {}).get(metric), metric) if metric and error is None else None,
            created_at=created_at if isinstance(created_at, str) else None,
            error=error,
            sequence=entry_sequence(manifest),
            damaged=damaged,
            newer_format=newer,
        )
        old = found.get(entry.step)
        if old is None or (entry.committed, not entry.archive) > (old.committed, not old.archive):
            found[entry.step] = entry  # one entry per step: committed first, a directory over an archive
    return sorted(_placed(found.values()), key=lambda e: e.step)


def _placed(entries: Iterable[RotationEntry]) -> list[RotationEntry]:
    """``entries``, each committed one without a counter placed after the newest counted commit created no later than
    it: a checkpoint saved into the directory by hand after the rotation's saves is newer than they are (ordered
    first, ``latest()`` passed over it, ``resume`` took an older entry and the next save pruned it)."""
    entries = list(entries)
    counted = sorted((_timestamp(e.created_at), e.sequence) for e in entries if e.committed and e.sequence is not None)
    if not counted:
        return entries
    out = []
    for e in entries:
        if e.committed and e.sequence is None:
            when = _timestamp(e.created_at)
            after = max((seq for at, seq in counted if at <= when), default=0)
            e = dataclasses.replace(e, placed_after=after)
        out.append(e)
    return out


def blocking_entries(location: Location, after: int) -> list[RotationEntry]:
    """The ``step-<N>`` entries of a rotation directory (or prefix), ``N > after``, that a save of their step will
    refuse to replace: not committed, not a damaged checkpoint of ours (a manifest lost, a user's files; in a store,
    also an object at the entry's key). A resume from ``after`` says so then, rather than the job failing at that
    step's save hours later.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> d = Path(tempfile.mkdtemp())
        >>> (d / "step-000000000030").mkdir()
        >>> (d / "step-000000000030" / "notes.txt").write_text("mine")
        4
        >>> [e.step for e in blocking_entries(location_for(d), 20)], blocking_entries(location_for(d), 30)
        ([30], [])
    """
    if not location.is_local:  # (an object store: what its save refuses, asked of each newer entry)
        return sorted(
            (
                RotationEntry(step=step, path=child.location.path, committed=False, archive=False, size=0, error=why)
                for child in location.children()
                if (parsed := entry_name_step(child.name)) is not None
                and not parsed[1]
                and (step := parsed[0]) > after
                and (why := child.location.save_refusal()) is not None
            ),
            key=lambda e: e.step,
        )
    from torchrl_dcp.storage.directory import is_replaceable

    found = [
        e
        for e in list_entries(location, include_uncommitted=True)
        if e.step > after and not e.committed and not e.archive and not e.newer_format and not is_replaceable(e.path)
    ]
    for child in location.children():  # links (and FIFOs...) are no entries: never written through, nor replaced
        parsed = entry_name_step(child.name)
        if parsed is None or parsed[0] <= after:
            continue
        if child.kind == "other" or (child.kind == "archive" and not parsed[1]):  # (a file named like a directory)
            if child.kind == "archive":
                what = "a file, not a checkpoint directory"
            else:
                what = "a symbolic link" if os.path.islink(child.location.path) else "not a directory or regular file"
            found.append(
                RotationEntry(
                    step=parsed[0], path=child.location.path, committed=False, archive=parsed[1], size=0, error=what
                )
            )
    return sorted(found, key=lambda e: e.step)


def check_rotation_directory(location: Location) -> None:
    """Refuse to take a checkpoint (a directory, prefix or archive holding one) or a file as a rotation directory:
    it holds no ``step-<N>`` entries, and a resume from it would start fresh while a checkpoint is there (an easy
    slip: ``resume(ckpt, "ckpts/step-000000001000")``). Nothing there, or a directory of entries, passes.

    Example:
        >>> import tempfile
        >>> check_rotation_directory(location_for(tempfile.mkdtemp()))  # (empty: a fresh start)
    """
    try:
        location.root()
    except CheckpointVersionError as err:  # (a checkpoint all the same: a newer library's)
        raise CheckpointError(
            f"is a checkpoint ({err.message}), not a rotation directory of checkpoints", path=location.path
        ) from None
    except CheckpointError:
        pass  # (none here, the usual case; a damaged one: not a rotation directory either way, left to the listing)
    else:
        raise CheckpointError(
            "is a checkpoint, not a rotation directory of checkpoints: resume from the directory holding its "
            f"step-<N> entries ({location.path.parent}), or load it with DistributedCheckpoint.load",
            path=location.path,
        )
    if location.is_local and os.path.isfile(location.path):
        raise CheckpointError(
            "is a file, not a rotation directory of checkpoints: pass the directory holding the step-<N> entries",
            path=location.path,
        )


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


def metric_value(value: Any, key: str | None, required: bool = False) -> float | None:
    """A metadata value as the finite float retention ranks by; ``None`` (or, ``required``, an error) otherwise."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer past a float's range (valid JSON): no rank to give it
            number = math.inf
        if math.isfinite(number):
            return number
    if required:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ValueError(f"keep_best needs a finite number in metadata[{key!r}], got {shown}")
    return None

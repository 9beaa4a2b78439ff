"""Retention of step-named checkpoints, "latest good one" resolution, and a one-call resume.

``CheckpointRotation(directory, keep_last=N, keep_best=("reward", "max"))`` saves
``<directory>/step-<N, 12 digits>`` (or ``step-<N>.zip`` with ``archive=True``),
commits it before anything older is deleted (rank 0 deletes), and resolves
``latest()`` / ``best()`` from committed manifests only, so a killed save is never
picked. :func:`resume` loads the newest checkpoint that loads, or says to start fresh.

Retention, ``latest()`` and resume follow the **commit order** (the rotation's
commit counter, the manifest's ``sequence``, one more than the largest in the
directory at each save; an entry saved without one follows the newest counted commit
created before it), never the step number nor a node's clock: after a rollback or a
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

import os
import time
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torchrl_dcp import save_decision
from torchrl_dcp._log import get_logger
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    LocalTierWarning,
    StaleCheckpointWarning,
    TorchrlDcpWarning,
)
from torchrl_dcp.format.layout import is_data_file
from torchrl_dcp.format.rank_table import ShardRecords
from torchrl_dcp.json_values import metadata_values
from torchrl_dcp.preemption import PreemptionWatcher
from torchrl_dcp.rotation_entries import (
    RotationEntry,
    archive_of_ours,
    by_commit,
    entry_name_step,
    latest_entry,
    list_entries,
    metric_value,
)
from torchrl_dcp.rotation_local import note_shared, save_local
from torchrl_dcp.rotation_resume import ResumeInfo, group_of, resume_rotation, settle_pending
from torchrl_dcp.save_decision import SaveDecision, check_step
from torchrl_dcp.save_policy import MetricMode, Retention, SaveSchedule, parse_keep_best
from torchrl_dcp.storage.backends import location_for
from torchrl_dcp.storage.base import Location

logger = get_logger(__name__)


def _whole(rotation: Any, entry: RotationEntry) -> bool:
    """Whether ``entry``'s manifest shards are there whole (their sizes and checksums, without parsing them): the
    newest entry a resume found damaged (a shard truncated or deleted) is no base of an incremental save, which
    would read its shards and fail at every save."""
    container = rotation.location.child(entry.path.name).container()
    try:
        shards = list(ShardRecords(container.root()))
        container.check(shards, only=shards)
    except CheckpointError as err:
        logger.warning("%s is damaged (%s): not the base of the next incremental save", entry.path, err)
        return False
    return True


def _committed(location: Any) -> bool:
    try:
        location.root()
    except CheckpointError:
        return False
    return True


def _recorded_step(location: Any) -> Any:
    """The step a committed entry's manifest records (``None``: not readable as one)."""
    try:
        return location.root().get("step")
    except CheckpointError:
        return None


def _check_committed(location: Location) -> None:
    """The entry just committed passes the checks a load runs before it reads any tensor (its manifest and every
    shard, every file present with its size and this save's identity, the storage entries: coverage, bounds,
    inventory), and ``.metadata`` its checksum (what a plain ``dcp.load`` reads; not parsed), or the rotation
    prunes nothing: a checkpoint damaged between its commit and the prune never replaces the good one before it."""
    try:
        src = location.open_source()
        files = src.manifest()["files"]
        src.check([n for n in files if not is_data_file(n)])  # sizes; checksums of .metadata and the shards
        src.check_identity([n for n in files if is_data_file(n)])
        src.dcp_metadata()
    except CheckpointError as err:
        raise CheckpointIntegrityError(
            f"the checkpoint just committed fails a load's checks ({err.message}); no older entry was pruned: "
            "save again, or resume from the previous one",
            path=err.path or location.path,
        ) from None


class CheckpointRotation:
    """Save step-named checkpoints when a policy says so, keep what the retention policy says, resume the newest.

    Args:
        directory: where the ``step-<N>`` entries live (created on first save).
        keep_last: how many of the newest committed entries to keep (``None``: every one).
        keep_best: ``(metadata_key, "max" | "min"[, N])`` (a list works too, as YAML gives): also keep
            the N entries (default 1) whose user metadata holds the best values; every save must then
            pass that metric.
        keep_every: also keep, forever, every entry whose step is a multiple of this (Orbax's ``keep_period``).
        every_steps: :meth:`maybe_save` saves when the step reaches a multiple of this that the
            previous save (or the resume) had not reached.
        every_seconds: :meth:`maybe_save` saves when this many seconds have passed since the previous
            save, on rank 0's clock (every rank saves the same step).
        async_saves: :meth:`maybe_save` saves with :meth:`DistributedCheckpoint.async_save`; the entry is
            converted (``archive``) and older ones pruned in the background after its commit. Call
            :meth:`close` (or :meth:`wait`) before the job ends.
        preemption_signals: signals (``signal.SIGTERM``, ``"SIGUSR1"``) whose arrival on **any** rank makes
            the next :meth:`maybe_save` save synchronously on every rank and set :attr:`preempted`
            (:mod:`torchrl_dcp.preemption`). Installed from the main thread; :meth:`close` restores the
            previous handlers.
        archive: store each entry as one ZIP file (``step-<N>.zip``), converted after commit.
        incremental: save each entry incrementally from the newest committed one (chunk
            files whose rows are unchanged are hard-linked, :mod:`torchrl_dcp.incremental`);
            every entry still stands alone, so pruning never breaks a kept one. Off with
            ``archive=True`` (an archive's members cannot be linked).
        storage_options: fsspec options when ``directory`` is a URL (``s3://bucket/run``; docs/objectstores.md).
        local: a :class:`~torchrl_dcp.LocalTier`: :meth:`maybe_save` also saves to each node's own storage on
            its (more frequent) schedule, with replicas on other nodes, and :meth:`resume` restores from it
            first when it holds a step newer than the shared tier's newest entry, by commit (docs/recovery.md).

    ``save``, ``maybe_save``, ``resume`` and ``load_latest`` are collective (every rank of the
    checkpoint calls them); ``entries``, ``latest`` and ``best`` only read manifests and may be
    called from any rank. See docs/job_loop.md.

    Example:
        >>> import tempfile, torch, torchrl_dcp as tdcp
        >>> ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1))
        >>> rotation = tdcp.CheckpointRotation(tempfile.mkdtemp(), every_steps=10, keep_last=2)
        >>> saved = [step for step in range(1, 41) if rotation.maybe_save(ckpt, step)]
        >>> saved, [e.step for e in rotation.entries()]
        ([10, 20, 30, 40], [30, 40])
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last: int | None = None,
        keep_best: Sequence[Any] | None = None,
        keep_every: int | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        async_saves: bool = False,
        preemption_signals: Iterable[Any] = (),
        archive: bool = False,
        incremental: bool = True,
        storage_options: Mapping[str, Any] | None = None,
        local: Any = None,
    ) -> None:
        checked = Retention(keep_last, keep_every, parse_keep_best(keep_best))  # checks the arguments (as ints)
        keep_last, keep_every = checked.keep_last, checked.keep_every
        if local is not None:
            from torchrl_dcp.local_tier import LocalTier

            if not isinstance(local, LocalTier):
                raise TypeError(f"local must be a tdcp.LocalTier, got {type(local).__name__}")
        self.local = local
        self.schedule = SaveSchedule(every_steps, every_seconds)
        if not isinstance(async_saves, bool):
            raise TypeError(f"async_saves must be True or False, got {async_saves!r}")
        self.location: Location = location_for(directory, storage_options)
        self.directory = self.location.path
        if local is not None and self.location.is_local:
            shared, tier = Path(self.directory).resolve(), local.path.resolve()
            if shared == tier or shared in tier.parents or tier in shared.parents:
                raise ValueError(
                    f"local=LocalTier({str(local.path)!r}) and the rotation's directory {str(self.directory)!r} "
                    "overlap: each tier needs a directory of its own (their entries are both step-N): give the "
                    "local tier a path on the node's own storage, e.g. /dev/shm/<job>"
                )
        if archive and not self.location.holds_archives:
            raise ValueError(
                f"archive=True is for local directories: an {self.location.kind} entry is already one prefix"
            )
        self.keep_last = keep_last
        self.keep_best = keep_best  # type: ignore[assignment]
        self.keep_every = keep_every
        self.async_saves = async_saves
        self.archive = archive
        self.incremental = incremental
        self.preempted = False  # set on every rank once a preemption save has committed
        self._watcher = PreemptionWatcher(preemption_signals) if preemption_signals else None
        self._last_step = 0  # the step last saved or resumed (every_steps counts from it)
        self._resuming = False  # while resume() runs (its Trainer's loads leave the counting to it)
        #: the newest commit sequence this job knows of in the shared tier (listed, or given to a save of its own),
        #: the same on every rank; ``None``: not listed yet. The local tier's records name it: a resume orders the
        #: tiers by it (``local_records.local_is_newer``)
        self._shared_sequence: int | None = None
        self._last_time = time.monotonic()  # when the last save started (rank 0's clock decides)
        self._in_flight: Any = None  # the checkpoint of the async save in flight

    @property
    def keep_best(self) -> tuple[str, MetricMode] | None:
        """``(metadata_key, mode)`` of the ``keep_best`` policy (its count: ``retention.keep_best[2]``)."""
        return None if self._keep_best is None else (self._keep_best[0], self._keep_best[1])

    @keep_best.setter
    def keep_best(self, value: Sequence[Any] | None) -> None:
        self._keep_best = parse_keep_best(value)

    @property
    def retention(self) -> Retention:
        """What :meth:`prune` keeps (from ``keep_last``, ``keep_every`` and ``keep_best``, which may be changed)."""
        return Retention(self.keep_last, self.keep_every, self._keep_best)

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
        """Save ``step`` now (collective, synchronous), then delete what the retention policy no longer keeps.

        The new checkpoint is committed (and, with ``archive=True``, converted and
        published) before any older entry is removed. Returns the entry's path. It counts as the previous save for
        ``every_steps`` / ``every_seconds`` (as ``maybe_save(..., force=True)`` does).
        """
        started = time.monotonic()
        path = self._save(ckpt, step, metadata, components, save_kwargs)
        self._last_step, self._last_time = check_step(step), started
        return path

    def _save(
        self,
        ckpt: Any,
        step: Any,
        metadata: Mapping[str, Any] | None,
        components: Collection[str] | None,
        save_kwargs: dict[str, Any],
        *,
        preempting: bool = False,
    ) -> Path:
        try:
            step = check_step(step)
        except ValueError as err:
            refuse = getattr(ckpt, "_refuse_save", None)
            if refuse is None:
                raise
            self._prepare(ckpt, None, metadata, save_kwargs)  # the exchanges the other ranks make before the save's
            refuse(err)  # its first exchange, as a rank that failed: every rank raises, none waits for this one
        directory_path, metadata, save_kwargs = self._prepare(ckpt, step, metadata, save_kwargs, preempting)
        path = ckpt.save(directory_path, step=step, metadata=metadata, components=components, **save_kwargs)
        return self._rotate(ckpt, path, step)

    def maybe_save(
        self,
        ckpt: Any,
        step: int,
        metadata: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        components: Collection[str] | None = None,
        **save_kwargs: Any,
    ) -> Any:
        """Save ``step`` if a policy makes it due, a preemption signal reached any rank, or ``force`` (collective).

        Every rank takes the same decision at this call (one small collective when a
        preemption signal or ``every_seconds`` is configured; none otherwise). A preemption
        save is synchronous (after waiting for an async save in flight) and sets
        :attr:`preempted` on every rank: the job should then exit. Returns the entry's path,
        the :class:`SaveHandle` of an async save, or ``None`` when nothing was due.

        Example:
            >>> for step in range(start, total):  # doctest: +SKIP
            ...     train_one_step()
            ...     rotation.maybe_save(ckpt, step, {"reward": reward})
            ...     if rotation.preempted:
            ...         break
            >>> rotation.close()  # doctest: +SKIP
        """
        try:
            decision = self.decide(ckpt, step)
        except ValueError as err:
            save_decision.refuse_with_the_savers(self, ckpt, step, err, force, metadata)
            raise
        return self.save_decided(ckpt, decision, metadata, force=force, components=components, **save_kwargs)

    def decide(self, ckpt: Any, step: int) -> SaveDecision:
        """Whether ``step`` is due or a rank was preempted, the same on every rank (collective; see :meth:`maybe_save`)."""
        return save_decision.decide(self, ckpt, step)

    def save_decided(
        self,
        ckpt: Any,
        decision: SaveDecision,
        metadata: Mapping[str, Any] | None = None,
        *,
        force: bool = False,
        sync: bool = False,
        components: Collection[str] | None = None,
        counted: bool = True,
        **save_kwargs: Any,
    ) -> Any:
        """Act on a :meth:`decide` result: save (async when configured, unless ``sync`` or preempted), or nothing.
        ``counted=False``: the save counts toward no schedule (the steps and time of the last save, this rotation's
        and its local tier's, stay as they were: a Trainer's save from inside an iteration)."""
        if counted:
            return self._act(ckpt, decision, metadata, force, sync, components, save_kwargs)
        before = (self._last_step, self._last_time, getattr(self.local, "last_step", None))
        try:
            return self._act(ckpt, decision, metadata, force, sync, components, save_kwargs)
        finally:
            self._last_step, self._last_time = before[:2]
            if self.local is not None:
                self.local.last_step = before[2]

    def _act(
        self,
        ckpt: Any,
        decision: SaveDecision,
        metadata: Mapping[str, Any] | None,
        force: bool,
        sync: bool,
        components: Collection[str] | None,
        save_kwargs: dict[str, Any],
    ) -> Any:
        reserved = None  # the shared commit the local step's records name, when a shared save of the step follows
        if self.local is not None and not decision.preempted and self.local.due(decision.step):
            reserved = save_local(self, ckpt, decision.step, metadata, with_shared=force or decision.due)
        if not (force or decision.due or decision.preempted):
            return None
        try:
            return self._act_shared(ckpt, decision, metadata, components, sync, save_kwargs)
        except BaseException:  # (before its counter was chosen: the next shared commit comes after the local step)
            if reserved is not None:
                self._shared_sequence = max(self._shared_sequence or 0, reserved)
            raise

    def _act_shared(
        self,
        ckpt: Any,
        decision: SaveDecision,
        metadata: Mapping[str, Any] | None,
        components: Collection[str] | None,
        sync: bool,
        save_kwargs: dict[str, Any],
    ) -> Any:
        step, started = decision.step, time.monotonic()
        if decision.preempted:
            try:
                settle_pending(ckpt)  # (its failure raised alike on every rank)
            except CheckpointError as err:  # the job is about to stop: its last save first, the failure said
                warnings.warn(
                    f"the previous async save failed ({err}); the preemption save of step {step} is made now",
                    TorchrlDcpWarning,
                    stacklevel=5,
                )
        if decision.preempted or sync or not self.async_saves:
            path = self._save(ckpt, step, metadata, components, save_kwargs, preempting=decision.preempted)
            self._last_step, self._last_time = step, started  # (a failed save leaves the step due)
            if decision.preempted:
                self.preempted = True
                logger.warning(
                    "preemption (%s on some rank): step %d saved to %s", decision.signal or "a signal", step, path
                )
            return path
        unknown = sorted(
            set(save_kwargs) - {"component_options", "stage_memmap", "incremental_from", "commit_sequence"}
        )
        if unknown:  # before anything is staged or exchanged
            raise TypeError(f"unexpected save arguments: {unknown}")
        directory_path, metadata, save_kwargs = self._prepare(ckpt, step, metadata, save_kwargs)
        handle = ckpt._async_save(
            directory_path, step, metadata, components,
            save_kwargs.pop("component_options", None), save_kwargs.pop("stage_memmap", False),
            save_kwargs.pop("incremental_from", None), save_kwargs.pop("commit_sequence", None),
            then=lambda committed: self._rotate(ckpt, committed, step),
        )  # fmt: skip
        handle.path = self.path_for(step)  # what the save commits (with archive=True, the .zip its directory becomes)
        self._in_flight = ckpt
        self._last_step, self._last_time = step, started
        return handle

    def wait(self) -> Path | None:
        """Block until the async save in flight (if any) is committed and pruned; its path, or ``None``."""
        ckpt, self._in_flight = self._in_flight, None
        return None if ckpt is None else ckpt.wait()

    def close(self) -> None:
        """:meth:`wait`, then restore the signal handlers ``preemption_signals`` replaced (idempotent)."""
        try:
            self.wait()
        finally:
            if self._watcher is not None:
                self._watcher.restore()

    def __enter__(self) -> CheckpointRotation:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _bind_trainer(self, trainer: Any, ckpt: Any) -> None:
        """Called when a torchrl ``Trainer`` built with ``checkpoint_rotation=self`` binds ``ckpt`` (see trainer_loop)."""
        from torchrl_dcp.trainer_loop import bind_trainer

        bind_trainer(self, trainer, ckpt)

    def _prepare(
        self,
        ckpt: Any,
        step: int | None,
        metadata: Mapping[str, Any] | None,
        save_kwargs: dict[str, Any],
        preempting: bool = False,
    ) -> tuple[Path, dict[str, Any], dict[str, Any]]:
        """Check the metric, wait for a save in flight, choose the commit counter and the base (``step``: checked by
        the caller; ``None``: refused on this rank, which makes the same exchanges before raising). ``preempting``:
        a refused metric is recorded as ``null`` (the entry is not ranked), not raised: the job's last save first."""
        metadata = metadata_values(metadata)  # a metric may be a numpy or 0-d tensor scalar
        settle_pending(ckpt)  # a save in flight prunes in its thread: never interleave with its collectives
        if self._in_flight is not None and self._in_flight is not ckpt:  # this rotation's save of another checkpoint:
            settle_pending(self._in_flight)  # committed first, or the next commit took its order and it the newest's
        base, sequence = self._next_commit(ckpt, metadata, preempting)
        save_kwargs = dict(save_kwargs)
        save_kwargs.setdefault("commit_sequence", sequence)
        if (
            self.incremental
            and not self.archive
            and self.location.keeps_files()
            and "incremental_from" not in save_kwargs
        ):
            save_kwargs["incremental_from"] = base
        return self.directory / f"step-{step or 0:012d}", metadata, save_kwargs

    def _rotate(self, ckpt: Any, path: Path, step: int) -> Path:
        """After the commit of ``path``: convert it (``archive``), check it, prune (rank 0; collective)."""
        from torchrl_dcp.collective import run_on_coordinator

        target = self.path_for(step)

        def rotate() -> None:
            stale = self.location.child(f"step-{step:012d}.zip")  # this step saved as an archive before
            if self.location.holds_archives and stale.entry_kind() == "archive":  # (never in a store: no request)
                recorded = _recorded_step(stale)
                if not archive_of_ours(stale):
                    if not self.archive:  # (with archives, to_archive refuses it, naming it)
                        logger.warning("%s: kept, no archive of ours (this step's save is a directory)", stale.path)
                elif recorded is not None and recorded != step:  # (renamed: not this rotation's entry of the step)
                    logger.warning(
                        "%s: kept, it records step %s, not %d (renamed by hand?)", stale.path, recorded, step
                    )
                elif not self.archive or not _committed(stale):  # (a committed one is replaced by to_archive at once)
                    stale.remove()  # (a damaged one: a resume warned about it)
            if self.archive:
                from torchrl_dcp.convert import to_archive

                to_archive(path, target, overwrite=True)
                self.location.child(path.name).remove()
            _check_committed(self.location.child(target.name))  # what replaces the pruned entries must load
            self.prune(protect=target)

        try:
            run_on_coordinator(
                group_of(ckpt), "rotating checkpoints", rotate, monitored=False
            )  # (right after the save)
        except CheckpointError as err:  # (said as what it is: the save stands, the rotation's work after it failed)
            where = f"{err.path}: " if err.path is not None else ""
            raise type(err)(
                f"step {step} was committed at {path}, then rotating checkpoints failed ({where}{err.message}); "
                "latest() and resume see the committed entries as they are, and the entries this rotation would have "
                "pruned are kept until a later save prunes them",
                path=target,
            ) from err
        return target

    def _next_commit(self, ckpt: Any, metadata: dict[str, Any], preempting: bool = False) -> tuple[Path | None, int]:
        """The base of the next incremental save (the newest committed directory entry) and its commit counter.

        Rank 0 chooses and every rank receives its choice, so all ranks agree even when
        another process commits or prunes meanwhile. The counter is one more than the
        largest in the directory. Rank 0 also checks the ``keep_best`` metric of ``metadata`` (its metadata is the
        one the manifest records): a refused metric raises on every rank at once, never on one rank alone.
        """
        from torchrl_dcp.collective import broadcast_step

        def choose() -> tuple[str | None, int, str | None]:
            refused = None
            if self.keep_best is not None:
                try:
                    metric_value(metadata.get(self.keep_best[0]), self.keep_best[0], required=True)
                except ValueError as err:
                    refused = str(err)
            entries = self.entries()
            base = next((e for e in reversed(by_commit(e for e in entries if not e.archive)) if _whole(self, e)), None)
            counter = 1 + max((e.sequence or 0 for e in entries), default=0)
            counter = max(counter, (self._shared_sequence or 0) + 1)  # (after a failed save of its own: not again)
            return (None if base is None else str(base.path)), counter, refused

        chosen, counter, refused = broadcast_step(group_of(ckpt), "choosing the incremental base", choose)
        self._shared_sequence = counter  # (before it commits: a local step saved meanwhile is newer than it)
        if refused is not None and preempting:  # (every rank alike: rank 0's metadata is the one recorded)
            warnings.warn(
                f"{refused}: the preemption save records it as null (the entry is kept as one of the last, not ranked "
                "among the best)",
                TorchrlDcpWarning,
                stacklevel=5,
            )
            metadata[self.keep_best[0]] = None  # type: ignore[index]
        elif refused is not None:  # the same ValueError on every rank, before anything is written
            raise ValueError(refused)
        return (None if chosen is None else self.directory / Path(chosen).name), counter  # a Path, or a StorePath

    def prune(self, *, protect: Path | None = None) -> list[Path]:
        """Delete committed entries outside the policy and leftovers of killed saves (run by one process).

        The policy keeps the ``keep_last`` most recent commits (commit order, not
        step order), every ``keep_every``-th step, the ``keep_best`` entries, and ``protect``
        (the entry :meth:`save` has just committed) whatever its place. Higher steps
        committed before ``protect`` (left by an earlier run, or before a rollback) are
        reported with a warning. Entries removed meanwhile by another process are skipped.
        """
        entries = by_commit(self.entries())
        keep = self.retention.kept(entries, protect)
        if protect is not None:
            self._warn_stale(entries, protect)
        newest = max((e.step for e in entries), default=-1)
        removed = []
        for e in entries:
            if e.path not in keep and self.location.child(e.path.name).remove():
                removed.append(e.path)
        for left in self.location.leftovers():
            owner = entry_name_step(left.owner)  # the entry a leftover of a killed save or conversion was for
            if (
                owner is not None and owner[0] < newest and self.location.remove_leftover(left)
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
        return resume_rotation(self, ckpt, fallback, load_kwargs)

    def _resumed_from(self, step: int, ckpt: Any = None) -> None:
        """A load of ``step`` into ``ckpt`` done outside :meth:`resume` (its bound Trainer's, any way: a roll-back
        too): the save policy counts from it, and the local tier drops its newer steps (an abandoned future: a
        later resume would take them), as after a resume (collective with a local tier)."""
        self._last_step, self._last_time = step, time.monotonic()
        listed = note_shared(self, ckpt if self.local is not None else None)  # (one listing on each rank without)
        newer = sorted({s for s in listed or () if s > step})  # (this run's local steps are saved after them)
        if newer:  # (the newest commit is a resume's: until this run commits, it is the abandoned run's)
            warnings.warn(
                f"checkpoint rotation {self.directory}: a load of step {step} rolled back past its entries of steps "
                f"{newer}; until this run saves (to the shared tier, or to its local tier), a resume takes the last "
                "of them committed (the abandoned run's): save now (rotation.save) to make this run's state the "
                "newest, or remove those entries",
                TorchrlDcpWarning,
                stacklevel=3,
            )
        if self.local is not None and ckpt is not None:
            try:
                self.local.forget_after(ckpt, step)
            except CheckpointError as err:  # (raised alike on every rank: the load itself succeeded)
                warnings.warn(
                    LocalTierWarning(
                        f"local tier {self.local.path}: the steps after step {step}, which the load of step {step} "
                        f"abandoned, could not be dropped ({err}); a resume may take them: delete them, or resume "
                        "from the shared tier with rotation.resume"
                    ),
                    stacklevel=3,
                )


def resume(ckpt: Any, directory: str | os.PathLike, **load_kwargs: Any) -> ResumeInfo | None:
    """Load the latest committed checkpoint under ``directory`` if there is one (collective).

    Returns :class:`ResumeInfo` (``step``, ``path``, ``result``) or ``None`` to start fresh.
    Damaged entries are skipped for the next older one.

    Example:
        >>> info = tdcp.resume(ckpt, "ckpts")  # doctest: +SKIP
        >>> start = 0 if info is None else info.step + 1  # doctest: +SKIP

    When ``ckpt`` is bound to a torchrl ``Trainer`` whose ``checkpoint_rotation`` is a rotation of ``directory``
    (however spelled: a link to it too), that rotation resumes, with its local tier, so its save policy counts from
    the resumed step (a new rotation's would count from 0 and save again at the first iteration).
    """
    rotation = CheckpointRotation(directory, storage_options=getattr(ckpt, "storage_options", None))
    bound = _trainer_rotation(ckpt)
    if bound is not None and _same_directory(bound, rotation):
        rotation = bound
    return rotation.resume(ckpt, **load_kwargs)


def _same_directory(a: CheckpointRotation, b: CheckpointRotation) -> bool:
    """Whether two rotations name one directory: a local one however spelled (a link to it, ``..``), a store's by
    its URL."""
    return a.location.identity() == b.location.identity()


def _trainer_rotation(ckpt: Any) -> CheckpointRotation | None:
    """The rotation of the torchrl Trainer ``ckpt`` is bound to, if it is one of ours."""
    components = getattr(ckpt, "_components", {})
    marker = components.get("trainer_state") if isinstance(components, Mapping) else None
    trainer = getattr(getattr(marker, "value", None), "trainer", None)
    rotation = getattr(trainer, "checkpoint_rotation", None)
    return (
        rotation if isinstance(rotation, CheckpointRotation) and getattr(trainer, "checkpoint", None) is ckpt else None
    )

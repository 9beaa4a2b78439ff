"""A node-local checkpoint tier: frequent saves to each node's own storage, replicas on other nodes.

``CheckpointRotation(directory, ..., local=LocalTier("/dev/shm/run", every_steps=10))``
saves every ``every_steps`` to the local tier besides its own (shared) saves. Each rank writes
its **part** (what it needs to resume alone: the replicated components and its own per-rank
ones) as a torchrl_dcp checkpoint of a world of one under ``path`` on its own node, and sends a
copy to ``replicas`` ranks on other nodes, which keep it in their tier (:mod:`torchrl_dcp.peer_copy`).
Once every part and every replica is durable (one agreement), each node writes the commit
records of the parts it holds: a step without them does not exist for a resume.

:meth:`CheckpointRotation.resume` asks the tier first: every rank lists what its node holds, and
the newest step whose parts are **all** held somewhere (and newer than the shared tier's
newest, by commit) is restored: a rank loads its part from its own node (``ResumeInfo.tier == "local"``), or
receives it from a rank that holds its replica (``"peer"``). A tier of another job (run id, shared
directory) or world size is ignored with a log line. Nothing is restored on any rank before
every rank's part is verified and read; a copy of a part found damaged is passed over for the
part's other copies, then for the next older complete step; any other failure sends every rank to
the shared tier, every rank as it was. Components of placement ``sharded`` are not saved
by the tier (DCP shards them over the whole group).

Layout under ``path`` (one directory per node, shared by the node's ranks)::

    step-<N, 12 digits>/rank-<R, 5 digits>/              rank R's part: a torchrl_dcp checkpoint
    step-<N, 12 digits>/rank-<R, 5 digits>.commit.json    its commit record (JSON)

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1))
    >>> local = tdcp.LocalTier(tempfile.mkdtemp(), every_steps=2)
    >>> rotation = tdcp.CheckpointRotation(tempfile.mkdtemp(), every_steps=10, local=local)
    >>> for step in range(1, 6):
    ...     _ = rotation.maybe_save(ckpt, step)
    >>> local.steps()
    [2, 4]
    >>> rotation.resume(ckpt).tier
    'local'
"""

from __future__ import annotations

import os
import re
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from torchrl_dcp import _dist, load_engine, load_rollback
from torchrl_dcp._gc import gc_paused
from torchrl_dcp._log import get_logger
from torchrl_dcp.collective import differing_steps, run_step
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointVersionError,
    CollectiveError,
    LocalTierWarning,
    from_os_error,
)
from torchrl_dcp.load_plan import LoadPlan
from torchrl_dcp.local_nodes import NodeLayout, abandoned, newest_complete, node_identity
from torchrl_dcp.local_records import (
    RECORD,
    RECORD_TMP,
    HeldPart,
    check_record,
    local_is_newer,
    plain,
    record_name,
    write_record,
)
from torchrl_dcp.peer_copy import exchange_entries
from torchrl_dcp.save_policy import SaveSchedule, as_integer
from torchrl_dcp.storage.commit import remove_entry, sweep_stale_locks
from torchrl_dcp.storage.directory import (
    DirectoryContainer,
    DirectoryLocation,
    is_replaceable,
    refuse_inside_checkpoint,
)
from torchrl_dcp.storage.files import is_real_dir
from torchrl_dcp.storage.urls import local_path

logger = get_logger(__name__)

Tier = Literal["local", "peer", "shared"]
_STEP = re.compile(r"step-([0-9]{12,})")  # (fullmatch: "$" would take a name ending in a newline)
_PART = re.compile(r"rank-[0-9]{5}")


class LocalTier:
    """A node-local tier for :class:`~torchrl_dcp.CheckpointRotation` (``local=``): see the module docstring.

    Args:
        path: a directory on each node's own storage (tmpfs such as ``/dev/shm/<job>``, or a local NVMe);
            the same string on every node, a different directory on each.
        every_steps: save to the tier when the step reaches a multiple of this (far more often than the
            shared tier).
        keep_last: how many local steps each node keeps (at least 1; 2 keeps one while the next is written).
        replicas: on how many other nodes each rank's part is also kept (0: none; capped at nodes - 1).
    """

    def __init__(self, path: str | os.PathLike, *, every_steps: int, keep_last: int = 2, replicas: int = 1) -> None:
        for name, value, least in (
            ("every_steps", every_steps, 1),
            ("keep_last", keep_last, 1),
            ("replicas", replicas, 0),
        ):
            number = as_integer(value)
            if number is None or number < least:
                raise ValueError(f"LocalTier {name} must be an integer of at least {least}, got {value!r}")
        every_steps, keep_last, replicas = (as_integer(v) for v in (every_steps, keep_last, replicas))
        self.path = local_path(path)
        if str(self.path).startswith(("s3:", "gs:", "az:")) or "://" in os.fspath(path):
            raise ValueError(f"LocalTier needs a directory on the node's own storage, got {os.fspath(path)!r}")
        self.every_steps, self.keep_last, self.replicas = every_steps, keep_last, replicas
        self.schedule = SaveSchedule(every_steps, None)
        self.last_step = 0  # the step last saved to the tier or resumed (every_steps counts from it)
        # this run: the step it resumed (-1: a fresh start) and when (rank 0's clock), recorded with every part it
        # saves: a later resume passes over parts an older run saved after which this one rolled back (``abandoned``)
        self.run: tuple[int, float] | None = None
        self._layouts: dict[int, NodeLayout] = {}
        self._warned_replicas = False

    def __repr__(self) -> str:
        return (
            f"LocalTier({str(self.path)!r}, every_steps={self.every_steps}, keep_last={self.keep_last}, "
            f"replicas={self.replicas})"
        )

    def due(self, step: int) -> bool:
        return self.schedule.due_by_steps(step, self.last_step)

    def steps(self) -> list[int]:
        """The steps this node's tier holds committed parts of (any rank's, any job's), sorted."""
        return sorted({p.step for p in self._held(None)})

    def newest_part(
        self, identity: Mapping[str, Any], than: tuple[int, int | None] | None = None
    ) -> tuple[int, Path] | None:
        """``(step, part)`` of the newest step this node holds a committed part of for the job ``identity``
        (:func:`job_identity`), its lowest rank's: what a resume may restore, readable before the job is built (its
        options, a ``config`` component); ``None`` when it holds none, or when ``than``, the shared tier's newest
        entry ``(step, its manifest's sequence)``, is newer (:func:`~torchrl_dcp.local_records.local_is_newer`)."""
        held = self._held(identity)
        runs = {p.resumed for p in held if p.resumed is not None}
        held = [p for p in held if not abandoned(p.step, p.saved_at, runs, p.resumed)]  # (this node's word of runs)
        if not held:
            return None
        newest = max(held, key=lambda p: (p.step, -p.rank))
        if than is not None and not local_is_newer((newest.step, newest.shared_sequence), than):
            return None
        return newest.step, self.path / f"step-{newest.step:012d}" / f"rank-{newest.rank:05d}"

    # ------------------------------------------------------------------ saving
    def save(
        self,
        ckpt: Any,
        step: int,
        metadata: Mapping[str, Any],
        identity: Mapping[str, Any],
        shared_sequence: int = -1,
    ) -> Path:
        """Save this rank's part of ``step`` and its replicas, agree, then record the commit (collective);
        ``shared_sequence``: the newest shared-tier commit the job knows of (``-1``: none known), which the records
        name (a resume orders the tiers by it: :func:`~torchrl_dcp.local_records.local_is_newer`)."""
        group = _group(ckpt)
        rank = _dist.group_rank(group)
        layout = self._layout(group)
        targets, sources = self._peers(layout, rank)
        step_dir = self.path / f"step-{step:012d}"
        own = step_dir / f"rank-{rank:05d}"
        solo = ckpt._solo()
        names = _unsharded(ckpt)

        def write() -> tuple[str, int]:
            failure: Exception | None = None
            try:
                if layout.leader(rank):  # every rank is in this save: none can be writing a newer step now
                    self._drop_newer(step)
                    try:
                        self._make_room(step)
                    except (OSError, CheckpointError) as err:  # the save says whether the room was needed
                        logger.warning("local tier %s: removing steps before %d failed: %s", self.path, step, err)
                _make_dir(self.path)  # the tier's own directory too: never a link to somewhere else
                _make_dir(step_dir)
                for r in (rank, *sources):  # a step saved again: its old records go before its parts change
                    (step_dir / record_name(r)).unlink(missing_ok=True)
                solo.save(
                    own,
                    step=step,
                    metadata={**metadata, "local_tier": self._described(rank, shared_sequence)},
                    components=names,
                )
            except Exception as err:  # raised below, after the peers know
                failure = _own_failure(err, rank, own)
            # the peers are told of a failure instead of waiting for a part that will not come
            try:
                exchange_entries(
                    [(own, t) for t in targets],
                    [(step_dir / f"rank-{s:05d}", s) for s in sources],
                    group,
                    send_error=None if failure is None else f"its own save failed: {failure}",
                )
            except (OSError, CheckpointError):
                if failure is None:
                    raise
            if failure is not None:  # (its own failure says more than what the exchange met after it)
                raise failure
            return uuid.uuid4().hex, step

        written = run_step(group, f"saving step {step} to the local tier {self.path}", write)
        if any(s != step for _, s in written):  # ranks of other steps: their parts are never committed together
            raise differing_steps([s for _, s in written], f"local tier {self.path}", group)
        save_id = written[0][0]
        for r in (rank, *sources):  # every part and replica is durable: this node records what it holds
            try:
                write_record(step_dir, r, step, save_id, identity, shared_sequence)
            except (OSError, CheckpointError) as err:
                logger.warning(
                    "local tier %s: the commit record of rank %d at step %d failed: %s", step_dir, r, step, err
                )
        self.last_step = step
        if layout.leader(rank):  # the node's other ranks may already be writing the next step: older ones only
            try:
                self._prune(keep_from=step)
            except (OSError, CheckpointError) as err:  # the step is committed: a failed prune is the next one's to do
                logger.warning("local tier %s: removing steps older than %d failed: %s", self.path, step, err)
        logger.info("local tier %s: step %d committed (replicas on ranks %s)", self.path, step, targets or "none")
        return own

    def _described(self, rank: int, shared_sequence: int) -> dict[str, Any]:
        """What a part's manifest records of its save (``local_records.HeldPart``)."""
        resumed = None if self.run is None else list(self.run)
        return {"rank": rank, "shared_sequence": shared_sequence, "saved_at": time.time(), "resumed": resumed}

    def _peers(self, layout: NodeLayout, rank: int) -> tuple[list[int], list[int]]:
        if self.replicas > layout.node_count() - 1 and not self._warned_replicas:
            self._warned_replicas = True
            logger.info(
                "local tier %s: %d replica(s) asked on %d node(s): each part is kept on %d other node(s)",
                self.path, self.replicas, layout.node_count(), layout.node_count() - 1,
            )  # fmt: skip
        return layout.targets(rank, self.replicas), layout.sources(rank, self.replicas)

    def _layout(self, group: Any) -> NodeLayout:
        key = id(group)
        if key not in self._layouts:  # one exchange per process: the nodes do not move while it lives
            self._layouts[key] = NodeLayout(tuple(_dist.all_gather(node_identity(), group, "listing the nodes")))
        return self._layouts[key]

    def _prune(self, keep_from: int) -> None:
        """Remove the node's steps older than the ``keep_last`` newest up to ``keep_from`` (that step included).

        Never a newer one: once a save has committed ``keep_from``, the node's other ranks (and the ranks
        that send it replicas) may already be writing the next step. Newer leftovers (an abandoned future,
        a failed save) are removed where no rank can be writing them: :meth:`_drop_newer`.
        """
        older = [s for s in self.steps_on_disk() if s <= keep_from]
        for s in older[: max(len(older) - self.keep_last, 0)]:
            self._remove_step(s)

    def _make_room(self, step: int) -> None:
        """Before ``step`` is written: keep the ``keep_last - 1`` newest committed steps older than it and remove the
        others (a failed save's leftovers too), so that the node never holds more than ``keep_last`` steps, the one
        being written included (docs/recovery.md, Sizing). Every rank of the job is in this save: none is writing
        or reading an older step."""
        committed = set(self.steps())
        older = [s for s in self.steps_on_disk() if s < step]
        kept = set([s for s in older if s in committed][-(self.keep_last - 1) :]) if self.keep_last > 1 else set()
        for s in older:
            if s not in kept:
                self._remove_step(s)

    def _drop_newer(self, step: int | None) -> list[int]:
        """Remove the node's steps newer than ``step`` (``None``: every step); returns those removed.

        Only while every rank of the job is inside the same collective call (a save of ``step`` before its
        agreement, a resume): no rank can be writing a newer step then. A step that cannot be removed (a tier
        mounted read-only) is left, with a :class:`~torchrl_dcp.errors.LocalTierWarning`: a clean-up, never a reason
        to give up the step restored or the save being made.
        """
        removed = []
        for s in self.steps_on_disk():
            if step is None or s > step:
                try:
                    self._remove_step(s)
                    removed.append(s)
                except (OSError, CheckpointError) as err:
                    text = (
                        f"local tier {self.path}: step {s}, newer than the step {step} restored or saved, could not be "
                        f"removed ({err}); remove {self.path / f'step-{s:012d}'} by hand once the tier is writable"
                    )
                    logger.warning("%s", text)
                    warnings.warn(LocalTierWarning(text), stacklevel=3)
        return removed

    def steps_on_disk(self) -> list[int]:
        """The steps of the ``step-<N>`` directories under ``path`` (a link or file planted there is no step)."""
        if not is_real_dir(self.path):  # absent, or a link or file planted in its place: nothing of the tier's
            return []
        try:
            names = os.listdir(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = (m for m in map(_STEP.fullmatch, names) if m and f"{int(m.group(1)):012d}" == m.group(1))
        return sorted(int(m.group(1)) for m in found if is_real_dir(self.path / m.group(0)))  # (names it writes)

    def _remove_step(self, step: int) -> None:
        step_dir = self.path / f"step-{step:012d}"
        try:
            names = os.listdir(step_dir)
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:  # records first: a step half removed is never taken for a committed one
            if RECORD.fullmatch(name) and not is_real_dir(step_dir / name):  # (a directory of that name: not ours)
                (step_dir / name).unlink(missing_ok=True)
        for name in names:  # a killed record write's temporary (``write_file_durably``)
            if RECORD_TMP.fullmatch(name) and not is_real_dir(step_dir / name):
                (step_dir / name).unlink(missing_ok=True)
        for name in names:  # parts it wrote (committed checkpoints), never a directory of the user's of that name;
            part = step_dir / name  # a link planted in a part's place goes (itself: never what it points to)
            if _PART.fullmatch(name) and (part.is_symlink() or is_replaceable(part) or _holds_checkpoint(part)):
                remove_entry(part)  # (a file a user put into a part of ours is kept: remove_tree)
        where = DirectoryLocation(step_dir)
        for left in where.leftovers():  # a killed save's staging and trash, unless that save is running
            if _PART.fullmatch(left.owner):
                where.remove_leftover(left)
        sweep_stale_locks(step_dir)  # parts' locks a killed save left (a live save's stay)
        try:
            step_dir.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # something we did not write is there: left alone, and said
            logger.warning("%s: kept %s, which the local tier never writes", step_dir, sorted(os.listdir(step_dir))[:5])

    def forget_after(self, ckpt: Any, step: int | None) -> None:
        """After a resume from ``step``: every node drops newer steps (an abandoned future; collective)."""
        group = _group(ckpt)
        layout = self._layout(group)
        self.last_step = step or 0

        def drop() -> float:
            if layout.leader(_dist.group_rank(group)) and (removed := self._drop_newer(step)):
                text = (  # (a relaunch on another number of ranks, or a roll-back: never unseen)
                    f"local tier {self.path}: steps {removed} were removed, newer than "
                    + ("the fresh start" if step is None else f"step {step}, the step resumed or loaded")
                    + " (an abandoned future: steps the resume could not take, being of another number of ranks or "
                    "job, incomplete or damaged, or steps a roll-back went past)"
                )
                logger.warning("%s", text)
                warnings.warn(LocalTierWarning(text), stacklevel=4)
            return time.time()

        stamps = run_step(group, f"dropping local steps after step {step}", drop)
        self.run = (-1 if step is None else step, float(stamps[0]))  # (rank 0's clock, on every rank)

    # ------------------------------------------------------------------ resuming
    def resume(
        self,
        ckpt: Any,
        shared: tuple[int, int | None] | None,
        identity: Mapping[str, Any],
        load_kwargs: Mapping[str, Any],
        *,
        fallback: bool = True,
        failed: list[CheckpointError] | None = None,
    ) -> tuple[int, Path, Any, Tier, int] | None:
        """Restore the newest step every rank can obtain from the tier (collective); ``None``: use the shared tier.

        A copy of a part that fails its verified load as damaged (a data file, a shard) is passed over: the
        step is tried again with the part's other copies (replicas on other nodes), then (with ``fallback``;
        without it, :class:`~torchrl_dcp.CheckpointIntegrityError` on every rank, the tier kept) the next older
        complete step, as long as it is not older than ``shared_step``; each try warns, naming the rank and
        the copy. Any other failure sends every rank to the shared tier, and is appended to ``failed``: the
        caller raises it if the shared tier has nothing to resume either (the local steps are then kept).

        ``shared``: the shared tier's newest entry, ``(step, commit sequence)`` (``None``: no entry; a sequence of
        ``None``: not known): a local step is restored only when it is newer (:func:`local_is_newer`)."""
        group = _group(ckpt)
        layout = self._layout(group)
        held = self._listing(identity, group)
        refused: set[tuple[int, str, int, str]] = set()  # (step, save, part's rank, node): copies found damaged
        chosen = newest_complete(held, _dist.group_size(group), refused, layout)
        while chosen is not None:
            if not _newer(chosen, shared):
                logger.info(
                    "local tier %s: step %d was saved before the shared tier's step %d (commit %s)",
                    self.path, chosen[0], *shared,  # type: ignore[misc]
                )  # fmt: skip
                return None
            outcome = self._attempt(ckpt, group, layout, chosen, identity, load_kwargs, failed)
            if not isinstance(outcome, dict):
                return outcome
            step, save_id, _, _ = chosen
            for r, (holder, _) in sorted(outcome.items()):
                refused.add((step, save_id, r, layout.nodes[holder]))
            chosen = newest_complete(held, _dist.group_size(group), refused, layout)
            if not fallback and (chosen is None or chosen[0] != step):  # (every rank knows the same damage)
                raise CheckpointIntegrityError(
                    f"local tier {self.path}: step {step} could not be restored from any copy: "
                    + "; ".join(f"rank {r}'s part is damaged: {why}" for r, (_, why) in sorted(outcome.items()))
                    + "; resume(fallback=False) stops here: nothing was restored and the tier is kept (pass "
                    "fallback=True to resume the previous complete step, or the shared tier's newest entry)",
                    path=self.path / f"step-{step:012d}",
                )
            self._warn_damaged(step, outcome, chosen, shared)
        return None

    def _warn_damaged(
        self,
        step: int,
        damaged: Mapping[int, tuple[int, str]],
        chosen: tuple[int, str, dict[int, list[int]], int] | None,
        shared: tuple[int, int | None] | None,
    ) -> None:
        """Say which parts of ``step`` were found damaged, and what is tried next (``chosen``)."""

        def copy(r: int, h: int) -> str:
            return "its own copy" if h == r else f"the copy on rank {h}'s node, checked where rank {r} received it"

        copies = "; ".join(
            f"rank {r}'s part ({copy(r, h)}) is damaged: {why}" for r, (h, why) in sorted(damaged.items())
        )
        if chosen is None or not _newer(chosen, shared):
            after = "the shared tier is next"
        elif chosen[0] == step:
            after = f"step {step} is tried again with the other copies of those parts"
        else:
            after = f"step {chosen[0]} is next"
        text = f"local tier {self.path}: step {step} could not be restored: {copies}; {after}"
        logger.warning("%s", text)
        warnings.warn(LocalTierWarning(text), stacklevel=5)

    def _attempt(
        self,
        ckpt: Any,
        group: Any,
        layout: NodeLayout,
        chosen: tuple[int, str, dict[int, list[int]], int],
        identity: Mapping[str, Any],
        load_kwargs: Mapping[str, Any],
        failed: list[CheckpointError] | None = None,
    ) -> tuple[int, Path, Any, Tier, int] | dict[int, tuple[int, str]] | None:
        """One try at restoring ``chosen`` (collective): what :meth:`resume` returns, or ``{rank: (holder, why)}``
        of the copies that failed their verified load as damaged (every rank as it was); ``None`` after another
        failure (appended to ``failed``)."""
        rank = _dist.group_rank(group)
        step, save_id, holders, shared_sequence = chosen
        step_dir = self.path / f"step-{step:012d}"
        own = step_dir / f"rank-{rank:05d}"
        source = {r: (r if r in hs else min(hs)) for r, hs in holders.items()}
        sends = [(step_dir / f"rank-{r:05d}", r) for r, h in source.items() if h == rank and r != rank]
        receives = [(own, source[rank])] if source[rank] != rank else []
        tier: Tier = "local" if not receives else "peer"
        solo = ckpt._solo()
        loading: dict[str, Any] = {}

        def prepare() -> str | None:  # every rank's part received, opened, planned, verified and read: nothing changed
            if receives:  # a replaced node's tier is empty: the step's directory comes first
                try:
                    _make_dir(self.path)
                    _make_dir(step_dir)
                    (step_dir / record_name(rank)).unlink(missing_ok=True)  # (a damaged copy is being replaced)
                except (OSError, CheckpointError):
                    pass  # the receive fails on it (after draining what the peer sends) and says why
            unreceived = _exchange_parts(sends, receives, group)
            if unreceived is not None:
                return unreceived
            if layout.leader(rank):  # steps newer than the one restored belong to an abandoned future
                self._drop_newer(step)
            if receives:
                write_record(step_dir, rank, step, save_id, identity, shared_sequence)
            _check_part(own)  # (listed as held while it was a real directory: a link since planted is refused)
            return _read_part(solo, own, load_kwargs, loading)

        def restore(in_place: bool) -> None:
            # the load engine's restore in its two halves, with the ranks' agreement between them as in a load of
            # the whole group: the components read into fresh buffers first (a failure there leaves every object
            # as it was, on every rank), then the tensors read in place and their components (RNG-like ones again)
            plan: LoadPlan = loading["plan"]
            if in_place:
                comps = {n: c for n, c in plan.components.items() if c.in_place or c.restore_last}
                part = replace(plan, components=comps)
                if not (plan.live or any(c.in_place for c in comps.values())):
                    return
            else:
                comps = {n: c for n, c in plan.components.items() if not c.in_place}
                part = replace(plan, components=comps, fresh={**plan.fresh, **plan.live}, live={})
            load_engine.restore(loading["src"], loading["request"], part, loading["result"])

        where = f"step {step} from the local tier {self.path}"
        try:
            with gc_paused():
                found = run_step(group, f"loading {where}", prepare)
                damaged = {r: (source[r], why) for r, why in enumerate(found) if why is not None}
                if damaged:
                    raise _Damaged(f"the parts of ranks {sorted(damaged)} are damaged")
                run_step(group, f"restoring {where}", lambda: restore(False), monitored=False)
                run_step(group, f"reading in place {where}", lambda: restore(True), monitored=False)
        except (CheckpointError, _Damaged) as err:
            # every rank undoes what it planned or restored (restoring a snapshot twice is harmless)
            problems = load_rollback.rollback(list(loading["plan"].components.values())) if "plan" in loading else []
            if isinstance(err, _Damaged) and not problems:
                return damaged
            note = f"; could not roll back {', '.join(problems)}" if problems else ""
            text = f"local tier {self.path}: step {step} could not be restored on every rank ({err}{note})"
            text += "; the shared tier is next"
            logger.warning("%s", text)
            warnings.warn(LocalTierWarning(text), stacklevel=5)  # (as a damaged shared entry is: never unseen)
            if failed is not None and isinstance(err, CheckpointError):
                failed.append(err)
            return None
        self.last_step = step
        logger.info("local tier %s: resumed step %d (%s)", self.path, step, tier)
        return step, own, loading["result"], tier, shared_sequence

    def _held(self, identity: Mapping[str, Any] | None, damaged: list[str] | None = None) -> list[HeldPart]:
        """The committed parts this node holds whose record matches ``identity`` (``None``: any); ``damaged``
        collects those whose record or manifest is damaged (they do not count either)."""
        out, foreign = [], set()
        for step in self.steps_on_disk():
            step_dir = self.path / f"step-{step:012d}"
            try:
                names = os.listdir(step_dir)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                m = RECORD.fullmatch(name)
                if not m:
                    continue
                part = check_record(step_dir, int(m.group(1)), step, identity)
                if isinstance(part, HeldPart):
                    out.append(part)
                elif part is None:
                    foreign.add(step)
                elif damaged is not None:
                    damaged.append(f"step {step} rank {int(m.group(1))}'s part: {part}")
        if foreign and identity is not None:
            logger.info(
                "local tier %s: steps %s hold parts of another job, world size or shared directory: ignored "
                "(delete them to free the space)", self.path, sorted(foreign),
            )  # fmt: skip
        return out

    def _listing(self, identity: Mapping[str, Any], group: Any) -> list[list[tuple[int, int, str]]]:
        """Every rank's list of the committed parts its node holds (collective); parts found damaged on any node
        are warned about on every rank (they do not count: another copy, or an older step, is resumed)."""

        def mine() -> tuple[list[tuple[int, int, str]], list[str]]:
            damaged: list[str] = []
            parts = [plain(p) for p in self._held(identity, damaged)]
            return parts, damaged if self._layout(group).leader(_dist.group_rank(group)) else []

        listed = run_step(group, f"listing the local tier {self.path}", mine)
        said = [f"on rank {r}'s node, {what}" for r, (_, damaged) in enumerate(listed) for what in damaged]
        if said:
            text = f"local tier {self.path}: parts found damaged do not count: {'; '.join(said[:6])}"
            text += f"; and {len(said) - 6} more" if len(said) > 6 else ""
            text += (
                ". A copy of the same step on a peer's node is restored instead where one is complete, else an "
                "older local step or the shared tier (the resume says which)"
            )
            logger.warning("%s", text)
            warnings.warn(LocalTierWarning(text), stacklevel=5)
        return [parts for parts, _ in listed]


def _newer(chosen: tuple[int, str, Any, int], shared: tuple[int, int | None] | None) -> bool:
    """Whether the local step ``chosen`` (:func:`newest_complete`) is to be resumed rather than ``shared``."""
    return shared is None or local_is_newer((chosen[0], chosen[3]), shared)


def _own_failure(err: Exception, rank: int, own: Path) -> Exception:
    """This rank's failure to save its own part, as every rank says it: an ``OSError`` as a ``CheckpointError`` naming
    the part, and this rank's number where the error says rank 0 (the part is saved as a world of one)."""
    if isinstance(err, OSError):
        return from_os_error(err, "saving to the local tier", own)
    if isinstance(err, CheckpointError) and rank:
        err.reword(re.sub(r"\brank 0\b", f"rank {rank}", err.message))
    return err


def _group(ckpt: Any) -> Any:
    if getattr(ckpt, "no_dist", False):
        return None
    return _dist.checkpoint_group(getattr(ckpt, "timeout", None), getattr(ckpt, "process_group", None), "local")


def _unsharded(ckpt: Any) -> list[str]:
    sharded = [n for n in ckpt.components if ckpt.placement(n) == "sharded"]
    if sharded:
        logger.info("local tier: sharded components %s are left to the shared tier", sharded)
    selection = ckpt.save_components
    return [n for n in ckpt.components if n not in sharded and (selection is None or n in selection)]


def tier_identity(ckpt: Any, shared: Any) -> dict[str, Any]:
    """What a local part must match to be restored: the job's run id, world size and shared directory.

    The components are not part of it: a torchrl ``Trainer`` registers some only at its first save, and
    a part is loaded (and its components checked) like any checkpoint; one that does not fit fails the
    load on its rank, which sends every rank to the shared tier.
    """
    return job_identity(_dist.group_size(_group(ckpt)), shared)


def job_identity(world_size: int, shared: Any) -> dict[str, Any]:
    """:func:`tier_identity` of a job of ``world_size`` ranks saving to ``shared`` (before its checkpoint exists):
    the shared location's :meth:`~torchrl_dcp.storage.base.Location.identity` (a job restarted through a link to its
    directory is the same job)."""
    return {"run": os.environ.get("TORCHELASTIC_RUN_ID"), "world_size": world_size, "shared": str(shared)}


def _holds_checkpoint(part: Path) -> bool:
    """Whether ``part`` is a directory holding a checkpoint (ours, with a user's file put into it: its own files are
    removed, the user's kept); a directory of the user's named like a part holds none and stays."""
    if not is_real_dir(part):
        return False
    try:
        DirectoryContainer(part).manifest()
    except CheckpointError:
        return False
    return True


def _make_dir(path: Path) -> None:
    """Create ``path`` (and its parents); what is there must be a directory itself, not a link to one, and never
    inside a checkpoint (refused before anything is made: an entry its manifest does not list would damage it)."""
    refuse_inside_checkpoint(path)
    path.mkdir(parents=True, exist_ok=True)
    if not is_real_dir(path):
        raise CheckpointError(
            "is not a directory (a link or a file was put in its place): refused, never followed; a link of your own "
            "to the tier: pass its resolved path (os.path.realpath) as the LocalTier's",
            path=path,
        )


def _check_part(part: Path) -> None:
    """A part directory must be a real directory, as the tier's and its step directories: a link planted in its
    place (to a directory outside the tier) is refused, never followed."""
    if not is_real_dir(part):
        raise CheckpointError("is not a directory (a link or a file was put in its place): refused", path=part)


def _read_part(solo: Any, own: Path, load_kwargs: Mapping[str, Any], loading: dict[str, Any]) -> str | None:
    """Open, plan, verify and read the part at ``own`` into fresh buffers (``loading`` holds what the restore
    needs); returns why the copy is damaged (its verified load refused it: every rank tries another), else ``None``."""
    request = solo._load_request(own, **load_kwargs)  # (what solo.load(own, ...) would ask)
    result = load_engine.LoadResult(path=request.path)
    try:
        src, plan = load_engine.prepare(request, result)  # a failure here undoes its own plan
        loading.update(src=src, request=request, plan=plan, result=result)
        load_engine.read(src, request, plan.fresh_reads(), plan.verify_inline, result)
    except (CheckpointIntegrityError, CheckpointFormatError) as err:
        if isinstance(err, CheckpointVersionError):
            raise
        return str(err)
    return None


def _exchange_parts(sends: list[tuple[Path, int]], receives: list[tuple[Path, int]], group: Any) -> str | None:
    """Send and receive parts (:func:`~torchrl_dcp.peer_copy.exchange_entries`); returns why the copy this rank was to
    receive could not be had (damaged where it is held: tried no more), else ``None``. A part this rank could not
    send is its receiver's to report (logged here); a broken group raises."""
    try:
        exchange_entries(sends, receives, group)
    except CheckpointError as err:
        if isinstance(err, CollectiveError):
            raise
        if getattr(err, "receiving", False):
            return str(err)
        logger.warning("local tier: sending a part to another rank failed (it tries another copy): %s", err)
    return None


class _Damaged(Exception):
    """A try's parts found damaged on some ranks (every rank knows which): the next copy or step is tried."""

"""How a :class:`~torchrl_dcp.CheckpointRotation` resumes: which tier and entry, the fallbacks, what is said.

The newest step every rank can obtain from any tier: the node-local tier's newest complete step when it is not older
than the shared tier's newest entry (:class:`~torchrl_dcp.LocalTier`), else the newest shared entry that loads. An
entry that proves damaged is skipped with a :class:`~torchrl_dcp.TorchrlDcpWarning` (``fallback=False`` raises
instead), and the local tier is asked again before each older one; starting fresh while entries are there (damaged,
uncommitted, or ``torchrl.checkpoint``'s) is a warning naming them. Every rank loads the same entries: rank 0 lists
them and broadcasts the list.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> rotation = tdcp.CheckpointRotation(tempfile.mkdtemp())
    >>> ckpt = tdcp.DistributedCheckpoint(w={"x": torch.zeros(2)})
    >>> _ = rotation.save(ckpt, step=3)
    >>> resume_rotation(rotation, ckpt, True, {}).step
    3
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchrl_dcp._log import get_logger, user_stacklevel
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
    CheckpointReplacedError,
    CheckpointVersionError,
    CollectiveError,
    TorchrlDcpWarning,
)
from torchrl_dcp.rotation_entries import blocking_entries, by_commit, check_rotation_directory, list_entries

logger = get_logger(__name__)

#: how many times a resume lists the entries again when one it picked was removed meanwhile (another job's prune)
_RELISTS = 3


class _EntryGone(Exception):
    """An entry a resume picked was removed or replaced by another process meanwhile (``error`` says which, on
    every rank): the entries are listed again."""

    def __init__(self, error: CheckpointError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class ResumeInfo:
    """Where a resume came from: the step, the checkpoint path, the :class:`LoadResult` and the tier.

    ``tier`` is ``"shared"`` (the rotation's directory), ``"local"`` (this rank's part in its node's
    :class:`~torchrl_dcp.LocalTier`) or ``"peer"`` (its part received from a rank of another node holding
    its replica); ``path`` is the entry (or, for a local tier, this rank's part) that was loaded.
    """

    step: int
    path: Path
    result: Any
    tier: str = "shared"

    @property
    def loaded(self) -> set[str]:
        """The components restored (``result.loaded``), as the repr shows them."""
        return set(self.result.loaded)

    def __repr__(self) -> str:  # (the result's manifest stays out: printing a resume reads in one line)
        return (
            f"ResumeInfo(step={self.step}, path={str(self.path)!r}, tier={self.tier!r}, "
            f"loaded={sorted(self.result.loaded)!r})"
        )


def resume_rotation(rotation: Any, ckpt: Any, fallback: bool, load_kwargs: dict[str, Any]) -> ResumeInfo | None:
    """What ``rotation.resume(ckpt)`` does (collective): the local tier's newest complete step when it is newer than
    the shared tier's newest entry (by commit: ``local_records.local_is_newer``), else the newest loadable shared entry (asking the local tier again before each
    older one once a newer proved damaged); newer local steps are then forgotten. Starting fresh while entries are
    there is warned about, naming them."""
    from torchrl_dcp import _dist

    rotation._resuming = True  # (its Trainer's loads leave the counting to this resume: note_trainer_load)
    try:
        with _dist.reading():  # (a collective's failure then says nothing was saved)
            return _resume(rotation, ckpt, fallback, load_kwargs)
    finally:
        rotation._resuming = False


def _resume(rotation: Any, ckpt: Any, fallback: bool, load_kwargs: dict[str, Any]) -> ResumeInfo | None:
    from torchrl_dcp.collective import broadcast_step

    settle_pending(ckpt)
    group = group_of(ckpt)
    candidates = broadcast_step(  # rank 0 lists, newest commit first; every rank loads the same entries
        group, "listing checkpoints", lambda: _candidates(_listed(rotation.location))
    )
    rotation._shared_sequence = max((seq or 0 for _, _, seq in candidates), default=0)  # (every rank alike)
    local_resume: Callable[[tuple[int, int | None] | None], ResumeInfo | None] | None = None
    failed: list[CheckpointError] = []  # the local tier's tries that failed but for damage
    if rotation.local is not None:
        from torchrl_dcp.local_tier import tier_identity

        identity = tier_identity(ckpt, rotation.location.identity())

        def local_resume(shared: tuple[int, int | None] | None) -> ResumeInfo | None:
            """The local tier's newest complete step, if newer than the shared entry ``(step, commit sequence)``
            (collective)."""
            found = rotation.local.resume(ckpt, shared, identity, load_kwargs, fallback=fallback, failed=failed)
            if found is None:
                return None
            step, path, result, tier, known = found
            rotation._shared_sequence = max(rotation._shared_sequence, known)  # (a shared save after it: later)
            counted = _counted_step(ckpt, step)
            rotation._last_step, rotation._last_time = counted, time.monotonic()
            # this run is recorded with the parts it saves (the step it goes on from: a Trainer whose counters the
            # load left out goes on from its frames), and newer steps are an abandoned future
            rotation.local.forget_after(ckpt, counted)
            return ResumeInfo(step, path, result, tier)

        info = local_resume(candidates[0][::2] if candidates else None)
        if info is not None:
            return info
    for attempt in range(_RELISTS + 1):
        try:
            info = _resume_shared(rotation, ckpt, candidates, fallback, load_kwargs, local_resume)
            break
        except _EntryGone as gone:  # (every rank agreed: an entry listed is gone, another save pruned it)
            if attempt == _RELISTS:
                raise gone.error from None
            candidates = broadcast_step(group, "listing checkpoints", lambda: _candidates(_listed(rotation.location)))
    if info is None and failed:  # a local step is there, refused but for damage: never a fresh start that drops it
        err = failed[0]
        err.extend(
            "the shared tier holds no entry to resume instead: nothing was restored and the local tier's steps are "
            f"kept; fix the cause and resume again (delete {rotation.local.path} to start fresh)"
        )
        raise err
    if rotation.local is not None and (info is None or info.tier == "shared"):  # newer local steps: an abandoned
        rotation.local.forget_after(ckpt, None if info is None else _counted_step(ckpt, info.step))  # future
    _warn_blocking(rotation, None if info is None else info.step, group)
    return info


def _counted_step(ckpt: Any, step: int) -> int:
    from torchrl_dcp.trainer_binding import counted_step  # (imports torch: the listing tools must not)

    return counted_step(ckpt, step)


def _warn_blocking(rotation: Any, step: int | None, group: Any) -> None:
    """Warn (rank 0) about the entries newer than ``step`` (``None``: a fresh start, any step) that a save of their
    step will refuse to replace; at a fresh start, those the fresh start's own warning did not name (links)."""
    from torchrl_dcp import _dist

    if _dist.group_rank(group) != 0:
        return
    blocking = blocking_entries(rotation.location, -1 if step is None else step)
    if step is None and blocking:
        named = {e.path.name for e in rotation.entries(include_uncommitted=True)}
        blocking = [e for e in blocking if e.path.name not in named]
    if blocking:
        newer = "" if step is None else f" newer than step {step}"
        warnings.warn(
            f"{rotation.directory} holds entries{newer} that are not checkpoints this rotation can "
            "load or replace: "
            + "; ".join(f"{e.path.name} ({e.error})" for e in blocking[:3])
            + ". The save of such a step will be refused (a save never deletes what it did not write): move them "
            "out of the rotation directory (keep your files beside the step directories) before the job gets there",
            TorchrlDcpWarning,
            stacklevel=user_stacklevel(),
        )


def _listed(location: Any) -> list[Any]:
    check_rotation_directory(location)  # (a checkpoint or a file: no entries, a fresh start while one is there)
    return list_entries(location, include_damaged=True)


def _candidates(entries: list[Any]) -> list[tuple[int, str, int | None]]:
    """``(step, path, commit sequence)`` of what a resume tries, in order: the committed entries, newest commit
    first (a sequence of ``None``: not recorded, or unreadable), after the
    damaged ones of a later step (a manifest truncated or altered: loading them fails, and the resume warns and
    falls back, or raises with ``fallback=False``, rather than skip them unseen) and those of a newer format (the
    load raises :class:`~torchrl_dcp.CheckpointVersionError`: upgrade to resume from it)."""
    committed = [(e.step, str(e.path), e.sequence) for e in reversed(by_commit(entries))]
    newest = max((step for step, _, _ in committed), default=-1)
    later = (e for e in entries if (e.damaged or e.newer_format) and e.step > newest)
    damaged = sorted(((e.step, str(e.path), None) for e in later), key=lambda c: c[0], reverse=True)
    return damaged + committed


def torchrl_entries(rotation: Any) -> list[str]:
    """Names of the ``torchrl.checkpoint`` checkpoints in a local rotation directory, sorted."""
    from torchrl_dcp.torchrl_format.detect import is_torchrl_checkpoint

    if not rotation.location.is_local:
        return []
    return sorted(e.name for e in rotation.location.children() if is_torchrl_checkpoint(e.location.path))


def _resume_shared(
    rotation: Any,
    ckpt: Any,
    candidates: list[tuple[int, str, int | None]],
    fallback: bool,
    load_kwargs: dict[str, Any],
    local_resume: Callable[[tuple[int, int | None] | None], ResumeInfo | None] | None = None,
) -> ResumeInfo | None:
    """The newest loadable shared entry; once a newer one proved damaged, the local tier is asked again before
    each older one (``local_resume``): a local step between them is the newest step every rank can obtain (it
    was passed over for the damaged entry, then deleted as newer than the one restored)."""
    from torchrl_dcp import _dist

    group = group_of(ckpt)
    skipped: list[str] = []
    for step, listed, sequence in candidates:
        if skipped and local_resume is not None:
            info = local_resume((step, sequence))
            if info is not None:
                return info
        path = rotation.directory / listed.rsplit("/", 1)[-1]  # the rotation's own path (and storage options)
        try:
            result = ckpt.load(path, **load_kwargs)
        except CheckpointError as err:
            if isinstance(err, CollectiveError) and getattr(err, "failed_rank", None) is None:
                raise  # the exchange itself failed (a rank dead or stuck): no vote on that group, the error names it
            damaged = isinstance(err, (CheckpointIntegrityError, CheckpointFormatError)) and not isinstance(
                err, CheckpointVersionError
            )
            own = None if isinstance(err, CollectiveError) else damaged
            gone = isinstance(err, CheckpointNotFoundError)  # removed (or replaced) since it was listed
            ballots = _dist.all_gather((_users_file(err) or own, gone), group)
            votes = [vote for vote, _ in ballots]
            if any(g for _, g in ballots):  # another job's save pruned it (or saved over it): the entries are listed
                raise _EntryGone(  # again (on every rank)
                    err
                    if gone
                    else CheckpointReplacedError(
                        "was removed or replaced while it was read (another save pruned it, or saved over it)",
                        path=path,
                    )
                ) from err
            users = next((v for v in votes if isinstance(v, str)), None)  # (every rank says it, not only the finder)
            if users:
                raise CheckpointError(
                    f"holds {users!r}, a file no save writes, so it does not load as a checkpoint (loads and verify "
                    "refuse what its manifest does not list). Resuming an older entry would fail when the job saves "
                    "this step again (a save never replaces an entry holding your files): move it out of the entry "
                    "(keep your files beside the step directories) and resume again",
                    path=path,
                ) from None
            if not fallback or any(v is False for v in votes) or not any(votes):
                raise
            skipped.append(f"{path.name} ({err})")
            logger.warning("checkpoint %s is damaged (%s); trying the previous one", path, err)
            warnings.warn(  # (a log line alone is never shown by a job without logging configured)
                f"checkpoint {path} is damaged ({err}); trying the previous one",
                TorchrlDcpWarning,
                stacklevel=user_stacklevel(),
            )
            continue
        logger.info("resumed from step %d (%s)", step, path)
        rotation._last_step, rotation._last_time = _counted_step(ckpt, step), time.monotonic()  # counts from it
        return ResumeInfo(step, path, result)
    if skipped and local_resume is not None:  # every shared entry damaged: any complete local step
        info = local_resume(None)
        if info is not None:
            return info
    foreign = torchrl_entries(rotation)
    # starting fresh while checkpoints are there retrains from scratch: a warning (not a log line, which a job
    # without logging configured never shows)
    if skipped:  # every committed checkpoint was tried and refused
        warnings.warn(
            f"no usable checkpoint in {rotation.directory}: every committed one is damaged ("
            + "; ".join(skipped[:3])
            + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")
            + "): starting fresh; the next saves replace them as the retention policy prunes",
            TorchrlDcpWarning,
            stacklevel=user_stacklevel(),
        )
    elif foreign:  # a run moving from torchrl's rotation
        warnings.warn(
            f"no committed torchrl_dcp checkpoint in {rotation.directory}, but torchrl.checkpoint entries "
            f"({', '.join(foreign[-3:])}): this rotation does not resume from them; load the newest with "
            "ckpt.load(path) (read-only), then save with this rotation. Starting fresh",
            TorchrlDcpWarning,
            stacklevel=user_stacklevel(),
        )
    elif unusable := [e for e in rotation.entries(include_uncommitted=True) if not e.committed]:
        warnings.warn(  # a checkpoint is there but no load would be what it claims
            f"no usable checkpoint in {rotation.directory}: "
            + "; ".join(f"{e.path.name} ({e.error})" for e in unusable[-3:])
            + "; starting fresh",
            TorchrlDcpWarning,
            stacklevel=user_stacklevel(),
        )
    else:
        logger.info("no committed checkpoint in %s: starting fresh", rotation.directory)
    return None


def group_of(ckpt: Any) -> Any:
    """The checkpoint's own group (its ``process_group``'s ranks, ``None`` with ``no_dist``)."""
    if hasattr(ckpt, "_group"):
        return ckpt._group()
    from torchrl_dcp import _dist

    return _dist.checkpoint_group(getattr(ckpt, "timeout", None))


def settle_pending(ckpt: Any) -> None:
    """At a collective call: the save in flight settled alike on every rank (its failure raised on every rank
    unless every rank raised it already), so that no rank skips a call the others make."""
    settle = getattr(ckpt, "_settle_async", None) or getattr(ckpt, "wait", None)  # (a checkpoint of another kind)
    if callable(settle):
        settle()


def _users_file(err: CheckpointError) -> str | None:
    """The name of the file that made a load refuse an entry when no save writes files of that name (a user's
    evaluation results put into a step directory): a resume stops there instead of passing over it."""
    from torchrl_dcp.storage.commit import is_ours

    name = getattr(err, "unlisted", None)
    # (a name ending with "/": a prefix under the entry, e.g. ``__0_shared.distcp/x`` on a store: a user's, too)
    return name if isinstance(name, str) and "/" not in name.rstrip("/") and not is_ours(name) else None

"""A rotation's side of its local tier: the local saves it makes, and the shared commits their records name.

:class:`~torchrl_dcp.CheckpointRotation` saves to its :class:`~torchrl_dcp.LocalTier` first when the tier's schedule
makes a step due (a failure is a warning: a fast-recovery copy, not the job's own). Each local step's commit records
name the newest shared-tier commit the job knows of (``rotation._shared_sequence``), or the one the shared save of
the same step that follows will make: a resume orders the two tiers by it
(:func:`~torchrl_dcp.local_records.local_is_newer`), never by step.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> d = tempfile.mkdtemp()
    >>> rotation = tdcp.CheckpointRotation(d + "/shared", every_steps=4, local=tdcp.LocalTier(d + "/local", every_steps=2))
    >>> note_shared(rotation, None), rotation._shared_sequence  # (nothing committed yet)
    ([], 0)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torchrl_dcp._log import get_logger
from torchrl_dcp.errors import CheckpointError, LocalTierWarning
from torchrl_dcp.json_values import metadata_values
from torchrl_dcp.rotation_resume import group_of
from torchrl_dcp.save_decision import check_step

logger = get_logger(__name__)


def save_local(
    rotation: Any, ckpt: Any, step: int, metadata: Mapping[str, Any] | None, with_shared: bool
) -> int | None:
    """Save ``step`` to the rotation's local tier (``with_shared``: a shared save of the step follows in this call);
    a failure is a warning (every rank hears of it). Returns the shared commit the step's records name when
    ``with_shared`` (``None``: none named, or not saved)."""
    try:
        named = _save(rotation, ckpt, step, metadata, with_shared)
    except CheckpointError as err:
        rotation.local.last_step = step  # tried: the next try comes every_steps later, not each step
        warnings.warn(LocalTierWarning(_failure(rotation, ckpt, step, err)), stacklevel=5)
        return None
    return named if with_shared and named >= 0 else None


def _failure(rotation: Any, ckpt: Any, step: int, err: CheckpointError) -> str:
    """A failed local save, said from this rank (an error of its own part's save names it already)."""
    from torchrl_dcp import _dist

    rank = _dist.group_rank(ckpt._control_group())
    tier = rotation.local
    return (
        f"rank {rank}: step {step} was not saved to the local tier {tier.path} ({err}); the job goes on, the "
        f"shared tier's saves are made as scheduled, and the tier is tried again at step {step + tier.every_steps}."
        f" The tier holds up to keep_last={tier.keep_last} steps of each rank's part and its replicas "
        f"(replicas={tier.replicas}): give it that room (docs/recovery.md, Sizing) or lower keep_last or replicas"
    )


def _save(rotation: Any, ckpt: Any, step: int, metadata: Mapping[str, Any] | None, with_shared: bool) -> int:
    """The local tier's save of ``step``, its records naming the newest shared commit known, or, ``with_shared``,
    the one the shared save of the same step that follows will choose (no later than: a later commit at the same
    step, a roll-back's, is newer than this local step; a shared save that chose more is the same state).
    Returns the commit named (``-1``: none known)."""
    from torchrl_dcp.local_tier import tier_identity

    check_step(step)
    if rotation._shared_sequence is None:  # (the first local save of a run that neither resumed nor saved: once)
        note_shared(rotation, ckpt)  # (not listed: the records name none, and a resume compares the steps)
    named = -1 if rotation._shared_sequence is None else rotation._shared_sequence + with_shared
    identity = tier_identity(ckpt, rotation.location.identity())
    rotation.local.save(ckpt, step, metadata_values(metadata), identity, shared_sequence=named)
    return named


def note_shared(rotation: Any, ckpt: Any) -> list[int] | None:
    """Learn the shared tier's newest commit sequence (rank 0 lists; collective with ``ckpt``, on this rank alone
    without); returns the steps of its entries, or ``None`` when the listing failed (said in the log: the sequence
    stays as it was)."""
    from torchrl_dcp.collective import broadcast_step

    def newest() -> tuple[int, list[int]]:
        entries = rotation.entries()
        return max((e.sequence or 0 for e in entries), default=0), [e.step for e in entries]

    try:
        sequence, steps = newest() if ckpt is None else broadcast_step(group_of(ckpt), "listing checkpoints", newest)
    except (CheckpointError, OSError) as err:  # (every rank alike: the broadcast raises on each)
        logger.warning("checkpoint rotation %s: listing its entries failed: %s", rotation.directory, err)
        return None
    rotation._shared_sequence = max(sequence, rotation._shared_sequence or 0)
    return steps

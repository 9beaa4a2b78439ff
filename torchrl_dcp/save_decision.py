"""A rotation's per-step decision: is ``step`` due, was a rank preempted, the same on every rank.

:meth:`CheckpointRotation.maybe_save <torchrl_dcp.rotation.CheckpointRotation.maybe_save>` decides with
:func:`decide`: locally from the save schedule when nothing needs the ranks to agree, else in one fixed-size
``all_reduce`` (preemption signals: any rank signalled; ``every_seconds``: rank 0's clock) that also compares the
steps and carries a step refused on some rank, so that every rank fails that call alike. Where no exchange is made,
:func:`refuse_with_the_savers` lets a rank that refused its step meet the others at their save, when it can tell
they save.

Example:
    >>> check_step(7), SaveDecision(7, due=True, preempted=False)
    (7, SaveDecision(step=7, due=True, preempted=False, signal=None))
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SaveDecision:
    """What every rank agreed at one ``maybe_save`` call: a policy made ``step`` due, or a rank was preempted."""

    step: int
    due: bool
    preempted: bool
    signal: str | None = None


def check_step(step: Any) -> int:
    """``step`` as an ``int`` (a NumPy integer or 0-d integer tensor converted, as ``save`` does); negative and
    non-integer steps are refused."""
    from torchrl_dcp.arguments import check_step as integral  # (imports torch: the rotation's listing tools must not)

    try:
        value = integral(step)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    return value


def decides_together(rotation: Any, ckpt: Any) -> bool:
    """Whether :func:`decide` exchanges (preemption signals or ``every_seconds``, a checkpoint with a group)."""
    return (rotation._watcher is not None or rotation.schedule.every_seconds is not None) and hasattr(
        ckpt, "_control_group"
    )


def decide(rotation: Any, ckpt: Any, step: Any) -> SaveDecision:
    """Whether ``step`` is due or a rank was preempted, the same on every rank (collective where
    :func:`decides_together`)."""
    from torchrl_dcp import _dist
    from torchrl_dcp.collective import differing_steps, raise_failure

    exchanged = decides_together(rotation, ckpt)
    refused: ValueError | None = None
    try:
        step = check_step(step)
    except ValueError as err:
        if not exchanged:  # (no exchange here: maybe_save meets the savers at their save's, if it can tell)
            raise
        refused, step = err, 0
    watcher = rotation._watcher
    signalled = watcher.signalled if watcher is not None and not rotation.preempted else None
    due = rotation.schedule.due_by_steps(step, rotation._last_step)
    by_time = rotation.schedule.due_by_time(time.monotonic(), rotation._last_time)
    if not exchanged:
        return SaveDecision(step, due or by_time, signalled is not None, signalled)
    group = ckpt._control_group()
    by_time = by_time and _dist.group_rank(group) == 0  # rank 0's clock decides
    phase = "agreeing whether to save"
    (failed, preempted, by_time), same = _dist.agree(
        [refused is not None, signalled is not None, by_time], step, group, phase, monitored=False
    )
    if failed:  # a step refused on some rank: that rank raises its own error, as one process does; the others name it
        try:
            raise_failure(group, phase, refused)
        except BaseException:
            if refused is None:
                raise
        raise refused  # type: ignore[misc]
    if not same:  # (the steps decide a save: ranks of other steps would take other decisions)
        raise differing_steps(_dist.all_gather(step, group, phase, monitored=False, kind="steps"), "maybe_save", group)
    return SaveDecision(step, due or by_time, preempted, signalled)


def refuse_with_the_savers(
    rotation: Any, ckpt: Any, step: Any, err: ValueError, force: bool, metadata: Mapping[str, Any] | None
) -> None:
    """``step``, refused on this rank where :func:`decide` exchanges nothing: when the other ranks save at this
    call (``force``, or the step due by the integer it spells, such as ``2.0``), take part in their save's first
    exchange as a rank that failed, so that every rank raises in this call (else they stayed a call apart). A
    step that spells no integer (``3.5``, ``-1``) cannot say whether they save: raised here alone."""
    refuse = getattr(ckpt, "_refuse_save", None)
    if refuse is None or rotation.local is not None or decides_together(rotation, ckpt):
        return  # (decide raised in its exchange already; a local tier's saves come first: not matched)
    try:
        value = float(step)
    except (TypeError, ValueError, OverflowError):
        value = math.nan
    guess = int(value) if value.is_integer() and value >= 0 else None
    if force or (guess is not None and rotation.schedule.due_by_steps(guess, rotation._last_step)):
        rotation._prepare(ckpt, None, metadata, {})  # the exchanges the savers make before their save's first
        refuse(err)

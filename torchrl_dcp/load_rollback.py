"""Undoing a load that failed: the components restored (or changed while planned) are rolled back, newest first,
and what could not be rolled back is said in the error.

A load restores every component only after every check and read succeeded; a failure while restoring rolls back
those restored before it (:func:`rollback`, through each adapter's snapshot), and a refusal before anything was
restored rolls back only what planning changed (:func:`planned_changes`: a storage allocated for a lazily built
buffer).

Example:
    >>> rollback([])
    []
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrl_dcp._log import get_logger
from torchrl_dcp.collective import raise_if_failed
from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.load_plan import ComponentPlan, LoadPlan, rollback_one

if TYPE_CHECKING:
    from torchrl_dcp.load_engine import LoadResult

logger = get_logger(__name__)


def planned_changes(load_plan: LoadPlan) -> list[ComponentPlan]:
    """The components whose planning may have changed them (:attr:`Adapter.allocates_when_planned`): what a load
    refused before it restores anything rolls back, and nothing else."""
    return [c for c in load_plan.components.values() if c.adapter.allocates_when_planned]


def with_planned(done: list[ComponentPlan], load_plan: LoadPlan) -> list[ComponentPlan]:
    """``done`` and, after them, the components planning changed that were not restored (a storage allocated
    while planning, for a buffer a failure stopped before its turn): what a failed restore rolls back."""
    restored = {id(c) for c in done}
    return done + [c for c in planned_changes(load_plan) if id(c) not in restored]


def rollback(comps: list[ComponentPlan]) -> list[str]:
    """Roll ``comps`` back, newest first; returns what could not be rolled back."""
    return [p for p in (rollback_one(c) for c in reversed(comps)) if p]


def rollback_refused(comps: list[ComponentPlan], err: BaseException) -> None:
    """Roll ``comps`` back after ``err`` refused the load; what could not be rolled back is added to ``err``'s
    message (a :class:`CheckpointError`; other errors are logged with it)."""
    problems = rollback(comps)
    if not problems:
        return
    note = f"could not roll back {', '.join(problems)}"
    if isinstance(err, CheckpointError):
        err.extend(note)
    else:
        logger.error("after %s: %s", type(err).__name__, note)


def fail(
    done: list[ComponentPlan],
    statuses: list[Any],
    own: BaseException | None,
    phase: str,
    result: LoadResult,
    partial: list[ComponentPlan] = (),  # type: ignore[assignment]
    group: Any = None,
) -> None:
    problems = undo(done, result)
    try:
        raise_if_failed(statuses, phase, own, group)
    except CheckpointError as err:
        err.result = result
        notes = []
        if problems:
            notes.append(f"could not roll back {', '.join(problems)}")
        if partial:
            notes.append(f"rows read in place into {sorted(c.name for c in partial)} keep the loaded values")
        if notes:
            err.extend("; ".join(notes))
        raise


def undo(comps: list[ComponentPlan], result: LoadResult) -> list[str]:
    """Roll ``comps`` back and empty ``result`` (nothing was loaded); returns what could not be rolled back."""
    problems = rollback(comps)
    result.loaded.clear()
    result.values.clear()
    return problems


def rollback_and_raise(
    done: list[ComponentPlan], err: BaseException, partial: list[ComponentPlan], result: LoadResult
) -> None:
    problems = undo(done + partial, result)
    note = f"the components restored before it were rolled back; tensors of {sorted(c.name for c in partial)} may hold partly loaded values"
    if problems:
        note += f"; could not roll back {', '.join(problems)}"
    if isinstance(err, CheckpointError):
        err.extend(note)
        err.result = result
    raise err

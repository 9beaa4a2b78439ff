"""Collective steps: run a step on every rank, gather the outcome, raise the same error everywhere.

Every step of a save or load that can fail on one rank goes through :func:`run_step`
(every rank runs it) or :func:`run_on_coordinator` (rank 0 runs it, the others wait
for its outcome). When any rank fails, every rank raises: the failing rank its own
error (a :class:`CheckpointError`, or one wrapping what was raised), the others a
:class:`CollectiveError` naming the failed rank, the step and the error. The outcome
travels over the checkpoint's own gloo group (``_dist``); only our own status
tuples are exchanged, never checkpoint content.

Example (one process: a world of one):
    >>> from torchrl_dcp.collective import run_step
    >>> run_step(None, "counting", lambda: 3)
    [3]
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from torchrl_dcp import _dist
from torchrl_dcp.errors import CheckpointError, CollectiveError

T = TypeVar("T")
Status = tuple[str, str, "str | None"]


def error_status(error: BaseException | None) -> Status | None:
    """What other ranks learn of a failure: ``(type name, message, path)``, or ``None`` for success."""
    if error is None:
        return None
    return (type(error).__name__, getattr(error, "message", None) or str(error), getattr(error, "path", None))


def as_checkpoint_error(error: BaseException, phase: str) -> BaseException:
    """``error`` itself when it is a :class:`CheckpointError` (or not an ``Exception``), else one wrapping it."""
    if isinstance(error, CheckpointError) or not isinstance(error, Exception):
        return error
    wrapped = CheckpointError(f"{phase} failed: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def raise_if_failed(statuses: list[Status | None], phase: str, own: BaseException | None, group: Any = None) -> None:
    """Raise on every rank if any rank failed: a rank re-raises its own error, the others name the first failed rank
    (with its global rank when ``group`` is a subgroup)."""
    if own is not None:
        raise as_checkpoint_error(own, phase)
    for rank, status in enumerate(statuses):
        if status is not None:
            kind, message, path = status
            who = _dist.ranks_named(group, str(rank)) if group is not None else str(rank)
            err = CollectiveError(f"rank {who} failed while {phase}: {kind}: {message}", path=path)
            err.failed_rank = rank  # (its failure was reported: the exchange itself went through)
            raise err


def run_step(group: Any, phase: str, fn: Callable[[], T], *, fallback: Any = None, monitored: bool = True) -> list[T]:
    """Run ``fn()`` on this rank, gather every rank's result, raise everywhere if any rank failed.

    Returns every rank's result, in rank order. ``fallback`` stands for this rank's
    result when it failed (what the others receive before everyone raises).
    """
    error: BaseException | None = None
    try:
        value: Any = fn()
    except BaseException as err:  # reported to every rank below, then re-raised here
        value, error = fallback, err
    gathered = _dist.all_gather((error_status(error), value), group, phase, monitored=monitored, kind="step")
    raise_if_failed([status for status, _ in gathered], phase, error, group)
    return [v for _, v in gathered]


def run_agreed(
    group: Any,
    phase: str,
    fn: Callable[[], T],
    *,
    flag: Callable[[T], bool] | None = None,
    monitored: bool = True,
    alike: Callable[[T], Any] | None = None,
    shown: Callable[[], str] | None = None,
    explain: Callable[[list[Any]], str | None] | None = None,
) -> tuple[T, bool]:
    """Like :func:`run_step`, but every rank learns only whether any rank failed (and the OR of ``flag(result)``).

    Returns this rank's result and that OR. The exchange is one fixed-size ``all_reduce``
    (:func:`torchrl_dcp._dist.agree`), whatever the world size; only when a rank failed are the
    statuses gathered, so that every rank raises naming it, as :func:`run_step` does. ``alike(result)``: a
    JSON-safe description every rank must share (what a load reads and restores), compared by its digest in the same
    exchange; when they differ, they are gathered and every rank raises the same :class:`CheckpointError` naming
    the first rank that differs from rank 0, with ``shown()`` of each (what tells them apart to a user, not compared:
    the path each rank was given). ``explain(descriptions)``: a message of its own for a disagreement it knows (every
    rank's description, in rank order), else ``None``.

    Example (one process):
        >>> run_agreed(None, "counting", lambda: 3, flag=lambda n: n > 2)
        (3, True)
    """
    error: BaseException | None = None
    value: Any = None
    try:
        value = fn()
    except BaseException as err:  # reported to every rank below, then re-raised here
        error = err
    mine = error is None and flag is not None and bool(flag(value))
    description = alike(value) if alike is not None and error is None else None
    digest = zlib.crc32(json.dumps(description, sort_keys=True).encode())
    (failed, any_flag), same = _dist.agree([error is not None, mine], digest, group, phase, monitored=monitored)
    if failed:
        raise_failure(group, phase, error)
    if not same:
        context = shown() if shown is not None else None
        described = _dist.all_gather((description, context), group, phase, monitored=False, kind="described")
        rank = next(r for r, (d, _) in enumerate(described) if d != described[0][0])
        explained = explain([d for d, _ in described]) if explain is not None else None
        if explained is not None:
            raise CheckpointError(f"{phase}: {explained}")

        def told(r: int) -> str:
            d, where = described[r]
            return f"rank {_dist.ranks_named(group, str(r))}: {where + ', ' if where else ''}{d}"

        raise CheckpointError(
            f"{phase}: the ranks do not agree ({told(0)}; {told(rank)}): every rank must call it with the same "
            "checkpoint and the same components; nothing was changed"
        )
    return value, any_flag


def scatter_step(group: Any, phase: str, fn: Callable[[], list[T]], *, rank: int | None = None) -> T:
    """Run ``fn()`` on rank 0 (one value per rank) and hand each rank its own; every rank raises if it failed.

    What a rank receives is its part, not every rank's (unlike :func:`broadcast_step`). No monitored
    barrier: for a step between two exchanges of the same checkpoint call.
    """
    size = _dist.group_size(group)

    def split() -> list[Any]:
        values = list(fn())
        if len(values) != size:
            raise ValueError(f"{phase}: {len(values)} parts for {size} ranks")
        return values

    values, error = _on_rank_0(group, rank, split)
    parts = None if values is None and error is None else [(error_status(error), v) for v in values or [None] * size]
    status, value = _dist.scatter_from_0(parts, group, phase, monitored=False, kind="scattered step")
    raise_if_failed([status], phase, error, group)
    return value


def _on_rank_0(group: Any, rank: int | None, fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """``fn()``'s result on rank 0 (``None`` elsewhere) and the error it raised there, if any."""
    if (_dist.group_rank(group) if rank is None else rank) != 0:
        return None, None
    try:
        return fn(), None
    except BaseException as err:  # reported to every rank by the caller, then re-raised here
        return None, err


def failures(failure: BaseException | None, group: Any, phase: str) -> list[Status | None] | None:
    """Every rank's status when any rank failed (gathered only then), else ``None``: one fixed-size exchange, no
    barrier (for a step inside a checkpoint call, whose caller decides how to undo and raise)."""
    (failed,), _ = _dist.agree([failure is not None], 0, group, phase, monitored=False)
    return _dist.all_gather(error_status(failure), group, phase, monitored=False, kind="statuses") if failed else None


def raise_failure(group: Any, phase: str, error: BaseException | None) -> None:
    """Some rank failed at ``phase`` (every rank knows it): gather the statuses, raise on every rank naming it."""
    statuses = _dist.all_gather(error_status(error), group, phase, monitored=False, kind="statuses")
    raise_if_failed(statuses, phase, error, group)
    raise CollectiveError(f"a rank failed while {phase}")  # (not reached: a rank reported its failure)


def run_on_coordinator(
    group: Any, phase: str, fn: Callable[[], T], *, rank: int | None = None, monitored: bool = True
) -> T | None:
    """Run ``fn()`` on rank 0 only; every rank raises if it failed. Returns rank 0's result (``None`` elsewhere).

    Only rank 0's status travels (a broadcast): the others have nothing to report."""
    value, error = _on_rank_0(group, rank, fn)
    status = _dist.broadcast_from_0(error_status(error), group, phase, monitored=monitored, kind="coordinator status")
    raise_if_failed([status], phase, error, group)
    return value


def broadcast_step(
    group: Any, phase: str, fn: Callable[[], T], *, rank: int | None = None, monitored: bool = True
) -> T:
    """Run ``fn()`` on rank 0 and hand its result to every rank; every rank raises if it failed.

    ``monitored=False`` skips the monitored barrier (``_dist``): for a step between two exchanges
    of the same checkpoint call, where no rank can be elsewhere."""
    value, error = _on_rank_0(group, rank, fn)
    status, value = _dist.broadcast_from_0(
        (error_status(error), value), group, phase, monitored=monitored, kind="broadcast step"
    )
    raise_if_failed([status], phase, error, group)
    return value


def differing_steps(steps: list[int], where: str, group: Any = None) -> CheckpointError:
    """The error of a collective call whose ranks passed different ``steps`` (by rank of ``group``): it names the
    first rank that differs from rank 0 (with its global rank, in a subgroup).

    Example:
        >>> print(differing_steps([20, 20, 23], "maybe_save").message.split(":")[1])
         rank 2 passed step 23, rank 0 step 20
    """
    rank = next(r for r, s in enumerate(steps) if s != steps[0])
    named = _dist.ranks_named(group, str(rank)) if group is not None else str(rank)
    first = _dist.ranks_named(group, "0") if group is not None else "0"
    return CheckpointError(
        f"{where}: rank {named} passed step {steps[rank]}, rank {first} step {steps[0]}: every rank must pass "
        "the same step (a count every rank shares: the iteration, or frames summed over the ranks); "
        "nothing was saved"
    )


def refused_on_every_rank(group: Any, err: BaseException, join: Callable[[Callable[[], Any]], Any]) -> NoReturn:
    """Raise ``err``, an argument this rank refused at the call, after taking part in the call's first exchange as
    a rank that failed (``join(fail)``): the other ranks, already in it, raise naming this rank, instead of waiting
    for it (and pairing with its next call: every later save and load then failed)."""
    if group is not None and _dist.group_size(group) > 1:

        def fail() -> Any:
            raise err

        try:
            join(fail)
        except BaseException:  # noqa: BLE001 - this rank's own error is raised, as a single process raises it
            pass
    raise err

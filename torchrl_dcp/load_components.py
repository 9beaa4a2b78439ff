"""Which components a load restores and which it skips: the request against the checkpoint's components.

What the checkpoint lacks or holds beyond the request (said by the ranks that would lose something), the
``component_options`` a rank gives for another rank's per-rank component, and the refusal of a reshard some new ranks
do not take their part of.

Example:
    >>> unshared_parts("ckpt", [{"save": "a", "shared_out_by_the_reshard": ["rb"]}, {"save": "a"}])[:48]
    "ckpt: a reshard shares the transitions of ['rb']"
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchrl_dcp.adapters.trainer_rank_state import TRAINER_RANK_STATE, TRAINER_STATE, NoLogger
from torchrl_dcp.errors import CheckpointError, InexactResumeWarning, UnrestoredComponentWarning
from torchrl_dcp.placement import is_absent_skeleton

if TYPE_CHECKING:
    from torchrl_dcp.load_engine import LoadRequest, LoadResult


def refuse_options_elsewhere(request: LoadRequest, saved: Mapping[str, Any]) -> None:
    """``component_options`` may name a component this rank did not register only where the checkpoint holds it as
    a per-rank one (a logger, an evaluation hook of another rank's): any other name is refused (on every rank)."""
    unknown = [n for n in request.options_elsewhere if (saved.get(n) or {}).get("placement") != "per_rank"]
    if unknown:
        raise CheckpointError(
            f"component_options names {unknown}, which this rank did not register and the checkpoint holds no per-rank "
            "component of that name: register them, or leave them out of component_options; nothing was changed",
            path=request.path,
        )


def unshared_parts(path: Any, described: list[Any]) -> str | None:
    """The refusal of a reshard whose shared-out components (a replay buffer's transitions) some new ranks do not
    load (not registered, or incompatible there): their parts would be lost. ``None`` for any other
    disagreement (``described``: every rank's description, from :func:`prepare`)."""
    key = "shared_out_by_the_reshard"
    if not all(isinstance(d, Mapping) for d in described):
        return None
    rest = [{k: v for k, v in d.items() if k != key} for d in described]
    shared = [set(d.get(key, ())) for d in described]
    if any(r != rest[0] for r in rest) or all(s == shared[0] for s in shared):
        return None  # (another difference, the checkpoint itself: the general refusal names it)
    names = sorted(set().union(*shared))
    without = {n: [r for r, s in enumerate(shared) if n not in s] for n in names}
    where = "; ".join(f"{n!r} on ranks {ranks}" for n, ranks in without.items() if ranks)
    return (
        f"{path}: a reshard shares the transitions of {names} out among every new rank, and some ranks do not load "
        f"them ({where}: not registered there, or incompatible: see the warnings there), so their parts would be "
        "lost: register them on every rank, each with room for its part (or resume with the saved number of ranks, "
        "or leave them out on every rank: components=[...]); nothing was changed"
    )


def restored_elsewhere(name: str, registered: Any, saved: Mapping[str, Any]) -> bool:
    """Whether an optional component a checkpoint lacks loses nothing: a Trainer's ``trainer_rank_state`` where the saved
    ``trainer_state`` holds ``_last_log`` (saved before it moved, or by torchrl), a :class:`NoLogger` (nothing to
    restore)."""
    return isinstance(getattr(registered, "value", None), NoLogger) or (
        name == TRAINER_RANK_STATE and TRAINER_STATE in saved
    )


def compare_components(
    request: LoadRequest,
    result: LoadResult,
    saved: Mapping[str, Any],
    *,
    stacklevel: int = 7,
    saved_world_size: int | None = None,
) -> None:
    """What the checkpoint lacks (``missing``) and holds beyond the request (``unrequested``); the latter is warned
    about (:class:`UnrestoredComponentWarning`, at the caller's ``load``: ``stacklevel`` frames up) unless the caller
    chose the components: by rank 0, and at the saved world size (``saved_world_size``) by each rank that skips a
    per-rank state it saved itself (rank 0 does not read the others' states)."""
    result.missing = {n for n in request.requested if n not in saved}
    result.unrequested = set(saved) - set(request.requested)
    optional = {n for n in result.missing if getattr(request.registered.get(n), "optional", False)}
    if optional:  # what the library registered itself, absent from a checkpoint saved before it did: not an error
        result.missing -= optional
        kept = sorted(n for n in optional if not restored_elsewhere(n, request.registered[n], saved))
        if kept and request.rank == 0:
            warnings.warn(
                InexactResumeWarning(
                    f"{request.path}: the checkpoint holds no state for {kept} (hooks the Trainer runs "
                    "only through register_op, saved since torchrl_dcp registers them; this checkpoint was saved "
                    "before, or by torchrl): they keep their current state"
                ),
                stacklevel=stacklevel,
            )
    skipped = sorted(n for n in result.unrequested if _skipped_here(saved[n], request, saved_world_size))
    if skipped and not request.chosen:
        where = f"rank {request.rank}: " if request.world_size > 1 else ""
        warnings.warn(
            UnrestoredComponentWarning(
                f"{request.path}: {where}the checkpoint holds components no object is registered for, which this "
                f"load skips: {skipped}; register them before loading, or pass components=[...] to choose what to "
                "restore"
            ),
            stacklevel=stacklevel,
        )


def _skipped_here(rec: Any, request: LoadRequest, saved_world_size: int | None) -> bool:
    """Whether this rank warns that its load skips the saved component ``rec``: at the saved world size, a per-rank
    one where this rank saved a state of its own (not :data:`~torchrl_dcp.placement.ABSENT_SKELETON`: a logger of
    another rank's); any other, on rank 0."""
    if not (isinstance(rec, Mapping) and rec.get("placement") == "per_rank" and saved_world_size == request.world_size):
        return request.rank == 0
    own = (rec.get("ranks") or {}).get(str(request.rank))
    return not (isinstance(own, Mapping) and is_absent_skeleton(own.get("state")))

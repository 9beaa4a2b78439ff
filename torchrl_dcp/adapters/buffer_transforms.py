"""State that a replay buffer's transforms hold between ``extend`` calls, saved with the buffer.

A ``MultiStepTransform`` (n-step returns) keeps the last ``n_steps`` transitions of each ``extend`` back until the
next one completes their returns; that TensorDict lives on the transform, not in the storage, so a restore lost
them (the next ``extend`` then wrote other transitions than an uninterrupted run). The buffer adapter saves each
such transform's held-back data by its place in the buffer's ``Compose``, and puts it back at load.

Example:
    >>> import torch
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> from torchrl.envs.transforms import MultiStepTransform
    >>> rb = ReplayBuffer(storage=LazyTensorStorage(8), transform=MultiStepTransform(n_steps=3, gamma=0.9))
    >>> transform_states(rb)  # nothing held back yet
    {'0': {'kind': 'multi_step', 'held': None}}
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from torchrl.envs.transforms import MultiStepTransform

from torchrl_dcp.adapters.base import AdapterContext
from torchrl_dcp.adapters.env_transforms import STATELESS_TRANSFORMS
from torchrl_dcp.adapters.tensordict import tensordict_from_state, tensordict_state
from torchrl_dcp.errors import IncompatibleComponentError, InexactResumeWarning


def _held_transforms(rb: Any) -> dict[str, MultiStepTransform]:
    """``{position in the buffer's Compose: transform}`` of the transforms that hold data back."""
    transform = getattr(rb, "_transform", None)
    children = list(getattr(transform, "transforms", None) or ([] if transform is None else [transform]))
    return {str(i): t for i, t in enumerate(children) if isinstance(t, MultiStepTransform)}


def unsaved_transforms(rb: Any) -> list[str]:
    """``"position (Class)"`` of each transform of ``rb`` not verified exact in a buffer: any but
    ``MultiStepTransform`` (its held items saved), ``Compose`` (its children are looked at) and torchrl's stateless
    transforms. (The buffer saves its transform's module state, parameters and buffers, as ``state_dict`` gathers
    them; what a transform keeps elsewhere is not saved.)

    Example:
        >>> from torchrl.data import ReplayBuffer
        >>> from torchrl.envs.transforms import Compose, RewardScaling, VecNormV2
        >>> rb = ReplayBuffer(transform=Compose(RewardScaling(0.0, 2.0), VecNormV2(in_keys=["obs"])))
        >>> unsaved_transforms(rb)
        ['1 (VecNormV2)']
    """
    transform = getattr(rb, "_transform", None)
    out: list[str] = []
    stack = [("", transform)] if transform is not None else []
    while stack:
        where, t = stack.pop(0)
        klass = type(t)
        torchrl = (klass.__module__ or "").startswith("torchrl.")
        if torchrl and klass.__name__ == "Compose":
            stack.extend((f"{where}.{i}" if where else str(i), c) for i, c in enumerate(t.transforms))
        elif not (isinstance(t, MultiStepTransform) or (torchrl and klass.__name__ in STATELESS_TRANSFORMS)):
            out.append(f"{where or 'transform'} ({klass.__name__})")
    return out


def warn_unsaved_transforms(rb: Any, name: str, action: str) -> None:
    """An :class:`~torchrl_dcp.errors.InexactResumeWarning` naming what :func:`unsaved_transforms` lists."""
    found = unsaved_transforms(rb)
    if found:
        warnings.warn(
            f"component {name!r} ({action}): the replay buffer's transform(s) at {', '.join(found)} are not verified "
            "exact in a buffer: their module state (parameters, buffers) is saved with the buffer, state kept "
            "elsewhere (a state_dict of their own inside a Compose, Python attributes, lazily built statistics) is "
            "not, so samples after a restore may differ; register such a transform as a component of its own",
            InexactResumeWarning,
            stacklevel=3,
        )


def transform_states(rb: Any) -> dict[str, Any]:
    """What each data-holding transform of ``rb`` holds now (empty when it has none)."""
    return {
        where: {"kind": "multi_step", "held": None if t._buffer is None else tensordict_state(t._buffer)}
        for where, t in _held_transforms(rb).items()
    }


def held_back_counts(saved: Mapping[str, Any]) -> dict[str, int]:
    """``{position: number of transitions}`` that saved :func:`transform_states` hold back (none: empty)."""
    out: dict[str, int] = {}
    for where, state in saved.items():
        held = state.get("held") if isinstance(state, Mapping) else None
        if held is not None:
            size = held.get("batch_size") if isinstance(held, Mapping) else None
            out[where] = int(size[0]) if isinstance(size, (list, tuple)) and size else -1
    return {w: n for w, n in out.items() if n != 0}


def check_transform_layout(rb: Any, saved: Mapping[str, Any], ctx: AdapterContext) -> None:
    """The buffer's data-holding transforms sit where the checkpoint's did (else ``IncompatibleComponentError``)."""
    live = _held_transforms(rb)
    if set(saved) != set(live):
        raise IncompatibleComponentError(
            f"component {ctx.name!r}: the checkpoint holds the state of the buffer's n-step transforms at "
            f"{sorted(saved)}, the buffer has them at {sorted(live)}: build it with the transforms it was saved with"
        )


def restore_transform_states(rb: Any, saved: Mapping[str, Any], ctx: AdapterContext) -> None:
    """Put back what :func:`transform_states` saved (checkpoints saved before hold nothing to put back)."""
    check_transform_layout(rb, saved, ctx)
    live = _held_transforms(rb)
    for where, state in saved.items():
        held = state.get("held") if isinstance(state, Mapping) else None
        live[where]._buffer = None if held is None else tensordict_from_state(held, ctx)

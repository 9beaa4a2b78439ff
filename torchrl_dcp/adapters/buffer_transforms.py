"""State that a replay buffer's transforms hold between ``extend`` calls, saved with the buffer.

A ``MultiStepTransform`` (n-step returns) keeps the last ``n_steps`` transitions of each ``extend`` back until the
next one completes their returns; that TensorDict lives on the transform, not in the storage, so a restore lost
them (the next ``extend`` then wrote other transitions than an uninterrupted run). The buffer adapter saves each
such transform's held-back data by its place in the buffer's ``Compose``, and puts it back at load.

Example:
    >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
    >>> from torchrl.envs.transforms import MultiStepTransform
    >>> rb = ReplayBuffer(storage=LazyTensorStorage(8), transform=MultiStepTransform(n_steps=3, gamma=0.9))
    >>> transform_states(rb)  # nothing held back yet
    {'0': {'kind': 'multi_step', 'held': None}}
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torchrl.envs.transforms import MultiStepTransform

from torchrl_dcp.adapters.base import AdapterContext
from torchrl_dcp.adapters.env_transforms import STATELESS_TRANSFORMS
from torchrl_dcp.adapters.tensordict import tensordict_from_state, tensordict_state
from torchrl_dcp.errors import CheckpointIntegrityError, IncompatibleComponentError, InexactResumeWarning


def _held_transforms(rb: Any) -> dict[str, MultiStepTransform]:
    """``{position: transform}`` of the transforms that hold data back, in the buffer's ``Compose`` however nested
    (``"1"``: its second child; ``"0.1"``: the second child of its first, a ``Compose``; a bare transform: ``"0"``)."""
    transform = getattr(rb, "_transform", None)
    children = list(getattr(transform, "transforms", None) or ([] if transform is None else [transform]))
    found: dict[str, MultiStepTransform] = {}
    stack = [(str(i), t) for i, t in enumerate(children)]
    while stack:
        where, t = stack.pop(0)
        if isinstance(t, MultiStepTransform):
            found[where] = t
        elif type(t).__name__ == "Compose" and isinstance(getattr(t, "transforms", None), Iterable):
            stack.extend((f"{where}.{i}", c) for i, c in enumerate(t.transforms))
    return found


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


def check_held_states(rb: Any, saved: Mapping[str, Any], storage: Any, name: str) -> None:
    """While a load is planned (tensors as :class:`~torchrl_dcp.format.codec.TensorSpec`): what each n-step transform
    holds back fits it and the saved ``storage`` state's rows (:func:`_check_held`), before any row is read."""
    from torchrl_dcp.adapters.buffer_state import flatten
    from torchrl_dcp.adapters.tensordict import meta_tensordict

    live = _held_transforms(rb)
    rows = None
    if isinstance(storage, Mapping) and storage.get("initialized") is True and type(storage.get("ndim")) is int:
        ndim = storage["ndim"]
        rows = {
            key: (spec.dtype, tuple(spec.shape[ndim:]))
            for key, spec in flatten(storage.get("data")).items()
            if hasattr(spec, "dtype") and hasattr(spec, "shape")
        }
    for where, state in saved.items():
        held = state.get("held") if isinstance(state, Mapping) else None
        if held is not None and where in live:
            where_text = f"component {name!r}: its n-step transform {where}"
            _check_held(live[where], meta_tensordict(held), rows, where_text)


def restore_transform_states(rb: Any, saved: Mapping[str, Any], ctx: AdapterContext) -> None:
    """Put back what :func:`transform_states` saved (checkpoints saved before hold nothing to put back), each held
    TensorDict checked as the transform's next ``extend`` will use it (:func:`_check_held`) before any is set."""
    check_transform_layout(rb, saved, ctx)
    live = _held_transforms(rb)
    restored = {}
    for where, state in saved.items():
        held = state.get("held") if isinstance(state, Mapping) else None
        restored[where] = None if held is None else tensordict_from_state(held, ctx)
        if restored[where] is not None:
            _check_held(live[where], restored[where], None, f"component {ctx.name!r}: its n-step transform {where}")
    for where, held in restored.items():
        live[where]._buffer = held


def _check_held(transform: MultiStepTransform, held: Any, rows: Mapping[Any, Any] | None, where: str) -> None:
    """What a ``MultiStepTransform`` holds back is at most ``n_steps`` transitions along its last batch dimension
    (``data[..., -n_steps:]``), with the entries, dtypes and shapes of what the live transform holds (when it holds
    something), else of the buffer's saved rows (``rows``: ``{key path: (dtype, shape of one item)}``, the entries
    both have): the next ``extend`` concatenates it with new data and writes it into the buffer."""
    if not held.batch_dims or held.batch_size[-1] > transform.n_steps:
        raise CheckpointIntegrityError(
            f"{where} holds back transitions of batch size {list(held.batch_size)}, more than its n_steps="
            f"{transform.n_steps} along the time dimension: no save writes that; damaged or forged"
        )
    live = transform._buffer
    if live is not None:
        keys = set(held.keys(True, True)) ^ set(live.keys(True, True))
        if keys:
            raise IncompatibleComponentError(
                f"{where} held back entries {sorted(map(str, keys))[:4]} the live transform's do not have (or "
                "lack them): build the buffer's data as it was saved"
            )
        rows = {
            (k,) if isinstance(k, str) else k: (v.dtype, tuple(v.shape[live.batch_dims :]))
            for k in live.keys(True, True)
            if isinstance(v := live.get(k), torch.Tensor)
        }
    for key in held.keys(True, True):
        value, expected = held.get(key), (rows or {}).get((key,) if isinstance(key, str) else key)
        if expected is None or not isinstance(value, torch.Tensor):
            continue
        found = (value.dtype, tuple(value.shape[held.batch_dims :]))
        if found != expected:
            raise CheckpointIntegrityError(
                f"{where} holds back {key!r} as {found[0]} {list(found[1])} per transition, the buffer holds "
                f"{expected[0]} {list(expected[1])}: damaged or forged"
            )

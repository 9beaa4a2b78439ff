"""An env's uninitialised (lazy) tensors: found, matched to where a saved state holds them, given their shapes.

torch's ``load_state_dict`` skips an uninitialised parameter or buffer silently (an ``ObservationNorm`` built without
``loc``/``scale``, before ``init_stats``; ``CatFrames``' buffers before its first step), so a resumed env kept them
uninitialised. :func:`materialize_lazy` gives each the shape and dtype the saved state holds for it first (found by
marker tensors put in the slots while the env's state is taken: the state's layout is the adapter's, whatever it
is), or refuses before anything changes. The env adapter (:mod:`torchrl_dcp.adapters.env`) passes its own
state function.

Example:
    >>> from torchrl.envs import ObservationNorm, PendulumEnv, TransformedEnv
    >>> env = TransformedEnv(PendulumEnv(), ObservationNorm(in_keys=["th"], standard_normal=True))
    >>> [slot.where for slot in lazy_tensors(env)]
    ['transform.loc', 'transform.scale']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from torchrl_dcp.errors import CheckpointError, IncompatibleComponentError

__all__ = ["LazySlot", "lazy_places", "lazy_plan", "lazy_tensors", "materialize_lazy", "set_aside"]


@dataclass
class LazySlot:
    """One uninitialised (lazy) parameter or buffer of an env's module tree (:func:`lazy_tensors`): where it is
    (``where``, for messages), the module and slot holding it (``module._buffers[name]`` or ``module._parameters``),
    the tensor itself, and its class, device and dtype while uninitialised (what a rollback puts back)."""

    where: str
    module: torch.nn.Module
    kind: str  # "_parameters" or "_buffers"
    name: str
    tensor: Any
    lazy_class: type
    device: torch.device
    dtype: torch.dtype

    def set(self, value: Any) -> None:
        getattr(self.module, self.kind)[self.name] = value

    def unmaterialize(self) -> None:
        """Make the tensor uninitialised again, the same object in the same slot (the inverse of torch's
        ``materialize``, which turned it into a plain tensor in place)."""
        if not torch.nn.parameter.is_lazy(self.tensor):
            self.tensor.data = torch.empty(0, device=self.device, dtype=self.dtype)
            self.tensor.__class__ = self.lazy_class
        self.set(self.tensor)


def lazy_tensors(env: Any) -> list[LazySlot]:
    """Every uninitialised (lazy) parameter and buffer of ``env``'s module tree: through wrappers and transforms,
    the sub-envs of a ``SerialEnv`` (started first, as its ``state_dict``/``load_state_dict`` do) and the parent envs
    torchrl caches for transforms (a ``ParallelEnv``'s sub-envs live in worker processes, out of reach).

    ``ObservationNorm`` built without ``loc``/``scale`` holds them as ``UninitializedBuffer`` until ``init_stats``
    (torchrl's tutorials build it so), ``CatFrames`` its frame buffers until its first step. torch's
    ``load_state_dict`` skips such tensors without a word, so a resumed env kept them uninitialised:
    :func:`materialize_lazy` gives them the saved shapes and dtypes first.

    Example:
        >>> from torchrl.envs import ObservationNorm, PendulumEnv, TransformedEnv
        >>> env = TransformedEnv(PendulumEnv(), ObservationNorm(in_keys=["th"], standard_normal=True))
        >>> [slot.where for slot in lazy_tensors(env)]
        ['transform.loc', 'transform.scale']
    """
    from torchrl.envs import ParallelEnv, SerialEnv

    found: list[LazySlot] = []
    seen: set[int] = set()

    def walk(obj: Any, path: str) -> None:
        if id(obj) in seen or isinstance(obj, ParallelEnv):
            return
        seen.add(id(obj))
        if isinstance(obj, SerialEnv) and obj.is_closed and getattr(obj, "_owns_workers", True):
            obj.start()  # (its sub-envs exist once started; a load starts it anyway)
        attrs = vars(obj)
        for kind in ("_parameters", "_buffers"):
            for name, t in list((attrs.get(kind) or {}).items()):
                if torch.nn.parameter.is_lazy(t):
                    found.append(LazySlot(f"{path}{name}", obj, kind, name, t, type(t), t.device, t.dtype))
        for name, value in {**attrs, **(attrs.get("_modules") or {})}.items():
            if isinstance(value, torch.nn.Module) and name != "policy":  # wrapped envs, transforms, cached parents
                walk(value, f"{path}{'transform' if name == '_transform' else name}.")
            elif isinstance(value, (list, tuple)) and name in ("envs", "_envs"):
                for i, child in enumerate(value):
                    if isinstance(child, torch.nn.Module):
                        walk(child, f"{path}{name}.{i}.")

    walk(env, "")
    return found


@contextmanager
def set_aside(slots: list[LazySlot]) -> Iterator[None]:
    """The slots emptied (``None``: ``state_dict`` leaves such a slot out, ``load_state_dict`` skips it) while the
    block runs, then given their tensors back."""
    for slot in slots:
        slot.set(None)
    try:
        yield
    finally:
        for slot in slots:
            slot.set(slot.tensor)


def _marker(i: int) -> torch.Tensor:
    return torch.full((1,), -math.ldexp(1.0 + i / 2**20, 1000), dtype=torch.float64)  # (no statistic is -1e301)


def _marker_paths(state: Any, markers: dict[float, int], path: tuple[Any, ...] = ()) -> Iterator[tuple[int, tuple]]:
    """``(slot index, path in state)`` of every marker :func:`lazy_places` put in the state (by value: a state
    that copies its tensors still shows them)."""
    if isinstance(state, torch.Tensor):
        if state.dtype == torch.float64 and state.shape == (1,) and (i := markers.get(float(state))) is not None:
            yield i, path
    elif isinstance(state, Mapping):
        for key, value in state.items():
            yield from _marker_paths(value, markers, (*path, key))
    elif isinstance(state, (list, tuple)):
        for key, value in enumerate(state):
            yield from _marker_paths(value, markers, (*path, key))


def lazy_places(
    env: Any, name: str, state_of: Callable[[Any, str], Any]
) -> list[tuple[LazySlot, list[tuple[Any, ...]]]]:
    """``(slot, paths)`` of each uninitialised tensor of ``env`` (:func:`lazy_tensors`) that the adapter's state
    holds, with where it holds it (paths in :meth:`EnvAdapter.state`'s nested state; one tensor may be held at
    several). Found by putting a marker tensor in each slot while the state is taken; nothing changes."""
    slots = lazy_tensors(env)
    if not slots:
        return []
    markers = {float(_marker(i)): i for i in range(len(slots))}
    for i, slot in enumerate(slots):
        slot.set(_marker(i))
    try:
        state = state_of(env, name)
    except CheckpointError:
        raise
    except Exception as err:
        raise IncompatibleComponentError(
            f"component {name!r}: the env holds uninitialised tensors ({', '.join(s.where for s in slots[:4])}), "
            f"and its state could not be taken to find where a checkpoint holds them ({type(err).__name__}: {err})"
        ) from err
    finally:
        for slot in slots:
            slot.set(slot.tensor)
    places: dict[int, list[tuple[Any, ...]]] = {}
    for i, path in _marker_paths(state, markers):
        places.setdefault(i, []).append(path)
    return [(slots[i], paths) for i, paths in sorted(places.items())]


_ABSENT = object()


def _value_at(state: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        if isinstance(state, Mapping) and key in state:
            state = state[key]
        elif isinstance(state, (list, tuple)) and isinstance(key, int) and 0 <= key < len(state):
            state = state[key]
        else:
            return _ABSENT
    return state


def lazy_plan(
    env: Any, saved: Any, name: str, state_of: Callable[[Any, str], Any]
) -> list[tuple[LazySlot, tuple[int, ...], torch.dtype]]:
    """``(slot, shape, dtype)`` to materialise each uninitialised tensor of ``env`` the saved state holds a value
    for (tensors, or :class:`~torchrl_dcp.format.codec.TensorSpec` while a load is planned), or an
    :class:`IncompatibleComponentError` before anything changes: the checkpoint holds no value for it (only a cached
    parent env the save had not built may lack it: the restore drops that parent), or not a tensor, or several."""
    from torchrl_dcp.format.codec import TensorSpec

    plan = []
    for slot, paths in lazy_places(env, name, state_of):
        found = [(path, v) for path in paths if (v := _value_at(saved, path)) is not _ABSENT]
        if not found and all(path[0] == "parents" for path in paths):
            continue
        where = f"component {name!r}: {slot.where} ({type(slot.module).__name__}) is not initialised in this env"
        if not found:
            raise IncompatibleComponentError(
                f"{where} (a lazy tensor, e.g. ObservationNorm's loc/scale before init_stats) and the checkpoint "
                "holds no value for it: build the env as it was saved"
            )
        kinds = {
            (tuple(v.shape), v.dtype) if isinstance(v, (torch.Tensor, TensorSpec)) else type(v).__name__
            for _, v in found
        }
        if len(kinds) != 1 or not isinstance(kind := next(iter(kinds)), tuple):
            raise IncompatibleComponentError(
                f"{where}, and the checkpoint holds no single tensor to shape it: {sorted(map(str, kinds))[:3]} "
                f"(at {['/'.join(map(str, path)) for path, _ in found][:3]}): damaged, or another env"
            )
        plan.append((slot, kind[0], kind[1]))
    return plan


def materialize_lazy(env: Any, state: Any, name: str, state_of: Callable[[Any, str], Any]) -> list[LazySlot]:
    """Give every uninitialised tensor of ``env`` the shape and dtype ``state`` (what :meth:`EnvAdapter.state`
    returned) holds for it (on its own device, in place, as torch's ``materialize``), so that the loads which follow
    fill it: torch's ``load_state_dict`` skips an uninitialised tensor silently. Raises before changing anything
    when the state holds no value for one (:func:`lazy_plan`). Returns the slots materialised.

    Example:
        >>> from torchrl.envs import ObservationNorm, PendulumEnv, TransformedEnv
        >>> env = TransformedEnv(PendulumEnv(), ObservationNorm(in_keys=["th"], standard_normal=True))
        >>> state = {"state_dict": {"loc": torch.zeros(3), "scale": torch.ones(3)}}
        >>> [slot.where for slot in materialize_lazy(env, state, "env", lambda e, n: {"state_dict": e.state_dict()})]
        ['transform.loc', 'transform.scale']
        >>> env.transform.loc.shape
        torch.Size([3])
    """
    plan = lazy_plan(env, state, name, state_of)
    for slot, shape, dtype in plan:
        if torch.nn.parameter.is_lazy(slot.tensor):  # (one tensor held by two modules: materialised once)
            slot.tensor.materialize(shape, dtype=dtype)
    return [slot for slot, _, _ in plan]

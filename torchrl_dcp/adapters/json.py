"""Adapter for plain values: dicts (and any ``Mapping``), lists and tuples of JSON scalars (and tensors).

Loading returns the saved value in ``LoadResult.values[name]`` and, when the
registered object is a mutable mapping (``dict``, ``OrderedDict``, Hydra's ``DictConfig``) or a mutable sequence
(``list``, Hydra's ``ListConfig``), also updates it in place: its tensors receive the saved bytes where they are
(as ``dcp.load`` fills a state dict: :mod:`~torchrl_dcp.adapters.in_place` says when), its other items are replaced. A mapping of another type is stored as a plain ``dict``
of its items (an ``OrderedDict``, a ``Counter`` and a ``defaultdict`` keep their type), a mutable sequence as a ``list`` (a ``deque``
stays one, with its ``maxlen``; nested ones too: a ``DictConfig`` is stored as its container form, interpolations
resolved).

Example:
    >>> from torchrl_dcp.adapters.json import is_plain_value
    >>> is_plain_value({"episodes": 3, "tags": ["a", "b"]})
    True
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Mapping, MutableMapping, MutableSequence
from typing import Any

import torch

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.in_place import in_place_tensors
from torchrl_dcp.errors import IncompatibleComponentError, InexactResumeWarning
from torchrl_dcp.format.codec import named_factory

_SCALARS = (type(None), bool, int, float, str)


def is_plain_value(value: Any) -> bool:
    """A scalar, a mapping or a plain ``list``/``tuple``: stored by the JSON adapter.

    Its content is checked when saving; an entry that cannot be stored raises
    an error naming its key.
    """
    return isinstance(value, (*_SCALARS, Mapping)) or type(value) in (list, tuple) or _is_sequence(value)


def _is_sequence(value: Any) -> bool:
    """A mutable sequence other than bytes (Hydra's ``ListConfig``, a ``deque``): stored as a ``list``."""
    return isinstance(value, MutableSequence) and not isinstance(value, bytearray)


def _is_tensordict(value: Any) -> bool:
    return type(value).__module__.startswith("tensordict.")


def _plain(value: Any, found: list[bool] | None = None) -> Any:
    """``value`` with every mapping turned into a ``dict`` (an ``OrderedDict``, ``Counter`` or ``defaultdict`` kept
    as one) and
    every mutable sequence into a ``list`` (a ``deque`` kept as one, with its ``maxlen``), recursively; ``True`` is
    appended to ``found`` when a TensorDict is made a dict (:func:`_tensordict_paths` then names them)."""
    if isinstance(value, Mapping):
        if found is not None and not found and _is_tensordict(value):
            found.append(True)
        items = dict((k, _plain(v, found)) for k, v in value.items())
        if type(value) is defaultdict:
            return defaultdict(value.default_factory, items)
        return type(value)(items) if type(value) in (OrderedDict, Counter) else items
    if type(value) in (list, tuple):
        return type(value)(_plain(v, found) for v in value)
    if type(value) is deque:  # (its maxlen kept)
        return deque((_plain(v, found) for v in value), maxlen=value.maxlen)
    if _is_sequence(value):
        return [_plain(v, found) for v in value]
    return value


def _tensordict_paths(value: Any, path: str = "") -> list[str]:
    """The paths of the TensorDicts :func:`_plain` makes dicts (walked again only when it found one, so a large plain
    state pays no path per element)."""
    if isinstance(value, Mapping):
        own = [path or "<root>"] if _is_tensordict(value) else []
        return own + [p for k, v in value.items() for p in _tensordict_paths(v, f"{path}/{k}")]
    if type(value) in (list, tuple, deque) or _is_sequence(value):
        return [p for i, v in enumerate(value) for p in _tensordict_paths(v, f"{path}/{i}")]
    return []


def _in_place(obj: Any, saved: dict[int, Any], ctx: AdapterContext) -> dict[str, torch.Tensor]:
    """``{saved key: live tensor}`` of the tensors a load reads where they are (:mod:`~torchrl_dcp.adapters.in_place`):
    one saved state of the live value's shape, not resharded."""
    if len(saved) != 1 or (ctx.saved_world_size is not None and ctx.saved_world_size != ctx.world_size):
        return {}
    (view,) = saved.values()
    return in_place_tensors(obj, view, ctx, partial=True)


class JSONAdapter(Adapter):
    """Stores the value itself; restores dicts and lists in place."""

    adapter_id = "torchrl_dcp.json"
    version = 1
    returns_values = True

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        found: list[bool] = []
        state = _plain(obj, found)
        if type(state) is defaultdict and not named_factory(state):  # (a load fills the registered one in place:
            state = dict(state)  # its own factory stays, whatever it is)
        if found:  # (a TensorDict registered itself is the TensorDict adapter's: whole, as it is)
            tensordicts = _tensordict_paths(obj)
            warnings.warn(
                f"component {ctx.name!r} (saving): the TensorDict(s) at {', '.join(tensordicts[:3])} are saved as "
                "plain dicts of their entries and come back as dicts (batch size, device and names lost): register "
                "each as a component of its own, whose adapter keeps them",
                InexactResumeWarning,
                stacklevel=3,
            )
        return state

    def snapshot(self, obj: Any, ctx: AdapterContext) -> Any:
        """A shallow copy: restoring replaces the container's items (tensors read in place aside: kept by reference,
        they hold loaded values once the final in-place read started)."""
        return copy.copy(obj)

    def validate(self, obj: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """A registered dict (or list) is updated in place: the checkpoint must hold a mapping (a list) for it,
        or the load would report it restored and leave it as it was."""
        for state in saved.values():
            mapping, sequence = isinstance(obj, MutableMapping), _is_sequence(obj)
            saved_kind = list if type(obj) is not deque else (list, deque)  # (a deque saved as a list before)
            if (mapping and not isinstance(state, Mapping)) or (sequence and not isinstance(state, saved_kind)):
                raise IncompatibleComponentError(
                    f"component {ctx.name!r} is a {type(obj).__name__}, updated in place by a load; the checkpoint "
                    f"holds a {type(state).__name__} for it: register an object of the saved kind"
                )
            if type(obj) is deque and type(state) is deque and obj.maxlen != state.maxlen:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r} is a deque of maxlen {obj.maxlen}, updated in place by a load; the "
                    f"checkpoint holds one of maxlen {state.maxlen}: register deque(maxlen={state.maxlen})"
                )
        ctx.plan["in_place"] = _in_place(obj, saved, ctx)

    def destinations(self, obj: Any, saved: Any, ctx: AdapterContext) -> dict[str, torch.Tensor] | None:
        """The registered value's own tensors, read in place where they match the saved ones (as ``dcp.load``
        fills a state dict's tensors: ``{"model": model.state_dict()}`` restores the model's weights)."""
        return ctx.plan.get("in_place") or None

    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        if isinstance(obj, MutableMapping) and isinstance(state, Mapping):
            obj.clear()
            obj.update(state)
        elif _is_sequence(obj) and isinstance(state, (list, deque)):
            obj.clear()
            obj.extend(state)
        return state

"""The adapter registry: which :class:`~torchrl_dcp.adapters.base.Adapter` serves an object, by type.

Registrations are global and matched along the object's MRO (most specific type
first); a checkpoint may pass its own registrations, consulted first. Objects of no
registered type fall back to the generic ``state_dict`` adapter, then to the JSON
adapter for plain values. The adapters this package ships are registered when
:mod:`torchrl_dcp.adapters` is imported (:mod:`torchrl_dcp.adapters.defaults`).

Example:
    >>> from torchrl_dcp.adapters import Adapter, register_adapter, resolve_adapter
    >>> class Counter:
    ...     def __init__(self): self.n = 0
    >>> class CounterAdapter(Adapter):
    ...     adapter_id = "example.counter"
    ...     def state(self, obj, ctx): return {"n": obj.n}
    ...     def restore(self, obj, state, ctx): obj.n = state["n"]
    >>> register_adapter(Counter, CounterAdapter())
    >>> resolve_adapter(Counter()).adapter_id
    'example.counter'
    >>> resolve_adapter({"episodes": 3}).adapter_id
    'torchrl_dcp.json'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrl_dcp.adapters.base import Adapter
from torchrl_dcp.adapters.json import JSONAdapter, is_plain_value
from torchrl_dcp.adapters.state_dict import StateDictAdapter

__all__ = ["adapter_by_id", "register_adapter", "resolve_adapter"]

_REGISTRY: dict[type, Adapter] = {}


def register_adapter(component_type: type, adapter: Adapter) -> None:
    """Use ``adapter`` for every instance of ``component_type`` (and its subclasses)."""
    if not isinstance(component_type, type):
        raise TypeError("component_type must be a type")
    if not isinstance(adapter, Adapter) or not adapter.adapter_id:
        raise TypeError("adapter must be an Adapter instance with an adapter_id")
    _REGISTRY[component_type] = adapter


def resolve_adapter(obj: Any, local: Mapping[type, Adapter] | None = None) -> Adapter:
    """The most specific adapter for ``obj``: per-checkpoint registrations first, then global ones.

    Falls back to the generic ``state_dict`` adapter for objects that have
    ``state_dict``/``load_state_dict``, and to the JSON adapter for plain values.
    """
    for klass in type(obj).__mro__:
        if local and klass in local:
            return local[klass]
        if klass in _REGISTRY:
            return _REGISTRY[klass]
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return StateDictAdapter()
    if is_plain_value(obj):
        return JSONAdapter()
    raise TypeError(
        f"no adapter for {type(obj).__module__}.{type(obj).__qualname__}: give it state_dict()/"
        "load_state_dict(), pass adapter=..., or call register_adapter(type, adapter)"
    )


def adapter_by_id(adapter_id: str) -> Adapter | None:
    """The registered (or built-in fallback) adapter whose ``adapter_id`` is ``adapter_id``, if any: one of the class
    that names it. A subclass that inherits its parent's id (``TorchrlGlobalRNGAdapter``, the Trainer's adapters:
    the generic state-dict payload) is never taken for every state saved under that id: what it checks of its own
    objects' states (GlobalRNGState's streams) holds for them only, and is run where such an object is registered."""
    for adapter in (*_REGISTRY.values(), StateDictAdapter(), JSONAdapter()):
        if adapter.adapter_id == adapter_id and "adapter_id" in vars(type(adapter)):
            return adapter
    return None

"""Adapter for plain values: dicts, lists and tuples of JSON scalars (and tensors).

Loading returns the saved value in ``LoadResult.values[name]`` and, when the
registered object is a mutable ``dict`` or ``list``, also updates it in place.

Example:
    >>> from torchrl_dcp.adapters.json import is_plain_value
    >>> is_plain_value({"episodes": 3, "tags": ["a", "b"]})
    True
"""

from __future__ import annotations

import copy
from typing import Any

from torchrl_dcp.adapters.base import Adapter, AdapterContext

_SCALARS = (type(None), bool, int, float, str)


def is_plain_value(value: Any) -> bool:
    """A scalar or a plain ``dict``/``list``/``tuple``: stored by the JSON adapter.

    Its content is checked when saving; an entry that cannot be stored raises
    an error naming its key.
    """
    return isinstance(value, _SCALARS) or type(value) in (dict, list, tuple)


class JSONAdapter(Adapter):
    """Stores the value itself; restores dicts and lists in place."""

    adapter_id = "torchrl_dcp.json"
    version = 1

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        return obj

    def snapshot(self, obj: Any, ctx: AdapterContext) -> Any:
        """A shallow copy: restoring replaces the container's items and never writes into the old ones."""
        return copy.copy(obj)

    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        if isinstance(obj, dict) and isinstance(state, dict):
            obj.clear()
            obj.update(state)
        elif isinstance(obj, list) and isinstance(state, list):
            obj[:] = state
        return state

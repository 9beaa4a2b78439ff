"""Plain JSON values from what training code hands over: NumPy and torch scalars become Python numbers.

``metadata=`` and the ``keep_best`` metric come from training code, where a reward is often a ``numpy.float32`` or a
0-d tensor (``loss.item()`` forgotten). They are stored as JSON, so such scalars are converted (recursively, inside
dicts, lists and tuples); anything else is left for the JSON check to refuse with its key. Never imports torch or
NumPy (the command-line tools import this module without them).

Example:
    >>> import numpy as np
    >>> plain_scalars({"reward": np.float32(1.5), "steps": [np.int64(3)]})
    {'reward': 1.5, 'steps': [3]}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["plain_scalars"]


def _scalar(value: Any) -> Any:
    module = type(value).__module__ or ""
    if module.startswith("numpy") and getattr(value, "shape", None) == ():  # numpy scalar or 0-d array
        return value.item()
    if module.startswith("torch") and callable(getattr(value, "numel", None)) and value.numel() == 1:
        if getattr(value, "ndim", 1) == 0:  # a 0-d tensor (a 1-element vector stays a tensor: refused, named)
            return value.item()
    return value


def plain_scalars(value: Any) -> Any:
    """``value`` with every NumPy scalar and 0-d tensor replaced by its Python number (see the module docstring)."""
    if isinstance(value, Mapping):
        return {k: plain_scalars(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(plain_scalars(v) for v in value)
    return _scalar(value)

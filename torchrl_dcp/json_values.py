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

from torchrl_dcp.errors import EncodingError

__all__ = ["metadata_values", "plain_scalars"]


def _scalar(value: Any) -> Any:
    module = type(value).__module__ or ""
    if module.startswith("numpy") and getattr(value, "shape", None) == ():  # numpy scalar or 0-d array
        return value.item()
    if module.startswith("torch") and callable(getattr(value, "numel", None)) and value.numel() == 1:
        if getattr(value, "ndim", 1) == 0:  # a 0-d tensor (a 1-element vector stays a tensor: refused, named)
            return value.item()
    return value


def plain_scalars(value: Any, _path: tuple[int, ...] = (), max_depth: int | None = None) -> Any:
    """``value`` with every NumPy scalar and 0-d tensor replaced by its Python number (see the module docstring).

    Raises ``ValueError`` when a container holds itself (JSON has no references), or containers are nested more
    than ``max_depth`` levels deep."""
    if isinstance(value, Mapping) or type(value) in (list, tuple):
        if id(value) in _path:
            raise ValueError("it holds itself (a reference cycle; JSON has no references)")
        if max_depth is not None and len(_path) >= max_depth:
            raise ValueError(f"it is nested more than {max_depth} levels deep (every load would refuse it)")
        inner = (*_path, id(value))
        if isinstance(value, Mapping):
            return {k: plain_scalars(v, inner, max_depth) for k, v in value.items()}
        return type(value)(plain_scalars(v, inner, max_depth) for v in value)
    return _scalar(value)


def metadata_values(metadata: Any, max_depth: int | None = None) -> dict[str, Any]:
    """The ``metadata=`` of a save as a plain dict (scalars converted): ``None`` is ``{}``; anything but a mapping is
    a ``TypeError``, a mapping that holds itself (or is nested more than ``max_depth`` levels deep: what the
    manifest holding it may be) an :class:`~torchrl_dcp.errors.EncodingError`.

    Example:
        >>> metadata_values(None), metadata_values({"reward": 1.5})
        ({}, {'reward': 1.5})
    """
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"metadata must be a mapping of JSON values (a dict) or None, got {type(metadata).__name__}: "
            "pass metadata={'name': value}"
        )
    try:
        return plain_scalars(dict(metadata), (), max_depth)
    except (ValueError, RecursionError) as err:
        why = str(err) if isinstance(err, ValueError) else "it is nested too deeply"
        raise EncodingError(f"metadata must be JSON-safe: {why}") from None

"""A saved state against the live object's own: the same kind of value wherever both hold one.

An object restored through its ``load_state_dict`` takes whatever the checkpoint holds: torch's LR schedulers
``__dict__.update`` it (a key ``"step"`` replaced the method), torchrl's hooks ``setattr`` each key, an optimizer's
``param_groups`` take a string for ``lr``. The live object's ``state_dict()`` says what a save of it writes:
:func:`check_kinds` refuses a saved value of another kind than the live one's at the same place (a string for a
number, a number for a mapping; with ``tensors``, where both are tensors, another dtype or a scalar for a
non-scalar), and
:func:`check_no_shadowing` a saved key the live state does not hold that names one of the object's methods.
``None`` on either side is not compared (an attribute set on first use); numbers, bools, tensors, arrays and
sequences are one kind (a learning rate set to ``1`` and scheduled to ``0.5``, a statistic that starts as ``0`` and
becomes a tensor); lists of other lengths are not compared element by element.

Example:
    >>> check_kinds({"lr": 0.1, "steps": [1, 2]}, {"lr": 1, "steps": [3]}, "opt")  # the same kinds
    >>> check_kinds({"lr": "0.1"}, {"lr": 0.1}, "opt")
    Traceback (most recent call last):
    ...
    torchrl_dcp.errors.IncompatibleComponentError: opt: 'lr' is a str in the checkpoint, a numeric in the live object
"""

from __future__ import annotations

import numbers
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchrl_dcp.errors import IncompatibleComponentError
from torchrl_dcp.format.codec import TensorSpec

__all__ = ["check_kinds", "check_no_shadowing", "integral_dtype", "kind_of"]


def kind_of(value: Any) -> str | None:
    """The kind a value is compared by (``None`` for ``None``). Numbers, bools, tensors, NumPy arrays and sequences
    are one kind, ``"numeric"``: honest runs turn one into another (a running statistic set to ``0`` becomes a
    tensor, a flag ``False`` a count, a warm-up writes a tensor learning rate, a NumPy array is saved as a tensor).
    Strings and mappings are kinds of their own; anything else is its type's name."""
    kind = _KINDS.get(type(value))  # the common types without the ABC checks (a state of 5,000 tensors: ~4 ms)
    if kind is not None:
        return kind
    if value is None:
        return None
    if isinstance(value, str):
        return "str"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, (bool, numbers.Number, torch.Tensor, TensorSpec, Sequence)) or hasattr(value, "__array__"):
        return "numeric"
    return type(value).__name__


#: the kind of the values most states hold, by exact type (subclasses go through :func:`kind_of`'s checks)
_KINDS: dict[type, str] = {
    str: "str",
    dict: "mapping",
    OrderedDict: "mapping",
    **dict.fromkeys((bool, int, float, complex, list, tuple, torch.Tensor, torch.nn.Parameter, TensorSpec), "numeric"),
}
#: values with nothing inside to compare (sequences are compared element by element)
_LEAVES = frozenset((bool, int, float, complex, torch.Tensor, torch.nn.Parameter, TensorSpec))
_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter, TensorSpec))


def check_kinds(saved: Any, live: Any, where: str, path: str = "", *, tensors: bool = True) -> None:
    """Raise :class:`IncompatibleComponentError` where ``saved`` holds another kind of value than ``live`` (the
    object's current state): mappings compared key by key (the keys both hold), sequences of one length element by
    element, tensors (with ``tensors``) by dtype and by whether they are scalars; without it, a tensor is any tensor
    (an object's own ``load_state_dict`` may take another dtype, as a module's casts)."""
    a, b = kind_of(saved), kind_of(live)
    if a is None or b is None:
        return
    at = repr(path) if path else "its state"
    if a != b:
        raise IncompatibleComponentError(f"{where}: {at} is a {a} in the checkpoint, a {b} in the live object")
    both_tensors = all(isinstance(v, (torch.Tensor, TensorSpec)) for v in (saved, live))
    if both_tensors and tensors:
        if saved.dtype != live.dtype or (len(saved.shape) == 0) != (len(live.shape) == 0):
            raise IncompatibleComponentError(
                f"{where}: {at} is a {saved.dtype} tensor of shape {list(saved.shape)} in the checkpoint, "
                f"{live.dtype} {list(live.shape)} in the live object"
            )
    elif a == "mapping":
        for key in saved.keys() & live.keys():
            x, y = saved[key], live[key]
            if type(x) in _LEAVES and type(y) in _LEAVES and not (tensors and _TENSORS.issuperset((type(x), type(y)))):
                continue  # two numbers, or (without ``tensors``) two tensors: one kind, nothing inside to compare
            check_kinds(x, y, where, f"{path}.{key}" if path else str(key), tensors=tensors)
    elif all(isinstance(v, Sequence) and not isinstance(v, str) for v in (saved, live)) and len(saved) == len(live):
        for i, (x, y) in enumerate(zip(saved, live)):
            check_kinds(x, y, where, f"{path}[{i}]", tensors=tensors)


def check_no_shadowing(saved: Any, live: Any, obj: Any, where: str) -> None:
    """Refuse a saved key the live state does not hold that names a method or property of ``obj``'s class: a
    ``load_state_dict`` that sets attributes from its keys (``__dict__.update``, ``setattr``) would replace it."""
    if not isinstance(saved, Mapping) or not isinstance(live, Mapping):
        return
    for key in saved.keys() - live.keys():
        if isinstance(key, str) and (
            callable(getattr(type(obj), key, None)) or isinstance(getattr(type(obj), key, None), property)
        ):
            kind = type(obj).__name__
            disabled = callable(getattr(obj, "is_enabled", None)) and obj.is_enabled() is False
            why = (
                f"this {kind} is disabled and holds no state, the checkpoint's was enabled: build it enabled (as "
                "when saved) to load it"
                if disabled
                else f"the checkpoint was saved from a {kind} built otherwise (build it as when saved), or it is "
                "damaged or forged"
            )
            raise IncompatibleComponentError(
                f"{where}: the checkpoint's state holds {key!r}, which this {kind}'s state does not hold (it holds "
                f"{sorted(map(str, live))[:8]}) and which names one of its methods: loading it would replace the "
                f"method; {why}"
            )


def integral_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` hold integers (not floating, complex or bool): what indices and counters are."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)

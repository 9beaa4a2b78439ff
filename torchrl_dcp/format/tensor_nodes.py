"""A tensor's node in a state skeleton: what it says of the tensor and how a load allocates for it.

A node ``{"t": "tensor", "key", "dtype", "shape", "device"}`` (``xref`` and ``dtensor`` nodes alike) becomes a
:class:`TensorSpec` through :func:`node_spec`, every field checked: known dtype names, non-negative sizes, a real
device, ``grad`` true or absent, and ``stride`` (a dense layout other than row-major: :func:`dense_layout`) bounded
by the element count, so that what a load allocates for it never depends on anything but checked sizes. A save adds
``stride`` through :func:`with_layout`.

Example:
    >>> spec = node_spec({"t": "tensor", "key": "w", "dtype": "float32", "shape": [3, 2], "stride": [1, 3]})
    >>> spec.empty().stride()
    (1, 3)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from torchrl_dcp.errors import CheckpointFormatError

__all__ = ["TensorSpec", "dense_layout", "dtype_from_name", "dtype_name", "grad_flag", "node_spec", "with_layout"]


class TensorSpec:
    """Shape, dtype and device of one saved tensor, enough to allocate it (a value: never change one). Slots, not
    a frozen dataclass: a load builds one per tensor, in 0.13 µs instead of 0.57 µs.

    Example:
        >>> spec = TensorSpec("w", (2, 3), torch.float32, "cpu")
        >>> spec.empty().shape, spec == TensorSpec("w", (2, 3), torch.float32, "cpu")
        (torch.Size([2, 3]), True)
    """

    __slots__ = ("key", "shape", "dtype", "device", "dtensor", "grad", "stride")

    def __init__(
        self,
        key: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: str,
        dtensor: bool = False,
        grad: bool = False,
        stride: tuple[int, ...] | None = None,
    ):
        self.key = key
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.dtensor = dtensor  # saved from a DTensor (placement "sharded"): loaded into a DTensor destination
        self.grad = grad  # saved while autograd tracked it: a fresh tensor read for it is tracked again
        self.stride = stride  # saved in another dense layout than row-major (a transpose): a fresh tensor gets it

    def _astuple(self) -> tuple[Any, ...]:
        return (self.key, self.shape, self.dtype, self.device, self.dtensor)

    def __eq__(self, other: object) -> bool:
        return type(other) is TensorSpec and self._astuple() == other._astuple()

    def __hash__(self) -> int:
        return hash(self._astuple())

    def __repr__(self) -> str:
        return (
            f"TensorSpec(key={self.key!r}, shape={self.shape!r}, dtype={self.dtype!r}, device={self.device!r}, "
            f"dtensor={self.dtensor!r})"
        )

    def empty(self, device: torch.device | str | None = None) -> torch.Tensor:
        """A fresh tensor of this shape, dtype and layout on ``device`` (default: the saved device)."""
        if self.stride is not None:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device or self.device)
        return torch.empty(self.shape, dtype=self.dtype, device=device or self.device)


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointFormatError(f"unknown torch dtype {name!r} in the checkpoint")
    return dtype


def node_spec(node: dict[str, Any]) -> TensorSpec:
    """The :class:`TensorSpec` of a tensor node of a skeleton (its fields checked)."""
    key, shape = node.get("key"), node.get("shape")
    if type(key) is not str or type(shape) is not list:
        raise CheckpointFormatError(f"malformed tensor entry {node!r}")
    for s in shape:  # (exact types, as JSON gives them: a bool is no size)
        if type(s) is not int or s < 0:
            raise CheckpointFormatError(f"malformed tensor shape {shape!r}")
    device, dtype_name_ = node.get("device", "cpu"), node.get("dtype")
    # a load of 5,000 tensors names a device or two: each checked once (the set only holds strings; a forged
    # node's list or dict is not hashable, so it is type-checked before the lookup)
    if not isinstance(device, str) or device not in _DEVICES_SEEN:
        _check_device(device, key)
    dtype = _DTYPES.get(dtype_name_) if isinstance(dtype_name_, str) else None
    if dtype is None:
        dtype = dtype_from_name(dtype_name_)
    stride = node.get("stride")
    if stride is not None:
        stride = _stride(node, shape)
    return TensorSpec(key, tuple(shape), dtype, device, node.get("t") == "dtensor", grad_flag(node), stride)


def with_layout(node: dict[str, Any], value: torch.Tensor) -> dict[str, Any]:
    """``node`` with ``stride`` when ``value`` is laid out densely in another order than row-major (a transpose,
    channels-last, a 1x1 convolution's channels-last weight whose strides differ on its dims of one element only),
    so that a fresh tensor read for it comes back so laid out, as ``torch.load`` returns it. Strides above the element
    count (an odd stride on a dim of one element, from ``as_strided``) are left out: loads refuse them."""
    shape = value.shape
    if len(shape) > 1 and (1 in shape or not value.is_contiguous()):  # (else its strides are row-major)
        stride = value.stride()
        if stride != _row_major(shape) and dense_layout(shape, stride) and max(stride) <= max(value.numel(), 1):
            node["stride"] = list(stride)
    return node


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


def _stride(node: dict[str, Any], shape: list[int]) -> tuple[int, ...]:
    """A tensor node's ``stride``: one per dimension, a dense layout without overlap of ``shape``'s elements (dims
    of more than one element, ordered by stride, each step the product of the smaller ones), on a ``tensor`` node."""
    stride = node["stride"]
    count = max(math.prod(shape), 1)
    if (
        node.get("t") not in ("tensor", "xref")
        or type(stride) is not list
        or len(stride) != len(shape)
        or not all(type(s) is int and 0 <= s <= count for s in stride)
    ):
        raise CheckpointFormatError(f"malformed tensor entry {node!r}: 'stride' is one count per dimension or absent")
    if not dense_layout(shape, stride):
        raise CheckpointFormatError(
            f"malformed tensor entry {node!r}: 'stride' is not a dense layout of its shape (no save writes it)"
        )
    return tuple(stride)


def dense_layout(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether ``stride`` lays out ``shape``'s elements densely, none twice: the dimensions of more than one element,
    ordered by stride, each step the product of the sizes below it (row-major, a transpose, channels-last).

    Example:
        >>> dense_layout((3, 4), (1, 3)), dense_layout((3, 4), (4, 1)), dense_layout((3, 4), (1, 1))
        (True, True, False)
    """
    expected = 1
    for step, size in sorted((st, sz) for st, sz in zip(stride, shape) if sz > 1):
        if step != expected:
            return False
        expected *= size
    return True


def grad_flag(node: dict[str, Any]) -> bool:
    """A tensor node's ``grad`` flag: ``true`` (on a ``tensor`` node) or absent."""
    grad = node.get("grad", False)
    if grad is not False and (grad is not True or node.get("t") != "tensor"):
        raise CheckpointFormatError(f"malformed tensor entry {node!r}: 'grad' is true or absent")
    return grad


_DEVICES_SEEN: set[str] = set()  # device strings found valid (never "meta"); bounded below
_DTYPES = {dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _check_device(device: Any, key: str) -> None:
    if not isinstance(device, str) or len(device) > 64:
        raise CheckpointFormatError(f"malformed tensor device {device!r}")
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise CheckpointFormatError(f"malformed tensor device {device!r}") from None
    if kind == "meta":  # a tensor without data: no save writes one, a forged skeleton would load "nothing"
        raise CheckpointFormatError(f"tensor {key!r} is on the meta device, which no save writes: refused")
    if len(_DEVICES_SEEN) < 1024:
        _DEVICES_SEEN.add(device)

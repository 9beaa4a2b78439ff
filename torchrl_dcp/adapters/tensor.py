"""Adapter for a bare tensor registered as a component (a running statistic, a step counter tensor).

The tensor is saved as itself and loaded into the registered tensor in place (same shape and dtype), so every
reference to it sees the restored values: a plain dense tensor receives the saved bytes where it is (no second copy),
any other is copied into. A tensor on the meta device (no memory) is refused while the load is planned.

Example:
    >>> import torch
    >>> from torchrl_dcp.adapters.base import AdapterContext
    >>> TensorAdapter().state(torch.ones(2), AdapterContext("count")).tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

from typing import Any

import torch

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.in_place import is_expanded
from torchrl_dcp.errors import IncompatibleComponentError
from torchrl_dcp.format.codec import TensorSpec

__all__ = ["TensorAdapter"]


class TensorAdapter(Adapter):
    """A ``torch.Tensor`` (or ``nn.Parameter``) component, restored in place."""

    adapter_id = "torchrl_dcp.tensor"
    version = 1

    def state(self, obj: torch.Tensor, ctx: AdapterContext) -> Any:
        _refuse_expanded(obj, ctx.name, "it could never be loaded back")
        return obj.detach()

    def validate(self, obj: torch.Tensor, saved: dict[int, Any], ctx: AdapterContext) -> None:
        _refuse_expanded(obj, ctx.name, "nothing can be loaded into it")
        for spec in saved.values():
            shape, dtype = tuple(getattr(spec, "shape", ())), getattr(spec, "dtype", None)
            if shape != tuple(obj.shape) or dtype != obj.dtype:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: the checkpoint holds a {dtype} tensor of shape {list(shape)}, the "
                    f"registered one is {obj.dtype} {list(obj.shape)}: register a tensor of the saved shape and dtype"
                )

    def destinations(self, obj: torch.Tensor, saved: Any, ctx: AdapterContext) -> dict[str, torch.Tensor] | None:
        """The tensor itself, read in place (no second copy), when it is a plain dense one; a tensor on the meta
        device is offered too, so that the load's destination check refuses it (it has no memory to load into)."""
        if type(saved) is not TensorSpec or saved.dtensor:
            return None  # (no tensor of its own, or a sharded one: read fresh, restored by copy)
        if obj.is_meta or (
            type(obj) in (torch.Tensor, torch.nn.Parameter)
            and obj.layout == torch.strided
            and obj.is_contiguous()
            and obj.grad_fn is None
            and not obj.is_inference()
            and not obj.is_conj()
            and not obj.is_neg()
            and obj.numel()
        ):
            return {saved.key: obj}
        return None

    def restore(self, obj: torch.Tensor, state: Any, ctx: AdapterContext) -> Any:
        if state is obj:  # read in place
            return None
        if obj.is_inference():  # (written only under inference mode, where it was made)
            with torch.inference_mode():
                obj.copy_(state)
            return None
        with torch.no_grad():
            obj.copy_(state)
        return None


def _refuse_expanded(obj: torch.Tensor, name: str, why: str) -> None:
    if is_expanded(obj):
        raise IncompatibleComponentError(
            f"component {name!r} is an expanded view (shape {list(obj.shape)}, stride {list(obj.stride())}: several "
            f"of its elements are one memory location), so {why}; register a tensor with memory of its own "
            "(value.expand(...).clone()), or the tensor it expands"
        )

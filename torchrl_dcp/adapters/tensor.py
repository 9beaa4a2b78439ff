"""Adapter for a bare tensor registered as a component (a running statistic, a step counter tensor).

The tensor is saved as itself and loaded into the registered tensor in place (same shape and dtype), so every
reference to it sees the restored values.

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
from torchrl_dcp.errors import IncompatibleComponentError

__all__ = ["TensorAdapter"]


class TensorAdapter(Adapter):
    """A ``torch.Tensor`` (or ``nn.Parameter``) component, restored in place."""

    adapter_id = "torchrl_dcp.tensor"
    version = 1

    def state(self, obj: torch.Tensor, ctx: AdapterContext) -> Any:
        return obj.detach()

    def validate(self, obj: torch.Tensor, saved: dict[int, Any], ctx: AdapterContext) -> None:
        for spec in saved.values():
            shape, dtype = tuple(getattr(spec, "shape", ())), getattr(spec, "dtype", None)
            if shape != tuple(obj.shape) or dtype != obj.dtype:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: the checkpoint holds a {dtype} tensor of shape {list(shape)}, the "
                    f"registered one is {obj.dtype} {list(obj.shape)}: register a tensor of the saved shape and dtype"
                )

    def restore(self, obj: torch.Tensor, state: Any, ctx: AdapterContext) -> Any:
        with torch.no_grad():
            obj.copy_(state)
        return None

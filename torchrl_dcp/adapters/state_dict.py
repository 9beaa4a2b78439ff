"""Adapter for any object with ``state_dict()`` / ``load_state_dict()``.

The state may nest dicts, lists and tuples of tensors and JSON-safe values (LR
schedulers, loss modules' extra state, custom counters, ...).

Example:
    >>> import torch
    >>> from torchrl_dcp.adapters import StateDictAdapter, AdapterContext
    >>> sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), 2)
    >>> StateDictAdapter().state(sched, AdapterContext("sched"))["step_size"]
    2
"""

from __future__ import annotations

from typing import Any

from torchrl_dcp.adapters.base import Adapter, AdapterContext


class StateDictAdapter(Adapter):
    """``obj.state_dict(*save_args, **save_kwargs)`` / ``obj.load_state_dict(state, *load_args, **load_kwargs)``."""

    adapter_id = "torchrl_dcp.state_dict"
    version = 1

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        return obj.state_dict(*(ctx.options.save_args or ()), **(ctx.options.save_kwargs or {}))

    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        obj.load_state_dict(state, *(ctx.options.load_args or ()), **(ctx.options.load_kwargs or {}))
        return None

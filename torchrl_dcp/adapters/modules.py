"""Adapters for ``nn.Module`` and ``torch.optim.Optimizer``.

Modules go through :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict`,
so DDP-wrapped models save without the ``module.`` prefix and FSDP2 models as
DTensors that DCP reshards. Optimizers use ``Optimizer.state_dict()``: the DCP
helper ``get_optimizer_state_dict`` was measured to *initialise* the state of an
optimizer that has not stepped yet (it writes ``step``, ``exp_avg``, ... into it), so
merely saving would change what training does next.

Example:
    >>> import torch
    >>> from torchrl_dcp.adapters import ModuleAdapter, AdapterContext
    >>> sorted(ModuleAdapter().state(torch.nn.Linear(2, 1), AdapterContext("policy")))
    ['bias', 'weight']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.errors import IncompatibleComponentError


class ModuleAdapter(Adapter):
    """``nn.Module`` weights and buffers (DDP / FSDP aware)."""

    adapter_id = "torchrl_dcp.module"
    version = 1

    def state(self, obj: torch.nn.Module, ctx: AdapterContext) -> Any:
        return get_model_state_dict(obj)

    def restore(self, obj: torch.nn.Module, state: Any, ctx: AdapterContext) -> Any:
        strict = bool((ctx.options.load_kwargs or {}).get("strict", True))
        current = get_model_state_dict(obj)
        _check_values(current, state, ctx.name)  # load_state_dict would fail half-way, with some tensors copied
        if strict:
            expected = set(current)
            missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
            if missing or unexpected:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: state_dict keys differ (missing in checkpoint: {missing[:5]}, "
                    f"not in module: {unexpected[:5]}); pass CheckpointOptions(load_kwargs={{'strict': False}}) "
                    "to load the common keys"
                )
        set_model_state_dict(obj, state, options=StateDictOptions(strict=strict))
        return None


def _check_values(current: Mapping[str, Any], state: Any, name: str) -> None:
    """Refuse, before anything is copied, a state whose values cannot be copied into the module's tensors."""
    if not isinstance(state, Mapping):
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds a {type(state).__name__}, not a state_dict"
        )
    for key, value in state.items():
        target = current.get(key)
        if target is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise IncompatibleComponentError(
                f"component {name!r}: {key!r} is a {type(value).__name__} in the checkpoint, a tensor in the module"
            )
        if value.shape != target.shape:
            raise IncompatibleComponentError(
                f"component {name!r}: {key!r} has shape {tuple(value.shape)} in the checkpoint, "
                f"{tuple(target.shape)} in the module"
            )


class OptimizerAdapter(Adapter):
    """``Optimizer.state_dict()`` / ``load_state_dict()`` (state allocated from the checkpoint)."""

    adapter_id = "torchrl_dcp.optimizer"
    version = 1

    def state(self, obj: torch.optim.Optimizer, ctx: AdapterContext) -> Any:
        return obj.state_dict()

    def destinations(
        self, obj: torch.optim.Optimizer, saved: Any, ctx: AdapterContext
    ) -> dict[str, torch.Tensor] | None:
        """DTensor destinations for state of DTensor (FSDP2) parameters, built from the parameters themselves.

        A freshly built optimizer has no state yet, so no live DTensor to read into: each
        saved per-parameter tensor with its parameter's shape is read into
        ``torch.empty_like(param)`` (the parameter's mesh and placements), which DCP fills
        with this rank's shard, at any world size. Scalars (``step``) and plain
        parameters are left to the checkpoint to allocate.
        """
        return optimizer_destinations(obj, saved)

    def restore(self, obj: torch.optim.Optimizer, state: Any, ctx: AdapterContext) -> Any:
        try:
            obj.load_state_dict(state)
        except (ValueError, KeyError) as err:
            raise IncompatibleComponentError(f"component {ctx.name!r}: {err}") from err
        return None


def optimizer_destinations(optimizer: torch.optim.Optimizer, saved: Any) -> dict[str, torch.Tensor]:
    """``{tensor key: empty DTensor like the parameter}`` for saved state of DTensor parameters.

    ``saved`` is the saved ``state_dict()`` with :class:`~torchrl_dcp.codec.TensorSpec` leaves;
    parameters are numbered as ``Optimizer.state_dict()`` numbers them (groups in order).

    Example:
        >>> import torch
        >>> opt = torch.optim.Adam(torch.nn.Linear(2, 1).parameters())
        >>> optimizer_destinations(opt, {"state": {}, "param_groups": []})
        {}
    """
    from torchrl_dcp.codec import TensorSpec, is_dtensor

    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping):
        return {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out: dict[str, torch.Tensor] = {}
    for index, entries in saved["state"].items():
        try:
            param = params[int(index)]
        except (ValueError, IndexError):
            continue  # load_state_dict reports the mismatch
        if not is_dtensor(param) or not isinstance(entries, Mapping):
            continue
        for spec in entries.values():
            if isinstance(spec, TensorSpec) and tuple(spec.shape) == tuple(param.shape):
                out[spec.key] = torch.empty_like(param.detach(), dtype=spec.dtype)
    return out

"""Adapters: one per family of objects, chosen by type (see :func:`resolve_adapter`).

The protocol lives in :mod:`~torchrl_dcp.adapters.base`, the registry in
:mod:`~torchrl_dcp.adapters.registry`; importing this package registers the shipped
adapters (:mod:`~torchrl_dcp.adapters.defaults`).

Example:
    >>> import torch
    >>> from torchrl_dcp.adapters import ModuleAdapter, resolve_adapter
    >>> isinstance(resolve_adapter(torch.nn.Linear(2, 2)), ModuleAdapter)
    True
"""

from __future__ import annotations

from torchrl_dcp.adapters.base import Adapter, AdapterContext, CheckpointOptions
from torchrl_dcp.adapters.defaults import register_default_adapters
from torchrl_dcp.adapters.env_attributes import register_exact_env
from torchrl_dcp.adapters.env_transforms import register_exact_transform
from torchrl_dcp.adapters.generators import NumpyGeneratorAdapter, NumpyRandomStateAdapter, PythonRandomAdapter
from torchrl_dcp.adapters.json import JSONAdapter
from torchrl_dcp.adapters.modules import ModuleAdapter
from torchrl_dcp.adapters.optimizer import OptimizerAdapter
from torchrl_dcp.adapters.registry import adapter_by_id, register_adapter, resolve_adapter
from torchrl_dcp.adapters.rng import GeneratorAdapter, RNGState, RNGStateAdapter
from torchrl_dcp.adapters.state_dict import StateDictAdapter
from torchrl_dcp.adapters.tensordict import TensorDictAdapter
from torchrl_dcp.errors import adopt_torchrl_base

register_default_adapters()
adopt_torchrl_base()  # torchrl is imported now: our errors become torchrl.checkpoint.CheckpointError too

__all__ = [
    "Adapter",
    "adapter_by_id",
    "AdapterContext",
    "CheckpointOptions",
    "GeneratorAdapter",
    "JSONAdapter",
    "ModuleAdapter",
    "NumpyGeneratorAdapter",
    "NumpyRandomStateAdapter",
    "OptimizerAdapter",
    "PythonRandomAdapter",
    "RNGState",
    "RNGStateAdapter",
    "StateDictAdapter",
    "TensorDictAdapter",
    "register_adapter",
    "register_exact_env",
    "register_exact_transform",
    "resolve_adapter",
]

"""Adapters: one per family of objects, chosen by type (see :func:`resolve_adapter`)."""

from __future__ import annotations

import random

import numpy as np
import torch
from tensordict import TensorDictBase

from torchrl_dcp.adapters.base import (
    Adapter,
    AdapterContext,
    CheckpointOptions,
    register_adapter,
    resolve_adapter,
)
from torchrl_dcp.adapters.generators import NumpyGeneratorAdapter, NumpyRandomStateAdapter, PythonRandomAdapter
from torchrl_dcp.adapters.json import JSONAdapter
from torchrl_dcp.adapters.modules import ModuleAdapter, OptimizerAdapter
from torchrl_dcp.adapters.rng import GeneratorAdapter, RNGState, RNGStateAdapter
from torchrl_dcp.adapters.state_dict import StateDictAdapter
from torchrl_dcp.adapters.tensordict import TensorDictAdapter

register_adapter(torch.nn.Module, ModuleAdapter())
register_adapter(torch.optim.Optimizer, OptimizerAdapter())
register_adapter(TensorDictBase, TensorDictAdapter())
register_adapter(RNGState, RNGStateAdapter())
register_adapter(torch.Generator, GeneratorAdapter())
register_adapter(random.Random, PythonRandomAdapter())
register_adapter(np.random.Generator, NumpyGeneratorAdapter())
register_adapter(np.random.RandomState, NumpyRandomStateAdapter())

__all__ = [
    "Adapter",
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
    "resolve_adapter",
]


def _register_torchrl_adapters() -> None:
    from torchrl.collectors import BaseCollector, Collector
    from torchrl.data.replay_buffers import ReplayBuffer

    from torchrl_dcp.adapters.collector import CollectorAdapter, MultiCollectorAdapter
    from torchrl_dcp.adapters.replay_buffer import ReplayBufferAdapter
    from torchrl_dcp.adapters.trainer import register_trainer_adapters

    register_adapter(ReplayBuffer, ReplayBufferAdapter())
    register_adapter(BaseCollector, MultiCollectorAdapter())
    register_adapter(Collector, CollectorAdapter())
    register_trainer_adapters()


_register_torchrl_adapters()

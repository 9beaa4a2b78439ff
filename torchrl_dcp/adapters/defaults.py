"""The adapters this package ships, registered by type when :mod:`torchrl_dcp.adapters` is imported.

Modules, optimizers, TensorDicts, RNG streams (torch, Python, NumPy), torchrl replay
buffers and their parameter schedulers, envs, collectors and Trainer hooks / loggers. Registering again is harmless: a
type maps to one adapter (:func:`~torchrl_dcp.adapters.registry.register_adapter`).

Example:
    >>> import torch
    >>> from torchrl_dcp.adapters.defaults import register_default_adapters
    >>> from torchrl_dcp.adapters.registry import resolve_adapter
    >>> register_default_adapters()
    >>> resolve_adapter(torch.nn.Linear(2, 2)).adapter_id
    'torchrl_dcp.module'
"""

from __future__ import annotations

import random

import numpy as np
import torch
from tensordict import TensorDictBase
from torchrl.collectors import BaseCollector, Collector
from torchrl.data.replay_buffers import ReplayBuffer
from torchrl.envs import EnvBase

from torchrl_dcp.adapters.collector import CollectorAdapter, MultiCollectorAdapter
from torchrl_dcp.adapters.env import EnvAdapter
from torchrl_dcp.adapters.generators import NumpyGeneratorAdapter, NumpyRandomStateAdapter, PythonRandomAdapter
from torchrl_dcp.adapters.modules import ModuleAdapter
from torchrl_dcp.adapters.optimizer import OptimizerAdapter
from torchrl_dcp.adapters.registry import register_adapter
from torchrl_dcp.adapters.replay_buffer import ReplayBufferAdapter
from torchrl_dcp.adapters.rng import GeneratorAdapter, RNGState, RNGStateAdapter, TorchrlGlobalRNGAdapter
from torchrl_dcp.adapters.state_dict import ParameterSchedulerAdapter
from torchrl_dcp.adapters.tensor import TensorAdapter
from torchrl_dcp.adapters.tensordict import TensorDictAdapter
from torchrl_dcp.adapters.trainer import register_trainer_adapters

__all__ = ["register_default_adapters"]


def register_default_adapters() -> None:
    """Register every adapter this package ships for the types it serves."""
    register_adapter(torch.nn.Module, ModuleAdapter())
    register_adapter(EnvBase, EnvAdapter())  # an env is a module: matched first along its MRO (adapters/env.py)
    register_adapter(torch.optim.Optimizer, OptimizerAdapter())
    register_adapter(TensorDictBase, TensorDictAdapter())
    register_adapter(torch.Tensor, TensorAdapter())
    register_adapter(RNGState, RNGStateAdapter())
    try:
        from torchrl.checkpoint import GlobalRNGState
    except ImportError:  # (a torchrl without torchrl.checkpoint)
        GlobalRNGState = None
    if GlobalRNGState is not None:
        register_adapter(GlobalRNGState, TorchrlGlobalRNGAdapter())
    register_adapter(torch.Generator, GeneratorAdapter())
    register_adapter(random.Random, PythonRandomAdapter())
    register_adapter(np.random.Generator, NumpyGeneratorAdapter())
    register_adapter(np.random.RandomState, NumpyRandomStateAdapter())
    register_adapter(ReplayBuffer, ReplayBufferAdapter())
    try:
        from torchrl.data.replay_buffers.scheduler import ParameterScheduler
    except ImportError:  # (a torchrl without them)
        ParameterScheduler = None
    if ParameterScheduler is not None:
        register_adapter(ParameterScheduler, ParameterSchedulerAdapter())
    register_adapter(BaseCollector, MultiCollectorAdapter())
    register_adapter(Collector, CollectorAdapter())
    register_trainer_adapters()

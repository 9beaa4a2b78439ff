"""What a torchrl ``Trainer`` registers by name: placements, and hooks / loggers that reshard.

A ``Trainer`` bound to a checkpoint registers its hooks as ``trainer_module.<name>``
and its ``logger``. Their state is small and of two kinds (torchrl 0.14.1,
``torchrl/trainers/trainers.py``):

- **the replicated learner's**: ``LRSchedulerHook`` (scheduler of the replicated
  optimizer), ``OptimizerHook`` (the optimizer), ``ValueEstimatorHook`` (the loss's
  value estimator): identical on every rank, placed ``replicated`` (checked to be
  identical at save, loadable at any world size);
- **each rank's own**: counters (``UpdateWeights``, ``CountFramesLog``,
  ``ClearCudaCache``, ``LogValidationReward``), ``RewardNormalizer`` statistics of the
  rank's own rewards, logging settings, and the logger's run name, directory and
  counters: placed ``per_rank``. After a world-size change new rank ``r`` takes the
  state of saved rank ``r % saved_world_size`` (:class:`TrainerHookAdapter`), as
  collectors and RNG streams do.

Example:
    >>> from torchrl.trainers.trainers import CountFramesLog, LRSchedulerHook
    >>> trainer_placement("trainer_module.count_frames_log")
    'per_rank'
    >>> trainer_placement("policy") is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrl_dcp.adapters.base import AdapterContext
from torchrl_dcp.adapters.registry import register_adapter
from torchrl_dcp.adapters.state_dict import StateDictAdapter
from torchrl_dcp.placement import Placement

__all__ = ["TrainerHookAdapter", "replicated_hook_types", "trainer_placement"]

#: the names ``Trainer._sync_checkpoint_components`` registers hooks and the logger under
HOOK_PREFIX = "trainer_module."
LOGGER = "logger"


def replicated_hook_types() -> tuple[type, ...]:
    """Hook types whose state belongs to the replicated learner (identical on every rank)."""
    from torchrl.trainers.trainers import LRSchedulerHook, OptimizerHook, ValueEstimatorHook

    return (LRSchedulerHook, OptimizerHook, ValueEstimatorHook)


def trainer_placement(name: str, component: Any = None) -> Placement | None:
    """Placement of what a ``Trainer`` registers as ``name`` (``None``: decide by the component's type).

    ``trainer_module.<hook>`` and ``logger`` are ``per_rank`` unless ``component`` is a hook
    holding the replicated learner's state (:func:`replicated_hook_types`), which is
    ``replicated``. Without ``component`` the answer is ``per_rank`` (always safe at the same
    world size; resharded by :class:`TrainerHookAdapter`).

    Example:
        >>> import torch
        >>> from torchrl.trainers.trainers import LRSchedulerHook
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> trainer_placement("trainer_module.lr_scheduler", LRSchedulerHook(torch.optim.lr_scheduler.StepLR(opt, 5)))
        'replicated'
    """
    if not (name.startswith(HOOK_PREFIX) or name == LOGGER):
        return None
    if component is not None and name.startswith(HOOK_PREFIX) and isinstance(component, replicated_hook_types()):
        return "replicated"
    return "per_rank"


#: Attributes torchrl hooks compute lazily and their ``state_dict`` leaves out, by hook class name: computing them
#: again after a restore would change what training does (``OfflineToOnlineReplayBufferHook`` finds its offline
#: keys with ``offline.sample(1)``, a draw from the global RNG stream the uninterrupted run made only once).
LAZY_HOOK_ATTRIBUTES: dict[str, tuple[str, ...]] = {"OfflineToOnlineReplayBufferHook": ("_offline_keys",)}
LAZY_KEY = "_tdcp_lazy_attributes"  # where the state dict carries them


class TrainerHookAdapter(StateDictAdapter):
    """``state_dict`` / ``load_state_dict`` of Trainer hooks and loggers, reshardable.

    The payload is the generic state-dict adapter's (same id and version: checkpoints
    saved before load unchanged). After a world-size change, new rank ``r`` loads the
    state saved by rank ``r % saved_world_size`` (counters, normaliser statistics,
    logger run name and directory continue from that rank's).
    """

    default_placement = "per_rank"
    can_reshard = True

    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        state = super().state(obj, ctx)
        lazy = LAZY_HOOK_ATTRIBUTES.get(type(obj).__name__, ())
        if lazy and isinstance(state, Mapping):
            state = {**state, LAZY_KEY: {a: getattr(obj, a, None) for a in lazy}}
        return state

    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        lazy = state.get(LAZY_KEY) if isinstance(state, Mapping) else None
        if lazy is not None:
            state = {k: v for k, v in state.items() if k != LAZY_KEY}
        out = super().restore(obj, state, ctx)
        for attr, value in (lazy or {}).items():
            if attr in LAZY_HOOK_ATTRIBUTES.get(type(obj).__name__, ()):
                setattr(obj, attr, value)
        return out

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return [ctx.rank % (ctx.saved_world_size or len(saved) or 1)]

    def reshard(self, obj: Any, states: dict[int, Any], ctx: AdapterContext) -> Any:
        (state,) = states.values()
        return self.restore(obj, state, ctx)


def register_trainer_adapters() -> None:
    """Use :class:`TrainerHookAdapter` for every ``TrainerHookBase`` and torchrl ``Logger``."""
    from torchrl.record.loggers import Logger
    from torchrl.trainers.trainers import TrainerHookBase

    adapter = TrainerHookAdapter()
    for klass in (TrainerHookBase, Logger):
        register_adapter(klass, adapter)  # by type only: the id stays the generic state-dict adapter's

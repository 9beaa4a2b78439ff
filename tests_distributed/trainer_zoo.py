"""One small, real instance of every Trainer class torchrl ships, bound to a DistributedCheckpoint.

:func:`trainer_classes` enumerates ``torchrl.trainers.algorithms`` (every submodule, every ``Trainer`` subclass
defined there), so a Trainer class added to torchrl appears in the conformance suite by itself: as a failing case
until :data:`BUILDERS` knows how to build it, or skipped with the reason in :data:`SKIPS`.

Every builder makes the same job shape: Pendulum (its torque discretised for DQN) with per-rank env seeds, a learner
replicated on every rank (same initial weights, gradients averaged over ranks), a per-rank replay buffer where
the algorithm has one, and scheduled saves every ``save_every`` collected frames.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import Categorical, LazyTensorStorage, ReplayBuffer
from torchrl.data.replay_buffers import SamplerWithoutReplacement
from torchrl.envs import ActionDiscretizer
from torchrl.modules import MLP, EGreedyModule, ProbabilisticActor, QValueActor, TanhModule, TanhNormal, ValueOperator

import torchrl_dcp as tdcp
from torchrl_dcp.examples.sac import make_env

FRAMES_PER_BATCH = 16
HIDDEN = 16

#: Trainer classes not built here, and why (a Trainer class torchrl adds is neither here nor in BUILDERS: it fails)
SKIPS: dict[str, str] = {}
if importlib.util.find_spec("transformers") is None:
    SKIPS["GRPOTrainer"] = (
        "GRPOTrainer fine-tunes language models (an LLM collector, a transformers or vLLM policy): "
        "transformers is not installed"
    )


def trainer_classes() -> dict[str, type]:
    """Every ``Trainer`` subclass defined in a submodule of ``torchrl.trainers.algorithms``, by name."""
    import torchrl.trainers.algorithms as package
    from torchrl.trainers.trainers import Trainer

    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
        if ".configs" in info.name:  # the Hydra config dataclasses, not trainers
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, Trainer) and obj.__module__ == module.__name__:
                found[name] = obj
    return dict(sorted(found.items()))


def average_gradients_over_ranks(module: torch.nn.Module) -> None:
    """One replicated learner: the example's gradient averaging, on ranks only (the hooks matrix runs one process)."""
    if dist.is_initialized():
        from torchrl_dcp.examples.sac_trainer import average_gradients_over_ranks as average

        average(module)


def _mlp(n_in: int, n_out: int) -> MLP:
    return MLP(in_features=n_in, out_features=n_out, num_cells=[HIDDEN], activation_class=torch.nn.Tanh)


def _stochastic_actor(env: Any) -> ProbabilisticActor:
    net = torch.nn.Sequential(_mlp(2, 2), NormalParamExtractor())
    return ProbabilisticActor(
        TensorDictModule(net, ["observation"], ["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=env.action_spec,
        distribution_class=TanhNormal,
        distribution_kwargs={"low": env.action_spec.space.low, "high": env.action_spec.space.high},
        return_log_prob=True,
    )


def _deterministic_actor(env: Any) -> TensorDictSequential:
    return TensorDictSequential(
        TensorDictModule(_mlp(2, 1), ["observation"], ["param"]),
        TanhModule(in_keys=["param"], out_keys=["action"], spec=env.action_spec),
    )


def _q(env: Any) -> ValueOperator:
    return ValueOperator(_mlp(3, 1), in_keys=["observation", "action"])


def _critic() -> ValueOperator:
    return ValueOperator(_mlp(2, 1), in_keys=["observation"])


def _buffer(capacity: int = 512, batch_size: int = 16) -> ReplayBuffer:
    return ReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=batch_size)


def _common(kind: str, rank: int, env: Any, policy: Any, loss: Any, args: dict[str, Any]) -> dict[str, Any]:
    average_gradients_over_ranks(loss)
    return {
        "collector": Collector(
            env, policy, frames_per_batch=FRAMES_PER_BATCH, total_frames=-1, auto_register_policy_transforms=False
        ),
        "total_frames": args["total_frames"],
        "frame_skip": 1,
        "optim_steps_per_batch": 2,
        "loss_module": loss,
        "optimizer": torch.optim.Adam(loss.parameters(), lr=1e-3),
        "progress_bar": False,
        "enable_logging": False,
        "checkpoint": tdcp.DistributedCheckpoint(),
        "checkpoint_rotation": tdcp.CheckpointRotation(args["ckpt_dir"], keep_last=2, every_steps=args["save_every"]),
    }


def _soft_update(loss: Any) -> Any:
    from torchrl.objectives import SoftUpdate

    return SoftUpdate(loss, eps=0.9)


def build_sac(kind: str, rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from torchrl.objectives import SACLoss

    env = make_env(1000 + rank, torch.device("cpu"))
    torch.manual_seed(0)
    actor = _stochastic_actor(env)
    loss = SACLoss(actor, _q(env), num_qvalue_nets=2, deactivate_vmap=True)
    loss.make_value_estimator(gamma=0.99)
    kw = _common(kind, rank, env, actor, loss, args)
    return {**kw, "replay_buffer": _buffer(), "target_net_updater": _soft_update(loss)}


def build_offline_to_online(kind: str, rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from torchrl.data import OfflineToOnlineReplayBuffer

    kw = build_sac(kind, rank, args)
    offline = _buffer(capacity=64)
    env = make_env(5000 + rank, torch.device("cpu"))
    torch.manual_seed(7 + rank)
    offline.extend(env.rollout(48, break_when_any_done=False).reshape(-1))  # random actions
    kw["replay_buffer"] = OfflineToOnlineReplayBuffer(offline, online_capacity=256, batch_size=16)
    return kw


def build_ddpg_td3(kind: str, rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from torchrl.objectives import DDPGLoss, TD3Loss

    env = make_env(1000 + rank, torch.device("cpu"))
    torch.manual_seed(0)
    actor = _deterministic_actor(env)
    if kind == "TD3Trainer":
        loss = TD3Loss(actor, _q(env), action_spec=env.action_spec, num_qvalue_nets=2, deactivate_vmap=True)
    else:
        loss = DDPGLoss(actor, _q(env))
    loss.make_value_estimator(gamma=0.99)
    kw = _common(kind, rank, env, actor, loss, args)
    return {**kw, "replay_buffer": _buffer(), "target_net_updater": _soft_update(loss)}


def build_iql_cql(kind: str, rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from torchrl.objectives import CQLLoss, IQLLoss

    env = make_env(1000 + rank, torch.device("cpu"))
    torch.manual_seed(0)
    actor = _stochastic_actor(env)
    if kind == "IQLTrainer":
        loss = IQLLoss(actor, _q(env), _critic(), deactivate_vmap=True)
    else:
        loss = CQLLoss(actor, _q(env), deactivate_vmap=True)
    loss.make_value_estimator(gamma=0.99)
    kw = _common(kind, rank, env, actor, loss, args)
    return {**kw, "replay_buffer": _buffer(), "target_net_updater": _soft_update(loss)}


def build_dqn(kind: str, rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from torchrl.objectives import DQNLoss

    env = make_env(1000 + rank, torch.device("cpu"))
    env.append_transform(ActionDiscretizer(5, categorical=True))  # 5 torques: one categorical action
    torch.manual_seed(0)
    qnet = QValueActor(
        _mlp(2, 5), in_keys=["observation"], spec=Categorical(5, shape=(1,)), action_space="categorical",
        strict_shape="auto",
    )  # fmt: skip
    greedy = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=200)
    loss = DQNLoss(qnet, action_space="categorical")
    loss.make_value_estimator(gamma=0.99)
    kw = _common(kind, rank, env, TensorDictSequential(qnet, greedy), loss, args)
    return {**kw, "replay_buffer": _buffer(), "target_net_updater": _soft_update(loss), "greedy_module": greedy}


def build_on_policy(kind: str, rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from torchrl.objectives import A2CLoss, ClipPPOLoss, ReinforceLoss

    env = make_env(1000 + rank, torch.device("cpu"))
    torch.manual_seed(0)
    actor, critic = _stochastic_actor(env), _critic()
    loss_type = {"A2CTrainer": A2CLoss, "ReinforceTrainer": ReinforceLoss}.get(kind, ClipPPOLoss)
    loss = loss_type(actor, critic)
    kw = _common(kind, rank, env, actor, loss, args)
    buffer = ReplayBuffer(
        storage=LazyTensorStorage(FRAMES_PER_BATCH), sampler=SamplerWithoutReplacement(), batch_size=8
    )
    epochs = args.get("num_epochs") or 2  # (one epoch: the buffer's generator pauses after an iteration's last batch)
    return {**kw, "replay_buffer": buffer, "num_epochs": epochs, "gamma": 0.99, "lmbda": 0.95}


BUILDERS: dict[str, Callable[[str, int, dict[str, Any]], dict[str, Any]]] = {
    "A2CTrainer": build_on_policy,
    "CQLTrainer": build_iql_cql,
    "DDPGTrainer": build_ddpg_td3,
    "DQNTrainer": build_dqn,
    "IQLTrainer": build_iql_cql,
    "OfflineToOnlineTrainer": build_offline_to_online,
    "OnPolicyTrainer": build_on_policy,
    "PPOTrainer": build_on_policy,
    "ReinforceTrainer": build_on_policy,
    "SACTrainer": build_sac,
    "TD3Trainer": build_ddpg_td3,
}


def build_trainer(
    kind: str,
    rank: int,
    ckpt_dir: str | Path,
    *,
    total_frames: int,
    save_every: int,
    logger: Any = None,
    num_epochs: int | None = None,
) -> Any:
    """``kind`` (a Trainer class name) built for this rank, its checkpoint bound, its scheduled saves set; ``logger``:
    the Trainer's (``None``: none); ``num_epochs``: an on-policy Trainer's (``None``: 2)."""
    if kind in SKIPS:
        raise RuntimeError(f"{kind} is not built here: {SKIPS[kind]}")
    if kind not in BUILDERS:
        raise NotImplementedError(f"no conformance builder for torchrl's {kind}: add one to trainer_zoo.BUILDERS")
    args = {"total_frames": total_frames, "save_every": save_every, "ckpt_dir": str(ckpt_dir), "num_epochs": num_epochs}
    kwargs = BUILDERS[kind](kind, rank, args)
    if logger is not None:
        kwargs["logger"] = logger
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental/prototype feature" and similar torchrl notices
        return trainer_classes()[kind](**kwargs)

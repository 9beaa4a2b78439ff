"""torchrl's ``SACTrainer`` built from a YAML config (torchrl's config system) with torchrl_dcp checkpoints.

``configs/sac_trainer.yaml`` composes torchrl's ``trainer: sac`` config with its optimizer, target updater and
replay-buffer configs, and ours (:mod:`torchrl_dcp.configs`) for ``checkpoint`` and ``checkpoint_rotation``;
``hydra.utils.instantiate`` builds the Trainer, and the Trainer binds the rotation (its schedule, retention and
SIGTERM preemption). The script resumes from the newest committed checkpoint, trains and flushes the rotation.
The env is torchrl's ``PendulumEnv`` (nothing to install); the collector and loss builders below are the two
``_target_`` s of the YAML that torchrl has no config for. Needs ``pip install 'torchrl_dcp[hydra]'``.

Run (arguments after the options are Hydra overrides):
    python -m torchrl_dcp.examples.sac_trainer_config                              # trains 512 frames
    python -m torchrl_dcp.examples.sac_trainer_config trainer.total_frames=1024    # resumes, trains on
    torchrun --standalone --nproc-per-node 2 -m torchrl_dcp.examples.sac_trainer_config
    python -m torchrl_dcp.examples.sac_trainer_config --config my.yaml trainer.checkpoint_rotation.keep_last=3
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrl.collectors import Collector

import torchrl_dcp as tdcp
from torchrl_dcp.examples.sac import fingerprint, make_env, make_learner
from torchrl_dcp.examples.sac_trainer import average_gradients_over_ranks

CONFIG = Path(__file__).resolve().parent / "configs" / "sac_trainer.yaml"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def make_collector(frames_per_batch: int, hidden: int) -> Collector:
    """The rank's collector: its own seeded ``PendulumEnv`` and a copy of the actor (the SACTrainer copies the
    learner's weights into it after every step)."""
    env = make_env(seed=1000 + _rank(), device=torch.device("cpu"))
    actor, _ = make_learner(env, torch.device("cpu"), hidden)
    return Collector(
        env, actor, frames_per_batch=frames_per_batch, total_frames=-1, auto_register_policy_transforms=False
    )


def make_loss(hidden: int, actor_network: Any = None, critic_network: Any = None) -> Any:
    """The SAC loss (actor, twin critics, value estimator), identical on every rank; with several ranks, gradients
    are averaged over them so that the unchanged Trainer loop trains one replicated learner."""
    if actor_network is not None or critic_network is not None:
        raise ValueError("make_loss builds its own networks: leave trainer.actor_network and critic_network unset")
    _, loss = make_learner(make_env(seed=0, device=torch.device("cpu")), torch.device("cpu"), hidden)
    if dist.is_initialized():
        average_gradients_over_ranks(loss)
    return loss


def compose(config: str | os.PathLike = CONFIG, overrides: list[str] | None = None) -> Any:
    """The composed config (torchrl's and torchrl_dcp's config groups registered first)."""
    import torchrl.trainers.algorithms.configs  # noqa: F401  (registers torchrl's groups)
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import torchrl_dcp.configs  # noqa: F401  (registers checkpoint/torchrl_dcp, checkpoint_rotation/torchrl_dcp)

    path = Path(config).resolve()
    with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
        return hydra_compose(config_name=path.stem, overrides=list(overrides or ()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(CONFIG), help="the YAML file (default: configs/sac_trainer.yaml)")
    p.add_argument("--print-config", action="store_true", help="print the composed config and exit")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.total_frames=1024")
    args = p.parse_args(argv)
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = compose(args.config, args.overrides)
    if args.print_config:
        print(OmegaConf.to_yaml(cfg), end="")
        return
    if "RANK" in os.environ and not dist.is_initialized():
        tdcp.init_process_group("gloo")
    rank = _rank()
    trainer = instantiate(cfg.trainer)  # our checkpoint and rotation first, then torchrl's SACTrainer factory
    torch.manual_seed(2000 + rank)  # each rank explores and samples its buffer with its own streams
    np.random.seed(2000 + rank)
    random.seed(2000 + rank)
    rotation = trainer.checkpoint_rotation
    info = rotation.resume(trainer.checkpoint)  # the rotation's own resume: every_steps counts from the resumed step
    if rank == 0:
        print("starting fresh" if info is None else f"resumed from frame {info.step}", flush=True)
    trainer.train()
    rotation.close()  # an async save in flight commits; the signal handlers are restored
    if rank == 0 and rotation.preempted:
        print(f"preempted: saved frame {trainer.collected_frames}", flush=True)
    loss = trainer.loss_module
    sys.stdout.write(
        f"rank {rank} final frames={trainer.collected_frames} learner={fingerprint(*loss.state_dict().values())} "
        f"saved={[e.step for e in rotation.entries()]}\n"
    )
    sys.stdout.flush()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

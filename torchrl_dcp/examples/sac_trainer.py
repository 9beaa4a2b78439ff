"""torchrl's ``SACTrainer`` with distributed checkpoints: the Trainer script unchanged but for two arguments.

The Trainer registers its components (policy, loss module, optimizer, collector,
replay buffer, target updater, its counters and hooks) through ``checkpoint=``;
``DistributedCheckpoint`` places the buffer and collector per rank, the learner
replicated, and adds per-rank RNG streams. Saves go through
``checkpoint_rotation=`` (DCP, atomic, the newest kept): every ``--save-every`` frames
and, when ``torchrun`` receives SIGTERM (a scheduler preempting the job), once more at the
end of the iteration in progress, after which ``train()`` returns and the job exits.
``tdcp.resume`` restarts from the latest committed checkpoint. Gradients are averaged over ranks by hooks
on the parameters, so the unchanged Trainer loop trains one replicated learner.

Run:
    torchrun --standalone --nproc-per-node 2 -m torchrl_dcp.examples.sac_trainer --frames 2048
    torchrun --standalone --nproc-per-node 2 -m torchrl_dcp.examples.sac_trainer --frames 4096   # resumes
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
from torchrl.objectives import SoftUpdate
from torchrl.record.loggers import CSVLogger
from torchrl.trainers.algorithms import SACTrainer
from torchrl.trainers.trainers import CountFramesLog, LRSchedulerHook

import torchrl_dcp as tdcp
from torchrl_dcp.examples.sac import fingerprint, make_env, make_learner


def average_gradients_over_ranks(module: torch.nn.Module) -> None:
    """All-reduce (mean) each parameter's gradient as soon as it is accumulated."""
    world = dist.get_world_size()

    def hook(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad)
        param.grad /= world

    for param in module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=2048, help="total frames per rank")
    p.add_argument("--frames-per-batch", type=int, default=64)
    p.add_argument("--save-every", type=int, default=512, help="frames between scheduled saves")
    p.add_argument("--ckpt-dir", default="ckpts/sac_trainer")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--hooks", action="store_true", help="also an LR-scheduler hook, a frame counter and a CSV logger")
    p.add_argument("--reshard", action="store_true", help="resume from a checkpoint saved by another number of ranks")
    p.add_argument("--async-saves", action="store_true", help="scheduled saves in the background")
    args = p.parse_args(argv)

    if "RANK" in os.environ and not dist.is_initialized():
        tdcp.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    env = make_env(seed=1000 + rank, device=torch.device("cpu"))
    actor, loss = make_learner(env, torch.device("cpu"), args.hidden)
    target = SoftUpdate(loss, eps=0.99)
    optimizer = torch.optim.Adam(loss.parameters(), lr=3e-3)
    if dist.is_initialized():
        average_gradients_over_ranks(loss)
    torch.manual_seed(2000 + rank)
    np.random.seed(2000 + rank)
    random.seed(2000 + rank)
    collector = Collector(
        env, actor, frames_per_batch=args.frames_per_batch, total_frames=-1, auto_register_policy_transforms=False
    )
    buffer = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(1024), batch_size=32)
    trainer = SACTrainer(
        collector=collector,
        total_frames=args.frames,
        frame_skip=1,
        optim_steps_per_batch=2,
        loss_module=loss,
        optimizer=optimizer,
        replay_buffer=buffer,
        target_net_updater=target,
        progress_bar=False,
        enable_logging=False,
        logger=CSVLogger("sac", log_dir=f"{args.ckpt_dir}-logs/rank{rank}") if args.hooks else None,
        checkpoint=tdcp.DistributedCheckpoint(),  # <- the two arguments
        checkpoint_rotation=tdcp.CheckpointRotation(  # <-
            args.ckpt_dir,
            keep_last=2,
            every_steps=args.save_every,  # steps are collected frames, as in torchrl's own checkpoints
            async_saves=args.async_saves,
            preemption_signals=(signal.SIGTERM,),
        ),
    )
    if args.hooks:  # registered as trainer_module.<name>: per rank, resharded by rank % saved ranks
        LRSchedulerHook(torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.9)).register(trainer)
        CountFramesLog(frame_skip=1).register(trainer)
    info = tdcp.resume(trainer.checkpoint, args.ckpt_dir, **({"world_size_change": "reshard"} if args.reshard else {}))
    if rank == 0:
        placements = {n: trainer.checkpoint.placement(n) for n in trainer.checkpoint.components}
        print(f"placements: {placements}", flush=True)
        print("starting fresh" if info is None else f"resumed from frame {info.step}", flush=True)
    trainer.train()
    trainer.checkpoint_rotation.close()  # an async save in flight commits; the signal handler is restored
    if rank == 0 and trainer.checkpoint_rotation.preempted:
        print(f"preempted: saved frame {trainer.collected_frames}", flush=True)
    idx = torch.arange(buffer._sampler._max_capacity)
    storage = buffer._storage._storage
    if os.environ.get("TDCP_DUMP"):
        torch.save(
            {str(k): storage.get(k)[: len(buffer)] for k in storage.keys(True, True)},
            f"{os.environ['TDCP_DUMP']}.{rank}.pt",
        )
    prints = {
        "learner": fingerprint(*loss.state_dict().values()),
        "optimizer": fingerprint(*(t for s in optimizer.state.values() for t in s.values())),
        "buffer": fingerprint(*(storage.get(k)[: len(buffer)] for k in sorted(storage.keys(True, True), key=str))),
        "trees": fingerprint(buffer._sampler._sum_tree[idx]),
        "rng": fingerprint(torch.rand(3), torch.from_numpy(np.random.rand(3))),
        "frames": str(trainer.collected_frames),
        **({"lr": f"{optimizer.param_groups[0]['lr']:.6g}"} if args.hooks else {}),
    }
    sys.stdout.write(f"rank {rank} final " + " ".join(f"{k}={v}" for k, v in prints.items()) + "\n")  # one write:
    sys.stdout.flush()  # lines of different ranks never interleave
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

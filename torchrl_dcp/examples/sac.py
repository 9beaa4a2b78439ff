"""Multi-rank SAC on ``PendulumEnv`` that checkpoints every N iterations and resumes exactly (the main job).

Every rank collects with its own ``Collector`` into its own prioritized replay
shard; the learner (actor, twin Q networks, temperature, target networks,
optimizer, LR schedule) is replicated and kept identical by all-reducing the
gradients. Checkpoints hold the learner once and every rank's collector,
buffer and RNG streams, and are committed atomically; ``--resume`` continues
from the newest committed one. The last lines print fingerprints of the
weights, the buffer and the RNG streams: a run that was killed and resumed
prints the same ones as a run that never stopped.

The printed ``return`` is the mean return of the rank's last 20 finished episodes
(100 steps each): about -550 for a random policy; the default run reaches about -300
by iteration 100 and -120 to -240 after the resume (2 ranks on 2 CPU cores: ~2.5 minutes for both).
Each checkpoint save prints how long it took. When ``torchrun`` receives SIGTERM (a
scheduler preempting the job: Slurm, Kubernetes, a spot instance), every rank finishes
its iteration, the job saves that iteration on every rank and exits cleanly; resume with
``--resume``.

Resuming: the checkpoint holds the run's training configuration (``config``:
frames per batch, updates per batch, batch size, buffer size, hidden width, learning
rate and its schedule, number of ranks). ``--resume`` adopts the saved values and
prints a ``note:`` line for every option given differently on the command line;
a different number of ranks is reported too (the per-rank state needs the same
count). ``--iterations`` is the total to reach and may change freely: the LR
schedule halves every ``--lr-decay-every`` iterations *done*, never depending on
the total asked for.

Run (2 ranks on CPU):
    torchrun --standalone --nproc-per-node 2 -m torchrl_dcp.examples.sac
    torchrun --standalone --nproc-per-node 2 -m torchrl_dcp.examples.sac --resume --iterations 150
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDictBase
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
from torchrl.envs import CatTensors, Compose, PendulumEnv, RewardSum, StepCounter, TransformedEnv, UnsqueezeTransform
from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
from torchrl.objectives import SACLoss, SoftUpdate

import torchrl_dcp as tdcp


def make_env(seed: int, device: torch.device) -> TransformedEnv:
    env = TransformedEnv(
        PendulumEnv(device=device),
        Compose(
            UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
            CatTensors(["th", "thdot"], "observation", del_keys=False),
            StepCounter(max_steps=100),
            RewardSum(),
        ),
    )
    env.set_seed(seed)
    return env


def make_learner(env: TransformedEnv, device: torch.device, hidden: int) -> tuple[Any, SACLoss]:
    torch.manual_seed(0)  # identical learner on every rank
    actor_net = torch.nn.Sequential(
        MLP(in_features=2, out_features=2, num_cells=[hidden, hidden], activation_class=torch.nn.Tanh),
        NormalParamExtractor(),
    )
    actor = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=env.action_spec,
        distribution_class=TanhNormal,
        distribution_kwargs={"low": env.action_spec.space.low, "high": env.action_spec.space.high},
        return_log_prob=False,
    ).to(device)
    qvalue = ValueOperator(
        MLP(in_features=3, out_features=1, num_cells=[hidden, hidden], activation_class=torch.nn.Tanh),
        in_keys=["observation", "action"],
    ).to(device)
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2, loss_function="l2", deactivate_vmap=True)
    loss.make_value_estimator(gamma=0.99)
    return actor, loss


def fingerprint(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class Job:
    """Everything one rank holds, built identically on a fresh start and on a resume."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.env = make_env(seed=1000 + rank, device=device)
        self.actor, self.loss = make_learner(self.env, device, args.hidden)
        self.target = SoftUpdate(self.loss, eps=0.99)  # built before any load: it copies online -> target weights
        self.optimizer = torch.optim.Adam(self.loss.parameters(), lr=args.lr)
        # the schedule depends on iterations done, never on how many the user asks for (--iterations)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=args.lr_decay_every, gamma=0.5)
        torch.manual_seed(2000 + rank)  # each rank explores (torch) and samples its buffer (numpy) with its own streams
        np.random.seed(2000 + rank)
        random.seed(2000 + rank)
        self.collector = Collector(
            self.env,
            self.actor,
            frames_per_batch=args.frames_per_batch,
            total_frames=-1,
            auto_register_policy_transforms=False,
        )
        self.buffer = TensorDictPrioritizedReplayBuffer(
            alpha=0.7, beta=0.5, storage=LazyTensorStorage(args.buffer_size, device=device), batch_size=args.batch_size
        )
        self.counters = {"iteration": 0, "frames": 0, "updates": 0}
        self.config = training_config(args, world)  # replicated: what a resume must not change silently
        self.returns: list[float] = []  # returns of this rank's finished episodes
        self.last_batch: TensorDictBase | None = None
        self.last_sampled = torch.zeros(0, dtype=torch.long)
        self.ckpt = tdcp.DistributedCheckpoint(
            actor=self.actor, loss=self.loss, optimizer=self.optimizer, scheduler=self.scheduler
        )
        self.ckpt.register("counters", self.counters)  # identical on every rank: replicated
        self.ckpt.register("config", self.config)  # the run's training configuration (JSON)
        self.ckpt.register("collector", self.collector)  # per_rank by default
        self.ckpt.register("buffer", self.buffer)  # per_rank by default
        self.ckpt.register("rng", tdcp.RNGState())  # per_rank, restored last
        self.rotation = tdcp.CheckpointRotation(
            args.ckpt_dir,
            keep_last=args.keep_last,
            every_steps=args.save_every,
            preemption_signals=(signal.SIGTERM,),  # torchrun forwards it to every worker
        )

    def iteration(self, batch: TensorDictBase) -> float:
        self.last_batch = batch
        done = batch["next", "done"].reshape(-1)
        self.returns += batch["next", "episode_reward"].reshape(-1)[done].tolist()
        self.buffer.extend(batch.reshape(-1))
        loss_value = 0.0
        if len(self.buffer) >= self.args.batch_size:
            for _ in range(self.args.updates_per_batch):
                sample = self.buffer.sample()
                losses = self.loss(sample)
                total = losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]
                self.optimizer.zero_grad()
                total.backward()
                if self.world > 1:
                    for p in self.loss.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= self.world
                self.optimizer.step()
                self.target.step()
                self.buffer.update_tensordict_priority(sample)
                self.last_sampled = sample["index"]
                self.counters["updates"] += 1
                loss_value = float(total.detach())
            self.scheduler.step()
        self.counters["iteration"] += 1
        self.counters["frames"] += batch.numel() * self.world
        return loss_value

    def fingerprints(self) -> dict[str, str]:
        storage = self.buffer._storage._storage
        sampler = self.buffer._sampler
        idx = torch.arange(sampler._max_capacity)
        return {
            "learner": fingerprint(*self.loss.state_dict().values(), *self.target_params()),
            "optimizer": fingerprint(*(t for s in self.optimizer.state.values() for t in s.values())),
            "buffer": fingerprint(
                *(storage[: len(self.buffer)].get(k) for k in sorted(storage.keys(True, True), key=str))
            ),
            "trees": fingerprint(sampler._sum_tree[idx], sampler._min_tree[idx]),
            "scheduler": fingerprint(
                torch.tensor([float(v) for v in self.scheduler.get_last_lr()]), torch.tensor(self.scheduler.last_epoch)
            ),
            "sampled": fingerprint(self.last_sampled),
            "batch": fingerprint(*(self.last_batch.get(k) for k in sorted(self.last_batch.keys(True, True), key=str)))
            if self.last_batch is not None
            else "none",
            "rng": fingerprint(torch.rand(4), torch.from_numpy(np.random.rand(4)), torch.tensor(random.random())),
        }

    def target_params(self) -> list[torch.Tensor]:
        return [p for name, p in self.loss.named_buffers() if "target" in name]


#: options that change what training does: a resume adopts the checkpoint's values (and says so)
TRAINING_OPTIONS = (
    "frames_per_batch",
    "updates_per_batch",
    "batch_size",
    "buffer_size",
    "hidden",
    "lr",
    "lr_decay_every",
)


def training_config(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """The options that shape training, and the number of ranks (saved in every checkpoint)."""
    return {**{k: getattr(args, k) for k in TRAINING_OPTIONS}, "world_size": world}


def adopt_saved_config(args: argparse.Namespace, saved: dict[str, Any], world: int) -> list[str]:
    """Make ``args`` use the checkpoint's training options; return one line per value that differed."""
    notes = []
    for key in TRAINING_OPTIONS:
        if key in saved and saved[key] != getattr(args, key):
            notes.append(
                f"--{key.replace('_', '-')} {getattr(args, key)} ignored: the run was trained with {saved[key]}"
            )
            setattr(args, key, saved[key])
    if saved.get("world_size", world) != world:
        notes.append(f"{world} ranks now, the run was saved by {saved['world_size']}: resume with as many ranks")
    return notes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Multi-rank SAC on PendulumEnv with distributed checkpoints.")
    p.add_argument("--iterations", type=int, default=100, help="collector batches per rank")
    p.add_argument("--frames-per-batch", type=int, default=64)
    p.add_argument("--updates-per-batch", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--buffer-size", type=int, default=2048, help="per-rank capacity (wraps around)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--lr-decay-every", type=int, default=100, help="halve the LR every N iterations (N done, not asked)"
    )
    p.add_argument("--save-every", type=int, default=25, help="iterations between checkpoints")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--ckpt-dir", default="ckpts/sac")
    p.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL every rank after this iteration (tests)")
    return p.parse_args(argv)


def adopt_latest_config(args: argparse.Namespace, world: int, say: Any) -> None:
    """Take the training options of the newest committed checkpoint (``--resume``), saying what changed."""
    latest = tdcp.CheckpointRotation(args.ckpt_dir).latest()
    if latest is not None and "config" in tdcp.read_manifest(latest)["components"]:
        from torchrl_dcp.extract import read_component

        for note in adopt_saved_config(args, read_component(latest, "config"), world):
            say(f"note: {note}", flush=True)


def report(say: Any, job: Any, batch: TensorDictBase, loss: float, elapsed: float) -> None:
    """One progress line (rank 0): the mean return of the last 20 episodes, reward, loss, LR, time."""
    it = job.counters["iteration"]
    reward = batch["next", "reward"].mean().item()
    recent = job.returns[-20:]
    ret = f"{sum(recent) / len(recent):8.1f}" if recent else "     n/a"
    say(
        f"iteration {it:4d}  frames {job.counters['frames']:6d}  return {ret} (last {len(recent)} episodes, "
        f"random policy ~ -550)  reward/step {reward:7.3f}  loss {loss:8.3f}  lr {job.scheduler.get_last_lr()[0]:.1e}"
        f"  {elapsed:5.1f}s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> dict[str, str]:
    args = parse_args(argv)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = (
        torch.device(f"cuda:{rank % torch.cuda.device_count()}") if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.resume:  # training options come from the run being resumed, not from this command line
        adopt_latest_config(args, world, say)
    job = Job(args, rank, world, device)
    say(f"SAC on PendulumEnv: {world} rank(s) on {device}, checkpoints in {args.ckpt_dir}", flush=True)

    if args.resume:
        info = job.rotation.resume(job.ckpt)  # the newest committed checkpoint (a damaged one is skipped)
        if info is None:
            say("no committed checkpoint found: starting fresh", flush=True)
        else:
            say(f"resumed from {info.path.name} (iteration {info.step}, {job.counters['frames']} frames)", flush=True)

    start = time.monotonic()
    collector = iter(job.collector)
    while job.counters["iteration"] < args.iterations:
        batch = next(collector)
        loss = job.iteration(batch)
        it = job.counters["iteration"]
        if it % 10 == 0:
            report(say, job, batch, loss, time.monotonic() - start)
        t0 = time.monotonic()
        path = job.rotation.maybe_save(job.ckpt, it, {"frames": job.counters["frames"]})  # when due, or preempted
        if path is not None:
            say(f"checkpoint saved: {path.name} in {time.monotonic() - t0:.2f}s", flush=True)
        if job.rotation.preempted:
            say(f"preempted: iteration {it} saved; resume with --resume", flush=True)
            break
        if args.kill_at is not None and it == args.kill_at:
            if dist.is_initialized():
                dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)

    job.rotation.close()
    prints = job.fingerprints()
    sys.stdout.write(f"rank {rank} final " + " ".join(f"{k}={v}" for k, v in prints.items()) + "\n")  # one write:
    sys.stdout.flush()  # lines of different ranks never interleave
    job.collector.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    return prints


if __name__ == "__main__":
    main()

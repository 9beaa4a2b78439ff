"""Multi-rank SAC on ``PendulumEnv`` that checkpoints every N iterations and resumes exactly (the main job).

Every rank collects with its own ``Collector`` into its own prioritized replay
shard; the learner (actor, twin Q networks, temperature, target networks,
optimizer, LR schedule) is replicated and kept identical by all-reducing the
gradients. Checkpoints hold the learner once and every rank's collector,
buffer and RNG streams, and are committed atomically; ``--resume`` continues
from the newest committed one. The last lines print fingerprints of the
weights, the buffer and the RNG streams: a run that was killed and resumed
prints the same ones as a run that never stopped.

Every 10 iterations rank 0 prints the mean return per 200-step episode of the episodes every rank ended in
those 10 iterations (a random policy scores about -1,250). Each rank's log of finished episodes is part of the
checkpoint (``episodes``), so the line after a resume averages the same episodes as a run that never stopped; rank
0 also writes the curve to ``<ckpt dir>/learning_curve.csv`` (a ``resumed`` row marks each resume; rows a killed run
logged after the checkpoint are dropped) and ``learning_curve.png`` when matplotlib is importable. Measured with 2
ranks on 2 CPU cores (about 3 minutes for both commands): -1364 at iteration 10, -198 at 50, -172 at 100, -116 at
150 after the resume (between -115 and -190 from iteration 60 on).
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
import csv
import hashlib
import os
import random
import signal
import sys
import time
from pathlib import Path
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

#: defaults of the training options (see ``TRAINING_OPTIONS``)
FRAMES_PER_BATCH, UPDATES_PER_BATCH, BATCH_SIZE, BUFFER_SIZE, HIDDEN, LR = 128, 48, 128, 16384, 128, 1e-3


def make_env(seed: int, device: torch.device, *, max_steps: int = 100) -> TransformedEnv:
    """Pendulum with ``observation = [th, thdot]``, episodes truncated after ``max_steps`` steps (the job uses 200)."""
    env = TransformedEnv(
        PendulumEnv(device=device),
        Compose(
            UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
            CatTensors(["th", "thdot"], "observation", del_keys=False),
            StepCounter(max_steps=max_steps),
            RewardSum(),
        ),
    )
    env.set_seed(seed)
    return env


class AngleFeatures(torch.nn.Module):
    """``net`` fed ``[cos th, sin th, rest...]`` for ``[th, rest...]``: the angle without its jump at +-pi (hanging).

    Several inputs (the Q network gets the observation and the action) are concatenated first, as ``MLP`` does.
    """

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        x = torch.cat(inputs, dim=-1)
        return self.net(torch.cat([x[..., :1].cos(), x[..., :1].sin(), x[..., 1:]], dim=-1))


def make_learner(
    env: TransformedEnv,
    device: torch.device,
    hidden: int,
    *,
    angle_features: bool = False,
    activation: type[torch.nn.Module] = torch.nn.Tanh,
) -> tuple[Any, SACLoss]:
    """The actor and the SAC loss (twin Q networks, temperature), identical on every rank (``torch.manual_seed(0)``).

    ``angle_features`` feeds both networks ``cos th, sin th`` instead of ``th`` (the main job does).
    """
    torch.manual_seed(0)  # identical learner on every rank
    extra = 1 if angle_features else 0

    def net(in_features: int, out_features: int) -> torch.nn.Module:
        mlp = MLP(
            in_features=in_features + extra,
            out_features=out_features,
            num_cells=[hidden, hidden],
            activation_class=activation,
        )
        return AngleFeatures(mlp) if angle_features else mlp

    actor_net = torch.nn.Sequential(net(2, 2), NormalParamExtractor())
    actor = ProbabilisticActor(
        TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=env.action_spec,
        distribution_class=TanhNormal,
        distribution_kwargs={"low": env.action_spec.space.low, "high": env.action_spec.space.high},
        return_log_prob=False,
    ).to(device)
    qvalue = ValueOperator(net(3, 1), in_keys=["observation", "action"]).to(device)
    loss = SACLoss(actor, qvalue, num_qvalue_nets=2, loss_function="l2", deactivate_vmap=True)
    loss.make_value_estimator(gamma=0.99)
    return actor, loss


def fingerprint(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


#: steps per Pendulum episode (truncated): the length Pendulum users know, where a random policy scores about -1,250
EPISODE_STEPS = 200
#: iterations between progress lines: each line averages the episodes (of all ranks) that ended in this many iterations
REPORT_EVERY = 10
#: finished episodes each rank keeps in its checkpointed log ([iteration, return] pairs)
KEEP_EPISODES = 64


def average_gradients(params: list[torch.nn.Parameter], world: int) -> None:
    """All-reduce every gradient in one flat collective (one call per update, not one per parameter) and average."""
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(chunk.view_as(g))


class Job:
    """Everything one rank holds, built identically on a fresh start and on a resume."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> None:
        self.args, self.rank, self.world, self.device = args, rank, world, device
        self.env = make_env(seed=1000 + rank, device=device, max_steps=EPISODE_STEPS)
        self.actor, self.loss = make_learner(
            self.env, device, args.hidden, angle_features=True, activation=torch.nn.ReLU
        )
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
        # the replay shard stays in host memory (torchrl's PyPI wheels build the sum trees for the CPU only:
        # a prioritized buffer on CUDA needs a CUDA build of torchrl); each sampled batch goes to `device`
        self.buffer = TensorDictPrioritizedReplayBuffer(
            alpha=0.7, beta=0.5, storage=LazyTensorStorage(args.buffer_size, device="cpu"), batch_size=args.batch_size
        )
        self.counters = {"iteration": 0, "frames": 0, "updates": 0}
        self.config = training_config(args, world)  # replicated: what a resume must not change silently
        # this rank's last finished episodes as [iteration it ended in, return]: checkpointed, so the progress
        # lines (and the learning curve) after a resume average the same episodes as a run that never stopped
        self.episodes: dict[str, list[list[float]]] = {"ended": []}
        self.last_batch: TensorDictBase | None = None
        self.last_sampled = torch.zeros(0, dtype=torch.long)
        self.ckpt = tdcp.DistributedCheckpoint(
            actor=self.actor, loss=self.loss, optimizer=self.optimizer, scheduler=self.scheduler
        )
        self.ckpt.register("counters", self.counters)  # identical on every rank: replicated
        self.ckpt.register("config", self.config)  # the run's training configuration (JSON)
        self.ckpt.register("episodes", self.episodes, placement="per_rank")  # this rank's episode log (JSON)
        self.ckpt.register("collector", self.collector)  # per_rank by default
        self.ckpt.register("buffer", self.buffer)  # per_rank by default
        self.ckpt.register("rng", tdcp.RNGState())  # per_rank, restored last
        self.rotation = tdcp.CheckpointRotation(
            args.ckpt_dir,
            keep_last=args.keep_last,
            every_steps=args.save_every,
            preemption_signals=(signal.SIGTERM,),  # torchrun forwards it to every worker
            local=tdcp.LocalTier(args.local_dir, every_steps=args.local_every) if args.local_dir else None,
        )

    def iteration(self, batch: TensorDictBase) -> float:
        self.last_batch = batch
        self.log_episodes(batch, self.counters["iteration"] + 1)
        self.buffer.extend(batch.reshape(-1))
        loss_value = 0.0
        if len(self.buffer) >= self.args.batch_size:
            for _ in range(self.args.updates_per_batch):
                loss_value = self.update()
            self.scheduler.step()
        self.counters["iteration"] += 1
        self.counters["frames"] += batch.numel() * self.world
        return loss_value

    def update(self) -> float:
        sample = self.buffer.sample().to(self.device)  # the priorities go back to the host trees below
        losses = self.loss(sample)
        total = losses["loss_actor"] + losses["loss_qvalue"] + losses["loss_alpha"]
        self.optimizer.zero_grad()
        total.backward()
        if self.world > 1:
            average_gradients(list(self.loss.parameters()), self.world)
        self.optimizer.step()
        self.target.step()
        self.buffer.update_tensordict_priority(sample)
        self.last_sampled = sample["index"]
        self.counters["updates"] += 1
        return float(total.detach())

    def log_episodes(self, batch: TensorDictBase, iteration: int) -> None:
        done = batch["next", "done"].reshape(-1)
        ended = self.episodes["ended"]
        ended += [[iteration, r] for r in batch["next", "episode_reward"].reshape(-1)[done].tolist()]
        del ended[:-KEEP_EPISODES]

    def recent_return(self) -> tuple[float | None, int]:
        """Mean return of the episodes every rank finished in the last ``REPORT_EVERY`` iterations (collective)."""
        first = self.counters["iteration"] - REPORT_EVERY
        recent = [r for it, r in self.episodes["ended"] if it > first]
        stats = torch.tensor([sum(recent), len(recent)], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(stats)
        count = int(stats[1])
        return (float(stats[0]) / count if count else None), count

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
            "episodes": fingerprint(torch.tensor(self.episodes["ended"], dtype=torch.float64)),
            "rng": fingerprint(torch.rand(4), torch.from_numpy(np.random.rand(4)), torch.tensor(random.random())),
        }

    def target_params(self) -> list[torch.Tensor]:
        return [p for name, p in self.loss.named_buffers() if "target" in name]


class LearningCurve:
    """``<ckpt dir>/learning_curve.csv`` (and ``.png`` when matplotlib is importable), written by rank 0 only.

    One row per progress line (``event`` ``progress``), plus ``start``, ``resumed`` and ``preempted`` rows. A resume
    from iteration N keeps the rows up to N (a killed run may have logged later ones: they are dropped), marks the
    resume and continues; every write replaces the file atomically (written beside it, then renamed).
    """

    COLUMNS = ("iteration", "frames", "episodes", "return", "event")

    def __init__(self, ckpt_dir: str, enabled: bool) -> None:
        self.enabled = enabled and "://" not in ckpt_dir  # a local directory (an object-store URL: no curve)
        self.csv = Path(ckpt_dir) / "learning_curve.csv"
        self.png = self.csv.with_suffix(".png")
        self.rows: list[dict[str, str]] = []

    def start(self, resumed_at: int | None, frames: int) -> None:
        """A fresh run starts a new curve; a resume keeps the rows up to its iteration and marks the resume."""
        if not self.enabled:
            return
        if resumed_at is not None and self.csv.is_file():
            with open(self.csv, newline="") as f:
                self.rows = [row for row in csv.DictReader(f) if int(row["iteration"]) <= resumed_at]
        if resumed_at is None:
            self.add(0, 0, 0, None, "start")
        else:
            self.add(resumed_at, frames, 0, None, "resumed")

    def add(self, iteration: int, frames: int, episodes: int, ret: float | None, event: str) -> None:
        if not self.enabled:
            return
        value = "" if ret is None else f"{ret:.2f}"
        self.rows.append(dict(zip(self.COLUMNS, map(str, (iteration, frames, episodes, value, event)), strict=True)))
        self.write()

    def write(self) -> None:
        self.csv.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.csv.with_name(f".{self.csv.name}.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.csv)
        self.plot()

    def plot(self) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:  # matplotlib is optional (the ``bench`` extra): the CSV is the curve
            return
        points = [(int(r["frames"]), float(r["return"])) for r in self.rows if r["return"]]
        fig, ax = plt.subplots(figsize=(7, 4))
        if points:
            ax.plot(*zip(*points, strict=True), marker=".")
        for r in self.rows:
            if r["event"] == "resumed":
                ax.axvline(int(r["frames"]), color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("frames (all ranks)")
        ax.set_ylabel(f"return per {EPISODE_STEPS}-step episode")
        ax.set_title("SAC on PendulumEnv (dashed: resumed)")
        ax.grid(True, alpha=0.3)
        tmp = self.png.with_name(f".{self.png.name}.tmp.png")
        fig.savefig(tmp, dpi=80, bbox_inches="tight")
        plt.close(fig)
        os.replace(tmp, self.png)


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
    p.add_argument("--frames-per-batch", type=int, default=FRAMES_PER_BATCH)
    p.add_argument("--updates-per-batch", type=int, default=UPDATES_PER_BATCH)
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    p.add_argument("--buffer-size", type=int, default=BUFFER_SIZE, help="per-rank capacity (wraps around)")
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument(
        "--lr-decay-every", type=int, default=100, help="halve the LR every N iterations (N done, not asked)"
    )
    p.add_argument("--save-every", type=int, default=25, help="iterations between checkpoints")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--ckpt-dir", default="ckpts/sac")
    p.add_argument("--resume", action="store_true", help="continue from the newest committed checkpoint")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL every rank after this iteration (tests)")
    p.add_argument(
        "--local-dir", default=None, help="a node-local tier (e.g. /dev/shm/sac): frequent saves, fast restarts"
    )
    p.add_argument("--local-every", type=int, default=5, help="iterations between saves to the node-local tier")
    return p.parse_args(argv)


def adopt_latest_config(args: argparse.Namespace, world: int, say: Any) -> None:
    """Take the training options of the newest committed checkpoint (``--resume``), saying what changed: the shared
    tier's, or this node's local tier's when it holds a newer step (what the resume restores then)."""
    from torchrl_dcp.local_tier import job_identity

    rotation = tdcp.CheckpointRotation(args.ckpt_dir)
    latest = rotation.latest()
    if args.local_dir:
        shared = tdcp.read_manifest(latest) if latest is not None else None
        local = tdcp.LocalTier(args.local_dir, every_steps=args.local_every).newest_part(
            job_identity(world, rotation.location.identity()),
            than=None if shared is None else (shared["step"], shared.get("sequence")),
        )
        if local is not None:
            latest = local[1]
    if latest is not None and "config" in tdcp.read_manifest(latest)["components"]:
        from torchrl_dcp.extract import read_component

        for note in adopt_saved_config(args, read_component(latest, "config"), world):
            say(f"note: {note}", flush=True)


def report(say: Any, job: Job, curve: LearningCurve, batch: TensorDictBase, loss: float, elapsed: float) -> None:
    """One progress line (rank 0; every rank calls it, the mean is collective) and its learning-curve row."""
    it, frames = job.counters["iteration"], job.counters["frames"]
    mean, count = job.recent_return()
    curve.add(it, frames, count, mean, "progress")
    ret = f"{mean:7.1f}" if mean is not None else "    n/a"
    say(
        f"iteration {it:4d}  frames {frames:6d}  return {ret} per {EPISODE_STEPS}-step episode "
        f"({count:2d} ended in iterations {max(it - REPORT_EVERY, 0) + 1}-{it}, all ranks; random ~ -1250)  "
        f"loss {loss:7.2f}  lr {job.scheduler.get_last_lr()[0]:.1e}  {elapsed:5.1f}s",
        flush=True,
    )


def setup(argv: list[str] | None) -> tuple[argparse.Namespace, Job, LearningCurve, Any]:
    """Parse the options, join the process group, build the job and resume it when asked."""
    args = parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if "RANK" in os.environ and not dist.is_initialized():  # restart-safe under torchrun
        # NCCL for CUDA tensors when every local rank has a GPU of its own (else gloo for all); gloo for the CPU
        # tensors of the progress lines either way (NCCL alone refuses them)
        tdcp.init_process_group("cpu:gloo,cuda:nccl" if 0 < local_ranks <= gpus else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank % gpus}") if gpus else torch.device("cpu")  # ranks may share a GPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
    say = print if rank == 0 else (lambda *a, **k: None)
    restarted = (tdcp.start_count() or 1) > 1  # torchrun --max-restarts restarted the workers
    if args.resume or restarted:  # training options come from the run being resumed, not from this command line
        adopt_latest_config(args, world, say)
    job = Job(args, rank, world, device)
    say(f"SAC on PendulumEnv: {world} rank(s) on {device}, checkpoints in {args.ckpt_dir}", flush=True)
    curve = LearningCurve(args.ckpt_dir, enabled=rank == 0)
    resumed_at = None
    if args.resume or restarted:
        info = job.rotation.resume(job.ckpt)  # the newest committed checkpoint (a damaged one is skipped)
        if info is None:
            say("no committed checkpoint found: starting fresh", flush=True)
        else:
            resumed_at = job.counters["iteration"]
            where = info.path.name if info.tier == "shared" else f"the {info.tier} tier"
            say(f"resumed from {where} (iteration {info.step}, {job.counters['frames']} frames)", flush=True)
    curve.start(resumed_at, job.counters["frames"])
    return args, job, curve, say


def main(argv: list[str] | None = None) -> dict[str, str]:
    args, job, curve, say = setup(argv)
    restarted = (tdcp.start_count() or 1) > 1
    start = time.monotonic()
    collector = iter(job.collector)
    while job.counters["iteration"] < args.iterations:
        batch = next(collector)
        loss = job.iteration(batch)
        it = job.counters["iteration"]
        if it % REPORT_EVERY == 0 or it == args.iterations:
            report(say, job, curve, batch, loss, time.monotonic() - start)
        t0 = time.monotonic()
        path = job.rotation.maybe_save(job.ckpt, it, {"frames": job.counters["frames"]})  # when due, or preempted
        if path is not None:
            say(f"checkpoint saved: {path.name} in {time.monotonic() - t0:.2f}s", flush=True)
        if job.rotation.preempted:
            curve.add(it, job.counters["frames"], 0, None, "preempted")
            say(f"preempted: iteration {it} saved; resume with --resume", flush=True)
            break
        if args.kill_at is not None and it == args.kill_at and not restarted:  # a restarted worker goes on
            if dist.is_initialized():
                dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)

    job.rotation.close()
    if curve.enabled:
        say(f"learning curve: {curve.csv}" + (f" and {curve.png.name}" if curve.png.is_file() else ""), flush=True)
    prints = job.fingerprints()
    sys.stdout.write(f"rank {job.rank} final " + " ".join(f"{k}={v}" for k, v in prints.items()) + "\n")  # one write:
    sys.stdout.flush()  # lines of different ranks never interleave
    job.collector.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    return prints


if __name__ == "__main__":
    main()

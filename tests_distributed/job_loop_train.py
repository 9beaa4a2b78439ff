"""A 2-rank training loop driven by ``CheckpointRotation.maybe_save`` with preemption, run under ``torchrun``.

Each rank holds a replicated learner (a linear model and Adam, gradients averaged over
ranks), its own replay buffer (torchrl ``ReplayBuffer`` over ``LazyTensorStorage``) and its
own RNG streams. A step writes 8 new transitions, samples 16, takes one optimizer step and
sleeps ``--step-ms``. The loop resumes from the rotation, saves through
``maybe_save(every_steps=...)`` (``--async-saves``: in the background), and leaves after a
preemption save. Each rank writes ``<out>/rank<r>.json``: the last step trained, whether it
was preempted and a digest of its whole state. Rank 0 appends ``step N`` (and ``async N``
when an async save started) to ``<out>/progress``.

Run:
    torchrun --nproc-per-node 2 -m tests_distributed.job_loop_train --dir ckpts --out out --steps 200
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

import torchrl_dcp as tdcp


def digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=15.0)
    p.add_argument("--async-saves", action="store_true")
    return p.parse_args(argv)


def train(*argv: str) -> None:
    """The loop on the ranks of an initialised process group (``launch`` calls this; ``main`` under torchrun)."""
    args = parse(list(argv))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)
    buffer = ReplayBuffer(storage=LazyTensorStorage(256), batch_size=16)
    ckpt = tdcp.DistributedCheckpoint(model=model, optimizer=optimizer)
    ckpt.register("buffer", buffer)  # per rank
    ckpt.register("rng", tdcp.RNGState())
    rotation = tdcp.CheckpointRotation(
        args.dir,
        keep_last=2,
        every_steps=args.every,
        async_saves=args.async_saves,
        preemption_signals=(signal.SIGTERM,),
    )
    info = rotation.resume(ckpt)
    start = 1 if info is None else info.step + 1
    out = Path(args.out)
    progress = out / "progress"
    last, in_flight_at_preemption = start - 1, None
    for step in range(start, args.steps + 1):
        obs = torch.randn(8, 4)
        buffer.extend(TensorDict(obs=obs, target=obs.sum(-1, keepdim=True) * 0.5, batch_size=[8]))
        batch = buffer.sample()
        loss = (model(batch["obs"]) - batch["target"]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
            param.grad /= world
        optimizer.step()
        time.sleep(args.step_ms / 1000)
        last = step
        pending = ckpt._async.pending
        was_in_flight = pending is not None and not pending.done()
        saved = rotation.maybe_save(ckpt, step, {"loss": loss.item()})
        if rank == 0:
            with progress.open("a") as f:
                f.write(f"step {step}\n" + (f"async {step}\n" if isinstance(saved, tdcp.SaveHandle) else ""))
        if rotation.preempted:
            in_flight_at_preemption = was_in_flight
            break
    rotation.close()
    state = [*model.state_dict().values(), *(t for s in optimizer.state.values() for t in s.values())]
    storage = buffer._storage._storage
    state += [storage[k][: len(buffer)] for k in sorted(storage.keys())]
    state += [torch.rand(3)]
    result = {
        "last": last,
        "preempted": rotation.preempted,
        "in_flight": in_flight_at_preemption,
        "digest": digest(*state),
        "resumed_from": None if info is None else info.step,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    dist.init_process_group("gloo")
    train(*sys.argv[1:])
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("RL_WARNINGS", "False")
    main()

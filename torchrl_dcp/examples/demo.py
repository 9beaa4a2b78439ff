"""A small multi-rank training that checkpoints and resumes exactly, under ``torchrun``.

Every rank trains a replicated MLP on its own random data (gradients all-reduced),
keeps per-rank state (its RNG streams, a running counter, a per-rank tensor), and
saves a checkpoint every ``--save-every`` steps. ``--resume`` continues from the
newest committed checkpoint; the final line prints a fingerprint of the weights,
identical whether or not the run was interrupted.

With ``--rotation`` the saves go through :class:`torchrl_dcp.CheckpointRotation`
(``keep_last``; rank 0 prunes) and ``--resume`` through :func:`torchrl_dcp.resume`.

Run:
    torchrun --standalone --nproc-per-node 2 -m torchrl_dcp.examples.demo --ckpt-dir ckpts/demo
    torchrun --standalone --nproc-per-node 2 -m torchrl_dcp.examples.demo --ckpt-dir ckpts/demo --resume
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp


def latest_checkpoint(directory: Path) -> Path | None:
    """Newest ``step-N`` entry with a valid manifest (half-written ones are invisible)."""
    best: tuple[int, Path] | None = None
    for entry in directory.glob("step-*") if directory.is_dir() else []:
        try:
            step = tdcp.read_manifest(entry)["step"]
        except tdcp.CheckpointError:
            continue
        if step is not None and (best is None or step > best[0]):
            best = (step, entry)
    return None if best is None else best[1]


def fingerprint(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in module.state_dict().values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--ckpt-dir", default="ckpts/demo")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--rotation", action="store_true", help="save and resume through CheckpointRotation")
    parser.add_argument("--kill-at-step", type=int, default=None, help="SIGKILL every rank after this step (tests)")
    args = parser.parse_args(argv)

    if "RANK" in os.environ and not dist.is_initialized():
        tdcp.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # this rank's GPU on its own node (several nodes)
    device = (
        torch.device(f"cuda:{local_rank % torch.cuda.device_count()}")
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=25, gamma=0.5)
    torch.manual_seed(1000 + rank)  # every rank draws its own data
    counters = {"step": 0, "samples": 0}
    seen = torch.zeros(8, device=device)  # per-rank running sum of inputs

    ckpt = tdcp.DistributedCheckpoint(model=model, optimizer=optimizer, scheduler=scheduler)
    ckpt.register("counters", counters, placement="per_rank")
    ckpt.register("seen", {"sum": seen}, placement="per_rank")
    ckpt.register("rng", tdcp.RNGState())  # per_rank by default, restored last

    ckpt_dir = Path(args.ckpt_dir)
    rotation = tdcp.CheckpointRotation(ckpt_dir, keep_last=args.keep_last) if args.rotation else None
    if args.resume:
        seen = restore(ckpt, ckpt_dir, rotation, rank, seen)

    w_true = torch.arange(8, dtype=torch.float32, device=device) / 8
    while counters["step"] < args.steps:
        x = torch.randn(64, 8, device=device)
        y = (x @ w_true).unsqueeze(-1) + 0.1 * torch.randn(64, 1, device=device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        optimizer.step()
        scheduler.step()
        seen += x.sum(0)
        counters["step"] += 1
        counters["samples"] += x.shape[0]
        step = counters["step"]
        if step % 10 == 0:
            print0(rank, f"step {step:4d}  loss {loss.item():.4f}  samples/rank {counters['samples']}")
        if step % args.save_every == 0 and rotation is not None:
            path = rotation.save(ckpt, step=step, metadata={"loss": loss.item()})
            print0(rank, f"checkpoint saved: {path}")
        elif step % args.save_every == 0:
            path = ckpt.save(ckpt_dir / f"step-{step:06d}", step=step, metadata={"loss": loss.item()})
            print0(rank, f"checkpoint saved: {path}")
            if rank == 0:
                prune(ckpt_dir, args.keep_last)
        if args.kill_at_step is not None and step == args.kill_at_step:
            if dist.is_initialized():
                dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)

    sys.stdout.write(
        f"rank {rank} final step {counters['step']} weights {fingerprint(model)} seen {seen.sum().item():.6f}\n"
    )
    sys.stdout.flush()
    if dist.is_initialized():
        dist.destroy_process_group()


def restore(
    ckpt: tdcp.DistributedCheckpoint,
    ckpt_dir: Path,
    rotation: tdcp.CheckpointRotation | None,
    rank: int,
    seen: torch.Tensor,
) -> torch.Tensor:
    """Load the newest committed checkpoint (collective); return the restored per-rank ``seen`` tensor."""
    if rotation is not None:
        info = rotation.resume(ckpt)
        path, result = (None, None) if info is None else (info.path, info.result)
    else:
        path = latest_checkpoint(ckpt_dir)
        result = None if path is None else ckpt.load(path)
    if result is None:
        print0(rank, f"no checkpoint in {ckpt_dir}: starting fresh")
        return seen
    print0(rank, f"resumed from {path} (step {result.step}, saved by {result.manifest['world_size']} ranks)")
    return result.values["seen"]["sum"]


def prune(directory: Path, keep_last: int) -> None:
    entries = sorted(p for p in directory.glob("step-*") if (p / "manifest.json").exists())
    for old in entries[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def print0(rank: int, message: str) -> None:
    if rank == 0:
        print(message, flush=True)


if __name__ == "__main__":
    main()

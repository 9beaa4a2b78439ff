"""Recovery and save times of the node-local tier against the shared tier, and what local saves cost a training loop.

Real ranks (spawned, gloo) on ``--nodes`` simulated nodes (``GROUP_RANK`` per rank, each node its own
tier directory under ``--local-dir``, tmpfs by default); each rank holds a replay buffer of ``--mib`` MiB
(its per-rank state) and a small learner. Measured, every figure the slowest rank's, best of ``--reps``:

- ``save shared``: ``CheckpointRotation.save`` to ``--shared-dir`` (a disk; full saves, not incremental ones;
  checksums, fsyncs, commit);
- ``save local``: a local-tier save (each rank's part into its node's tier, its replica sent to a rank of the
  next node and stored there, commit records);
- ``recover local`` / ``recover peer`` / ``recover shared``: ``rotation.resume`` by restarted workers (new
  processes that build the learner and an empty buffer, as a job does after ``torchrun`` restarts it, so the
  buffer's memory is new to the process) when every node holds its parts; when the last node's tier was wiped
  (its ranks receive their parts from the replicas); when every tier was wiped (cold page cache when it can be
  dropped: ``echo 3 > /proc/sys/vm/drop_caches`` needs root; tmpfs pages are never dropped);
- ``training``: update steps per second of a SAC-sized update on each rank, with no saves and with a local save
  every ``--every-seconds`` of training (the step count derived from the loop's measured speed).

Usage::

    python -m benchmarks.recovery --mib 1024 --ranks 2 --nodes 2 --reps 3 --out benchmarks/results/recovery-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.async_training import make_buffer, make_learner, update
from benchmarks.bench import drop_caches
from benchmarks.world import spawn_world


def _timed(fn: Any) -> float:
    """Seconds the slowest rank spends in ``fn`` (barriers on both sides)."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _wipe(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)


def _join_node(rank: int, world: int, nodes: int) -> tuple[int, int]:
    """This rank's simulated node and its rank within it; sets ``GROUP_RANK`` as torchrun's agents do (the tier's
    node identity)."""
    node = rank * nodes // world
    os.environ["GROUP_RANK"] = str(node)
    return node, rank - min(r for r in range(world) if r * nodes // world == node)


def _rank_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torchrl_dcp as tdcp

    nodes = cfg["nodes"]
    node, _ = _join_node(rank, world, nodes)
    node_dir = Path(cfg["local_dir"]) / f"node-{node}"
    torch.manual_seed(0)  # the learner is replicated: the same on every rank
    nets, optim = make_learner()
    torch.manual_seed(1 + rank)  # each rank's own transitions
    buffer = make_buffer(cfg["mib"])
    ckpt = tdcp.DistributedCheckpoint(policy=nets[0], optimizer=optim)
    ckpt.register("buffer", buffer)
    local = tdcp.LocalTier(node_dir, every_steps=1, keep_last=1)
    rotation = tdcp.CheckpointRotation(cfg["shared_dir"], keep_last=1, local=local, incremental=False)  # full saves
    reps = cfg["reps"]
    step = [0]

    def next_step() -> int:
        step[0] += 1
        return step[0]

    out: dict[str, Any] = {"ranks": world, "nodes": nodes, "mib_per_rank": cfg["mib"]}
    out["save_shared_s"] = min(_timed(lambda: rotation.save(ckpt, step=next_step())) for _ in range(reps))
    out["save_local_s"] = min(_timed(lambda: rotation.maybe_save(ckpt, next_step())) for _ in range(reps))
    rotation.save(ckpt, step=step[0])  # shared and local tiers now hold the same step: what restarts resume
    rotation.close()
    out["step"] = step[0]
    return out


def _training_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Training steps per second without saves and with a local-tier save every ``--every-seconds`` (tiers of
    their own)."""
    import torchrl_dcp as tdcp

    nodes = cfg["nodes"]
    node, _ = _join_node(rank, world, nodes)
    torch.manual_seed(0)
    nets, optim = make_learner()
    torch.manual_seed(1 + rank)
    ckpt = tdcp.DistributedCheckpoint(policy=nets[0], optimizer=optim)
    ckpt.register("buffer", make_buffer(cfg["mib"]))
    dist.barrier()  # every rank's buffer built (its memory touched) before the loop's speed is probed
    warm = time.perf_counter()
    while time.perf_counter() - warm < 3.0:
        update(nets, optim)
    probe, n = time.perf_counter(), 0
    while time.perf_counter() - probe < 3.0:
        update(nets, optim)
        n += 1
    rate = torch.tensor([n / (time.perf_counter() - probe)], dtype=torch.float64)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    every = max(1, int(float(rate) * cfg["every_seconds"]))  # the same step count on every rank
    total = every * cfg["intervals"]
    local = tdcp.LocalTier(Path(cfg["local_dir"]) / f"training-node-{node}", every_steps=every)
    timed = tdcp.CheckpointRotation(cfg["shared_dir"] + "-training", keep_last=1, local=local)
    step = [0]
    for _ in range(local.keep_last + 1):  # the tier's memory allocated once, as in a job that has been running
        step[0] += every
        timed.maybe_save(ckpt, step[0])

    def loop(save: bool) -> float:
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(total):
            update(nets, optim)
            step[0] += 1
            if save:
                timed.maybe_save(ckpt, step[0])
        return total / (time.perf_counter() - begin)

    rates: dict[str, list[float]] = {"none": [], "local": []}
    for _ in range(max(1, cfg["reps"] // 2 + 1)):
        for mode in ("none", "local"):
            rates[mode].append(loop(mode == "local"))
    timed.close()
    steps_per_s = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "train_steps_per_save": every,
        "train_steps_per_s": steps_per_s,
        "train_slowdown": 1 - steps_per_s["local"] / steps_per_s["none"],
    }


def _restarted_main(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """A restarted worker: the learner and an empty buffer built as at startup, then ``rotation.resume`` from the tier
    that ``cfg["kind"]`` leaves (``peer``: the last node's tier wiped first; ``shared``: every tier wiped); the tiers are
    then filled again at the next step."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    import torchrl_dcp as tdcp

    nodes, kind = cfg["nodes"], cfg["kind"]
    node, local_rank = _join_node(rank, world, nodes)
    node_dir = Path(cfg["local_dir"]) / f"node-{node}"
    torch.manual_seed(0)
    nets, optim = make_learner()
    ckpt = tdcp.DistributedCheckpoint(policy=nets[0], optimizer=optim)
    ckpt.register("buffer", ReplayBuffer(storage=LazyTensorStorage((cfg["mib"] << 20) // 4096)))  # not allocated
    rotation = tdcp.CheckpointRotation(
        cfg["shared_dir"], keep_last=1, local=tdcp.LocalTier(node_dir, every_steps=1, keep_last=1), incremental=False
    )
    dist.barrier()
    if local_rank == 0 and (kind == "shared" or (kind == "peer" and node == nodes - 1)):
        _wipe(node_dir)
    if kind == "shared" and rank == 0:
        drop_caches()
    found: list[Any] = []
    seconds = _timed(lambda: found.append(rotation.resume(ckpt)))
    tiers: list[Any] = [None] * world
    dist.all_gather_object(tiers, found[0].tier)
    step = cfg["step"]
    if kind != "local":  # every node's tier holds the step again for the next restart
        step += 1
        rotation.maybe_save(ckpt, step)
        rotation.save(ckpt, step=step)
    rotation.close()
    return {"seconds": seconds, "tiers": tiers, "step": step}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="replay buffer MiB per rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--every-seconds", type=float, default=20.0, help="training time between local saves")
    parser.add_argument("--intervals", type=int, default=3, help="local saves per timed training loop")
    parser.add_argument("--local-dir", default=None, help="parent of the nodes' tiers (default: under /dev/shm)")
    parser.add_argument("--shared-dir", default=None, help="the shared tier (default: a directory under ./)")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.ranks % args.nodes:
        parser.error("--ranks must be a multiple of --nodes")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    local_dir = Path(args.local_dir or tempfile.mkdtemp(prefix="tdcp-bench-local-", dir=shm))
    shared_dir = Path(args.shared_dir or tempfile.mkdtemp(prefix="tdcp-bench-shared-", dir="."))
    cfg = {**vars(args), "local_dir": str(local_dir), "shared_dir": str(shared_dir / "run")}
    try:
        report = spawn_world(args.ranks, _rank_main, cfg)
        report["tiers"] = {}
        for kind in ("local", "peer", "shared"):
            seconds = []
            for _ in range(args.reps):
                restart = spawn_world(args.ranks, _restarted_main, {**cfg, "kind": kind, "step": report["step"]})
                seconds.append(restart["seconds"])
                report["step"] = restart["step"]
                report["tiers"].setdefault(kind, restart["tiers"])
            report[f"recover_{kind}_s"] = min(seconds)
        report["cold_page_cache"] = drop_caches()
        for tier in local_dir.iterdir():  # the training loop's tiers start empty, in memory freed for them
            shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(cfg["shared_dir"], ignore_errors=True)
        time.sleep(10)  # a VM that reports free memory to its host is busy doing so for a few seconds after a free
        report.update(spawn_world(args.ranks, _training_main, cfg))
    finally:
        if args.local_dir is None:
            shutil.rmtree(local_dir, ignore_errors=True)
        if args.shared_dir is None:
            shutil.rmtree(shared_dir, ignore_errors=True)
    shared = report["recover_shared_s"]
    report["ratios"] = {
        "recover_local_vs_shared": shared / report["recover_local_s"],
        "recover_peer_vs_shared": shared / report["recover_peer_s"],
        "save_local_vs_shared": report["save_shared_s"] / report["save_local_s"],
    }
    report["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    gib = report["mib_per_rank"] / 1024
    for name in ("save_shared", "save_local", "recover_local", "recover_peer", "recover_shared"):
        print(f"{name:16s} {report[name + '_s']:7.3f} s  ({gib / report[name + '_s']:.2f} GiB/s per rank)")
    for name, value in report["ratios"].items():
        print(f"{name:28s} {value:6.2f}x")
    steps = report["train_steps_per_s"]
    print(
        f"training: {steps['none']:.1f} steps/s without saves, {steps['local']:.1f} with a local save every "
        f"{report['train_steps_per_save']} steps (~{args.every_seconds:g} s): slowdown {report['train_slowdown']:.1%}"
    )
    print("tiers:", json.dumps(report["tiers"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

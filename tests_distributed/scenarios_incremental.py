"""Incremental saves on real ranks: every rank's buffer shard at once, kills mid-save, the save after a reshard.

Run with ``TDCP_CHUNK_BYTES``/``TDCP_MIN_CHUNKED_BYTES`` small so small shards are cut
into many chunk files (set by the tests through the launcher's environment).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import torchrl_dcp as tdcp

CAPACITY = 1200


def rows(n: int, start: int, rank: int) -> TensorDict:
    idx = torch.arange(start, start + n)
    return TensorDict({"obs": (idx[:, None] * 100 + torch.arange(16) + 1e6 * rank).float(), "i": idx}, [n])


def job(rank: int) -> tuple[TensorDictReplayBuffer, torch.nn.Module, tdcp.DistributedCheckpoint]:
    torch.manual_seed(0)
    policy = torch.nn.Embedding(512, 16)  # 32 KiB, replicated: its chunks spread over the ranks
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=4)
    rb.extend(rows(1000, 0, rank))
    ckpt = tdcp.DistributedCheckpoint(policy=policy, buffer=rb)
    return rb, policy, ckpt


def step(rb: TensorDictReplayBuffer, policy: torch.nn.Module, rank: int, k: int) -> None:
    rb.extend(rows(7 + rank, 10_000 * k, rank))  # each rank writes its own number of rows
    with torch.no_grad():
        policy.weight[k] += 1.0


def kept(path: Path) -> dict[str, list[str]]:
    m = tdcp.read_manifest(path)
    out: dict[str, list[str]] = {"kept": [], "written": []}
    for entries in m["chunks"].values():
        for e in entries:
            out["kept" if "origin" in m["files"][e["file"]] else "written"].append(e["file"])
    return out


def incremental_shards(directory: str) -> dict[str, Any]:
    """Base, one step on every rank, then an incremental and a full save of the same state."""
    rank = dist.get_rank()
    rb, policy, ckpt = job(rank)
    d = Path(directory)
    base = ckpt.save(d / "base", step=0)
    step(rb, policy, rank, 1)
    import torchrl_dcp.save_prepare as checkpoint_module

    received: list[str] = []  # the keys of the base this rank was sent: the shared ones and its own
    original_share = checkpoint_module.share_base

    def recording(*args: Any, **kwargs: Any) -> Any:
        part = original_share(*args, **kwargs)
        received.extend(sorted(set(part.inventory) | set(part.chunks)))
        return part

    checkpoint_module.share_base = recording
    try:
        inc = ckpt.save(d / "inc", step=1, incremental_from=base)
    finally:
        checkpoint_module.share_base = original_share
    ckpt.save(d / "full", step=1)
    restored_rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=4)
    restored_policy = torch.nn.Embedding(512, 16)
    restored = tdcp.DistributedCheckpoint(policy=restored_policy, buffer=restored_rb)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(base)  # the incremental checkpoint must not need it
    dist.barrier()
    restored.load(inc)
    same = bool((restored_rb[:].exclude("index") == rb[:].exclude("index")).all())
    same_policy = torch.equal(restored_policy.weight, policy.weight)
    return {"same": same, "same_policy": same_policy, "received": received, **kept(inc)}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(phase: str) -> None:
    import torchrl_dcp.storage.directory as dir_backend
    from torchrl_dcp.storage import chunk_writer

    if phase == "chunk_write":  # half-way through writing a new chunk file
        original = chunk_writer.pwrite_all

        def pwrite_and_die(fd: int, data: Any, offset: int) -> None:
            original(fd, data, offset)
            if offset > 0:
                _die()

        chunk_writer.pwrite_all = pwrite_and_die
    elif phase == "link":  # after the first hard link of a kept chunk file
        original_link = chunk_writer._link_same

        def link_and_die(*args: Any) -> bool:
            original_link(*args)
            _die()
            return True

        chunk_writer._link_same = link_and_die
    elif phase == "manifest":  # manifest written in staging, before the rename
        dir_backend.publish = lambda staging, destination, **kwargs: _die()
    else:
        raise ValueError(phase)


def kill_during_incremental_save(directory: str, phase: str, victim: int) -> Any:
    """Rotation commits step 1 (full) and 2 (incremental); step 3's incremental save is killed at ``phase``."""
    rank = dist.get_rank()
    rb, policy, ckpt, rotation = _two_saves(directory)
    dist.barrier()
    step(rb, policy, rank, 3)
    if rank == victim:
        arm(phase)
    try:
        rotation.save(ckpt, step=3)
    except tdcp.CheckpointError as err:
        return {"error": type(err).__name__}
    return {"error": None}


def two_rotation_saves(directory: str) -> None:
    """The rotation commits step 1 (full) and step 2 (incremental from it)."""
    _two_saves(directory)


def _two_saves(directory: str) -> tuple[Any, Any, tdcp.DistributedCheckpoint, tdcp.CheckpointRotation]:
    """:func:`two_rotation_saves`, returning the buffer, policy, checkpoint and rotation."""
    rank = dist.get_rank()
    rb, policy, ckpt = job(rank)
    rotation = tdcp.CheckpointRotation(directory, keep_last=2)
    for k in (1, 2):
        step(rb, policy, rank, k)
        rotation.save(ckpt, step=k)
    return rb, policy, ckpt, rotation


def resume_and_save_again(directory: str, asynchronous: bool = False) -> dict[str, Any]:
    """After the kill: load the latest, check it is step 2 exactly, then save step 3 incrementally from it (with
    ``asynchronous``, an async save: kept chunks get no staged rows, so a base file no longer vouched for fails it)."""
    rank = dist.get_rank()
    rb, policy, ckpt = job(rank)
    for k in (1, 2):
        step(rb, policy, rank, k)
    expected = rb[:].exclude("index").clone()
    fresh_rb = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=4)
    fresh_policy = torch.nn.Embedding(512, 16)
    fresh = tdcp.DistributedCheckpoint(policy=fresh_policy, buffer=fresh_rb)
    rotation = tdcp.CheckpointRotation(directory, keep_last=2)
    info = rotation.resume(fresh)
    same = bool((fresh_rb[:].exclude("index") == expected).all())
    step(fresh_rb, fresh_policy, rank, 3)
    if asynchronous:
        path = fresh.async_save(rotation.path_for(3), step=3, incremental_from=rotation.path_for(2)).wait()
    else:
        path = rotation.save(fresh, step=3)
    return {"step": info.step if info else None, "same": same, "path": str(path), **kept(path)}


def save_after_reshard(directory: str) -> dict[str, Any]:
    """Load a 2-rank checkpoint on this job's ranks (resharding), then save incrementally from it: in full."""
    rank = dist.get_rank()
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(2 * CAPACITY), batch_size=4)
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Embedding(512, 16), buffer=rb)
    source = Path(directory) / "inc"
    ckpt.load(source, world_size_change="reshard")
    path = ckpt.save(Path(directory) / "after", incremental_from=source)
    return {"rank": rank, "len": len(rb), **kept(path)}


def extend_in_child(rb: TensorDictReplayBuffer, start: int) -> None:
    """Run in a spawned process: write rows into a buffer whose storage the parent shares."""
    rb.extend(rows(5, start, 0))
    rb[torch.tensor([3])] = rows(1, start + 100, 0)

"""Per-rank programs for the fault tests: SIGKILL at each phase of a save, hangs, full disks, two jobs.

Objects are deterministic in ``(seed, rank)`` so the test process can rebuild the
expected values without the ranks. Ranks that survive a fault write what they saw
to ``<report>/rank<r>.json`` as soon as they see it (the launcher stops the other
ranks shortly after one dies).
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp


def objects(seed: int, rank: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    big = {f"w{i}": torch.full((4096,), float(seed + i)) for i in range(4)}  # replicated, written by several ranks
    shard = {"values": torch.arange(2000, dtype=torch.float64) + 1000 * rank + seed, "rank": rank}
    return {"model": model, "big": big, "shard": shard}


def checkpoint(objs: dict[str, Any], timeout: float | None = None) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(
        model=objs["model"], big=objs["big"], timeout=None if timeout is None else datetime.timedelta(seconds=timeout)
    )
    ckpt.register("shard", objs["shard"], placement="per_rank")
    return ckpt


def check_loaded(objs: dict[str, Any], seed: int, rank: int) -> None:
    expected = objects(seed, rank)
    assert torch.equal(objs["model"].weight, expected["model"].weight), "model differs"
    assert all(torch.equal(objs["big"][k], expected["big"][k]) for k in expected["big"]), "big differs"
    assert torch.equal(objs["shard"]["values"], expected["shard"]["values"]), "shard differs"
    assert objs["shard"]["rank"] == rank


def report(directory: str, value: Any) -> None:
    path = Path(directory) / f"rank{dist.get_rank()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(phase: str) -> None:
    """Install the hook that SIGKILLs this rank at ``phase`` of the next save."""
    import torchrl_dcp.storage.directory as dir_backend
    import torchrl_dcp.storage.writer as storage_writer
    from torchrl_dcp import _dist
    from torchrl_dcp.storage import commit, writer

    if phase == "staging":  # staging directory created, before any rank hears of it (rank 0 holds the lock)
        original_staging = dir_backend.staging_path

        def staging_and_die(destination, token=None):  # type: ignore[no-untyped-def]
            path = original_staging(destination, token)
            path.mkdir()
            _die()

        dir_backend.staging_path = staging_and_die
    elif phase == "announce":  # a rank dies while the staging directory is being announced
        original_broadcast = _dist.broadcast_from_0

        def broadcast_and_die(obj, group, phase="broadcast", **kwargs):  # type: ignore[no-untyped-def]
            if phase == "preparing the staging directory":
                _die()
            return original_broadcast(obj, group, phase, **kwargs)

        _dist.broadcast_from_0 = broadcast_and_die
    elif phase in ("write", "async_write"):  # in the middle of writing its data file
        original_pwrite = writer.pwrite_all
        calls = [0]

        def pwrite_and_die(fd, data, offset):  # type: ignore[no-untyped-def]
            original_pwrite(fd, data, offset)
            calls[0] += 1
            if calls[0] >= 2 or len(data) > 4096:
                _die()

        writer.pwrite_all = pwrite_and_die
    elif phase == "after_data":  # its data written and checksummed, before reporting it
        original_share = storage_writer.write_share

        def share_and_die(*args, **kwargs):  # type: ignore[no-untyped-def]
            original_share(*args, **kwargs)
            _die()

        storage_writer.write_share = share_and_die
    elif phase == "manifest":  # manifest written in the staging directory, before the rename
        dir_backend.publish = lambda staging, destination, **kwargs: _die()
    elif phase == "rename":  # right after the rename into place, before the parent directory is fsynced
        original_fsync = commit.fsync_path
        calls = [0]

        def fsync_and_die(path, **kwargs):  # type: ignore[no-untyped-def]
            original_fsync(path, **kwargs)
            calls[0] += 1
            if calls[0] == 2:
                _die()

        commit.publish.__globals__["fsync_path"] = fsync_and_die
    elif phase == "exchange":  # over an existing checkpoint: right after the swap, old one not yet removed
        original_exchange = commit._exchange

        def exchange_and_die(a, b):  # type: ignore[no-untyped-def]
            swapped = original_exchange(a, b)
            Path(os.environ["TDCP_REPORT"], "exchanged").write_text(str(swapped))
            _die()

        commit._exchange = exchange_and_die
    elif phase == "rotation_delete":  # half-way through deleting a checkpoint rotation no longer keeps
        original_remove = commit.remove_tree

        def remove_and_die(path):  # type: ignore[no-untyped-def]
            if commit.TRASH_TAG in path.name and path.is_dir():
                next(p for p in path.iterdir() if p.is_file()).unlink()
                _die()
            original_remove(path)

        commit.remove_tree = remove_and_die
    else:
        raise ValueError(phase)


def kill_during_save(directory: str, report_dir: str, phase: str, victim: int) -> Any:
    """Commit step 1 (rotation, keep_last=1), then save step 2 with ``victim`` killed at ``phase``."""
    os.environ["TDCP_REPORT"] = report_dir
    rank = dist.get_rank()
    objs = objects(1, rank)
    ckpt = checkpoint(objs)
    rotation = tdcp.CheckpointRotation(directory, keep_last=1)
    fixed = Path(directory) / "fixed"
    if phase == "exchange":
        ckpt.save(fixed, step=1)
    else:
        rotation.save(ckpt, step=1)
    dist.barrier()
    objs2 = objects(2, rank)
    ckpt2 = checkpoint(objs2)
    if rank == victim:
        arm(phase)
    try:
        if phase == "exchange":
            ckpt2.save(fixed, step=2)
        elif phase == "async_write":
            ckpt2.async_save(rotation.path_for(2), step=2).wait()
        else:
            rotation.save(ckpt2, step=2)
    except tdcp.CheckpointError as err:
        report(report_dir, {"error": type(err).__name__, "message": str(err)})
        return None
    report(report_dir, {"error": None})
    return None


def hang_during_save(directory: str, report_dir: str, hung: int, timeout: float) -> Any:
    """Commit step 1, then save step 2 while rank ``hung`` is stuck writing its data (until released)."""
    import torchrl_dcp.storage.writer as storage_writer

    rank = dist.get_rank()
    path = Path(directory) / "ckpt"
    checkpoint(objects(1, rank), timeout=timeout).save(path, step=1)
    release = Path(report_dir) / "release"
    if rank == hung:
        original_share = storage_writer.write_share

        def stuck(*args, **kwargs):  # type: ignore[no-untyped-def]
            deadline = time.monotonic() + 120
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            return original_share(*args, **kwargs)

        storage_writer.write_share = stuck
    try:
        checkpoint(objects(2, rank), timeout=timeout).save(path, step=2)
        outcome: dict[str, Any] = {"error": None}
    except tdcp.CheckpointError as err:
        outcome = {"error": type(err).__name__, "message": str(err)}
    if rank != hung:
        report(report_dir, outcome)
        release.touch()
    return outcome


def full_disk(directory: str, mode: str) -> dict[str, Any]:
    """Save small (fits), big (ENOSPC: real tmpfs, or injected), load the small one back, save small again."""
    import torchrl_dcp.storage.directory as dir_backend
    from torchrl_dcp.storage import writer

    rank = dist.get_rank()
    path = Path(directory) / "ckpt"
    checkpoint(objects(1, rank)).save(path, step=1)
    objs = objects(2, rank)
    if mode == "tmpfs":
        objs["shard"]["values"] = torch.zeros(200_000, dtype=torch.float64)  # 1.6 MB per rank: does not fit
    elif mode == "data" and rank == 1:
        original = writer.pwrite_all

        def full(fd, data, offset):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        writer.pwrite_all = full
    elif mode == "manifest" and rank == 0:

        def full_manifest(path, data, **kwargs):  # type: ignore[no-untyped-def]
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        dir_backend.write_file_durably = full_manifest
    out: dict[str, Any] = {}
    try:
        checkpoint(objs).save(path, step=2)
        out["error"] = None
    except tdcp.CheckpointError as err:
        out["error"], out["message"] = type(err).__name__, str(err)
    if mode == "data" and rank == 1:
        writer.pwrite_all = original
    if mode == "manifest" and rank == 0:
        from torchrl_dcp.storage.commit import write_file_durably

        dir_backend.write_file_durably = write_file_durably
    fresh = objects(3, rank)
    result = checkpoint(fresh).load(path)
    check_loaded(fresh, 1, rank)  # the previous checkpoint, intact
    out["loaded_step"] = result.step
    out["leftovers"] = sorted(p.name for p in Path(directory).iterdir() if p.name != "ckpt" and p.name != "lost+found")
    dist.barrier()
    checkpoint(objects(4, rank)).save(path, step=4)  # space is back: the next save works
    out["after"] = tdcp.read_manifest(path)["step"]
    return out


def two_jobs(path: str, sync_dir: str, job: str) -> dict[str, Any]:
    """Job A parks its commit until job B tried the same path; B must be refused, then succeed after A."""
    import torchrl_dcp.storage.directory as dir_backend

    rank = dist.get_rank()
    sync = Path(sync_dir)
    seed = 1 if job == "A" else 2

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 90
        while not (sync / name).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job}: {name} never appeared")
            time.sleep(0.05)

    out: dict[str, Any] = {}
    if job == "A":
        if rank == 0:
            original = dir_backend.publish

            def parked(staging, destination, **kwargs):  # type: ignore[no-untyped-def]
                (sync / "A-staged").touch()
                wait_for("B-refused")
                original(staging, destination, **kwargs)

            dir_backend.publish = parked
        checkpoint(objects(seed, rank)).save(path, step=1, metadata={"job": "A"})
        (sync / f"A-done-{rank}").touch()
        out["saved"] = True
        return out
    wait_for("A-staged")
    try:
        checkpoint(objects(seed, rank)).save(path, step=2, metadata={"job": "B"})
        out["first"] = None
    except tdcp.CheckpointError as err:
        out["first"] = str(err)
    dist.barrier()
    if rank == 0:
        (sync / "B-refused").touch()
    wait_for("A-done-0")
    wait_for("A-done-1")
    checkpoint(objects(seed, rank)).save(path, step=3, metadata={"job": "B"})
    fresh = objects(5, rank)
    checkpoint(fresh).load(path)
    check_loaded(fresh, seed, rank)
    out["second"] = "ok"
    return out


def reload_latest(directory: str, seed: int) -> int:
    """Every rank loads the rotation's latest checkpoint (per-rank state included) and checks it."""
    rank = dist.get_rank()
    fresh = objects(seed + 100, rank)
    info = tdcp.CheckpointRotation(directory).resume(checkpoint(fresh))
    assert info is not None
    check_loaded(fresh, seed, rank)
    return info.step

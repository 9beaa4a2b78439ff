"""Per-rank programs counting the checkpoint's collectives: how many a save and a load make, at any world size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp

COUNTED = ("sync", "agree", "all_gather", "gather_to_0", "broadcast_from_0", "scatter_from_0")


def _count_collectives() -> list[str]:
    """Wrap ``_dist``'s collectives in this process; each call appends its name to the list returned."""
    from torchrl_dcp import _dist

    calls: list[str] = []
    for name in COUNTED:
        original = getattr(_dist, name)

        def counted(*args: Any, __name: str = name, __original: Any = original, **kwargs: Any) -> Any:
            calls.append(__name)
            return __original(*args, **kwargs)

        setattr(_dist, name, counted)
    return calls


def save_and_load(directory: str) -> dict[str, Any]:
    """A save and a load of replicated, per-rank and in-place (replay buffer) state; the collectives of each."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rank = dist.get_rank()
    torch.manual_seed(0)
    policy = torch.nn.Linear(8, 4)
    buffer = ReplayBuffer(storage=LazyTensorStorage(64))
    buffer.extend(torch.arange(32 * 3, dtype=torch.float32).reshape(32, 3) + rank)
    small = {f"t{i}": torch.full((4,), float(rank * 100 + i)) for i in range(20)}
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    ckpt.register("small", small, placement="per_rank")
    ckpt.register("buffer", buffer, placement="per_rank")
    path = Path(directory) / "ckpt"
    ckpt.save(path / "warm", step=0)  # the checkpoint group is created here, outside the counts
    calls = _count_collectives()
    ckpt.save(path / "step-1", step=1)
    save_calls = list(calls)
    calls.clear()
    expected = {k: v.clone() for k, v in small.items()}
    for v in small.values():
        v.zero_()
    ckpt.load(path / "step-1")
    load_calls = list(calls)
    assert all(torch.equal(small[k], expected[k]) for k in small)
    return {"save": save_calls, "load": load_calls}


def _opened_during(fn: Any) -> list[str]:
    """The names of the files this process opened (``os.open``) while ``fn()`` ran."""
    import os

    names: list[str] = []
    original = os.open

    def recording(path: Any, *args: Any, **kwargs: Any) -> int:
        names.append(os.path.basename(os.fspath(path)))
        return original(path, *args, **kwargs)

    os.open = recording
    try:
        fn()
    finally:
        os.open = original
    return names


def own_files_only(directory: str, tamper: str) -> dict[str, Any]:
    """Per-rank state and a replicated policy (its tensors written by several ranks): which data files (and which
    manifest files, shards and ``.metadata``) each rank opens while loading. ``tamper`` (rank 0 does it before the
    load): ``"plant"`` a file the manifest does not list, ``"truncate"`` rank 1's own data file by a byte, add an
    ``"extra"`` chunk file of rank 2 (rank 0, which checks the whole listing, refuses each; every rank raises)."""
    rank = dist.get_rank()
    state = {f"t{i}": torch.full((64,), float(rank * 10 + i)) for i in range(8)}
    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    ckpt.register("state", state, placement="per_rank")
    path = Path(directory) / "ckpt"
    ckpt.save(path, step=1)
    if tamper and rank == 0:
        if tamper == "plant":
            (path / "__9_0.distcp").write_bytes(b"planted")
        elif tamper == "truncate":
            os.truncate(path / "__1_0.distcp", (path / "__1_0.distcp").stat().st_size - 1)
        else:
            (path / "__2_7.distcp").write_bytes(b"extra")
    dist.barrier()
    try:
        opened = _opened_during(lambda: ckpt.load(path))
    except tdcp.CheckpointError as err:
        return {"error": type(err).__name__, "message": str(err)}
    listed = {p.name for p in path.iterdir()}
    return {
        "error": None,
        "opened": sorted(n for n in opened if n.endswith(".distcp")),
        "metadata_opened": sorted({n for n in opened if n in listed and not n.endswith(".distcp")}),
    }


def rotation_save(directory: str) -> list[str]:
    """The collectives of a rotation's second save (an incremental one: the first is its base), pruning included."""
    rank = dist.get_rank()
    state = {"x": torch.full((64,), float(rank))}
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 4))
    ckpt.register("state", state, placement="per_rank")
    rotation = tdcp.CheckpointRotation(Path(directory) / "run", keep_last=1)
    rotation.save(ckpt, step=1)
    calls = _count_collectives()
    rotation.save(ckpt, step=2)
    return calls

"""Per-rank programs for the peer-copy tests: two ranks exchange checkpoint directories, one side failing.

Every program returns what the rank saw (the error text or the files it holds) as JSON; none may
hang: a failure on one side is told to, or drained by, the other.
"""

from __future__ import annotations

import datetime
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp
from torchrl_dcp import peer_copy
from torchrl_dcp.errors import CheckpointError


def _entry(root: Path, name: str, sizes: dict[str, int]) -> Path:
    entry = root / name
    entry.mkdir(parents=True)
    for i, (file, size) in enumerate(sizes.items()):
        (entry / file).write_bytes(bytes([i + 1]) * size)
    return entry


def _files(path: Path) -> dict[str, int] | None:
    return {p.name: p.stat().st_size for p in sorted(path.iterdir())} if path.is_dir() else None


def exchange(root: str, case: str) -> dict[str, Any]:
    """Rank 0 sends two entries to rank 1 (and rank 1 one to rank 0); ``case`` breaks one side."""
    rank, base = dist.get_rank(), Path(root) / f"rank{dist.get_rank()}"
    peer_copy.PIECE = 1000  # several pieces per file
    sizes = {"a.distcp": 2500, "manifest.json": 10, "empty": 0}
    error: str | None = None
    if rank == 0:
        sends = [(_entry(base, "one", sizes), 1), (_entry(base, "two", sizes), 1)]
        receives = [(base / "back", 1)]
        if case == "sender_cannot_read_a_file":  # listed, then unreadable (removed, or a disk error)
            real = peer_copy._open_or_none
            first = [True]

            def open_once_fails(handle: Any, name: str) -> int | None:
                if name == "a.distcp" and first[0]:
                    first[0] = False
                    return None
                return real(handle, name)

            peer_copy._open_or_none = open_once_fails  # type: ignore[assignment]
    else:
        base.mkdir(parents=True)
        sends = [(_entry(base, "mine", sizes), 0)]
        receives = [(base / "one", 0), (base / "two", 0)]
        if case == "receiver_has_no_directory":
            receives[0] = (base / "missing" / "one", 0)
    send_error = "its own save failed: disk full" if case == "send_error" and rank == 1 else None
    try:
        peer_copy.exchange_entries(sends, receives, None, send_error=send_error)
    except CheckpointError as err:
        error = str(err)
    dist.barrier()
    return {
        "error": error,
        "received": {str(d.relative_to(base)): _files(d) for d, _ in receives},
        "staging_left": sorted(p.name for p in base.rglob("*") if ".tdcp-" in p.name),
    }


def local_save_fails_on_one_rank(root: str, local: str) -> dict[str, Any]:
    """Rank 1's part cannot be written (its adapter raises): every rank is warned (a failed local save does not stop
    the job), no rank hangs, no step."""
    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank)  # two "nodes": each rank's replica goes to the other
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2), timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    ckpt.register("shard", {"x": torch.arange(3) + rank}, placement="per_rank")
    tier = tdcp.LocalTier(Path(local) / f"node-{rank}", every_steps=1)
    rotation = tdcp.CheckpointRotation(root, local=tier)
    rotation.maybe_save(ckpt, 1)
    if rank == 1:
        ckpt.register("broken", _Unsaveable(), placement="per_rank")
    else:
        ckpt.register("broken", {"y": torch.zeros(1)}, placement="per_rank")
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        try:
            rotation.maybe_save(ckpt, 2)
            error = None
        except Exception as err:  # noqa: BLE001 - what each rank saw is the result
            error = f"{type(err).__name__}: {err}"
    warned = [str(w.message) for w in heard if issubclass(w.category, tdcp.LocalTierWarning)]
    return {"error": error, "warned": warned, "steps": tier.steps()}


class _Unsaveable:
    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("this component cannot be saved")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("never loaded")

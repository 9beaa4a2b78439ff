"""Per-rank programs for the multi-node tests, run under ``torchrun`` (one agent per "node").

    torchrun --nnodes 2 ... -m tests_distributed.scenarios_multinode FUNCTION ARGS_JSON OUT_DIR

runs ``FUNCTION(*ARGS_JSON)`` on every rank (gloo) and writes ``OUT_DIR/rank<R>.json``
with its value and where the rank ran (``GROUP_RANK`` is the node torchrun gave it).

The state is a small learner and a per-rank prioritized replay shard: a replicated
policy and Adam optimizer (gradients all-reduced), each rank's buffer shard (ids,
observations, priorities) and its RNG streams. Reports are bit-exact digests of that
state plus what the next draws, samples and training step give, so a test compares
a loaded state with the saved one by equality.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

import torchrl_dcp as tdcp
from tests_distributed.scenarios_reshard import _items
from torchrl_dcp.storage.copying import default_threads, node_cpus_per_rank

CAPACITY = 64


def _objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    policy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.05)
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(CAPACITY), batch_size=4)
    return {"policy": policy, "optimizer": optimizer, "buffer": rb}


def _checkpoint(objs: dict[str, Any]) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(policy=objs["policy"], optimizer=objs["optimizer"])
    ckpt.register("buffer", objs["buffer"])  # per_rank: this rank's shard
    ckpt.register("rng", tdcp.RNGState())
    return ckpt


def _seed_rank(seed: int) -> None:
    rank = dist.get_rank()
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    np.random.seed(seed + rank)


def _train_step(objs: dict[str, Any]) -> None:
    """Collect 3 + rank transitions into this rank's shard, then one all-reduced Adam step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 3 + rank
    ids = torch.arange(n, dtype=torch.float64) + 1000 * rank + len(objs["buffer"])  # the buffer never wraps here
    idx = objs["buffer"].extend(TensorDict({"id": ids, "obs": torch.randn(n, 4)}, [n]))
    objs["buffer"].update_priority(idx, (ids % 17 + 1).float())
    x = objs["buffer"].sample()["obs"].float()
    loss = objs["policy"](x).pow(2).mean()
    objs["optimizer"].zero_grad()
    loss.backward()
    for p in objs["policy"].parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    objs["optimizer"].step()


def _hash(obj: Any, h: Any) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _hash(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _hash(v, h)
    else:
        h.update(repr(obj).encode())


def _sha(obj: Any) -> str:
    h = hashlib.sha256()
    _hash(obj, h)
    return h.hexdigest()


def digest(objs: dict[str, Any]) -> dict[str, Any]:
    """Bit-exact fingerprints of the learner and of this rank's shard (its filled slots only)."""
    rb = objs["buffer"]
    n = len(rb)
    filled = {k: v[:n] for k, v in rb._storage._storage.items()} if n else {}
    return {
        "policy": _sha(objs["policy"].state_dict()),
        "optimizer": _sha(objs["optimizer"].state_dict()),
        "shard": _sha([filled, rb._sampler._sum_tree[torch.arange(n)].tolist() if n else []]),
        "cursor": rb._writer._cursor,
        "items": _items(rb),
    }


def _continue(objs: dict[str, Any]) -> dict[str, Any]:
    """What happens next: draws from every RNG stream, a sample, and one more training step."""
    draws = [torch.rand(2).tolist(), random.random(), float(np.random.rand())]
    sample = objs["buffer"].sample()["id"].tolist()
    _train_step(objs)
    return {"draws": draws, "sample": sample, "policy_after": _sha(objs["policy"].state_dict())}


def save_state(path: str, seed: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps, save; report the saved state and what follows."""
    objs = _objects(seed)
    _seed_rank(seed)
    for _ in range(steps):
        _train_step(objs)
    _checkpoint(objs).save(path, step=steps)
    return {"saved": digest(objs), "next": _continue(objs)}


def async_save_state(path: str, seed: int, steps: int) -> dict[str, Any]:
    """Like :func:`save_state` with ``async_save``: keep training while it is written, then ``wait``."""
    objs = _objects(seed)
    _seed_rank(seed)
    for _ in range(steps):
        _train_step(objs)
    handle = _checkpoint(objs).async_save(path, step=steps)
    saved = digest(objs)
    after = _continue(objs)  # changes the policy, optimizer, buffer and RNG while the save is in flight
    committed = handle.wait()
    return {"saved": saved, "next": after, "committed": str(committed)}


def load_state(path: str, seed: int, world_size_change: str) -> dict[str, Any]:
    """Fresh objects (another seed), load ``path``; report the loaded state and what follows."""
    objs = _objects(seed + 1000)
    _seed_rank(seed + 1000)
    result = _checkpoint(objs).load(path, world_size_change=world_size_change)
    return {"loaded": sorted(result.loaded), "saved": digest(objs), "next": _continue(objs)}


def _skew_clock(seconds: float) -> None:
    """This process's wall clock (as the manifest reads it) runs ``seconds`` behind: a node with a skewed clock."""
    import datetime as real

    import torchrl_dcp.format.manifest as manifest

    class Skewed(real.datetime):
        @classmethod
        def now(cls, tz: real.tzinfo | None = None) -> real.datetime:  # type: ignore[override]
            return real.datetime.now(tz) - real.timedelta(seconds=seconds)

    manifest.datetime = SimpleNamespace(datetime=Skewed, timezone=real.timezone, timedelta=real.timedelta)  # type: ignore[assignment]


def rotation_saves(directory: str, steps: list[int], skew_seconds: float) -> dict[str, Any]:
    """Save ``steps`` through ``CheckpointRotation(keep_last=2)``; rank 0 (the coordinator) on a skewed clock."""
    if dist.get_rank() == 0 and skew_seconds:
        _skew_clock(skew_seconds)
    objs = _objects(0)
    ckpt = tdcp.DistributedCheckpoint(policy=objs["policy"])
    rotation = tdcp.CheckpointRotation(directory, keep_last=2)
    for step in steps:
        rotation.save(ckpt, step=step)
    latest = rotation.latest()
    return {"kept": [e.step for e in rotation.entries()], "latest": latest.name if latest else None}


def _where() -> dict[str, Any]:
    env = os.environ
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "node": int(env["GROUP_RANK"]),
        "local_rank": int(env["LOCAL_RANK"]),
        "local_world": int(env["LOCAL_WORLD_SIZE"]),
        "threads": default_threads(),
        "cpus_per_rank": node_cpus_per_rank(),
    }


def main(argv: list[str]) -> None:
    name, args, out = argv
    dist.init_process_group("gloo")
    try:
        value = globals()[name](*json.loads(args))
        where = _where()
    finally:
        dist.destroy_process_group()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{where['rank']}.json").write_text(json.dumps({**where, "value": value}))


if __name__ == "__main__":
    main(sys.argv[1:])

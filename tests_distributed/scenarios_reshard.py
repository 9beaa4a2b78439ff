"""Per-rank programs for resharding tests: prioritized replay shards saved on N ranks, loaded on M."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictPrioritizedReplayBuffer, TensorStorage

import torchrl_dcp as tdcp


def _buffer(capacity: int, preallocated: bool = False) -> TensorDictPrioritizedReplayBuffer:
    """A prioritized buffer over a lazy storage, or over a ``TensorStorage`` of rows the user allocated."""
    storage = LazyTensorStorage(capacity)
    if preallocated:  # (without the "index" entry the buffer adds at its first write)
        rows = {"id": torch.zeros(capacity, dtype=torch.float64), "obs": torch.zeros(capacity, 3)}
        storage = TensorStorage(TensorDict(rows, [capacity]))
    return TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=storage, batch_size=4)


def _checkpoint(rb, policy) -> tdcp.DistributedCheckpoint:
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    ckpt.register("buffer", rb)
    ckpt.register("rng", tdcp.RNGState())
    return ckpt


def _items(rb) -> list[list[float]]:
    n = len(rb)
    if n == 0:
        return []
    ids = rb._storage._storage["id"][:n].tolist()
    leaves = rb._sampler._sum_tree[torch.arange(n)].tolist()
    return [[i, p] for i, p in zip(ids, leaves)]


def save_shards(path: str, capacity: int, preallocated: bool = False) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(rank)
    rb = _buffer(capacity, preallocated)
    n = 10 + 9 * rank  # unequal shards; rank 2 wraps around when capacity is small
    ids = torch.arange(n, dtype=torch.float64) + 1000 * rank
    idx = rb.extend(TensorDict({"id": ids, "obs": torch.randn(n, 3)}, [n]))
    rb.update_priority(idx, (ids % 17 + 1).float())
    policy = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(policy.weight, 0.25)
    torch.nn.init.zeros_(policy.bias)  # replicated: the same on every rank (the save compares them)
    _checkpoint(rb, policy).save(path, step=5)
    return {"items": _items(rb)}


def load_resharded(path: str, capacity: int, preallocated: bool = False) -> dict[str, Any]:
    rb = _buffer(capacity, preallocated)
    policy = torch.nn.Linear(2, 2)
    ckpt = _checkpoint(rb, policy)
    out: dict[str, Any] = {}
    try:
        ckpt.load(path)
    except tdcp.WorldSizeMismatchError as err:
        out["default_error"] = str(err)
    ckpt.load(path, world_size_change="reshard")
    out["items"] = _items(rb)
    out["weight"] = policy.weight.flatten().tolist()
    out["draw"] = torch.rand(1).item()
    if len(rb):
        out["sample_ok"] = bool(rb.sample()["id"].numel() == 4)
    out["cursor"] = rb._writer._cursor
    return out


def load_resharded_into_too_small_buffers(path: str, capacity: int) -> dict[str, Any]:
    """Reshard into buffers that cannot hold this rank's share: refused while planning, nothing changes."""
    rb = _buffer(capacity)
    torch.manual_seed(99)
    policy = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    rng_before = torch.get_rng_state()
    try:
        _checkpoint(rb, policy).load(path, world_size_change="reshard")
    except tdcp.CheckpointError as err:
        error = str(err)
    else:
        error = None
    return {
        "error": error,
        "policy_unchanged": all(torch.equal(before[k], v) for k, v in policy.state_dict().items()),
        "rng_unchanged": torch.equal(rng_before, torch.get_rng_state()),
        "buffer_untouched": len(rb) == 0 and not rb._storage.initialized,
    }


def _generators(seed: int) -> dict[str, Any]:
    import random

    import numpy as np

    return {
        "py": random.Random(seed),
        "np": np.random.default_rng(seed),
        "philox": np.random.Generator(np.random.Philox(seed)),
        "legacy": np.random.RandomState(seed),
    }


def _draws(gens: dict[str, Any]) -> list[Any]:
    return [
        gens["py"].random(),
        gens["np"].random(3).tolist(),
        gens["philox"].integers(0, 1 << 60, 2).tolist(),
        gens["legacy"].randn(3).tolist(),
    ]


def save_generators(path: str) -> dict[str, Any]:
    """Every rank its own generators, advanced differently; returns what each draws next."""
    rank = dist.get_rank()
    gens = _generators(100 + rank)
    for _ in range(rank + 1):
        _draws(gens)
    tdcp.DistributedCheckpoint(**gens).save(path)
    return {"next": _draws(gens)}


def load_generators(path: str, reshard: bool) -> dict[str, Any]:
    gens = _generators(999)
    change = "reshard" if reshard else "error"
    tdcp.DistributedCheckpoint(**gens).load(path, world_size_change=change)
    return {"next": _draws(gens)}


def _list_buffer(capacity: int):
    from torchrl.data import ListStorage, ReplayBuffer

    return ReplayBuffer(storage=ListStorage(capacity), batch_size=2)


def save_list_shards(path: str) -> dict[str, Any]:
    """``ReplayBuffer()``-style list storages of unequal lengths, one per rank (transitions are tuples)."""
    rank = dist.get_rank()
    rb = _list_buffer(32)
    rb.extend([(torch.tensor(1000 * rank + i), torch.full((2,), float(i))) for i in range(5 + 4 * rank)])
    tdcp.DistributedCheckpoint(buffer=rb).save(path)
    return {"ids": [int(t[0]) for t in rb._storage._storage]}


def load_list_resharded(path: str) -> dict[str, Any]:
    rb = _list_buffer(32)
    tdcp.DistributedCheckpoint(buffer=rb).load(path, world_size_change="reshard")
    items = rb._storage._storage
    ok = all(torch.equal(t[1], torch.full((2,), float(int(t[0]) % 1000))) for t in items)
    return {"ids": [int(t[0]) for t in items], "values_ok": ok, "sample": len(rb.sample()[0]) if len(rb) else 0}


# ---------------------------------------------------------------- what a reshard refuses, or restores, exactly
def _kind_buffer(kind: str, capacity: int = 20):
    from torchrl.data import SliceSampler, TensorDictReplayBuffer
    from torchrl.envs.transforms import MultiStepTransform

    if kind == "prioritized":
        return TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.4, storage=LazyTensorStorage(capacity), batch_size=4)
    if kind in ("slice", "slice_open"):
        sampler = SliceSampler(num_slices=2, end_key="done", strict_length=True)
        return TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), sampler=sampler, batch_size=4)
    if kind == "generations":  # (a small storage: the 6 rows wrap, slots 0 and 1 are written twice)
        from torchrl.data import TensorDictRoundRobinWriter

        writer = TensorDictRoundRobinWriter(track_generations=True)
        return TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), writer=writer, batch_size=4)
    if kind == "nstep":
        transform = MultiStepTransform(n_steps=3, gamma=0.9)
        return TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=4, transform=transform)
    if kind == "user_index":  # (a plain writer: the rows' "index" entry is the user's own)
        from torchrl.data import ReplayBuffer

        return ReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=4)
    if kind == "preallocated":  # (rows the user allocated: torchrl counts the 8 of a shard, the writer wrote 6)
        from torchrl.data import ReplayBuffer, TensorDictRoundRobinWriter, TensorStorage

        fresh = {"id": torch.full((capacity,), -1), "index": torch.full((capacity,), -1, dtype=torch.long)}
        return ReplayBuffer(
            storage=TensorStorage(TensorDict(fresh, [capacity])), writer=TensorDictRoundRobinWriter(), batch_size=4
        )
    if kind == "preallocated_unwritten":  # (rows the user allocated without the "index" a first write adds)
        from torchrl.data import TensorStorage

        return TensorDictReplayBuffer(
            storage=TensorStorage(TensorDict({"id": torch.full((capacity,), -1)}, [capacity]))
        )
    if kind == "observation_norm":  # (a transform not verified exact in a buffer: warned at save and at load)
        from torchrl.envs.transforms import ObservationNorm

        transform = ObservationNorm(loc=0.0, scale=2.0, in_keys=["obs"])
        return TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=4, transform=transform)
    return TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=4)


def _kind_data(kind: str, rank: int) -> TensorDict:
    n = 6
    ids = torch.arange(n) + 100 * rank
    if kind == "slice":
        return TensorDict({"id": ids, "done": (ids % 3 == 2).unsqueeze(-1)}, [n])
    if kind == "user_index":  # (sample ids that equal the saved positions)
        return TensorDict({"id": ids, "index": torch.arange(n)}, [n])
    if kind == "slice_open":  # (one episode ends, at id 3: every new rank's newest row is mid-episode)
        return TensorDict({"id": ids, "done": (ids % 100 == 3).unsqueeze(-1)}, [n])
    if kind == "nstep":
        z = torch.zeros(n, 1, dtype=torch.bool)
        nxt = {"reward": torch.ones(n, 1), "done": z, "terminated": z, "truncated": z, "obs": torch.randn(n, 3)}
        return TensorDict({"id": ids, "obs": torch.randn(n, 3), "next": TensorDict(nxt, [n])}, [n])
    return TensorDict({"id": ids, "obs": torch.full((n, 3), 1.0001)}, [n])


def save_kind_shards(path: str, kind: str) -> dict[str, Any]:
    """Every rank a buffer of ``kind`` with 6 transitions (ids ``100 * rank + i``)."""
    rank = dist.get_rank()
    rb = _kind_buffer(kind, {"generations": 4, "preallocated": 8, "preallocated_unwritten": 8}.get(kind, 20))
    if kind == "preallocated_unwritten":  # rank 0 has not written yet (its rows lack the "index" entry)
        if rank == 1:
            rb.extend(TensorDict({"id": torch.arange(3) + 100}, [3]))
        tdcp.DistributedCheckpoint(buffer=rb).save(path)
        return {}
    if kind == "preallocated":
        rb.extend(TensorDict({"id": torch.arange(6) + 100 * rank, "index": torch.zeros(6, dtype=torch.long)}, [6]))
        tdcp.DistributedCheckpoint(buffer=rb).save(path)
        return {}
    rb.extend(_kind_data(kind, rank))
    if kind == "prioritized":
        rb.update_priority(torch.arange(6), torch.arange(6).float() + 1)
        rb._sampler._beta = 0.9  # annealed during training
    tdcp.DistributedCheckpoint(buffer=rb).save(path)
    return {}


def load_kind_resharded(path: str, kind: str, live: str) -> dict[str, Any]:
    """Reshard into a buffer of ``kind``; ``live``: what the buffer is or holds before the load."""
    from torchrl.data import ListStorage, TensorDictReplayBuffer

    rb = _kind_buffer(kind, 16 if kind.startswith("preallocated") else 20)
    if live == "list":
        rb = TensorDictReplayBuffer(storage=ListStorage(20), batch_size=4)
    elif live == "extra":
        rb.extend(TensorDict({"id": torch.arange(2), "obs": torch.zeros(2, 3), "extra": torch.full((2,), 7.0)}, [2]))
    elif live == "float16":
        rb.extend(TensorDict({"id": torch.arange(2), "obs": torch.zeros(2, 3, dtype=torch.float16)}, [2]))
    elif live == "prioritized":
        rb = TensorDictPrioritizedReplayBuffer(alpha=0.2, beta=0.4, storage=LazyTensorStorage(20), batch_size=4)
    before = len(rb)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tdcp.DistributedCheckpoint(buffer=rb).load(path, world_size_change="reshard")
    except tdcp.CheckpointError as err:
        return {"error": str(err), "len_unchanged": len(rb) == before}
    out: dict[str, Any] = {"error": None, "len": len(rb)}
    out["inexact"] = [str(w.message) for w in caught if issubclass(w.category, tdcp.InexactResumeWarning)]
    stored = rb._storage._storage if len(rb) else None
    if stored is not None and "index" in stored.keys():  # (the position a TensorDict writer stores in each row)
        out["index"] = stored["index"][: len(rb)].tolist()
    if kind in ("generations", "preallocated_unwritten"):
        out["ids"] = stored["id"][: len(rb)].tolist()
        out["generations"] = rb._writer.generations_of(torch.arange(len(rb) + 2)).tolist()
    if isinstance(rb._sampler, PrioritizedSampler):
        out["alpha_beta_eps"] = [rb._sampler._alpha, rb._sampler._beta, rb._sampler._eps]
    if kind in ("slice", "slice_open") and len(rb):
        torch.manual_seed(0)
        joins = set()
        for _ in range(50):
            sample = rb.sample()["id"]
            for row in sample.split(sample.numel() // 2):
                r = row.tolist()
                joins |= {(a, b) for a, b in zip(r, r[1:]) if b != a + 1}
        out["joins"] = sorted(joins)
    return out


def _counted_env(seed: int):
    """A SerialEnv whose sub-envs normalise (VecNormV2 in each: their state is the SerialEnv's sub-envs'), under a
    Compose holding a TrajCounter (state Compose.state_dict() drops)."""
    from torchrl.envs import (
        CatTensors,
        Compose,
        PendulumEnv,
        SerialEnv,
        StepCounter,
        TrajCounter,
        TransformedEnv,
        UnsqueezeTransform,
        VecNormV2,
    )

    def sub():
        base = TransformedEnv(
            PendulumEnv(),
            Compose(
                UnsqueezeTransform(-1, in_keys=["th", "thdot"], in_keys_inv=["th", "thdot"]),
                CatTensors(["th", "thdot"], "observation", del_keys=False),
                VecNormV2(in_keys=["observation"], decay=0.9),
            ),
        )
        return base

    env = TransformedEnv(SerialEnv(2, sub), Compose(StepCounter(max_steps=5), TrajCounter()))
    env.set_seed(seed)
    return env


def _vecnorm_counts(env) -> list[float]:
    """Each sub-env's VecNormV2 count of observations."""
    return [
        float(worker["transforms.2._extra_state"]["count.-|-.observation"])
        for worker in env.base_env.state_dict().values()
    ]


def _vecnorms(env) -> list[Any]:
    from torchrl_dcp.adapters.env_transforms import env_transforms

    return [t for _, t in env_transforms(env) if type(t).__name__ == "VecNormV2"]


def save_counted_collector(path: str, frozen: bool = False) -> dict[str, Any]:
    from torchrl.collectors import Collector

    collector = Collector(_counted_env(dist.get_rank()), None, frames_per_batch=12, total_frames=-1)
    it = iter(collector)
    for i in range(2):
        batch = next(it)
        if frozen and i == 0:  # (statistics fixed after a warm-up)
            for vecnorm in _vecnorms(collector.env):
                vecnorm.freeze()
    tdcp.DistributedCheckpoint(collector=collector, timeout=60).save(path, step=1)
    out = {"max_count": int(batch["traj_count"].max()), "vecnorm": _vecnorm_counts(collector.env)}
    collector.shutdown()
    return out


def load_counted_collector(path: str) -> dict[str, Any]:
    from torchrl.collectors import Collector

    collector = Collector(_counted_env(100 + dist.get_rank()), None, frames_per_batch=12, total_frames=-1)
    tdcp.DistributedCheckpoint(collector=collector, timeout=60).load(path, world_size_change="reshard")
    frozen = [v.frozen for v in _vecnorms(collector.env)]
    out = {"vecnorm": _vecnorm_counts(collector.env), "next_min_count": int(next(iter(collector))["traj_count"].min())}
    out["frozen"] = frozen
    collector.shutdown()
    return out


def _assembling_collector(seed: int):
    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv, StepCounter, TransformedEnv

    env = TransformedEnv(PendulumEnv(), StepCounter(max_steps=3))
    env.set_seed(seed)
    return Collector(env, None, frames_per_batch=20, total_frames=-1, trajs_per_batch=2)


def save_assembling_collector(path: str) -> dict[str, Any]:
    """A collector with ``trajs_per_batch`` holding complete trajectories it has not yielded yet."""
    collector = _assembling_collector(dist.get_rank())
    next(iter(collector))
    held = len(collector._traj_assembly[1])
    tdcp.DistributedCheckpoint(collector=collector, timeout=60).save(path, step=1)
    collector.shutdown()
    return {"held": held}


def load_assembling_collector_resharded(path: str) -> dict[str, Any]:
    collector = _assembling_collector(50 + dist.get_rank())
    before = tdcp.state_snapshot(collector)
    try:
        tdcp.DistributedCheckpoint(collector=collector, timeout=60).load(path, world_size_change="reshard")
    except tdcp.CheckpointError as err:
        unchanged = not tdcp.state_differences(before, tdcp.state_snapshot(collector))
        collector.shutdown()
        return {"error": type(err).__name__, "message": str(err), "unchanged": unchanged}
    collector.shutdown()
    return {"error": None}

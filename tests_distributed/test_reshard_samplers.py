"""Samplers with state of their own across a world-size change: carried exactly with the transitions, or refused.

The per-rank programs are the functions below the tests (each rank imports this module: ``launch(f"{S}:...")``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from tests_distributed.launch import launch

S = "tests_distributed.test_reshard_samplers"


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("sampler_capacity, storage_capacity", [(6, 40), (12, 40), (6, 8)])
def test_a_prioritized_sampler_needs_a_leaf_for_every_transition_it_receives(
    tmp_path: Path, sampler_capacity: int, storage_capacity: int
) -> None:
    """2 shards of 6 onto 1 rank whose storage has room (40) but whose sampler's trees hold ``sampler_capacity``
    leaves: 6 is refused while planning (the leaves would wrap around onto other rows), naming the size needed; 12
    holds every transition's priority at its row. Probe f3: where the storage is short too (8), the one error names
    both capacities (it named the sampler's alone, and the user who raised it met the storage's next)."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_prioritized", 2, path)
    (r,) = launch(f"{S}:load_prioritized", 1, path, sampler_capacity, storage_capacity)
    if sampler_capacity < 12:
        assert r.value["error"] is not None and "max_capacity of at least 12" in r.value["error"], r.value
        assert ("a capacity of at least 12" in r.value["error"]) == (storage_capacity < 12), r.value
        assert r.value["len"] == 0, r.value  # nothing changed
        return
    assert r.value["error"] is None, r.value
    assert sorted(r.value["rows"]) == [*range(6), *range(100, 106)], r.value
    assert r.value["leaves"] == [t + 1.0 for t in r.value["rows"]], r.value  # each row its own priority


@pytest.mark.parametrize("resumed", [1, 3])
def test_consumed_transitions_stay_consumed_after_a_reshard(tmp_path: Path, resumed: int) -> None:
    """``ConsumingSampler(max_sample_count=2)``: every transition keeps how often it was sampled (consumed ones are
    never sampled again, half-used ones once more), ``len(rb)`` counts the live ones, and new writes reuse consumed
    rows first."""
    path = str(tmp_path / "ckpt")
    before = launch(f"{S}:save_consuming", 2, path)
    after = launch(f"{S}:load_consuming", resumed, path)
    saved_counts = {int(t): c for r in before for t, c in r.value["counts"].items()}
    assert sorted(c for c in saved_counts.values()) != [0] * 12 and 2 in saved_counts.values()  # (something consumed)
    loaded_counts = {int(t): c for r in after for t, c in r.value["counts"].items()}
    assert loaded_counts == saved_counts  # every transition once, with its sample count
    assert sum(r.value["len"] for r in after) == sum(r.value["len"] for r in before)
    drained = Counter(t for r in after for t in r.value["drained"])
    assert drained == Counter({t: 2 - c for t, c in saved_counts.items() if c < 2}), drained
    for r in after:
        if r.value["consumed_rows"]:  # the write went to a consumed row, not past the rows held
            assert r.value["written_over"] in r.value["consumed_rows"] and r.value["storage_len"] == 12 // resumed, (
                r.value
            )


def test_a_staleness_aware_sampler_keeps_its_consumer_version(tmp_path: Path) -> None:
    """The saved ``consumer_version`` (3) and ``max_staleness`` (1) after 2 -> 1 and 2 -> 3, not the defaults: the
    hard gate still admits only versions 2 and 3, and sampling works."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_staleness", 2, path, False, False)
    for resumed in (1, 3):
        for r in launch(f"{S}:load_staleness", resumed, path):
            assert r.value["error"] is None, r.value
            assert r.value["consumer_version"] == 3 and r.value["max_staleness"] == 1, r.value
            assert r.value["sampled_versions"] and set(r.value["sampled_versions"]) <= {2, 3}, r.value


@pytest.mark.parametrize("as_tensor", [False, True])
def test_staleness_aware_shards_of_different_consumer_versions_are_refused(tmp_path: Path, as_tensor: bool) -> None:
    """Saved ranks at consumer versions 3 and 4 joined on one rank: no single version is exact for both, so the
    reshard is refused (while planning; versions set as tensors, once their values are read), naming the versions
    and what to do; the buffers are left as they were (2 -> 3: only new rank 1 joins both shards, and every rank's
    load fails)."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_staleness", 2, path, True, as_tensor)
    for resumed in (1, 3):
        for r in launch(f"{S}:load_staleness", resumed, path):
            error = r.value["error"]
            assert error is not None and "{0: (3, 1), 1: (4, 1)}" in error, r.value
            assert "same consumer_version and max_staleness" in error and "saved number of ranks" in error, r.value
            assert r.value["len"] == 0 and r.value["consumer_version"] == 0, r.value


# ---------------------------------------------------------------- per-rank programs
def _load(rb: Any, path: str) -> str | None:
    import torchrl_dcp as tdcp

    try:
        tdcp.DistributedCheckpoint(rb=rb).load(path, world_size_change="reshard")
    except tdcp.CheckpointError as err:
        return str(err)
    return None


def _prioritized(storage_capacity: int, sampler_capacity: int) -> Any:
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer

    sampler = PrioritizedSampler(max_capacity=sampler_capacity, alpha=1.0, beta=1.0)
    return TensorDictReplayBuffer(storage=LazyTensorStorage(storage_capacity), sampler=sampler, batch_size=4)


def save_prioritized(path: str) -> dict[str, Any]:
    import torchrl_dcp as tdcp

    rb = _prioritized(8, 8)
    tids = torch.arange(6) + 100 * dist.get_rank()
    rb.extend(TensorDict({"tid": tids}, [6]))
    rb.update_priority(torch.arange(6), (tids + 1).float())  # priority tid + 1 (alpha 1: the leaf too)
    tdcp.DistributedCheckpoint(rb=rb).save(path)
    return {}


def load_prioritized(path: str, sampler_capacity: int, storage_capacity: int = 40) -> dict[str, Any]:
    rb = _prioritized(storage_capacity, sampler_capacity)
    error = _load(rb, path)
    n = len(rb)
    out: dict[str, Any] = {"error": error, "len": n}
    if error is None:
        out["rows"] = rb._storage._storage["tid"][:n].tolist()
        out["leaves"] = [float(rb._sampler._sum_tree[i]) for i in range(n)]
    return out


def _consuming(capacity: int) -> Any:
    from torchrl.data import ConsumingSampler, LazyTensorStorage, TensorDictReplayBuffer

    sampler = ConsumingSampler(max_sample_count=2)
    return TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), sampler=sampler, batch_size=3)


def _sample_counts(rb: Any) -> dict[str, int]:
    """``{tid: times sampled}`` of every stored row (JSON keys)."""
    n = len(rb._storage)
    sampler = rb._sampler
    sampler._ensure_state(rb._storage)
    tids = rb._storage._storage["tid"][:n].tolist()
    return {str(t): int(sampler._sample_count[i]) for i, t in enumerate(tids)}


def save_consuming(path: str) -> dict[str, Any]:
    import torchrl_dcp as tdcp

    rank = dist.get_rank()
    torch.manual_seed(rank)
    rb = _consuming(8)
    rb.extend(TensorDict({"tid": torch.arange(6) + 100 * rank}, [6]))
    for _ in range(3):  # 9 draws of 6 rows at most twice each: some consumed, some sampled once
        rb.sample()
    rb.extend(TensorDict({"tid": torch.arange(6, 8) + 100 * rank}, [2]))  # over consumed rows: never sampled
    tdcp.DistributedCheckpoint(rb=rb).save(path)
    return {"counts": _sample_counts(rb), "len": len(rb)}


def load_consuming(path: str) -> dict[str, Any]:
    rb = _consuming(40)
    error = _load(rb, path)
    assert error is None, error
    out: dict[str, Any] = {"counts": _sample_counts(rb), "len": len(rb)}
    storage = rb._storage._storage
    n = len(rb._storage)
    consumed = [t for t, c in out["counts"].items() if c >= 2]
    drained: list[int] = []
    torch.manual_seed(0)
    while len(rb):
        drained += rb.sample()["tid"].tolist()
    out["drained"] = drained
    out["consumed_rows"] = [int(t) for t in consumed]
    if consumed:
        old = storage["tid"][:n].clone()
        rb.extend(TensorDict({"tid": torch.tensor([-1])}, [1]))
        (where,) = torch.nonzero(rb._storage._storage["tid"][: len(rb._storage)] == -1).flatten().tolist()
        out["written_over"] = int(old[where]) if where < n else None
        out["storage_len"] = len(rb._storage)
    return out


def _staleness(capacity: int, max_staleness: int) -> Any:
    from torchrl.data import LazyTensorStorage, StalenessAwareSampler, TensorDictReplayBuffer

    sampler = StalenessAwareSampler(max_staleness=max_staleness)
    return TensorDictReplayBuffer(storage=LazyTensorStorage(capacity), sampler=sampler, batch_size=4)


def save_staleness(path: str, differ: bool, as_tensor: bool) -> dict[str, Any]:
    import torchrl_dcp as tdcp

    rank = dist.get_rank()
    rb = _staleness(8, 1)
    versions = torch.tensor([0, 2, 1, 3, 0, 2])  # (a 2 or 3 in every part of 2 -> 1 and 2 -> 3)
    rb.extend(TensorDict({"tid": torch.arange(6) + 100 * rank, "policy_version": versions}, [6]))
    version = 3 + rank if differ else 3
    rb.sampler.consumer_version = torch.tensor(version) if as_tensor else version
    rb.sample()
    tdcp.DistributedCheckpoint(rb=rb).save(path)
    return {}


def load_staleness(path: str) -> dict[str, Any]:
    rb = _staleness(40, 5)  # (another max_staleness than saved: the saved one is restored)
    error = _load(rb, path)
    sampler = rb.sampler
    out: dict[str, Any] = {"error": error, "len": len(rb), "consumer_version": sampler.consumer_version}
    out["max_staleness"] = sampler.max_staleness
    if error is None and len(rb):
        torch.manual_seed(0)
        out["sampled_versions"] = sorted({int(v) for _ in range(5) for v in rb.sample()["policy_version"].tolist()})
    return out

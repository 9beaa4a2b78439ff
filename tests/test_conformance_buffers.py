"""Conformance matrix: replay buffers over every storage × ndim × sampler × writer × fill level.

Each case saves a real torchrl buffer with ``DistributedCheckpoint(buffer=rb).save``, loads it into a freshly built
one, and checks that sampling (global RNG saved with ``RNGState``, or the buffer's own generator), priority updates
and further extends continue bit for bit as in the buffer that never stopped. Combinations torchrl itself does not
support are skipped with the reason.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    ConsumingSampler,
    LazyMemmapStorage,
    LazyTensorStorage,
    ListStorage,
    PrioritizedSampler,
    PrioritizedSliceSampler,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    StalenessAwareSampler,
    StreamingSliceSampler,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
    TensorDictRoundRobinWriter,
    TensorStorage,
)

import torchrl_dcp as tdcp
from torchrl_dcp.audit import state_differences, state_snapshot

CAPACITY = 24
ENVS = 2  # batch width of ndim=2 storages (a batched env's data: [envs, time])
STORAGES = ["tensor", "memmap", "preallocated"]  # preallocated: TensorStorage over a TensorDict the user built
NDIMS = [1, 2]
SAMPLERS = [
    "random", "without_replacement", "prioritized", "slice", "prioritized_slice", "slice_without_replacement",
    "consuming", "staleness", "streaming_slice",
]  # fmt: skip
WRITERS = ["round_robin", "max_value", "td_round_robin"]
FILLS = ["filled", "wrapped"]

BEFORE = "torchrl fails on it before any checkpoint"
SKIP = {
    # (storage, sampler, writer, ndim), None for any -> reason
    (None, None, "max_value", 2): "torchrl refuses it: TensorDictMaxValueWriter is not compatible with ndim > 1",
    (None, "consuming", None, 2): "torchrl refuses it: ConsumingSampler only supports 1-dimensional storages",
    (None, "consuming", "max_value", None): "torchrl refuses it: ConsumingSampler requires a writer with write_at",
    (None, "streaming_slice", None, 2): "torchrl refuses it: StreamingSliceSampler requires a 1-dimensional storage",
    (None, "staleness", None, 2): f"{BEFORE} (StalenessAwareSampler indexes a 2-dimensional storage by rows)",
    ("preallocated", "slice_without_replacement", None, 2): f"{BEFORE} (a reshape of the pre-allocated rows)",
}


def _skip_reason(storage: str, sampler: str, writer: str, ndim: int) -> str | None:
    for (st, s, w, n), reason in SKIP.items():
        if st in (None, storage) and s in (None, sampler) and w in (None, writer) and n in (None, ndim):
            return reason
    return None


def frames(n: int, start: int, ndim: int) -> TensorDict:
    """``n`` transitions (``[n]``), or ``n`` steps of ``ENVS`` envs (``[ENVS, n]``) for ndim=2; episodes of 4 steps."""
    g = torch.Generator().manual_seed(start)
    shape = [n] if ndim == 1 else [ENVS, n]
    step = torch.arange(start, start + n).expand(*shape)
    env = torch.zeros(shape, dtype=torch.long) if ndim == 1 else torch.arange(ENVS).unsqueeze(-1).expand(*shape)
    return TensorDict(
        {
            "obs": torch.randn(*shape, 3, generator=g),
            "episode": step // 4 + 1000 * env,
            "policy_version": step // 6,
            "next": {
                "reward": torch.randn(*shape, 1, generator=g),
                "done": (step % 4 == 3).unsqueeze(-1),
            },
        },
        shape,
    )


def build(storage: str, ndim: int, sampler: str, writer: str, generator: bool, tmp: Path, tag: str) -> ReplayBuffer:
    kw = {"ndim": ndim}
    if storage == "memmap":
        store = LazyMemmapStorage(CAPACITY, scratch_dir=tmp / f"scratch-{tag}", **kw)
    elif storage == "preallocated":  # rows the user allocated ([time, envs] for ndim=2), without the "index"
        rows = frames(CAPACITY, 0, 1) if ndim == 1 else frames(CAPACITY // ENVS, 0, 2).transpose(0, 1).contiguous()
        store = TensorStorage(rows.zero_(), ndim=ndim)  # entry a TensorDictReplayBuffer adds at its first write
    else:
        store = LazyTensorStorage(CAPACITY, **kw)
    samp = {
        "random": RandomSampler,
        "without_replacement": SamplerWithoutReplacement,
        "prioritized": lambda: PrioritizedSampler(CAPACITY, alpha=0.7, beta=0.5),
        "slice": lambda: SliceSampler(num_slices=2, traj_key="episode", strict_length=False),
        "prioritized_slice": lambda: PrioritizedSliceSampler(
            max_capacity=CAPACITY, alpha=0.7, beta=0.5, num_slices=2, traj_key="episode", strict_length=False
        ),
        "slice_without_replacement": lambda: SliceSamplerWithoutReplacement(
            num_slices=2, traj_key="episode", strict_length=False
        ),
        "consuming": lambda: ConsumingSampler(max_sample_count=3),
        "staleness": lambda: StalenessAwareSampler(),
        "streaming_slice": lambda: StreamingSliceSampler(slice_len=2, traj_key="episode"),
    }[sampler]()
    if sampler == "staleness":
        samp.consumer_version = 1000  # the learner's version: every stored transition is older
    wri = {
        "max_value": lambda: TensorDictMaxValueWriter(rank_key=("next", "reward")),
        "round_robin": RoundRobinWriter,
        "td_round_robin": TensorDictRoundRobinWriter,
    }[writer]()
    gen = torch.Generator().manual_seed(11) if generator else None
    return TensorDictReplayBuffer(
        storage=store, sampler=samp, writer=wri, batch_size=8, generator=gen, priority_key="td_error"
    )


def extend(rb: ReplayBuffer, n: int, start: int, ndim: int) -> None:
    rb.extend(frames(n, start, ndim))


def exercise(rb: ReplayBuffer, rounds: int, start: int, ndim: int, prioritized: bool) -> list[TensorDict]:
    out = []
    for i in range(rounds):
        sample = rb.sample()
        if prioritized:
            sample.set("td_error", sample["obs"].abs().sum(-1) + i)
            rb.update_tensordict_priority(sample)
        out.append(sample.exclude("td_error"))
        extend(rb, 3, start + 10 * i, ndim)
    return out


CASES = list(itertools.product(STORAGES, NDIMS, SAMPLERS, WRITERS, FILLS))


@pytest.mark.parametrize("storage, ndim, sampler, writer, fill", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_buffer_conformance(tmp_path: Path, storage: str, ndim: int, sampler: str, writer: str, fill: str) -> None:
    reason = _skip_reason(storage, sampler, writer, ndim)
    if reason:
        pytest.skip(reason)
    prioritized = sampler.startswith("prioritized")
    generator = storage == "memmap"  # tensor storages sample from the global RNG, memmap ones from their generator
    torch.manual_seed(3)
    rb = build(storage, ndim, sampler, writer, generator, tmp_path, "a")
    per_extend = 1 if ndim == 1 else ENVS
    n = (CAPACITY // per_extend) // 2 if fill == "filled" else (CAPACITY // per_extend) * 2 - 1
    extend(rb, n, 0, ndim)
    exercise(rb, 1, 500, ndim, prioritized)  # mid-epoch for samplers without replacement
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    ckpt.register("rng", tdcp.RNGState())
    path = ckpt.save(tmp_path / "ckpt")
    saved = state_snapshot(rb, "buffer")
    expected = exercise(rb, 4, 2000, ndim, prioritized)

    torch.manual_seed(99)  # the fresh buffer must not depend on the global RNG at load time
    fresh = build(storage, ndim, sampler, writer, generator, tmp_path, "b")
    ck2 = tdcp.DistributedCheckpoint(buffer=fresh)
    ck2.register("rng", tdcp.RNGState())
    ck2.load(path)
    differences = state_differences(saved, state_snapshot(fresh, "buffer"))  # the whole buffer, audited
    assert not differences, "the restored buffer differs:\n" + "\n".join(map(str, differences[:20]))
    got = exercise(fresh, 4, 2000, ndim, prioritized)
    assert len(fresh) == len(rb)
    for i, (a, b) in enumerate(zip(expected, got)):
        assert a.batch_size == b.batch_size and set(a.keys(True, True)) == set(b.keys(True, True))
        for key in a.keys(True, True):
            assert torch.equal(a[key], b[key]), f"sample {i}: {key} differs after the restore"
    stored = rb._storage._storage[: rb._storage._len_along_dim0]
    assert torch.equal(stored["obs"], fresh._storage._storage[: fresh._storage._len_along_dim0]["obs"])
    if prioritized:
        idx = torch.arange(CAPACITY)
        assert torch.equal(rb._sampler._sum_tree[idx], fresh._sampler._sum_tree[idx])
    if storage == "memmap":
        assert str(tmp_path / "scratch-b") in fresh._storage._storage["obs"].filename


@pytest.mark.parametrize("value", [1, "x", None], ids=["int", "str", "none"])
def test_list_storage_of_plain_values_round_trips(tmp_path: Path, value: object) -> None:
    """Plain values in a ListStorage (no tensor at all) come back as they were (``tests/test_list_storage.py``
    has the full matrix)."""
    rb = ReplayBuffer(storage=ListStorage(10))
    rb.extend([{"a": 1, "v": value}, {"a": 2, "v": [value]}])
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "ckpt")
    fresh = ReplayBuffer(storage=ListStorage(10))
    tdcp.DistributedCheckpoint(buffer=fresh).load(path)
    assert fresh._storage._storage == [{"a": 1, "v": value}, {"a": 2, "v": [value]}]


#: torchrl's samplers, writers and storages (``torchrl.data.replay_buffers``) the matrix above covers, by class
COVERED = {
    "RandomSampler": "random", "SamplerWithoutReplacement": "without_replacement", "PrioritizedSampler": "prioritized",
    "SliceSampler": "slice", "PrioritizedSliceSampler": "prioritized_slice",
    "SliceSamplerWithoutReplacement": "slice_without_replacement", "ConsumingSampler": "consuming",
    "StalenessAwareSampler": "staleness", "StreamingSliceSampler": "streaming_slice",
    "RoundRobinWriter": "round_robin", "TensorDictMaxValueWriter": "max_value", "TensorDictRoundRobinWriter": "td_round_robin",
    "LazyTensorStorage": "tensor", "LazyMemmapStorage": "memmap", "TensorStorage": "preallocated",
}  # fmt: skip
#: the others, and where they are covered or why not
ELSEWHERE = {
    "ListStorage": "tests/test_list_storage.py (transitions of any kind, samplers, resharding)",
    "LazyStackStorage": "tests/test_list_storage.py",
    "CompressedListStorage": "refused with an EncodingError naming the storage (tests/test_list_storage.py)",
    "SamplerEnsemble": "part of ReplayBufferEnsemble: refused as one component, each buffer registers on its own",
    "WriterEnsemble": "part of ReplayBufferEnsemble (see SamplerEnsemble)",
    "StorageEnsemble": "part of ReplayBufferEnsemble (see SamplerEnsemble)",
    "StoreStorage": "keeps its rows in a Redis server, outside the job",
    "PromptGroupSampler": "groups language-model prompts (needs an LLM collector's data)",
    "ImmutableDatasetWriter": "writes nothing: offline datasets, rebuilt by the job (OfflineToOnline's offline part)",
    "Sampler": "a base class",
    "Writer": "a base class",
    "Storage": "a base class",
}


def test_every_sampler_writer_and_storage_of_torchrl_is_covered_or_said_why() -> None:
    import inspect

    import torchrl.data.replay_buffers as rbs

    bases = (rbs.Sampler, rbs.Writer, rbs.Storage)
    found = {n for n in rbs.__all__ if inspect.isclass(getattr(rbs, n)) and issubclass(getattr(rbs, n), bases)}
    assert {"RandomSampler", "RoundRobinWriter", "LazyTensorStorage"} <= found
    assert found <= set(COVERED) | set(ELSEWHERE), f"new in torchrl: {found - set(COVERED) - set(ELSEWHERE)}"
    assert set(COVERED.values()) <= set(SAMPLERS) | set(WRITERS) | set(STORAGES)


def test_a_replay_buffer_ensemble_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    from torchrl.data import ReplayBufferEnsemble

    ensemble = ReplayBufferEnsemble(
        TensorDictReplayBuffer(storage=LazyTensorStorage(8)), TensorDictReplayBuffer(storage=LazyTensorStorage(8))
    )
    with pytest.raises(tdcp.EncodingError, match=r"register each of its buffers \(ensemble\[i\]\)"):
        tdcp.DistributedCheckpoint(buffer=ensemble).save(tmp_path / "c")
    ckpt = tdcp.DistributedCheckpoint(first=ensemble[0], second=ensemble[1])  # what the message says: it saves
    ckpt.save(tmp_path / "d")


def test_an_entry_missing_from_user_rows_is_allocated_only_when_saved_rows_back_it() -> None:
    """A saved state of zero rows backs no byte of its shape: the entry it names is not allocated (a forged shape of
    billions of elements per row would otherwise be), and is left for torchrl's first write."""
    from torchrl_dcp.adapters.replay_buffer import storage_destinations
    from torchrl_dcp.format.codec import TensorSpec

    storage = TensorStorage(TensorDict({"obs": torch.zeros(CAPACITY, 3)}, [CAPACITY]))
    huge = TensorSpec("rank/0/buffer/storage/data/index", (0, 1 << 40), torch.int64, "cpu")
    obs = TensorSpec("rank/0/buffer/storage/data/obs", (0, 3), torch.float32, "cpu")
    saved = {"kind": "tensor", "initialized": True, "ndim": 1, "rows": 0, "is_tensordict": True,
             "data": {"obs": obs, "index": huge}}  # fmt: skip
    out = storage_destinations(storage, saved, "buffer")
    assert set(out) == {obs.key} and "index" not in storage._storage.keys()


# ---------------------------------------------------------------------- replay buffer classes
def _her_reward(td: TensorDict) -> torch.Tensor:
    return -(td["next", "achieved_goal"] - td["desired_goal"]).norm(dim=-1, keepdim=True)


def _her_items(n: int, start: int) -> TensorDict:
    i = torch.arange(start, start + n, dtype=torch.float32).unsqueeze(-1)
    done = (torch.arange(start, start + n) % 3 == 2).unsqueeze(-1)
    return TensorDict(
        {
            "obs": i,
            "desired_goal": torch.zeros(n, 1),
            "achieved_goal": i,
            "next": {"achieved_goal": i, "reward": torch.zeros(n, 1), "done": done, "terminated": done},
        },
        [n],
    )


def _buffer_class(name: str) -> ReplayBuffer:
    import torchrl.data.replay_buffers as rbs

    if name == "HERReplayBuffer":
        return rbs.HERReplayBuffer(_her_reward, storage=LazyTensorStorage(CAPACITY), her_ratio=1.0, strategy="future")
    if name in ("PrioritizedReplayBuffer", "TensorDictPrioritizedReplayBuffer"):
        return getattr(rbs, name)(alpha=0.7, beta=0.5, storage=LazyTensorStorage(CAPACITY), batch_size=5)
    return getattr(rbs, name)(storage=LazyTensorStorage(CAPACITY), batch_size=5)


#: torchrl's replay buffer classes the recipe below covers (each built, filled past its capacity, sampled, saved,
#: restored into a fresh one: audited and its next samples compared)
BUFFER_RECIPES = ["HERReplayBuffer", "PrioritizedReplayBuffer", "RemoteTensorDictReplayBuffer",
                  "ReplayBuffer", "TensorDictPrioritizedReplayBuffer", "TensorDictReplayBuffer"]  # fmt: skip
#: the others, and why
BUFFER_ELSEWHERE = {
    "ReplayBufferEnsemble": "refused as one component, saying to register each of its buffers (below)",
    "RayReplayBuffer": "keeps its buffer in a Ray actor, outside the job's processes (needs Ray): not built here",
    "OfflineToOnlineReplayBuffer": "saved through the OfflineToOnlineTrainer's buffer hook (its online buffer and "
    "offline fractions; the offline dataset is rebuilt by the job: tests_distributed/test_trainer_conformance.py); "
    "registered alone, not covered",
}


def test_every_replay_buffer_class_of_torchrl_is_covered_or_said_why() -> None:
    import inspect

    import torchrl.data.replay_buffers as rbs

    found = {
        n for n in rbs.__all__
        if inspect.isclass(getattr(rbs, n)) and (issubclass(getattr(rbs, n), ReplayBuffer) or "ReplayBuffer" in n)
    }  # fmt: skip
    assert {"ReplayBuffer", "HERReplayBuffer"} <= found
    assert found <= set(BUFFER_RECIPES) | set(BUFFER_ELSEWHERE), f"new in torchrl: {found - set(BUFFER_RECIPES)}"


def _seed(n: int) -> None:
    """The global streams a sampler may draw from (prioritized samplers draw from NumPy's)."""
    import random

    import numpy as np

    torch.manual_seed(n)
    np.random.seed(n)
    random.seed(n)


def _add(buffer: ReplayBuffer, data: TensorDict) -> None:
    """Items one by one into a ``HERReplayBuffer`` (torchrl 0.14 fails on its episode ends once a batch extend has
    filled it), else one extend."""
    if type(buffer).__name__ == "HERReplayBuffer":
        for i in range(data.shape[0]):
            buffer.add(data[i])
    else:
        buffer.extend(data)


@pytest.mark.parametrize("name", BUFFER_RECIPES)
def test_a_replay_buffer_class_resumes_exactly(tmp_path: Path, name: str) -> None:
    def items(n: int, start: int) -> TensorDict:
        return _her_items(n, start) if name == "HERReplayBuffer" else frames(n, start, 1)

    rb = _buffer_class(name)
    # wrapped past its capacity; a HERReplayBuffer filled short of it (torchrl 0.14 fails on its episode ends then)
    _add(rb, items(CAPACITY - 4 if name == "HERReplayBuffer" else CAPACITY + 5, 0))
    _seed(1)
    rb.sample(5)
    saved = state_snapshot(rb, "buffer")
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    ckpt.register("rng", tdcp.RNGState())
    path = ckpt.save(tmp_path / "ckpt")
    fresh = _buffer_class(name)
    restore = tdcp.DistributedCheckpoint(buffer=fresh)
    restore.register("rng", tdcp.RNGState())
    restore.load(path)
    assert state_differences(saved, state_snapshot(fresh, "buffer")) == []
    for buffer in (rb, fresh):  # the same draws, extends and samples from here on
        _seed(2)
        _add(buffer, items(3, 100))
    for _ in range(3):
        _seed(3)
        a = rb.sample(5)
        _seed(3)
        b = fresh.sample(5)
        assert set(a.keys(True, True)) == set(b.keys(True, True))
        assert all(torch.equal(a[k], b[k]) for k in a.keys(True, True))

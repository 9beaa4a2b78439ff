"""Replay buffers restore exactly: same samples, same priorities, same writes, in the user's scratch_dir."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    PrioritizedSampler,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    SliceSampler,
    TensorDictMaxValueWriter,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

import torchrl_dcp as tdcp

CAPACITY = 32


def data(n: int, start: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(start)
    return TensorDict(
        {
            "obs": torch.randn(n, 3, generator=g),
            "action": torch.randint(0, 5, (n, 1), generator=g),
            "episode": (torch.arange(start, start + n) // 4),
            "next": {"reward": torch.randn(n, 1, generator=g), "done": torch.zeros(n, 1, dtype=torch.bool)},
        },
        [n],
    )


def storage(kind: str, tmp: Path, tag: str):
    if kind == "memmap":
        return LazyMemmapStorage(CAPACITY, scratch_dir=tmp / f"scratch-{tag}")
    return LazyTensorStorage(CAPACITY)


def make(sampler: str, writer: str, kind: str, tmp: Path, tag: str, generator: bool) -> ReplayBuffer:
    gen = torch.Generator().manual_seed(7) if generator else None
    kw = {"storage": storage(kind, tmp, tag), "batch_size": 6, "generator": gen}
    if writer == "max_value":
        kw["writer"] = TensorDictMaxValueWriter(rank_key=("next", "reward"))
    else:
        kw["writer"] = RoundRobinWriter()
    if sampler == "prioritized":
        del kw["writer"]
        return TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.4, **kw)
    kw["sampler"] = {
        "random": RandomSampler,
        "without_replacement": SamplerWithoutReplacement,
        "slice": lambda: SliceSampler(num_slices=2, traj_key="episode"),
    }[sampler]()
    return TensorDictReplayBuffer(**kw)


def exercise(rb: ReplayBuffer, rounds: int, start: int) -> list[TensorDict]:
    out = []
    for i in range(rounds):
        sample = rb.sample()
        if "td_error" in sample.keys() or isinstance(rb, TensorDictPrioritizedReplayBuffer):  # noqa: SIM118
            sample.set("td_error", sample["obs"].abs().sum(-1))
            rb.update_tensordict_priority(sample)
        out.append(sample.exclude("td_error"))
        rb.extend(data(5, start + 5 * i))
    return out


CASES = [
    ("random", "round_robin", "tensor", False, 20),
    ("random", "round_robin", "memmap", True, 45),  # wrapped around, own generator
    ("without_replacement", "round_robin", "tensor", False, 45),
    ("prioritized", "round_robin", "tensor", False, 20),
    ("prioritized", "round_robin", "memmap", False, 45),
    ("slice", "round_robin", "tensor", False, 24),
    ("random", "max_value", "tensor", False, 45),
]


@pytest.mark.parametrize("sampler, writer, kind, generator, filled", CASES)
def test_buffer_continues_identically(tmp_path: Path, sampler, writer, kind, generator, filled) -> None:
    rb = make(sampler, writer, kind, tmp_path, "a", generator)
    if writer == "max_value":
        for i in range(filled):
            rb.add(data(1, 100 + i)[0])
    else:
        rb.extend(data(filled))
    exercise(rb, 3, 1000)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    ckpt.register("rng", tdcp.RNGState())
    path = ckpt.save(tmp_path / "ckpt")
    expected = exercise(rb, 4, 2000)

    fresh = make(sampler, writer, kind, tmp_path, "b", generator)
    ck2 = tdcp.DistributedCheckpoint(buffer=fresh)
    ck2.register("rng", tdcp.RNGState())
    ck2.load(path)
    got = exercise(fresh, 4, 2000)
    for a, b in zip(expected, got):
        assert (a == b).all(), f"{sampler}/{writer}/{kind}: a sample differs after the restore"
    assert len(fresh) == len(rb)
    if kind == "memmap":  # the restored storage lives in the user's scratch_dir, on its memmap
        obs = fresh._storage._storage["obs"]
        assert str(tmp_path / "scratch-b") in obs.filename


def test_prioritized_trees_are_bit_identical(tmp_path: Path) -> None:
    rb = make("prioritized", "round_robin", "tensor", tmp_path, "a", False)
    rb.extend(data(40))
    exercise(rb, 3, 10)
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "ckpt")
    fresh = make("prioritized", "round_robin", "tensor", tmp_path, "b", False)
    tdcp.DistributedCheckpoint(buffer=fresh).load(path)
    idx = torch.arange(CAPACITY)
    for tree in ("_sum_tree", "_min_tree"):
        assert torch.equal(getattr(rb._sampler, tree)[idx], getattr(fresh._sampler, tree)[idx])
    assert rb._sampler._sum_tree.query(0, CAPACITY) == fresh._sampler._sum_tree.query(0, CAPACITY)
    assert rb._sampler._min_tree.query(0, CAPACITY) == fresh._sampler._min_tree.query(0, CAPACITY)


def test_partially_filled_buffer_saves_only_its_rows(tmp_path: Path) -> None:
    rb = make("random", "round_robin", "tensor", tmp_path, "a", False)
    rb.extend(data(5))
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "ckpt")
    rec = tdcp.read_manifest(path)["components"]["buffer"]
    assert rec["placement"] == "per_rank"
    storage_state = dict(rec["ranks"]["0"]["state"]["items"])["storage"]
    obs = dict(dict(storage_state["items"])["data"]["items"])["obs"]
    assert obs["shape"] == [5, 3]


def test_empty_buffer_round_trips(tmp_path: Path) -> None:
    rb = make("random", "round_robin", "tensor", tmp_path, "a", False)
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "ckpt")
    fresh = make("random", "round_robin", "tensor", tmp_path, "b", False)
    fresh.extend(data(3))
    tdcp.DistributedCheckpoint(buffer=fresh).load(path)
    assert len(fresh) == 0


def test_compressed_list_storage_is_refused_with_advice(tmp_path: Path) -> None:
    from torchrl.data import CompressedListStorage

    rb = ReplayBuffer(storage=CompressedListStorage(10))
    rb.extend([torch.zeros(3), torch.ones(3)])
    with pytest.raises(tdcp.EncodingError, match="CompressedListStorage.*ListStorage, LazyTensorStorage"):
        tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_too_small_capacity_is_incompatible(tmp_path: Path) -> None:
    rb = ReplayBuffer(storage=LazyTensorStorage(20))
    rb.extend(data(20))
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "ckpt")
    small = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(tdcp.IncompatibleComponentError, match="larger capacity"):
        tdcp.DistributedCheckpoint(buffer=small).load(path)


def test_plain_tensor_storage(tmp_path: Path) -> None:
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=3)
    rb.extend(torch.arange(7.0).unsqueeze(-1))
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "ckpt")
    fresh = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=3)
    tdcp.DistributedCheckpoint(buffer=fresh).load(path)
    assert torch.equal(fresh[:7], rb[:7])


@pytest.mark.parametrize("kind", ["tensor", "memmap"])
def test_ndim2_storage_loads_into_a_fresh_lazy_buffer(tmp_path: Path, kind: str) -> None:
    """Batched-env data ([envs, time]) in an ndim=2 storage: allocated from the saved shapes, only written rows saved."""

    def build(tag: str) -> TensorDictReplayBuffer:
        store = (
            LazyMemmapStorage(20, ndim=2, scratch_dir=tmp_path / tag)
            if kind == "memmap"
            else LazyTensorStorage(20, ndim=2)
        )
        return TensorDictReplayBuffer(
            storage=store, sampler=SliceSampler(num_slices=2, traj_key="episode"), batch_size=6
        )

    rb = build("a")
    episode = torch.arange(4).unsqueeze(-1).expand(4, 3) // 2 + 10 * torch.arange(4).unsqueeze(-1)
    rb.extend(TensorDict({"obs": torch.randn(4, 3, 2), "episode": episode}, [4, 3]))  # 4 envs, 3 steps
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "ckpt")
    fresh = build("b")
    tdcp.DistributedCheckpoint(buffer=fresh).load(path)
    assert len(fresh) == len(rb) == 12
    assert fresh._storage._storage.shape == rb._storage._storage.shape == (5, 4)
    assert torch.equal(fresh._storage._storage[:3]["obs"], rb._storage._storage[:3]["obs"])
    torch.manual_seed(0)
    a = rb.sample()
    torch.manual_seed(0)
    assert (fresh.sample() == a).all()


@pytest.mark.parametrize("where", ["the buffer's transform", "inside nested Composes"])
def test_a_multi_step_transform_keeps_what_it_held_back_across_a_restore(tmp_path: Path, where: str) -> None:
    """``ReplayBuffer(transform=MultiStepTransform(n_steps=3))`` writes a rollout's transitions only once the next
    ``extend`` completes their n-step returns; the held-back ones live on the transform. After a restore the next
    ``extend`` writes exactly what an uninterrupted buffer writes (they used to be lost; inside a ``Compose`` of a
    ``Compose`` they still were, without a warning)."""
    from torchrl.envs.transforms import Compose, MultiStepTransform, RewardScaling

    from torchrl_dcp.examples.sac import make_env

    env = make_env(0, torch.device("cpu"))
    torch.manual_seed(0)
    chunks = [env.rollout(10) for _ in range(3)]

    def make() -> ReplayBuffer:
        transform = MultiStepTransform(n_steps=3, gamma=0.9)
        if where != "the buffer's transform":
            transform = Compose(Compose(RewardScaling(0.0, 1.0), transform))
        return ReplayBuffer(storage=LazyTensorStorage(100), transform=transform)

    rb = make()
    rb.extend(chunks[0])
    assert len(rb) == 7  # 3 transitions held back
    path = tdcp.DistributedCheckpoint(rb=rb).save(tmp_path / "c")
    rb.extend(chunks[1])
    fresh = make()
    fresh.extend(chunks[2])  # other transitions held back: the load replaces them
    tdcp.DistributedCheckpoint(rb=fresh).load(path)
    fresh.extend(chunks[1])
    assert len(fresh) == len(rb) == 17
    a, b = rb._storage._storage[:17], fresh._storage._storage[:17]  # (what was written: no read-side transform)
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        assert torch.equal(a[key], b[key]), key


def test_a_memmap_scratch_dir_left_by_an_earlier_buffer_says_what_to_do(tmp_path: Path) -> None:
    """A resume that reuses the crashed job's ``scratch_dir``: torchrl refuses to overwrite its memmap files; the
    load is refused before anything changes and says to use an empty ``scratch_dir`` (which then loads)."""
    from torchrl.data import LazyMemmapStorage

    rb = ReplayBuffer(storage=LazyMemmapStorage(16, scratch_dir=tmp_path / "scratch"))
    rb.extend(TensorDict({"obs": torch.arange(12.0).reshape(4, 3)}, [4]))
    path = tdcp.DistributedCheckpoint(rb=rb).save(tmp_path / "c")
    reused = ReplayBuffer(storage=LazyMemmapStorage(16, scratch_dir=tmp_path / "scratch"))
    with pytest.raises(tdcp.IncompatibleComponentError, match="empty scratch_dir"):
        tdcp.DistributedCheckpoint(rb=reused).load(path)
    fresh = ReplayBuffer(storage=LazyMemmapStorage(16, scratch_dir=tmp_path / "scratch2"))
    tdcp.DistributedCheckpoint(rb=fresh).load(path)
    assert len(fresh) == 4 and torch.equal(fresh[:4]["obs"], torch.arange(12.0).reshape(4, 3))


@pytest.mark.parametrize("live_keys", [["obs", "stale"], ["act"]], ids=["an-extra-entry", "other-entries"])
def test_a_filled_storage_with_entries_the_checkpoint_lacks_is_refused_and_unchanged(
    tmp_path: Path, live_keys: list[str]
) -> None:
    """A buffer whose initialised storage holds entries the checkpoint does not would keep them in the restored rows
    (samples carrying values no save wrote): refused while planning, the buffer unchanged."""
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    rb.extend(TensorDict({"obs": torch.arange(4.0)}, [4]))
    path = tdcp.DistributedCheckpoint(rb=rb).save(tmp_path / "c")
    live = TensorDictReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    live.extend(TensorDict({k: torch.full((3,), 7.0) for k in live_keys}, [3]))
    before = live[:3].clone()
    with pytest.raises(tdcp.IncompatibleComponentError, match="entries the checkpoint does not"):
        tdcp.DistributedCheckpoint(rb=live).load(path)
    assert len(live) == 3 and (live[:3] == before).all()
    assert set(live.storage._storage.keys()) == set(before.keys())
    fresh = TensorDictReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    tdcp.DistributedCheckpoint(rb=fresh).load(path)  # a freshly built buffer loads it
    assert torch.equal(fresh[:4]["obs"], rb[:4]["obs"])


@pytest.mark.parametrize("differs", ["sampler", "writer"])
def test_a_buffer_of_another_sampler_or_writer_is_refused_before_anything_is_read(tmp_path: Path, differs: str) -> None:
    """A sampler or writer of another class was refused only while restoring, after other components' tensors (a
    policy's weights) had been read in place; now while planning: nothing changes."""
    policy = torch.nn.Linear(3, 2)
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(CAPACITY), batch_size=4)
    rb.extend(data(8))
    path = tdcp.DistributedCheckpoint(policy=policy, rb=rb).save(tmp_path / "c")
    live_policy = torch.nn.Linear(3, 2)
    weights = live_policy.weight.detach().clone()
    if differs == "sampler":
        live = TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), sampler=RandomSampler(), batch_size=4)
    else:
        live = TensorDictReplayBuffer(
            storage=LazyTensorStorage(CAPACITY),
            sampler=PrioritizedSampler(CAPACITY, alpha=0.7, beta=0.5),
            writer=TensorDictMaxValueWriter(rank_key="obs"),
            batch_size=4,
        )
    with pytest.raises(tdcp.IncompatibleComponentError, match=f"{differs} was"):
        tdcp.DistributedCheckpoint(policy=live_policy, rb=live).load(path)
    assert torch.equal(live_policy.weight, weights) and len(live) == 0


def _ids(n: int, start: int = 0) -> TensorDict:
    return TensorDict({"id": torch.arange(start, start + n)}, [n])


@pytest.mark.parametrize("written", [13, 10])  # wrapped around (cursor 3); exactly full (cursor back at 0)
def test_a_buffer_that_overwrote_or_refilled_its_capacity_loads_only_into_that_capacity(
    tmp_path: Path, written: int
) -> None:
    """Loaded into a larger buffer, a wrapped writer's cursor pointed into the saved rows: the next extend overwrote
    the oldest transitions and counted rows no one wrote. Exact only where nothing was overwritten; else refused."""
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    rb.extend(_ids(written))
    path = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "c")
    big = TensorDictReplayBuffer(storage=LazyTensorStorage(20), batch_size=4)
    if written > 10:
        with pytest.raises(tdcp.IncompatibleComponentError, match="build the buffer with capacity 10"):
            tdcp.DistributedCheckpoint(buffer=big).load(path)
        assert len(big) == 0
        return
    tdcp.DistributedCheckpoint(buffer=big).load(path)  # nothing overwritten: continues as a capacity-20 buffer would
    reference = TensorDictReplayBuffer(storage=LazyTensorStorage(20), batch_size=4)
    reference.extend(_ids(written))
    for buf in (big, reference):
        buf.extend(_ids(2, 100))
    assert len(big) == 12 and big._writer._cursor == reference._writer._cursor == 12
    assert big[:12]["id"].tolist() == reference[:12]["id"].tolist() == [*range(10), 100, 101]


@pytest.mark.parametrize("capacity", [24, 8])
def test_a_prioritized_buffer_that_never_wrapped_loads_into_another_capacity(tmp_path: Path, capacity: int) -> None:
    """As a plain buffer does (replay-buffers.md): 6 transitions of a capacity-12 prioritized buffer continue in a
    buffer of capacity 24 or 8 as one of that capacity would after the same writes and priority updates (the load was
    refused: the sampler's trees are sized by the capacity); its priorities are the first 6 leaves."""
    from torchrl.data import TensorDictPrioritizedReplayBuffer

    def make(size: int) -> TensorDictPrioritizedReplayBuffer:
        rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(size), batch_size=4)
        return rb

    def fill(rb: TensorDictPrioritizedReplayBuffer) -> None:
        rb.extend(_ids(6))
        rb.update_priority(torch.arange(6), torch.arange(1.0, 7.0))

    saved = make(12)
    fill(saved)
    path = tdcp.DistributedCheckpoint(buffer=saved).save(tmp_path / "c")
    loaded, reference = make(capacity), make(capacity)
    tdcp.DistributedCheckpoint(buffer=loaded).load(path)
    fill(reference)
    for buf in (loaded, reference):
        buf.extend(_ids(1, 100))
    leaves = torch.arange(capacity)
    assert torch.equal(loaded._sampler._sum_tree[leaves], reference._sampler._sum_tree[leaves])
    assert loaded._sampler._max_priority == reference._sampler._max_priority
    torch.manual_seed(0)
    np.random.seed(0)
    a = loaded.sample()["id"]
    torch.manual_seed(0)
    np.random.seed(0)
    assert torch.equal(a, reference.sample()["id"])


@pytest.mark.parametrize(
    "forge, why",
    [
        (("writer", "_cursor", 25), "cursor is 25"),
        (("writer", "_cursor", -1), "cursor is -1"),
        (("writer", "_cursor", True), "cursor is True"),
        (("writer", "_cursor", 10**30), "cursor is 1000000000000000000000000000000"),
        (("writer", "_write_count", -4), "write count is -4"),
        (("writer", "_write_count", 2**62), "more than torchrl's writers hold"),  # (a C int: it would become 0)
        (("storage", "len", 3), "len 3, rows 7"),
        (("storage", "initialized", False), "initialized False"),
    ],
)
def test_buffer_states_no_save_writes_are_refused(forge: tuple, why: str) -> None:
    """A writer cursor outside the storage (the next extend writes past the rows), a negative write count, a length
    other than the saved rows, an uninitialised storage holding rows: refused by ``check_saved`` (load and verify)."""
    from torchrl_dcp.adapters.base import AdapterContext
    from torchrl_dcp.adapters.replay_buffer import ReplayBufferAdapter

    rb = ReplayBuffer(storage=LazyTensorStorage(20))
    rb.extend(TensorDict({"obs": torch.arange(7.0)}, [7]))
    adapter = ReplayBufferAdapter()
    state = adapter.state(rb, AdapterContext("buffer"))
    adapter.check_saved(state)  # as saved: accepted
    part, key, value = forge
    (state["writer"]["state"] if part == "writer" else state["storage"])[key] = value
    with pytest.raises(ValueError, match=why):
        adapter.check_saved(state)


def test_a_part_filled_memmap_buffer_without_a_scratch_dir_saves_and_saves_again(tmp_path: Path) -> None:
    """``LazyMemmapStorage()`` (no ``scratch_dir``: memmaps without a file) holding fewer rows than its capacity
    failed at save ("The MemoryMappedTensor has no file associated", naming nothing): tensordict raises
    ``RuntimeError`` from ``.filename`` there. A restored one could not be saved again either."""

    def make() -> TensorDictReplayBuffer:
        return TensorDictReplayBuffer(storage=LazyMemmapStorage(16))

    rb = make()
    rb.extend(TensorDict({"obs": torch.arange(10.0).view(5, 2)}, batch_size=[5]))
    path = tdcp.DistributedCheckpoint(rb=rb).save(tmp_path / "a")
    fresh = make()
    tdcp.DistributedCheckpoint(rb=fresh).load(path)
    assert len(fresh) == 5 and torch.equal(fresh[:5]["obs"], rb[:5]["obs"])
    again = tdcp.DistributedCheckpoint(rb=fresh).save(tmp_path / "b")
    other = make()
    tdcp.DistributedCheckpoint(rb=other).load(again)
    assert torch.equal(other[:5]["obs"], rb[:5]["obs"])


def test_honest_buffers_the_checks_once_refused_load_exactly(tmp_path: Path) -> None:
    """A pre-allocated two-dimensional storage whose rows do not divide by its envs (torchrl rounds its rows up:
    5 elements over 4 envs are 2 rows), a tensor batch size, and a max-value writer ranking by integers past 2**53
    (timestamps, which float64 ranks rounded: the restored writer kept other transitions)."""
    from torchrl.data import TensorDictReplayBuffer, TensorStorage
    from torchrl.data.replay_buffers import TensorDictMaxValueWriter

    def two_dim() -> TensorDictReplayBuffer:
        rows = TensorDict({"obs": torch.zeros(5, 4, 2)}, [5, 4])
        return TensorDictReplayBuffer(storage=TensorStorage(rows, ndim=2), batch_size=torch.tensor(4))

    def by_time() -> TensorDictReplayBuffer:
        return TensorDictReplayBuffer(
            storage=LazyTensorStorage(2), writer=TensorDictMaxValueWriter(rank_key="t_ns"), batch_size=1
        )

    def item(t: int, v: float) -> TensorDict:
        return TensorDict({"t_ns": torch.tensor([t]), "obs": torch.tensor([v])}, [1])

    grid, timed = two_dim(), by_time()
    grid.extend(TensorDict({"obs": torch.randn(4, 3, 2)}, [4, 3]))  # 4 envs x 3 steps: the writer at row 1
    t0 = 1_733_400_000_000_000_000
    timed.extend(item(t0 + 100, 1.0))
    timed.extend(item(t0 + 300, 2.0))
    path = tdcp.DistributedCheckpoint(grid=grid, timed=timed).save(tmp_path / "c")
    tdcp.verify(path)
    grid2, timed2 = two_dim(), by_time()
    tdcp.DistributedCheckpoint(grid=grid2, timed=timed2).load(path)
    assert grid2._writer._cursor == grid._writer._cursor == 1
    assert torch.equal(grid2._storage._storage["obs"], grid._storage._storage["obs"])
    assert timed2._writer._current_top_values == timed._writer._current_top_values
    for rb in (timed, timed2):
        rb.extend(item(t0 + 50, 3.0))  # older than both kept ones: dropped
    assert sorted(timed2[:]["obs"].tolist()) == sorted(timed[:]["obs"].tolist()) == [1.0, 2.0]


def test_a_checkpoint_of_a_never_written_buffer_loads_into_a_used_one_as_it_was(tmp_path: Path) -> None:
    """Rolling a loop back to a save made before the first ``extend``: the storage kept the later rows' entries and
    cursor (only ``len`` was 0), so an ``extend`` of other entries carried the rolled-back rows' values; it is now as
    saved, never written (a sampler's epoch counter back to its default too)."""
    from torchrl.data.replay_buffers import SamplerWithoutReplacement

    def make() -> TensorDictReplayBuffer:
        return TensorDictReplayBuffer(storage=LazyTensorStorage(100), sampler=SamplerWithoutReplacement(), batch_size=4)

    rb = make()
    before = tdcp.state_snapshot(rb)
    path = tdcp.DistributedCheckpoint(rb=rb).save(tmp_path / "c")
    rb.extend(TensorDict({"x": torch.arange(10.0)}, [10]))
    rb.sample()
    tdcp.DistributedCheckpoint(rb=rb).load(path)
    assert not tdcp.state_differences(before, tdcp.state_snapshot(rb))
    fresh = make()
    for buf in (rb, fresh):
        buf.extend(TensorDict({"y": torch.zeros(3, 2)}, [3]))
    assert sorted(rb[:].keys()) == sorted(fresh[:].keys()) and "x" not in rb[:].keys()


def test_a_prioritized_sampler_smaller_than_the_rows_written_is_refused_at_save_saying_how_to_build_it(
    tmp_path: Path,
) -> None:
    """``PrioritizedSampler(max_capacity=4)`` over 6 rows of an 8-row storage: torchrl writes rows 4 and 5's priorities
    past its sum tree. The save went through and its load refused the max-priority index (5) as "damaged or forged".
    Within its capacity, the same buffer saves and loads exactly."""
    from torchrl.data import LazyTensorStorage, PrioritizedSampler, TensorDictReplayBuffer

    def buffer(rows: int) -> TensorDictReplayBuffer:
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(8), sampler=PrioritizedSampler(4, 0.7, 0.5), priority_key="td_error"
        )
        if rows:
            rb.extend(TensorDict({"id": torch.arange(rows), "td_error": torch.arange(rows) + 1.0}, [rows]))
        return rb

    with pytest.raises(tdcp.EncodingError, match=r"max_capacity=4 but the buffer holds 6 rows.*at least .* \(8\)"):
        tdcp.DistributedCheckpoint(rb=buffer(6)).save(tmp_path / "over")
    assert not (tmp_path / "over").exists()
    path = tdcp.DistributedCheckpoint(rb=buffer(4)).save(tmp_path / "within")
    fresh = buffer(0)
    tdcp.DistributedCheckpoint(rb=fresh).load(path)
    assert fresh[:4]["id"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("kind", ["linear", "step", "lambda"])
def test_torchrls_parameter_schedulers_resume_exactly(tmp_path, kind):  # type: ignore[no-untyped-def]
    """Probe g4: ``StepScheduler`` and ``LambdaScheduler`` (a prioritized sampler's ``beta`` annealed) were refused at
    save: their ``state_dict`` holds the function they were built with. Those stay the live scheduler's; the step
    count and the sampler's ``beta`` continue as in the run that never stopped."""
    from torchrl.data import TensorDictPrioritizedReplayBuffer
    from torchrl.data.replay_buffers.scheduler import LambdaScheduler, LinearScheduler, StepScheduler

    def build() -> tuple[Any, Any]:
        rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.4, storage=LazyTensorStorage(16), batch_size=4)
        scheduler = {
            "linear": lambda: LinearScheduler(rb, "beta", final_value=1.0, num_steps=10),
            "step": lambda: StepScheduler(rb, "beta", gamma=1.1, n_steps=2, max_value=1.0),
            "lambda": lambda: LambdaScheduler(rb, "beta", lambda_fn=lambda n: 0.99**n),
        }[kind]()
        return rb, scheduler

    rb, scheduler = build()
    for _ in range(3):
        scheduler.step()
    path = tdcp.DistributedCheckpoint(rb=rb, scheduler=scheduler).save(tmp_path / "ckpt")
    expected = []
    for _ in range(5):
        scheduler.step()
        expected.append((float(rb.sampler.beta), scheduler._step_cnt))
    again, resumed = build()
    tdcp.DistributedCheckpoint(rb=again, scheduler=resumed).load(path)
    got = []
    for _ in range(5):
        resumed.step()
        got.append((float(again.sampler.beta), resumed._step_cnt))
    assert got == expected


@pytest.mark.parametrize(
    "key, value, said",
    [
        ("param_name", "_sum_tree", "param_name='_sum_tree'"),  # (its next step segfaulted the process)
        ("operator", "x", "keeps no state under"),
        ("sampler", "x", "keeps no state under"),
        ("mode", "additive", "mode='additive'"),  # (the live operator multiplies: neither schedule)
        ("n_steps", 0, "n_steps=0"),
        ("_step_cnt", -7, "_step_cnt=-7"),
        ("_step_cnt", 2.5, "_step_cnt=2.5"),
    ],
)
def test_a_forged_parameter_scheduler_state_is_refused(tmp_path, key, value, said):  # type: ignore[no-untyped-def]
    """Probe j1: a resealed scheduler state holding what no save of it writes loaded (its functions and sampler
    replaced by the forged values, another parameter annealed, a zero period): refused while planning, naming the
    file, the scheduler unchanged."""
    from torchrl.data import TensorDictPrioritizedReplayBuffer
    from torchrl.data.replay_buffers.scheduler import StepScheduler

    from tests.forging import edit

    def build() -> tuple[Any, Any]:
        rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.4, storage=LazyTensorStorage(16), batch_size=4)
        return rb, StepScheduler(rb, "beta", gamma=1.1, n_steps=2, max_value=1.0)

    rb, scheduler = build()
    scheduler.step()
    path = tdcp.DistributedCheckpoint(scheduler=scheduler).save(tmp_path / "ckpt")

    def forge(manifest: dict[str, Any]) -> None:
        items = manifest["components"]["scheduler"]["state"]["items"]
        found = [item for item in items if item[0] == key]
        if found:
            found[0][1] = value
        else:
            items.append([key, value])

    edit(path, forge)
    again, resumed = build()
    before = dict(vars(resumed))
    with pytest.raises(tdcp.CheckpointError, match=re.escape(said)) as caught:
        tdcp.DistributedCheckpoint(scheduler=resumed).load(path)
    assert str(path) in str(caught.value)
    assert vars(resumed) == before

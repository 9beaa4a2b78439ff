"""Incremental saves: exact after every kind of write, complete and independent of their base.

Every case saves a base, changes the buffer one way, then saves twice from the same live
state: incrementally from the base and in full. The two checkpoints must hold the same
tensors bit for bit (read back by plain ``dcp.load``) and the same JSON state, and the
incremental one must load into a fresh buffer that samples what the live buffer samples.
Chunks are made small (a few KiB) so that small buffers are cut into many chunk files.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from tensordict import TensorDict
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)

import torchrl_dcp as tdcp
from torchrl_dcp import chunking
from torchrl_dcp.storage.filesystem import safe_load_metadata

CAPACITY = 1000
ROW_FEATURES = 16  # 64 bytes per obs row: 64 rows per 4 KiB chunk


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)


def batch(n: int, start: int) -> TensorDict:
    idx = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": (idx[:, None] * 1000 + torch.arange(ROW_FEATURES)).float(),
            "nested": {"reward": idx.double() / 7},
            "done": idx % 5 == 0,
        },
        [n],
    )


def make_buffer(kind: str, tmp: Path, tag: str) -> ReplayBuffer:
    if kind == "lazy":
        return TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=8)
    if kind == "memmap":
        return TensorDictReplayBuffer(storage=LazyMemmapStorage(CAPACITY, scratch_dir=tmp / f"mm-{tag}"), batch_size=8)
    if kind == "prioritized":
        return TensorDictPrioritizedReplayBuffer(
            alpha=0.7, beta=0.5, storage=LazyTensorStorage(CAPACITY), batch_size=8, priority_key="td_error"
        )
    if kind == "tensor":  # plain tensors, no TensorDict
        return ReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=8)
    raise ValueError(kind)


def fill(rb: ReplayBuffer, n: int, start: int) -> None:
    if isinstance(rb, TensorDictReplayBuffer):
        rb.extend(batch(n, start))
    else:
        rb.extend(batch(n, start)["obs"])


def leaf(rb: ReplayBuffer) -> torch.Tensor:
    data = rb._storage._storage
    return data if isinstance(data, torch.Tensor) else data["obs"]


# ---------------------------------------------------------------------- the kinds of writes
def w_nothing(rb: ReplayBuffer) -> None:
    pass


def w_extend_few(rb: ReplayBuffer) -> None:
    fill(rb, 10, 5000)


def w_wrap_around(rb: ReplayBuffer) -> None:
    fill(rb, 150, 6000)  # the buffer holds 900: 100 at the end, 50 at the start


def w_extend_beyond_capacity(rb: ReplayBuffer) -> None:
    fill(rb, CAPACITY + 37, 7000)


def w_scattered_setitem(rb: ReplayBuffer) -> None:
    idx = torch.tensor([3, 400, 401, 877])
    if isinstance(rb, TensorDictReplayBuffer):
        rb[idx] = batch(4, 8000).exclude("index", "td_error")
    else:
        rb[idx] = batch(4, 8000)["obs"]


def w_storage_set_scattered(rb: ReplayBuffer) -> None:
    idx = [17, 650]
    data = batch(2, 9000)
    rb._storage.set(idx, data if isinstance(rb, TensorDictReplayBuffer) else data["obs"], set_cursor=False)


def w_in_place_bypassing_set(rb: ReplayBuffer) -> None:
    leaf(rb)[512] += 1.0  # not through the storage's API: only the version counter sees it


def w_int_index(rb: ReplayBuffer) -> None:
    data = batch(1, 9500)[0]
    rb._storage[-101] = data if isinstance(rb, TensorDictReplayBuffer) else data["obs"]  # row 899, the last held


WRITES: dict[str, Callable[[ReplayBuffer], None]] = {
    f.__name__[2:]: f
    for f in (
        w_nothing,
        w_extend_few,
        w_wrap_around,
        w_extend_beyond_capacity,
        w_scattered_setitem,
        w_storage_set_scattered,
        w_in_place_bypassing_set,
        w_int_index,
    )
}


# ---------------------------------------------------------------------- checks
def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read by plain ``dcp.load``."""
    md = safe_load_metadata(path / ".metadata")
    dest = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(dest, checkpoint_id=str(path), no_dist=True)
    return dest


def states_of(path: Path) -> dict[str, Any]:
    m = tdcp.read_manifest(path)
    return {n: c.get("ranks", c.get("state")) for n, c in m["components"].items()}


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = tensors_of(a), tensors_of(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert states_of(a) == states_of(b)


def kept_files(path: Path) -> set[str]:
    return {n for n, rec in tdcp.read_manifest(path)["files"].items() if "origin" in rec}


def chunk_files(path: Path) -> set[str]:
    return {e["file"] for entries in tdcp.read_manifest(path)["chunks"].values() for e in entries}


def samples(rb: ReplayBuffer, seed: int = 0) -> list[Any]:
    torch.manual_seed(seed)
    np.random.seed(seed)  # the prioritized sampler draws from numpy's global RNG
    out = []
    for _ in range(3):
        s = rb.sample()
        out.append(s.exclude("index") if isinstance(s, TensorDict) else s)
    return out


def assert_same_samples(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b):
        if isinstance(x, TensorDict):
            assert (x == y).all()
        else:
            assert torch.equal(x, y)


# ---------------------------------------------------------------------- the matrix
@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("kind", ["lazy", "memmap", "prioritized", "tensor"])
def test_incremental_save_equals_a_full_save(tmp_path: Path, kind: str, write: str) -> None:
    rb = make_buffer(kind, tmp_path, "live")
    fill(rb, 900, 0)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    base = ckpt.save(tmp_path / "base")
    assert len(chunk_files(base)) >= 10
    WRITES[write](rb)
    if kind == "prioritized":  # priorities change anywhere: small state, written again
        s = rb.sample()
        rb.update_priority(s["index"], torch.rand(s.shape[0]) + 0.1)
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    full = ckpt.save(tmp_path / "full")
    assert_same_checkpoint(inc, full)
    kept = kept_files(inc)
    obs = {
        e["file"] for k, es in tdcp.read_manifest(inc)["chunks"].items() if "obs" in k or "data" == k[-4:] for e in es
    }
    assert obs
    if write == "nothing":
        assert obs <= kept  # every chunk of the storage, the last one too: nothing grew
    elif write == "extend_beyond_capacity":
        assert not obs & kept  # every row was written
    else:
        assert obs & kept and obs - kept
    for name in kept:  # a hard link: the same file, not a copy
        assert os.path.samefile(inc / name, base / kept_origin_name(base, inc, name))
    # the incremental checkpoint stands alone: the base deleted, it verifies and loads exactly
    shutil.rmtree(base)
    assert tdcp.verify(inc)["unchecked"] == []
    restored = make_buffer(kind, tmp_path, "restored")
    tdcp.DistributedCheckpoint(buffer=restored).load(inc)
    assert len(restored) == len(rb)
    assert_same_samples(samples(restored), samples(rb))


def kept_origin_name(base: Path, inc: Path, name: str) -> str:
    """The base's file holding the same chunk as ``name`` in ``inc``."""

    def by_chunk(path: Path) -> dict[tuple[str, int, int], str]:
        return {
            (k, e["start"], e["rows"]): e["file"] for k, es in tdcp.read_manifest(path)["chunks"].items() for e in es
        }

    inverse = {v: k for k, v in by_chunk(inc).items()}
    return by_chunk(base)[inverse[name]]


@pytest.mark.parametrize("write", ["extend_few", "wrap_around", "scattered_setitem", "in_place_bypassing_set"])
def test_chain_of_incremental_saves_stays_exact(tmp_path: Path, write: str) -> None:
    """Each save is incremental from the previous one (tracking carries over); every one equals a full save."""
    rb = make_buffer("lazy", tmp_path, "live")
    fill(rb, 900, 0)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    prev = ckpt.save(tmp_path / "s0")
    for i in range(1, 5):
        WRITES[write](rb)
        fill(rb, 3, 100 * i)
        cur = ckpt.save(tmp_path / f"s{i}", incremental_from=prev)
        full = ckpt.save(tmp_path / f"f{i}")
        assert_same_checkpoint(cur, full)
        shutil.rmtree(prev)
        prev = cur


def test_untracked_buffer_is_compared_by_content(tmp_path: Path) -> None:
    """A buffer loaded from the base (a resumed job) keeps the unchanged chunks, proven by their fingerprints."""
    rb = make_buffer("lazy", tmp_path, "a")
    fill(rb, 900, 0)
    base = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "base")
    resumed = make_buffer("lazy", tmp_path, "b")
    ckpt = tdcp.DistributedCheckpoint(buffer=resumed)
    ckpt.load(base)
    resumed._storage._storage["obs"][700] = -1.0  # an untracked write: found by content
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    assert_same_checkpoint(inc, ckpt.save(tmp_path / "full"))
    assert len(kept_files(inc)) >= len(chunk_files(inc)) - 8  # obs row 700 and the small trees: written


def test_failed_save_gives_its_rows_back(tmp_path: Path) -> None:
    """Rows written before a save that failed are still known as changed by the next incremental save."""
    rb = make_buffer("lazy", tmp_path, "live")
    fill(rb, 900, 0)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    base = ckpt.save(tmp_path / "base")
    rb[torch.tensor([5])] = batch(1, 4242)
    (tmp_path / "blocked").write_text("a file, not a checkpoint")
    with pytest.raises(tdcp.CheckpointError):
        ckpt.save(tmp_path / "blocked", incremental_from=base)
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    assert_same_checkpoint(inc, ckpt.save(tmp_path / "full"))


def test_replicated_large_tensor_is_spread_and_kept_when_unchanged(tmp_path: Path) -> None:
    frozen = torch.nn.Embedding(2000, 16)  # 128 KiB: 32 chunks
    head = torch.nn.Linear(16, 2)
    ckpt = tdcp.DistributedCheckpoint(frozen=frozen, head=head)
    base = ckpt.save(tmp_path / "base")
    with torch.no_grad():
        head.weight.add_(1.0)
        frozen.weight[1999] = 0.0
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    assert_same_checkpoint(inc, ckpt.save(tmp_path / "full"))
    chunks = tdcp.read_manifest(inc)["chunks"]["replicated/frozen/weight"]
    assert len(chunks) == 32 and len(kept_files(inc)) == 31


# ---------------------------------------------------------------------- independence and hostile bases
def base_and_buffer(tmp_path: Path) -> tuple[ReplayBuffer, tdcp.DistributedCheckpoint, Path]:
    rb = make_buffer("lazy", tmp_path, "live")
    fill(rb, 900, 0)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    return rb, ckpt, ckpt.save(tmp_path / "base")


DAMAGES: dict[str, Callable[[Path], None]] = {
    "deleted": lambda p: shutil.rmtree(p),
    "manifest_corrupted": lambda p: (p / "manifest.json").write_text("{}"),
    "metadata_removed": lambda p: (p / ".metadata").unlink(),
    "chunk_files_replaced": lambda p: [
        (f.unlink(), f.write_bytes(b"\0" * 4096))
        for f in p.iterdir()
        if f.name.startswith("__0_") and f.name != "__0_0.distcp"
    ],
    "chunk_files_renamed_away": lambda p: [f.rename(p / f"old{f.name}") for f in p.iterdir() if f.suffix == ".distcp"],
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaging_the_base_later_leaves_the_incremental_checkpoint_whole(tmp_path: Path, damage: str) -> None:
    rb, ckpt, base = base_and_buffer(tmp_path)
    fill(rb, 5, 123)
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    expected = tensors_of(inc)
    DAMAGES[damage](base)
    assert tdcp.verify(inc)["unchecked"] == []
    got = tensors_of(inc)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    restored = make_buffer("lazy", tmp_path, "restored")
    tdcp.DistributedCheckpoint(buffer=restored).load(inc)
    assert_same_samples(samples(restored), samples(rb))


SWAPS: dict[str, Callable[[Path, Path], None]] = {
    "foreign_file_same_size": lambda f, other: (f.unlink(), shutil.copyfile(other, f)),
    "symlink_to_outside": lambda f, other: (f.unlink(), f.symlink_to(other)),
    "directory": lambda f, other: (f.unlink(), f.mkdir()),
    "fifo": lambda f, other: (f.unlink(), os.mkfifo(f)),
    "truncated": lambda f, other: os.truncate(f, 100),
    "removed": lambda f, other: f.unlink(),
}


@pytest.mark.parametrize("swap", sorted(SWAPS))
def test_base_chunk_files_swapped_before_the_save_are_written_anew(tmp_path: Path, swap: str) -> None:
    """A base file that is no longer the one its manifest describes is never linked: its chunk is written."""
    rb, ckpt, base = base_and_buffer(tmp_path)
    other = tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "other")  # same sizes, another save's identity
    victims = sorted(chunk_files(base))[:3]
    for name in victims:
        SWAPS[swap](base / name, other / name)
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    assert_same_checkpoint(inc, ckpt.save(tmp_path / "full"))
    assert not kept_files(inc) & set(victims)
    assert tdcp.verify(inc)["unchecked"] == []


def test_hard_links_impossible_means_copies_said_in_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rb, ckpt, base = base_and_buffer(tmp_path)

    def no_link(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    with caplog.at_level("WARNING", logger="torchrl_dcp"):
        inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    assert "copied" in caplog.text
    kept = kept_files(inc)
    assert kept and all(os.stat(inc / n).st_nlink == 1 for n in kept)
    shutil.rmtree(base)
    assert tdcp.verify(inc)["unchecked"] == []


@pytest.mark.parametrize(
    "bad_base", ["missing", "not_a_checkpoint", "damaged_manifest", "damaged_shard", "a_file", "a_data_file", "torchrl"]
)
def test_an_explicit_base_that_is_not_a_checkpoint_is_refused_before_writing(tmp_path: Path, bad_base: str) -> None:
    """(A file was taken for an archive, never read: the save went on in full, silently.) The error names the damaged
    file (it named the base directory for a truncated manifest shard) and, for a torchrl.checkpoint export, says to
    save it with torchrl_dcp first (it said to copy it from an object store to a local path: it was one)."""
    rb, ckpt, base = base_and_buffer(tmp_path)
    target = tmp_path / "bad"
    if bad_base == "not_a_checkpoint":
        target.mkdir()
        (target / "x").write_text("hello")
    elif bad_base == "a_file":
        target.write_bytes(b"not a checkpoint")
    elif bad_base == "a_data_file":
        target = next(base.glob("*.distcp"))
    elif bad_base == "damaged_manifest":
        shutil.copytree(base, target)
        data = json.loads((target / "manifest.json").read_text())
        data["step"] = 99  # the seal no longer matches
        (target / "manifest.json").write_text(json.dumps(data))
    elif bad_base == "damaged_shard":
        shutil.copytree(base, target)
        shard = target / "manifest-0.json"
        shard.write_bytes(shard.read_bytes()[:-3])
    elif bad_base == "torchrl":
        policy = tdcp.DistributedCheckpoint(no_dist=True, policy=torch.nn.Linear(2, 2)).save(tmp_path / "policy")
        tdcp.export_torchrl(policy, target, ["policy"], format="directory")
    with pytest.raises(tdcp.CheckpointError, match="incremental_from") as err:
        ckpt.save(tmp_path / "inc", incremental_from=target)
    assert not (tmp_path / "inc").exists()
    if bad_base == "damaged_shard":
        assert err.value.path == str(target / "manifest-0.json") and "truncated" in str(err.value)
    if bad_base == "torchrl":
        assert "object store" not in str(err.value) and "save it with torchrl_dcp first" in str(err.value)


def test_archive_base_means_a_full_save(tmp_path: Path) -> None:
    rb, ckpt, base = base_and_buffer(tmp_path)
    archive = tdcp.to_archive(base, tmp_path / "base.zip")
    inc = ckpt.save(tmp_path / "inc", incremental_from=archive)
    assert not kept_files(inc)
    assert_same_checkpoint(inc, base)


def test_incremental_checkpoint_converts_and_loads_like_a_full_one(tmp_path: Path) -> None:
    rb, ckpt, base = base_and_buffer(tmp_path)
    fill(rb, 20, 555)
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    archive = tdcp.to_archive(inc, tmp_path / "inc.zip")
    back = tdcp.to_directory(archive, tmp_path / "back")
    assert_same_checkpoint(back, inc)
    for source in (archive, back):
        restored = make_buffer("lazy", tmp_path, f"r-{source.name}")
        tdcp.DistributedCheckpoint(buffer=restored).load(source)
        assert_same_samples(samples(restored), samples(rb))


def test_async_incremental_save_stages_only_written_chunks(tmp_path: Path) -> None:
    rb, ckpt, base = base_and_buffer(tmp_path)
    fill(rb, 5, 777)
    handle = ckpt.async_save(tmp_path / "inc", incremental_from=base)
    staged = set(ckpt._async._buffers)
    fill(rb, 50, 999)  # after staging: not in this checkpoint
    inc = handle.wait()
    chunks = tdcp.read_manifest(inc)["chunks"]
    written = {e["file"] for es in chunks.values() for e in es} - kept_files(inc)
    assert {k.removeprefix("chunk:") for k in staged if k.startswith("chunk:")} == written
    reference = make_buffer("lazy", tmp_path, "ref")
    fill(reference, 900, 0)
    fill(reference, 5, 777)
    expected = tdcp.DistributedCheckpoint(buffer=reference).save(tmp_path / "ref")
    assert_same_checkpoint(inc, expected)


def test_tracked_storage_still_copies_and_pickles(tmp_path: Path) -> None:
    rb, ckpt, base = base_and_buffer(tmp_path)
    clone = copy.deepcopy(rb)
    fill(clone, 5, 1)  # writes to the copy are not the original's
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    assert len(kept_files(inc)) == len(chunk_files(inc))
    storage = pickle.loads(pickle.dumps(rb._storage))
    storage.set(slice(0, 1), batch(1, 0))  # works, untracked, and not the original's
    assert storage.__dict__.get("_tdcp_row_tracker") is None
    inc2 = ckpt.save(tmp_path / "inc2", incremental_from=inc)
    assert kept_files(inc2) == chunk_files(inc2)


def test_a_buffer_filled_under_inference_mode_saves_and_its_rows_are_compared_by_content(tmp_path: Path) -> None:
    """A storage filled under ``torch.inference_mode()`` holds inference tensors, which keep no version counter:
    every save of such a buffer failed ("Inference tensors do not track version counter"). Its rows are now unknown
    to the tracker, so an incremental save proves them by content: exact, and the unchanged chunks kept."""
    rb = make_buffer("lazy", tmp_path, "a")
    with torch.inference_mode():
        fill(rb, 900, 0)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    base = ckpt.save(tmp_path / "base")
    with torch.inference_mode():
        rb[torch.tensor([700])] = batch(1, 4242)
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    assert_same_checkpoint(inc, ckpt.save(tmp_path / "full"))
    assert len(kept_files(inc)) >= len(chunk_files(inc)) - 8


def test_a_save_overlapping_an_async_one_leaves_the_rows_written_since_its_call_known(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An async incremental save S1 in flight; rows written after its call; another checkpoint of the same buffer
    (a local tier's) saves and commits first. Its start reset the record of written rows, so the next incremental
    save from S1 kept S1's chunk of those rows (their values at S1's call): stale rows, and verify passed."""
    import threading

    from torchrl_dcp.storage import chunk_writer

    rb, ckpt, base = base_and_buffer(tmp_path)
    gate = threading.Event()
    write_chunks = chunk_writer.write_chunks

    def held(*args: Any, **kwargs: Any) -> Any:  # the async save's writes wait until the other save committed
        if threading.current_thread().name.startswith("tdcp-async-save"):
            assert gate.wait(60)
        return write_chunks(*args, **kwargs)

    monkeypatch.setattr(chunk_writer, "write_chunks", held)  # (looked up at each call: storage/directory.py)
    handle = ckpt.async_save(tmp_path / "s1", incremental_from=base)
    rb[torch.arange(10)] = batch(10, 5000)  # while S1 is in flight: not in S1, in every later save
    tdcp.DistributedCheckpoint(buffer=rb).save(tmp_path / "other")
    assert not handle.done()
    gate.set()
    s1 = handle.wait()
    s2 = ckpt.save(tmp_path / "s2", incremental_from=s1)
    assert_same_checkpoint(s2, ckpt.save(tmp_path / "full"))


def test_each_open_save_keeps_its_own_record_of_the_rows_written() -> None:
    from torchrl.data import TensorStorage

    from torchrl_dcp.tracking import track

    storage = TensorStorage(torch.zeros(8, 3))
    tracker = track(storage)

    def begin() -> Any:  # (a save stores the storage under key "k")
        snap = tracker.begin()
        snap.keys.add("k")
        return snap

    tracker.commit(begin(), "s0")
    first = begin()  # an async save's call
    storage.set(torch.tensor([2]), torch.ones(1, 3))
    second = begin()  # another save while the first is in flight
    assert second.epoch == "s0" and not second.unchanged("s0", "k", 2, 1) and second.unchanged("s0", "k", 3, 5)
    assert not second.unchanged("s0", "other", 3, 5)  # (saved under another key there: nothing proven)
    storage.set(torch.tensor([4]), torch.ones(1, 3))
    tracker.commit(second, "s2")
    tracker.commit(first, "s1")  # committed last: the rows since its own call
    later = begin()
    assert later.epoch == "s1" and not later.unchanged("s1", "k", 2, 1) and not later.unchanged("s1", "k", 4, 1)
    assert later.unchanged("s1", "k", 5, 3)
    tracker.abort(later)  # a failed save leaves the committed record as it was
    assert tracker.begin().epoch == "s1"


def test_a_write_inside_set_when_a_save_begins_is_the_next_saves_to_write(tmp_path: Path) -> None:
    """Probe u2: a collector thread inside ``set`` (torchrl stacks a list before writing its first row) when a save
    began: the rows were marked before the save's record opened, and the write then counted as ours; the save copied
    the old rows, and the next incremental save kept its chunk file (the old rows, silently)."""
    import threading

    entered, go = threading.Event(), threading.Event()

    class PausingStorage(LazyTensorStorage):
        pause = False

        def set(self, cursor: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
            if PausingStorage.pause:  # (the time torchrl spends before its first leaf is written)
                entered.set()
                go.wait(30)
            return super().set(cursor, data, *args, **kwargs)

    rb = TensorDictReplayBuffer(storage=PausingStorage(256), batch_size=4)
    fill(rb, 256, 0)
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    base = ckpt.save(tmp_path / "base")
    PausingStorage.pause = True
    writer = threading.Thread(target=lambda: fill(rb, 64, 5000))  # rows 0..63 of the wrapped storage
    writer.start()
    assert entered.wait(30)
    PausingStorage.pause = False
    during = ckpt.save(tmp_path / "during", incremental_from=base)  # the write lands after this save copied
    go.set()
    writer.join()
    after = ckpt.save(tmp_path / "after", incremental_from=during)  # nothing writing: the live rows
    assert_same_checkpoint(after, ckpt.save(tmp_path / "full"))


def test_buffers_that_swapped_names_are_not_kept_from_each_others_chunks(tmp_path: Path) -> None:
    """Two buffers saved as ``buffer`` and ``aux``, then registered under each other's names: each one's tracker
    said "no row written since that save" (true), and the incremental save kept the base's chunk files of the
    *name*: ``buffer`` loaded ``aux``'s rows, verified and silently (a full save was right). A tracker's proof now
    holds only for the keys its storage was saved under."""
    first, second = make_buffer("lazy", tmp_path, "a"), make_buffer("lazy", tmp_path, "b")
    fill(first, 700, 0)
    fill(second, 700, 5000)
    ck = tdcp.DistributedCheckpoint(no_dist=True, buffer=first, aux=second)
    base = ck.save(tmp_path / "base")
    swapped = tdcp.DistributedCheckpoint(no_dist=True, buffer=second, aux=first)
    path = swapped.save(tmp_path / "inc", incremental_from=base)
    tdcp.verify(path)
    live = {"buffer": make_buffer("lazy", tmp_path, "c"), "aux": make_buffer("lazy", tmp_path, "d")}
    tdcp.DistributedCheckpoint(no_dist=True, **live).load(path)
    assert torch.equal(live["buffer"][:700]["obs"], second[:700]["obs"])
    assert torch.equal(live["aux"][:700]["obs"], first[:700]["obs"])
    again = swapped.save(tmp_path / "again", incremental_from=path)  # (the proof holds under the new names)
    assert kept_files(again)


def test_an_incremental_save_into_a_checkpoint_removes_nothing_named_there_like_a_leftover(tmp_path: Path) -> None:
    """Rank 0 removes a killed save's leftovers before the base is read (before any rank proves a base file): a
    destination inside a checkpoint is refused first, as the save itself refuses it, so a directory named there like
    a leftover of it is never removed."""
    import uuid

    from torchrl_dcp.storage.commit import staging_path

    ckpt = tdcp.DistributedCheckpoint(w={"x": torch.ones(4)})
    base = ckpt.save(tmp_path / "base")
    other = ckpt.save(tmp_path / "other")
    planted = staging_path(other / "x", uuid.uuid4().hex)
    planted.mkdir()
    (planted / "__0_0.distcp").write_bytes(b"kept")
    with pytest.raises(tdcp.CheckpointError, match="inside"):
        ckpt.save(other / "x", incremental_from=base)
    assert (planted / "__0_0.distcp").read_bytes() == b"kept"

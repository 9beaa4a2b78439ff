"""Rotation saves incrementally by default and never breaks a kept entry; tools read chunked checkpoints.

Twenty saves with ``keep_last=2``: each one incremental from the previous entry, the
older entries pruned as it goes. Whatever is kept verifies and holds exactly the state
of its step; bytes shared with pruned entries stay (hard links) and nothing else does.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import torchrl_dcp as tdcp
from torchrl_dcp import chunking
from torchrl_dcp.cli import main as cli_main
from torchrl_dcp.extract import read_component


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)


def rows(n: int, start: int) -> TensorDict:
    idx = torch.arange(start, start + n)
    return TensorDict({"obs": (idx[:, None] * 100 + torch.arange(32)).float(), "step": idx}, [n])


def snapshot(rb: TensorDictReplayBuffer) -> TensorDict:
    return rb[:].exclude("index").clone()


def test_twenty_incremental_saves_keep_only_what_they_should(tmp_path: Path) -> None:
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(2000), batch_size=4)
    rb.extend(rows(1500, 0))
    policy = torch.nn.Linear(4, 4)
    ckpt = tdcp.DistributedCheckpoint(policy=policy, buffer=rb)
    rotation = tdcp.CheckpointRotation(tmp_path / "run", keep_last=2)
    expected: dict[int, TensorDict] = {}
    kept_counts = []
    for step in range(1, 21):
        rb.extend(rows(40, 10_000 * step))  # wraps around the 2000 rows after a while
        with torch.no_grad():
            policy.weight.add_(1.0)
        path = rotation.save(ckpt, step=step)
        expected[step] = snapshot(rb)
        manifest = tdcp.read_manifest(path)
        kept_counts.append(sum("origin" in rec for rec in manifest["files"].values()))
        assert [e.step for e in rotation.entries()] == [s for s in (step - 1, step) if s >= 1]
    assert kept_counts[0] == 0 and min(kept_counts[1:]) > 0  # the first save is full, the others incremental
    entries = rotation.entries()
    assert [e.step for e in entries] == [19, 20]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [e.path.name for e in entries]
    for e in entries:
        assert tdcp.verify(e.path)["unchecked"] == []
        restored = TensorDictReplayBuffer(storage=LazyTensorStorage(2000), batch_size=4)
        tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 4), buffer=restored).load(e.path)
        assert (snapshot(restored) == expected[e.step]).all()
    # no bytes of pruned entries survive except through the kept entries' links
    inodes = {os.stat(f).st_ino for e in entries for f in e.path.iterdir()}
    for e in entries:
        for f in e.path.iterdir():
            assert os.stat(f).st_nlink <= 2 and os.stat(f).st_ino in inodes
    # the last entry stands alone once the one before it is gone
    rotation.keep_last = 1
    rotation.prune()
    last = rotation.latest()
    assert last is not None and [e.step for e in rotation.entries()] == [20]
    assert tdcp.verify(last)["unchecked"] == []


def test_rotation_incremental_can_be_turned_off(tmp_path: Path) -> None:
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(2000), batch_size=4)
    rb.extend(rows(1500, 0))
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    rotation = tdcp.CheckpointRotation(tmp_path / "run", keep_last=3, incremental=False)
    for step in (1, 2):
        path = rotation.save(ckpt, step=step)
    assert not any("origin" in rec for rec in tdcp.read_manifest(path)["files"].values())


def test_tools_read_a_chunked_incremental_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(2000), batch_size=4)
    rb.extend(rows(1500, 0))
    policy = torch.nn.Linear(64, 64)
    ckpt = tdcp.DistributedCheckpoint(policy=policy, buffer=rb)
    base = ckpt.save(tmp_path / "base")
    rb.extend(rows(10, 99))
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    state = read_component(inc, "buffer", rank=0)
    assert torch.equal(state["storage"]["data"]["obs"], rb[:]["obs"])
    exported = tdcp.export_torchrl(inc, tmp_path / "export", components=["policy"])
    assert exported.exists()
    assert cli_main(["verify", str(inc)]) == 0
    assert cli_main(["inspect", str(inc)]) == 0
    assert cli_main(["diff", str(base), str(inc)]) in (0, 1)
    out = capsys.readouterr().out
    assert "buffer" in out


def test_a_users_hard_link_to_a_kept_chunk_file_survives_the_prune(tmp_path: Path) -> None:
    """The user linked an unchanged chunk file of an entry under a name of their own; the next save kept that chunk
    (so its inode was proven) and pruned the entry: the prune unlinked every proven file by inode, whatever its
    name, and the user's file went with the entry."""
    state = {"big": torch.arange(8192, dtype=torch.float32).reshape(128, 64)}
    ckpt = tdcp.DistributedCheckpoint(data=state)
    rotation = tdcp.CheckpointRotation(tmp_path / "run", keep_last=1)
    first = rotation.save(ckpt, step=1)
    chunk = sorted(p for p in first.iterdir() if p.name.endswith(".distcp") and "shared" not in p.name)[-1]
    os.link(chunk, first / "my_saved_rows.bin")
    state["big"][0, 0] = -1.0  # the first chunk changes, the others are kept
    kept = chunk.read_bytes()
    rotation.save(ckpt, step=2)
    assert sorted(p.name for p in first.iterdir()) == ["my_saved_rows.bin"]  # the entry keeps the user's file only
    assert (first / "my_saved_rows.bin").read_bytes() == kept

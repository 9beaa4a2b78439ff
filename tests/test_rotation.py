"""Rotation (keep_last, keep_best, archives), latest-from-committed-only, and resume (one process)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp


def ckpt_for(step: int) -> tuple[tdcp.DistributedCheckpoint, torch.nn.Module]:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    return tdcp.DistributedCheckpoint(model=model, counters={"step": step}), model


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_keep_last_and_keep_best(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=2, keep_best=("reward", "max"))
    rewards = {1: 0.5, 2: 9.0, 3: 1.0, 4: 2.0, 5: 3.0}
    for step, reward in rewards.items():
        path = rotation.save(ckpt_for(step)[0], step=step, metadata={"reward": reward})
        assert path.name == f"step-{step:012d}" and rotation.latest() == path
    assert names(tmp_path) == ["step-000000000002", "step-000000000004", "step-000000000005"]
    assert rotation.best() == tmp_path / "step-000000000002"
    assert [(e.step, e.metric) for e in rotation.entries()] == [(2, 9.0), (4, 2.0), (5, 3.0)]
    low = tdcp.CheckpointRotation(tmp_path, keep_last=1, keep_best=("reward", "min"))
    assert low.best() == tmp_path / "step-000000000004"
    with pytest.raises(ValueError, match="reward"):
        rotation.save(ckpt_for(6)[0], step=6)  # keep_best needs the metric
    with pytest.raises(ValueError):
        tdcp.CheckpointRotation(tmp_path, keep_last=0)
    with pytest.raises(ValueError):
        tdcp.CheckpointRotation(tmp_path, keep_best=("reward", "up"))  # type: ignore[arg-type]


def test_archive_rotation_loads_latest_from_the_zip(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=2, archive=True)
    for step in (10, 20, 30):
        rotation.save(ckpt_for(step)[0], step=step)
    assert names(tmp_path) == ["step-000000000020.zip", "step-000000000030.zip"]
    ckpt, model = ckpt_for(0)
    result = rotation.load_latest(ckpt)
    assert result.step == 30 and result.values["counters"] == {"step": 30}
    assert torch.equal(model.weight, ckpt_for(30)[1].weight)
    assert all(e.archive and e.committed and e.size > 0 for e in rotation.entries())


def test_latest_never_picks_a_half_written_entry(tmp_path: Path) -> None:
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    rotation.save(ckpt_for(1)[0], step=1)
    # what killed saves leave: a staging directory, an uncommitted entry, a half-written archive
    staging = tmp_path / ".step-000000000002.tdcp-staging-dead"
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "step-000000000003").mkdir()
    (tmp_path / "step-000000000003" / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "step-000000000004.zip").write_bytes(b"PK\x03\x04 half an archive")
    assert rotation.latest() == tmp_path / "step-000000000001"
    every = rotation.entries(include_uncommitted=True)
    assert [(e.step, e.committed) for e in every] == [(1, True), (3, False), (4, False)]
    info = tdcp.resume(ckpt_for(0)[0], tmp_path)
    assert info is not None and info.step == 1
    rotation.save(ckpt_for(5)[0], step=5)  # cleans the older staging directory, keeps foreign-looking entries
    assert not staging.exists() and rotation.latest() == tmp_path / "step-000000000005"


def test_resume_starts_fresh_then_resumes_and_skips_a_damaged_latest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, model = ckpt_for(0)
    with caplog.at_level(logging.INFO, logger="torchrl_dcp"):
        assert tdcp.resume(ckpt, tmp_path / "none") is None
    assert "starting fresh" in caplog.text
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    for step in (1, 2):
        rotation.save(ckpt_for(step)[0], step=step)
    data = tmp_path / "step-000000000002" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(raw)
    with caplog.at_level(logging.INFO, logger="torchrl_dcp"):
        info = tdcp.resume(ckpt, tmp_path)
    assert info is not None and info.step == 1 and info.path.name == "step-000000000001"
    assert torch.equal(model.weight, ckpt_for(1)[1].weight)
    assert "damaged" in caplog.text and "resumed from step 1" in caplog.text
    with pytest.raises(tdcp.CheckpointIntegrityError):
        rotation.load_latest(ckpt, fallback=False)
    # a user error (not damage) is raised, not skipped
    wrong = tdcp.DistributedCheckpoint(model=torch.nn.Linear(3, 3), counters={})
    with pytest.raises(tdcp.IncompatibleComponentError):
        tdcp.resume(wrong, tmp_path)

"""Faults with real ranks: SIGKILL at every phase of a save, a stuck rank, a full disk, two jobs on one path.

Each test checks what the issue promises: the last committed checkpoint still loads
and verifies, ``latest()`` never returns a partial one, surviving ranks get a
``CheckpointError`` instead of hanging, and the next save succeeds and cleans up.
"""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp
from tests_distributed.launch import launch
from tests_distributed.scenarios_faults import checkpoint, objects
from torchrl_dcp.verification import verify

S = "tests_distributed.scenarios_faults"

# phase -> (killed rank, step that latest() must return afterwards)
PHASES = {
    "staging": (0, 1),
    "announce": (1, 1),
    "write": (1, 1),
    "write_rank0": (0, 1),
    "after_data": (1, 1),
    "manifest": (0, 1),
    "rename": (0, 2),
    "async_write": (1, 1),
    "rotation_delete": (0, 2),
}


def reports(directory: Path) -> dict[int, Any]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in directory.glob("rank*.json")}


def load_replicated(path: Path, seed: int) -> None:
    """Load the replicated components in this process and compare with the values saved at ``seed``."""
    objs = objects(seed + 100, 0)
    tdcp.DistributedCheckpoint(model=objs["model"], big=objs["big"]).load(path, components=["model", "big"])
    expected = objects(seed, 0)
    assert torch.equal(objs["model"].weight, expected["model"].weight)
    assert all(torch.equal(objs["big"][k], expected["big"][k]) for k in expected["big"])


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("phase", sorted(PHASES))
def test_sigkill_at_each_phase_of_a_save(tmp_path: Path, phase: str) -> None:
    victim, expected_step = PHASES[phase]
    base = phase.removesuffix("_rank0")
    directory, report_dir = tmp_path / "run", tmp_path / "report"
    directory.mkdir()
    report_dir.mkdir()
    results = launch(
        f"{S}:kill_during_save", 2, str(directory), str(report_dir), base, victim, expect_failure=True, timeout=120
    )
    assert results[victim].returncode == -9, results[victim].output[-2000:]
    survivor = 1 - victim
    seen = reports(report_dir)
    # the survivor learnt of the death at once, as a CheckpointError (no hang)
    assert survivor in seen and seen[survivor]["error"] in ("CollectiveError", "CheckpointError"), (
        seen,
        results[survivor].output[-3000:],
    )

    rotation = tdcp.CheckpointRotation(directory, keep_last=1)
    entries = rotation.entries()
    latest = rotation.latest()
    assert latest is not None and latest == rotation.path_for(expected_step), (
        latest,
        sorted(p.name for p in directory.iterdir()),
    )
    for e in entries:  # whatever is listed is complete: no half-written or half-deleted checkpoint
        verify(e.path)
    listed = {e.step for e in rotation.entries(include_uncommitted=True) if e.committed}
    assert listed == {e.step for e in entries}
    if phase == "rotation_delete":
        assert [e.step for e in entries] == [2]  # step 1 is gone (its remains are hidden trash)
    if base not in ("rename", "rotation_delete"):
        assert [e.step for e in entries] == [1]  # rotation deleted nothing before the new commit
    load_replicated(latest, 1 if expected_step == 1 else 2)

    # the next save (here by one process) succeeds and removes what the killed save left
    objs = objects(3, 0)
    rotation.save(checkpoint(objs), step=3)
    assert [e.step for e in rotation.entries()] == [3]
    assert leftovers(directory) == [], leftovers(directory)
    load_replicated(rotation.latest(), 3)


def test_sigkill_right_after_swapping_over_an_existing_checkpoint(tmp_path: Path) -> None:
    directory, report_dir = tmp_path / "run", tmp_path / "report"
    directory.mkdir()
    report_dir.mkdir()
    results = launch(
        f"{S}:kill_during_save", 2, str(directory), str(report_dir), "exchange", 0, expect_failure=True, timeout=120
    )
    assert results[0].returncode == -9
    fixed = directory / "fixed"
    swapped = (report_dir / "exchanged").read_text() == "True"
    step = tdcp.read_manifest(fixed)["step"]
    assert step == (2 if swapped else 1)  # the old or the new checkpoint, whole, never a mix
    verify(fixed)
    load_replicated(fixed, step)
    checkpoint(objects(3, 0)).save(fixed, step=3)
    assert sorted(p.name for p in directory.iterdir()) == ["fixed"]


def test_full_reload_after_killed_async_save(tmp_path: Path) -> None:
    """The per-rank state of the last committed checkpoint loads on every rank after a killed async save."""
    directory, report_dir = tmp_path / "run", tmp_path / "report"
    directory.mkdir()
    report_dir.mkdir()
    launch(f"{S}:kill_during_save", 2, str(directory), str(report_dir), "async_write", 1, expect_failure=True)
    assert [r.value for r in launch(f"{S}:reload_latest", 2, str(directory), 1)] == [1, 1]


# ---------------------------------------------------------------------- a stuck rank
@pytest.mark.parametrize("hung", [1, 0])
def test_stuck_rank_times_out_naming_it(tmp_path: Path, hung: int) -> None:
    directory, report_dir = tmp_path / "run", tmp_path / "report"
    directory.mkdir()
    report_dir.mkdir()
    # the launch timeout turns a deadlock into a failure; the checkpoint timeout is 4 s
    launch(f"{S}:hang_during_save", 3, str(directory), str(report_dir), hung, 4.0, timeout=150, expect_failure=True)
    seen = reports(report_dir)
    others = [r for r in range(3) if r != hung]
    assert sorted(seen) == others, seen
    for r in others:
        assert seen[r]["error"] == "CollectiveError", seen[r]
        assert f"rank {hung}" in seen[r]["message"] or f"ranks {hung}" in seen[r]["message"], seen[r]["message"]
    assert tdcp.read_manifest(directory / "ckpt")["step"] == 1
    verify(directory / "ckpt")
    load_replicated(directory / "ckpt", 1)


# ---------------------------------------------------------------------- a full disk
def _check_full_disk(results: list[Any], directory: Path) -> None:
    for r in results:
        v = r.value
        assert v["error"] is not None, v
        assert "No space left on device" in v["message"] and "full" in v["message"], v["message"]
        assert v["loaded_step"] == 1 and v["after"] == 4
        assert all(name.endswith(".tdcp-lock") is False and ".tdcp-" not in name for name in v["leftovers"]), v


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_injected_enospc(tmp_path: Path, where: str) -> None:
    results = launch(f"{S}:full_disk", 2, str(tmp_path), where)
    _check_full_disk(results, tmp_path)


def test_enospc_on_a_small_tmpfs(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        results = launch(f"{S}:full_disk", 2, str(mnt), "tmpfs")
        _check_full_disk(results, mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---------------------------------------------------------------------- two jobs, one path
def test_two_jobs_saving_to_one_path(tmp_path: Path) -> None:
    path, sync = tmp_path / "ckpt", tmp_path / "sync"
    sync.mkdir()
    out: dict[str, Any] = {}

    def run(job: str) -> None:
        out[job] = launch(f"{S}:two_jobs", 2, str(path), str(sync), job, timeout=150)

    threads = [threading.Thread(target=run, args=(job,)) for job in ("A", "B")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(out) == {"A", "B"}, "a job failed (see the assertion printed above)"
    assert all(r.value["saved"] for r in out["A"])
    for r in out["B"]:  # refused while A held the path, on every rank, saying why
        assert r.value["first"] is not None and "another save to this path is in progress" in r.value["first"]
        assert r.value["second"] == "ok"
    manifest = tdcp.read_manifest(path)
    assert manifest["metadata"] == {"job": "B"} and manifest["step"] == 3
    verify(path)
    load_replicated(path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "sync"]

"""Archives and rotation with 2 and 3 real ranks (gloo): conversion, in-place loads, killed saves."""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from tests_distributed.launch import launch
from torchrl_dcp.storage.archive import read_index

CORE = "tests_distributed.scenarios_core"
S = "tests_distributed.scenarios_archive"


@pytest.mark.parametrize("world_size", [2, 3])
def test_multi_rank_checkpoint_converts_both_ways_and_loads_from_the_archive(tmp_path: Path, world_size: int) -> None:
    path = tmp_path / "ckpt"
    saved = launch(f"{CORE}:save_then_draw", world_size, str(path), 7)
    assert len([p for p in path.iterdir() if p.suffix == ".distcp"]) >= world_size  # one file per rank at least
    archive = tdcp.to_archive(path, tmp_path / "ckpt.zip")
    assert set(read_index(archive)) == {p.name for p in path.iterdir()}
    back = tdcp.to_directory(archive, tmp_path / "back")
    assert all((back / f.name).read_bytes() == f.read_bytes() for f in path.iterdir())
    # every rank loads its own state straight from the ZIP, and training continues identically
    loaded = launch(f"{CORE}:load_then_draw", world_size, str(archive), 7)
    for s, got in zip(saved, loaded):
        r = got.value["rank"]
        assert got.value["loaded"] == ["big", "model", "optimizer", "rng", "shard", "stats"]
        assert got.value["shard"] == [100 * r + 7 + i for i in range(5)]
        assert got.value["draws"] == s.value["draws"] and got.value["after_step"] == s.value["after_step"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "ckpt", "ckpt.zip"]  # nothing extracted


@pytest.mark.parametrize("world_size", [1, 2])
def test_archive_of_three_ranks_loads_replicated_state_on_fewer_ranks(tmp_path: Path, world_size: int) -> None:
    path = tmp_path / "ckpt"
    launch(f"{CORE}:save_then_draw", 3, str(path), 5)
    archive = tdcp.to_archive(path, tmp_path / "ckpt.zip")
    for r in launch(f"{CORE}:load_replicated_only", world_size, str(archive), 5):
        assert "saved by 3 ranks" in r.value["full_load"]
        assert r.value["loaded"] == ["big", "model"] and r.value["big"] == [5.0 + i for i in range(8)]


@pytest.mark.parametrize("archive,kill", [(False, "commit"), (True, "commit"), (True, "archive")])
def test_rotation_resumes_from_the_last_committed_entry_after_a_killed_save(
    tmp_path: Path, archive: bool, kill: str
) -> None:
    d = tmp_path / "run"
    names = launch(f"{S}:rotation_saves", 2, str(d), [1, 2, 3, 4], archive, None, -1)[0].value
    suffix = ".zip" if archive else ""
    assert names == [f"step-{s:012d}{suffix}" for s in (1, 2, 3, 4)]
    # keep_last=2 keeps 3 and 4; the best reward (step 2: 2 % 3 = 2) is kept as well
    assert sorted(p.name for p in d.iterdir()) == [f"step-{s:012d}{suffix}" for s in (2, 3, 4)]

    results = launch(f"{S}:rotation_saves", 2, str(d), [5], archive, kill, 5, expect_failure=True, timeout=90)
    assert any(r.returncode == -9 for r in results)
    resumed = launch(f"{S}:rotation_resume", 2, str(d))
    if kill == "commit":  # step 5 never committed: resume from 4, nothing older was deleted
        assert [r.value["step"] for r in resumed] == [4, 4]
        assert {p.name for p in d.iterdir() if not p.name.startswith(".")} == {
            f"step-{s:012d}{suffix}" for s in (2, 3, 4)
        }
    else:  # step 5's directory committed, its archive was half-written: the directory is what resumes
        assert [r.value["step"] for r in resumed] == [5, 5]
        assert resumed[0].value["name"] == "step-000000000005"
    for r in resumed:
        assert r.value["model_ok"] and r.value["shard"] == 100.0 * r.rank + r.value["step"]
    # the next save commits and cleans what the killed one left
    launch(f"{S}:rotation_saves", 2, str(d), [6], archive, None, -1)
    left = sorted(p.name for p in d.iterdir())
    if kill == "archive":  # keep_last=2 keeps 5 (a directory) and 6; 5 ties 2 on reward and is newer, so it is the best
        assert left == ["step-000000000005", "step-000000000006.zip"], left
    else:  # 4 and 6 are the last two, 2 the best; step 5's staging directory is gone
        assert left == [f"step-{s:012d}{suffix}" for s in (2, 4, 6)], left
    assert [r.value["step"] for r in launch(f"{S}:rotation_resume", 2, str(d))] == [6, 6]

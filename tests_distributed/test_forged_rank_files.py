"""Two ranks' own data files swapped, every record the format documents resealed (2 real ranks, gloo): each file's
identity trailer names the rank that wrote it, which its new name contradicts; every rank refuses the checkpoint
(naming the file and both ranks) and restores nothing, ``verify`` refuses it. An honest 2-rank checkpoint loads."""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from tests import forging
from tests_distributed.launch import launch

S = "tests_distributed.scenarios_forged_rank_files"


def _swap(path: Path, a: str, b: str) -> None:
    data_a, data_b = (path / a).read_bytes(), (path / b).read_bytes()
    assert len(data_a) == len(data_b)  # a forger who needs the sizes to match picks files that do
    (path / a).write_bytes(data_b)
    (path / b).write_bytes(data_a)
    forging.reseal(path, a, b)  # the shards' records (format 7: a rank's own files) and the root, resealed


def test_each_rank_restores_its_own_state_from_an_honest_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    launch(f"{S}:save", 2, str(path))
    tdcp.verify(path)
    for r in launch(f"{S}:load", 2, str(path)):
        rank = r.value["rank"]
        assert r.value["error"] is None, r.value["error"]
        assert r.value["rows"] == 20 and r.value["first"] == [float(rank)] * 4 and r.value["steps"] == [10 + rank]


def test_two_ranks_swapped_data_files_are_refused_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    launch(f"{S}:save", 2, str(path))
    _swap(path, "__0_0.distcp", "__1_0.distcp")
    with pytest.raises(tdcp.CheckpointIntegrityError, match="identity trailer names rank 1, its name says rank 0"):
        tdcp.verify(path)
    for r in launch(f"{S}:load", 2, str(path)):
        rank = r.value["rank"]
        error = r.value["error"]
        assert r.value["kind"] == "CheckpointIntegrityError", error
        assert f"__{rank}_0.distcp" in error  # a rank reads (and checks) its own file only
        assert f"identity trailer names rank {1 - rank}, its name says rank {rank}" in error
        assert r.value["rows"] == 0 and r.value["steps"] == [-1] and r.value["policy_zero"]  # nothing restored


def test_ranks_reading_two_roots_of_one_save_resealed_alike_are_refused(tmp_path: Path) -> None:
    """Two copies of one save (one identity) whose roots differ, each resealed: each rank read its own and trusted
    it, so replicas restored different states (an optimizer's learning rate in the probe; the metadata here). The
    ranks compare a digest of the root's bytes: every rank refuses, nothing restored."""
    import shutil

    path = tmp_path / "ckpt"
    launch(f"{S}:save", 2, str(path))
    for rank in (0, 1):
        shutil.copytree(path, f"{path}-{rank}")
    forging.edit(Path(f"{path}-1"), lambda m: m["metadata"].update(note="another root"))
    for r in launch(f"{S}:load", 2, str(path), True):
        assert r.value["kind"] == "CheckpointError" and "do not agree" in r.value["error"], r.value["error"]
        assert r.value["rows"] == 0 and r.value["steps"] == [-1] and r.value["policy_zero"]  # nothing restored
    for r in launch(f"{S}:load", 2, str(path)):  # one copy: loads
        assert r.value["error"] is None, r.value["error"]


def _point_rank_0_at_rank_1s_record(path: Path) -> None:
    """Rank 0's storage entry for its counter names rank 1's record in ``__1_0.distcp``, and the root lists that file
    (where format 8 looks up a file rank 0's shard does not list): shard and root resealed. Each rank builds its
    metadata from the root and its own shard, so no two of its records overlap."""
    import json

    from torchrl_dcp.format.manifest import dumps, seal

    m = forging.read_parts(path)
    entries = {e[0]: e for e in m["index"]["entries"]}
    entries["rank/0/counter/steps"][1:] = entries["rank/1/counter/steps"][1:]
    forging.write_parts(path, m)
    root = json.loads((path / "manifest.json").read_text())
    root.pop("manifest_checksum", None)
    root["files"]["__1_0.distcp"] = m["files"]["__1_0.distcp"]
    (path / "manifest.json").write_bytes(dumps(seal(root)))


def test_a_rank_pointed_at_another_ranks_per_rank_record_is_refused(tmp_path: Path) -> None:
    """Rank 0 restored rank 1's counter (11), no word; ``verify`` refused only because two records overlapped."""
    path = tmp_path / "ckpt"
    launch(f"{S}:save", 2, str(path))
    _point_rank_0_at_rank_1s_record(path)
    says = "'rank/0/counter/steps', a per-rank tensor of rank 0, in __1_0.distcp, which is not a file of that rank"
    for r in launch(f"{S}:load", 2, str(path)):
        assert r.value["kind"] in ("CheckpointIntegrityError", "CollectiveError"), r.value
        assert says in r.value["error"], r.value["error"]
        assert r.value["rows"] == 0 and r.value["steps"] == [-1] and r.value["policy_zero"]  # nothing restored
    with pytest.raises(tdcp.CheckpointError, match=says):
        tdcp.verify(path)

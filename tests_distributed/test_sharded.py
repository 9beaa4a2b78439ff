"""Sharded (DTensor) components: saved by 2 ranks, loaded on 3 and back, resharded by DCP."""

from __future__ import annotations

from pathlib import Path

import torchrl_dcp as tdcp
from tests_distributed.launch import launch

S = "tests_distributed.scenarios_sharded"


def test_dtensor_state_reshards_across_world_sizes(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = launch(f"{S}:save_sharded", 2, path)
    assert [r.value["local_rows"] for r in saved] == [4, 3]
    manifest = tdcp.read_manifest(path)
    assert manifest["components"]["model"]["placement"] == "sharded"
    for r in launch(f"{S}:load_sharded", 3, path):
        assert r.value["equal"] and r.value["loaded"] == ["model"]
    path2 = str(tmp_path / "ckpt3")
    launch(f"{S}:save_sharded", 3, path2)
    for r in launch(f"{S}:load_sharded", 2, path2):
        assert r.value["equal"]


def test_a_dtensor_of_another_shape_or_dtype_is_skipped_by_strict_warn(tmp_path: Path) -> None:
    """A DTensor's shape and dtype were left to DCP's read: ``strict="warn"`` failed the whole load on every rank
    ("DCP load failed: ... was saved as torch.float32 (7, 5), the destination is ... (8, 5)") instead of skipping
    that component as it skips a module of another shape. Compared while planning now."""
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_sharded", 2, path)
    for rows, dtype in ((8, "float32"), (7, "float64")):
        for r in launch(f"{S}:load_into_another_shape", 2, path, rows, dtype):
            assert r.value["loaded"] == ["rng"] and list(r.value["incompatible"]) == ["model"], r.value
            assert (
                "sharded tensor 'w' was saved as torch.float32 (7, 5), the live DTensor"
                in r.value["incompatible"]["model"]
            )
            assert "PartialLoadWarning" in r.value["warned"] and r.value["untouched"], r.value


def test_a_replicated_dtensor_whose_copies_drifted_is_refused(tmp_path: Path) -> None:
    """A DTensor placed Replicate() (alone, or along HSDP's first mesh dimension) whose copy on one rank differs:
    the replica check left every DTensor out of a sharded component ("each rank's shard: its own"), DCP wrote one
    copy and every rank loaded it. So were the data-parallel copies of a tensor-parallel submesh's shard. The copies
    of one place of a DTensor (its key and offsets: what DCP writes once) are compared among the ranks holding it."""
    for shape, drift in (([2], 1), ([2, 2], 2), ([2, 2], 3), ([2, 2, 0], 2)):
        path = str(tmp_path / f"c{len(shape)}{drift}")
        results = launch(f"{S}:save_drifted_replicas", 2 if len(shape) == 1 else 4, path, shape, drift)
        for r in results:
            assert r.value["error"] is not None and "a place of a DTensor several ranks hold" in r.value["error"], (
                r.value
            )
    results = launch(f"{S}:save_drifted_replicas", 4, str(tmp_path / "alike"), [2, 2], -1)
    assert all(r.value["error"] is None for r in results), results

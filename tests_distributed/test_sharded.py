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

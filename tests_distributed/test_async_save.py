"""Async saves with real ranks (gloo): same bytes as a sync save, failures raised on every rank, atomic commit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import torchrl_dcp as tdcp
from tests_distributed.launch import launch

S = "tests_distributed.scenarios_async"


def test_async_save_matches_sync_save_on_two_ranks(tmp_path: Path) -> None:
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    saved = launch(f"{S}:sync_then_async", 2, str(sync), str(asyn), 3)
    files = tdcp.read_manifest(sync)["files"]
    assert files.keys() == tdcp.read_manifest(asyn)["files"].keys()
    own = {n for n in files if n.startswith("__") and not n.endswith("_shared.distcp")}
    assert own == {"__0_0.distcp", "__1_0.distcp"}  # both ranks wrote their own
    assert any(n.endswith("_shared.distcp") for n in files)  # and the replicated state, apart
    for name in files:
        if name.startswith("manifest-"):  # shards: the same but for the save and their files' CRCs (the trailers)
            a, b = (_without_identity(json.loads((d / name).read_text())) for d in (sync, asyn))
            assert a == b and a["files"], name
        elif name != ".metadata":  # data files differ only by their save identity trailer (64 bytes)
            assert (sync / name).read_bytes()[:-64] == (asyn / name).read_bytes()[:-64], name
    tdcp.verify(asyn)
    for s, got in zip(saved, launch(f"{S}:load_summary", 2, str(asyn), 3)):
        assert got.value == s.value["expected"]  # the state at the call, not after the later updates
    # each rank stages only what it writes: its shard and its share of the 6 replicated tensors
    staged = [s.value["staged_keys"] for s in saved]
    assert sum(staged) == 6 + 2 and all(0 < n < 7 for n in staged), staged


def _without_identity(shard: dict[str, Any]) -> dict[str, Any]:
    shard.pop("save_id")
    for rec in shard["files"].values():
        rec.pop("checksum")
    return shard


@pytest.mark.parametrize("where", ["wait", "next_call"])
def test_background_failure_raises_on_every_rank(tmp_path: Path, where: str) -> None:
    path = tmp_path / "ckpt"
    results = launch(f"{S}:fail_in_background", 2, str(path), 5, where)
    for r in results:
        assert r.value["error"] is not None, r.output
        assert "No space left" in r.value["message"]
    assert results[0].value["error"] == "CollectiveError" and "rank 1" in results[0].value["message"]
    assert tdcp.read_manifest(path)["step"] == 1  # the previous checkpoint stands
    tdcp.verify(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]

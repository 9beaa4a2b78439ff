"""Names the library reads or accepts are matched whole: a trailing newline, other digits, a non-canonical step or a
percent-encoded URL never passes for (or hides) a name of ours."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp.format.layout import is_data_file, shard_rank
from torchrl_dcp.rotation_entries import entry_name_step


@pytest.mark.parametrize("name", ["policy\n", "policy\n\n", "p\u0660"])
def test_a_component_name_with_a_trailing_newline_or_other_characters_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="component name"):
        tdcp.DistributedCheckpoint(no_dist=True).register(name, torch.nn.Linear(1, 1))


def test_file_names_are_matched_whole_and_in_ascii_digits() -> None:
    assert is_data_file("__0_0.distcp") and is_data_file("__3_shared.distcp")
    assert not any(is_data_file(n) for n in ("__0_0.distcp\n", "__\u0660_0.distcp", "__0_\u0661.distcp"))
    assert shard_rank("manifest-1.json") == 1 and shard_rank("manifest-1.json\n") is None
    assert entry_name_step("step-000000000042") == (42, False)
    assert entry_name_step("step-1000000000000.zip") == (10**12, True)  # more digits only where a step needs them
    for name in ("step-5", "step-000000000006\n", "step-0000000000007", "step-\u0660\u0660\u0660\u0660\u0660\u0660"):
        assert entry_name_step(name) is None


def test_rotation_prunes_only_names_it_gives(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    ck = tdcp.DistributedCheckpoint(no_dist=True, model=model)
    theirs = ["step-5", "step-000000000006\n", "step-0000000000007"]
    for name in theirs:
        ck.save(tmp_path / name)  # committed checkpoints a user made beside the rotation's entries
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=1)
    rotation.save(ck, step=10)
    rotation.save(ck, step=11)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*theirs, "step-000000000011"])
    assert [e.step for e in rotation.entries()] == [11]


def test_a_percent_encoded_file_url_names_the_decoded_path(tmp_path: Path) -> None:
    target = tmp_path / "my run #1"
    url = target.as_uri()
    assert "%20" in url
    path = tdcp.DistributedCheckpoint(no_dist=True, w={"x": torch.ones(2)}).save(url)
    assert Path(path) == target and target.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my run #1"]
    with pytest.raises(tdcp.CheckpointError, match="two slashes"):
        tdcp.DistributedCheckpoint(no_dist=True, w={"x": torch.ones(2)}).save(f"file:{tmp_path}/b")
    with pytest.raises(tdcp.CheckpointError, match="NUL"):
        tdcp.DistributedCheckpoint(no_dist=True, w={"x": torch.ones(2)}).save(f"file://{tmp_path}/a%00b")


def test_a_nul_in_a_torchrl_checkpoint_member_name_is_refused_naming_the_file(tmp_path: Path) -> None:
    import torchrl.checkpoint as tc

    p = tmp_path / "trl"
    tc.Checkpoint(policy=torch.nn.Linear(2, 2)).save(p)
    m = json.loads((p / "manifest.json").read_text())
    m["components"]["policy"]["path"] += "\x00x"
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(tdcp.CheckpointError, match="unsafe member name") as err:
        tdcp.verify(p)
    assert "manifest.json" in str(err.value)
    with pytest.raises(tdcp.CheckpointError, match="unsafe member name"):
        tdcp.DistributedCheckpoint(no_dist=True, policy=torch.nn.Linear(2, 2)).load(p)


def test_the_cli_prints_a_path_its_terminal_cannot_encode(tmp_path: Path) -> None:
    path = tdcp.DistributedCheckpoint(no_dist=True, w={"x": torch.ones(2)}).save(tmp_path / "run-\u65e5\u672c")
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    r = subprocess.run([sys.executable, "-m", "torchrl_dcp", "verify", str(path)], capture_output=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(b"OK ") and b"\\u65e5" in r.stdout


def test_a_store_url_the_store_reads_as_another_object_is_refused() -> None:
    pytest.importorskip("s3fs")
    from torchrl_dcp.storage.urls import StorePath

    with pytest.raises(tdcp.CheckpointError, match="versionId"):
        StorePath("s3://bkt/data/run?versionId=1/step-1", {"anon": True}).fs  # noqa: B018 - resolving refuses
    with pytest.raises(tdcp.CheckpointError, match="versionId"):
        tdcp.DistributedCheckpoint(no_dist=True, storage_options={"anon": True}, w={"x": torch.ones(1)}).save(
            "s3://bkt/data/run?versionId=1/step-1"
        )
    assert StorePath("s3://bkt/data/run?v=1/step-1", {"anon": True}).fs is not None  # a '?' alone is a key's

"""A save to S3 (s3fs, local moto server) SIGKILLed at each phase leaves the previous checkpoint loadable,
the killed one absent, and the next save removes its leftovers. Real processes, real kills."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp.storage.objectstore import list_objects
from torchrl_dcp.storage.urls import resolve_path

sys.path.insert(0, str(Path(__file__).parent))
from objectstore_child import incremental_state, state  # noqa: E402

CHILD = Path(__file__).with_name("objectstore_child.py")
ROOT = CHILD.parent.parent


def _child(s3, url: str, step: int, phase: str, **extra: str) -> int:  # type: ignore[no-untyped-def]
    env = {**os.environ, **s3.env, "PYTHONPATH": str(ROOT), "TDCP_STORE_PART_SIZE": str(5 << 20), **extra}
    proc = subprocess.run(
        [sys.executable, str(CHILD), url, str(step), phase], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr  # it died where we asked (SIGKILL), not earlier
    return proc.returncode


def _save(s3, url: str, step: int) -> None:  # type: ignore[no-untyped-def]
    ckpt = tdcp.DistributedCheckpoint(state=state(step), storage_options=s3.storage_options)
    tdcp.CheckpointRotation(url, keep_last=5, storage_options=s3.storage_options).save(ckpt, step=step)


def _load_step(s3, path) -> torch.Tensor:  # type: ignore[no-untyped-def]
    target = {"w": torch.zeros(3_000_000), "b": torch.zeros(10)}
    tdcp.DistributedCheckpoint(state=target, storage_options=s3.storage_options).load(path)
    return target["b"][0]


@pytest.mark.parametrize("phase", ["before_data", "mid_data", "before_manifest"])
def test_kill_at_each_phase_keeps_the_previous_checkpoint(s3, phase: str) -> None:  # type: ignore[no-untyped-def]
    url = s3.url()
    _save(s3, url, 1)
    _child(s3, url, 2, phase)
    rotation = tdcp.CheckpointRotation(url, storage_options=s3.storage_options)
    assert [e.step for e in rotation.entries()] == [1]  # the killed save is not a checkpoint
    assert rotation.latest() is not None and float(_load_step(s3, rotation.latest())) == 1.0
    tdcp.verify(rotation.latest())
    root = resolve_path(url, s3.storage_options)
    assert ".step-000000000002.tdcp-pending" in list_objects(root)  # the marker says who died
    killed = root / "step-000000000002"
    if phase == "before_manifest":
        assert sorted(list_objects(killed)) == [".metadata", "__0_shared.distcp"]
    with pytest.raises(tdcp.CheckpointError):
        tdcp.DistributedCheckpoint(state={"w": torch.zeros(1)}).load(killed)
    _save(s3, url, 3)  # the next save cleans up
    assert not list_objects(killed) and sorted(list_objects(root)) == ["step-000000000001", "step-000000000003"]
    assert [e.step for e in rotation.entries()] == [1, 3] and float(_load_step(s3, rotation.latest())) == 3.0


@pytest.mark.parametrize("phase", ["inc_mid_copy", "inc_before_manifest"])
def test_kill_during_an_incremental_save_keeps_the_previous_checkpoint(  # type: ignore[no-untyped-def]
    s3, monkeypatch: pytest.MonkeyPatch, phase: str
) -> None:
    """Killed while unchanged chunk objects are copied server-side from the previous checkpoint (or after every copy,
    before the manifest): the previous checkpoint is intact and exact, the killed one absent, the next save cleans."""
    from torchrl_dcp import chunking

    monkeypatch.setattr(chunking, "CHUNK_BYTES", 1 << 20)  # 12 chunk objects of 1 MiB; the child uses the same
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 2 << 20)
    url = s3.url()

    def save(step: int) -> None:
        ckpt = tdcp.DistributedCheckpoint(state=incremental_state(step), storage_options=s3.storage_options)
        tdcp.CheckpointRotation(url, keep_last=5, storage_options=s3.storage_options).save(ckpt, step=step)

    def loads_exactly(path, step: int) -> bool:  # type: ignore[no-untyped-def]
        target = {"w": torch.zeros(3_000_000), "b": torch.zeros(10)}
        tdcp.DistributedCheckpoint(state=target, storage_options=s3.storage_options).load(path)
        return all(torch.equal(target[k], v) for k, v in incremental_state(step).items())

    _child(s3, url, 2, phase, TDCP_CHUNK_BYTES=str(1 << 20))  # saves step 1, then step 2 from it (killed)
    root = resolve_path(url, s3.storage_options)
    first = root / "step-000000000001"
    assert len([n for n in list_objects(first) if n.endswith(".distcp")]) >= 10  # chunked: copies to kill amid
    killed = root / "step-000000000002"
    if phase == "inc_mid_copy":
        assert 1 <= len([n for n in list_objects(killed) if n.endswith(".distcp")]) < 12  # died amid the copies
    rotation = tdcp.CheckpointRotation(url, storage_options=s3.storage_options)
    assert [e.step for e in rotation.entries()] == [1]
    assert loads_exactly(rotation.latest(), 1)  # the copies' source is untouched
    tdcp.verify(rotation.latest())
    with pytest.raises(tdcp.CheckpointError):
        tdcp.DistributedCheckpoint(state={"w": torch.zeros(1)}, storage_options=s3.storage_options).load(killed)
    save(3)  # incremental from step 1 again; cleans the killed prefix
    assert not list_objects(killed)
    assert [e.step for e in rotation.entries()] == [1, 3] and loads_exactly(rotation.latest(), 3)


@pytest.mark.parametrize("replaced", ["incremental", "damaged"])
def test_a_save_killed_while_retiring_the_checkpoint_it_replaces_is_swept(s3, replaced: str) -> None:  # type: ignore[no-untyped-def]
    """Killed after the replaced checkpoint's manifest went, before its objects: the marker named the new save and the
    replaced one, but not the saves an incremental checkpoint's kept chunk objects come from, nor (the replaced one a
    damaged checkpoint, no save id to read) the saves its objects carry: the next sweep left the prefix, and every
    save to it was refused ("holds 7 object(s) but no valid manifest.json"). The marker now names them."""
    url = s3.url()
    _child(s3, url, 2, f"retire_{replaced}", TDCP_CHUNK_BYTES=str(1 << 20))
    killed = resolve_path(f"{url}/A", s3.storage_options)
    left = list_objects(killed)
    assert left and "manifest.json" not in left
    if replaced == "incremental":
        assert any(n.endswith(".distcp") and not n.endswith(("_0.distcp", "_shared.distcp")) for n in left), left
    ckpt = tdcp.DistributedCheckpoint(state=state(3), storage_options=s3.storage_options)
    ckpt.save(f"{url}/other")  # the sweep of the parent prefix
    assert not list_objects(killed)
    ckpt.save(f"{url}/A")
    assert float(_load_step(s3, f"{url}/A")) == 3.0

"""Incremental saves with real ranks (gloo): all shards at once, SIGKILL mid-save, the first save after a reshard."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from tests_distributed.launch import launch

S = "tests_distributed.scenarios_incremental"
SMALL_CHUNKS = {"TDCP_CHUNK_BYTES": "4096", "TDCP_MIN_CHUNKED_BYTES": "8192"}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from torchrl_dcp.storage.filesystem import safe_load_metadata

    md = safe_load_metadata(path / ".metadata")
    dest = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(dest, checkpoint_id=str(path), no_dist=True)
    return dest


def test_every_rank_keeps_its_unchanged_chunks_and_the_result_equals_a_full_save(tmp_path: Path) -> None:
    results = [r.value for r in launch(f"{S}:incremental_shards", 2, str(tmp_path), env=SMALL_CHUNKS)]
    assert all(r["same"] and r["same_policy"] for r in results), results
    for rank, r in enumerate(results):  # each rank was sent the base's shared keys and its own, not the other's
        assert any(k.startswith(f"rank/{rank}/buffer/") for k in r["received"]), r["received"]
        assert "replicated/policy/weight" in r["received"]
        assert all(k.startswith(("replicated/", f"rank/{rank}/")) for k in r["received"]), r["received"]
    kept = results[0]["kept"]
    assert any(f.startswith("__0_") for f in kept) and any(f.startswith("__1_") for f in kept), kept
    assert results[0]["written"], "the changed rows were written"
    policy_chunks = tdcp.read_manifest(tmp_path / "full")["chunks"]["replicated/policy/weight"]
    writers = {e["file"].split("_")[2] for e in policy_chunks}
    assert len(policy_chunks) == 8 and writers == {"0", "1"}, policy_chunks  # one replicated tensor, both ranks write
    inc, full = _tensors(tmp_path / "inc"), _tensors(tmp_path / "full")
    assert sorted(inc) == sorted(full) and all(torch.equal(inc[k], full[k]) for k in inc)
    assert tdcp.verify(tmp_path / "inc")["unchecked"] == []


@pytest.mark.parametrize("phase,victim", [("chunk_write", 1), ("link", 0), ("manifest", 0)])
def test_sigkill_during_an_incremental_save_leaves_the_previous_checkpoint(
    tmp_path: Path, phase: str, victim: int
) -> None:
    directory = tmp_path / "run"
    results = launch(
        f"{S}:kill_during_incremental_save",
        2,
        str(directory),
        phase,
        victim,
        env=SMALL_CHUNKS,
        expect_failure=True,
        timeout=120,
    )
    assert results[victim].returncode == -9, results[victim].output[-3000:]
    rotation = tdcp.CheckpointRotation(directory, keep_last=2)
    assert [e.step for e in rotation.entries()] == [1, 2]
    assert not rotation.path_for(3).exists()
    for e in rotation.entries():
        assert tdcp.verify(e.path)["unchecked"] == []
    after = [r.value for r in launch(f"{S}:resume_and_save_again", 2, str(directory), env=SMALL_CHUNKS)]
    assert all(r["step"] == 2 and r["same"] for r in after), after
    assert after[0]["kept"], "the save after the kill is incremental again"
    names = sorted(p.name for p in directory.iterdir())
    assert names == [rotation.path_for(2).name, rotation.path_for(3).name], names  # leftovers cleaned


def test_an_async_incremental_save_beside_a_killed_jobs_staging_keeps_the_base_files(tmp_path: Path) -> None:
    """A job killed whole (torchrun stops every rank when one dies) mid-save leaves its staging directory, holding
    hard links to the base's chunk files. The resumed job's async incremental save failed: rank 1 proved its base
    files, then rank 0, preparing the destination in the background, unlinked the leftover links (a file's ``ctime``
    moves), and rank 1's proofs no longer held ("changed after the incremental save checked it"). Rank 0 sweeps
    before any rank proves the base now: the save keeps the files, exactly."""
    from torchrl_dcp.storage.commit import staging_path

    directory = tmp_path / "run"
    launch(f"{S}:two_rotation_saves", 2, str(directory), env=SMALL_CHUNKS)
    rotation = tdcp.CheckpointRotation(directory, keep_last=2)
    base = rotation.path_for(2)
    leftover = staging_path(rotation.path_for(3))
    leftover.mkdir()
    own = sorted(p for p in base.iterdir() if p.name.startswith("__1_") and p.name != "__1_0.distcp")
    assert own, sorted(p.name for p in base.iterdir())
    for p in own:  # (what a save killed after linking rank 1's kept chunk files leaves)
        (leftover / p.name).hardlink_to(p)
    after = [r.value for r in launch(f"{S}:resume_and_save_again", 2, str(directory), True, env=SMALL_CHUNKS)]
    assert all(r["step"] == 2 and r["same"] for r in after), after
    assert any(f.startswith("__1_") for f in after[0]["kept"]), after[0]
    assert not leftover.exists()
    assert tdcp.verify(rotation.path_for(3))["unchecked"] == []


def test_first_save_after_a_reshard_is_full(tmp_path: Path) -> None:
    launch(f"{S}:incremental_shards", 2, str(tmp_path), env=SMALL_CHUNKS)
    results = [r.value for r in launch(f"{S}:save_after_reshard", 1, str(tmp_path), env=SMALL_CHUNKS)]
    assert results[0]["len"] == 2015 and results[0]["kept"] == [] and results[0]["written"], results


def test_rows_written_by_another_process_are_never_missed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer in shared memory, written by a worker process through its own copy: found by content."""
    import torch.multiprocessing as mp
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    from tests_distributed.scenarios_incremental import extend_in_child, rows
    from torchrl_dcp import chunking

    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1200), batch_size=4)
    rb.extend(rows(1000, 0, 0))
    rb._storage._storage.share_memory_()
    ckpt = tdcp.DistributedCheckpoint(buffer=rb)
    base = ckpt.save(tmp_path / "base")
    child = mp.get_context("spawn").Process(target=extend_in_child, args=(rb, 5000))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    # the parent never called set(): only the shared data (and torchrl's shared counter) changed
    assert torch.equal(rb._storage._storage["obs"][3], rows(1, 5100, 0)["obs"][0])
    inc = ckpt.save(tmp_path / "inc", incremental_from=base)
    a, b = _tensors(inc), _tensors(ckpt.save(tmp_path / "full"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any("origin" in r for r in tdcp.read_manifest(inc)["files"].values())  # untouched chunks still kept

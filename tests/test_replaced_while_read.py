"""A checkpoint replaced or removed by another process while a load reads it (an evaluator loading the path a
trainer saves over; a reader resuming a rotation the trainer prunes): never reported as damage.

The other process's save is made at a fixed point of the load (the read phase), in this process, through the
public API: the interleaving is the same every run.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp import load_engine


def _policy(value: float) -> torch.nn.Linear:
    policy = torch.nn.Linear(4, 4)
    with torch.no_grad():
        policy.weight.fill_(value)
        policy.bias.fill_(value)
    return policy


def _meanwhile(monkeypatch: pytest.MonkeyPatch, action: Callable[[], Any]) -> None:
    """Run ``action`` once, when the next load starts reading its tensors (after it read the manifest)."""
    real, done = load_engine.read, []

    def read(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(action())
        return real(*args, **kwargs)

    monkeypatch.setattr(load_engine, "read", read)


@pytest.mark.parametrize("how", ["saved over", "removed"])
def test_a_checkpoint_replaced_while_it_is_read_is_said_to_be_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """It was refused as damaged ("a file from another checkpoint (or a damaged one)", "checksum mismatch"): a
    user would delete a good checkpoint."""
    path = tdcp.DistributedCheckpoint(no_dist=True, policy=_policy(1.0)).save(tmp_path / "latest", step=1)
    if how == "saved over":
        _meanwhile(monkeypatch, lambda: tdcp.DistributedCheckpoint(no_dist=True, policy=_policy(2.0)).save(path))
    else:
        _meanwhile(monkeypatch, lambda: shutil.rmtree(path))
    live = _policy(-1.0)
    with pytest.raises(
        tdcp.CheckpointReplacedError, match="while this load read it.*nothing is damaged; load it again"
    ):
        tdcp.DistributedCheckpoint(no_dist=True, policy=live).load(path)
    assert bool((live.weight == -1.0).all())  # nothing restored
    if how == "saved over":
        monkeypatch.undo()
        tdcp.DistributedCheckpoint(no_dist=True, policy=live).load(path)  # loading again works
        assert bool((live.weight == 2.0).all())


def test_a_resume_whose_entry_is_pruned_meanwhile_lists_again_and_takes_the_newer_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader resuming a rotation while the trainer saved step 2 (``keep_last=1`` pruned step 1, which the reader
    had picked): step 1 was warned about as damaged, then "every committed one is damaged: starting fresh"."""
    trainer = tdcp.CheckpointRotation(tmp_path, keep_last=1)
    trainer.save(tdcp.DistributedCheckpoint(no_dist=True, policy=_policy(1.0)), step=1)
    _meanwhile(monkeypatch, lambda: trainer.save(tdcp.DistributedCheckpoint(no_dist=True, policy=_policy(2.0)), step=2))
    live = _policy(-1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tdcp.TorchrlDcpWarning)  # no "damaged", no "starting fresh"
        info = tdcp.CheckpointRotation(tmp_path).resume(tdcp.DistributedCheckpoint(no_dist=True, policy=live))
    assert info is not None and info.step == 2 and bool((live.weight == 2.0).all())


def _at_listing(monkeypatch: pytest.MonkeyPatch, action: Callable[[], Any]) -> None:
    """Run ``action`` once, while the load's validation lists the checkpoint's directory (before it reads data)."""
    from torchrl_dcp.storage import directory

    real, done = directory.DirectoryContainer._listing, []

    def listing(self: Any, files: Any) -> Any:
        if not done:
            done.append(action())
        return real(self, files)

    monkeypatch.setattr(directory.DirectoryContainer, "_listing", listing)


@pytest.mark.parametrize("when", [_at_listing, _meanwhile], ids=["validation", "read"])
def test_a_checkpoint_removed_at_any_point_of_its_load_is_said_to_be_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: Callable[..., None]
) -> None:
    """Removed while the validation listed its directory, it was a bare ``CheckpointError("validating the checkpoint
    failed: FileNotFoundError ...")``, and a resume stopped there instead of listing its entries again."""
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=3)
    for step in (1, 2):
        rotation.save(tdcp.DistributedCheckpoint(no_dist=True, policy=_policy(float(step))), step=step)
    newest = rotation.latest()
    assert newest is not None
    when(monkeypatch, lambda: shutil.rmtree(newest))
    live = _policy(-1.0)
    with pytest.raises(tdcp.CheckpointReplacedError, match="was removed while this load read it"):
        tdcp.DistributedCheckpoint(no_dist=True, policy=live).load(newest)
    assert bool((live.weight == -1.0).all())

    rotation.save(tdcp.DistributedCheckpoint(no_dist=True, policy=_policy(3.0)), step=3)
    newest = rotation.latest()
    monkeypatch.undo()
    when(monkeypatch, lambda: shutil.rmtree(newest))  # the entry a resume picks: pruned by another job meanwhile
    info = tdcp.CheckpointRotation(tmp_path).resume(tdcp.DistributedCheckpoint(no_dist=True, policy=live))
    assert info is not None and info.step == 1 and bool((live.weight == 1.0).all())

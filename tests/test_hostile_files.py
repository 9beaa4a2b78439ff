"""Planted special files in a checkpoint never hang, exhaust memory or load: every entry point refuses them.

Generated matrix: what is planted (a FIFO, a link to ``/dev/zero``, a directory, a link to
a file outside the checkpoint) × where (DCP's ``.metadata``, a data file, a ``.metadata``
the manifest does not list) × every entry point that reads a checkpoint (``load``,
``verify``, ``read_component``, ``export_torchrl``, ``resume``, ``torchrl-dcp diff``). Each
must raise a ``CheckpointError`` naming the file, within seconds (an alarm fails the test
instead of hanging CI), and a failed load must leave the objects unchanged.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp
from torchrl_dcp.cli import main as cli

KINDS = ["fifo", "dev_zero", "directory", "outside_link"]
TARGETS = [".metadata", "__0_0.distcp", "unlisted .metadata"]


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    def hung(*_: object) -> None:
        raise AssertionError(f"blocked for more than {seconds}s on a planted file")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _plant(at: Path, kind: str, outside: Path) -> None:
    if at.is_dir():
        shutil.rmtree(at)
    elif at.exists() or at.is_symlink():
        at.unlink()
    if kind == "fifo":
        os.mkfifo(at)
    elif kind == "dev_zero":
        at.symlink_to("/dev/zero")
    elif kind == "directory":
        at.mkdir()
    else:
        at.symlink_to(outside)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("planted")
    torch.manual_seed(0)
    with_tensors = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2)).save(root / "tensors", step=1)
    json_only = tdcp.DistributedCheckpoint(stats={"episodes": 3}).save(root / "json", step=1)
    return with_tensors, json_only


def _entry_points(path: Path, tmp: Path, name: str, json_only: bool) -> dict[str, Callable[[], object]]:
    def load() -> object:
        """A load of the components the checkpoint holds (so that it reaches the files: a load asking for a component
        the checkpoint lacks is refused for that first, before any file is opened)."""
        model = torch.nn.Linear(3, 2)
        stats: dict[str, object] = {"episodes": 0}
        before = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt = tdcp.DistributedCheckpoint(stats=stats) if json_only else tdcp.DistributedCheckpoint(policy=model)
        try:
            return ckpt.load(path)
        finally:
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            assert stats == {"episodes": 0}

    def rotation_resume() -> object:
        """The planted entry is the newest of a rotation: resume skips it for the older, intact one."""
        info = tdcp.resume(tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2)), path.parent)
        assert info is not None and info.step == 1, info
        raise tdcp.CheckpointIntegrityError(f"{name} skipped as damaged (resumed from step 1)", path=path)

    def cli_diff() -> object:
        code = cli(["diff", str(path), str(path)])
        if code != 0:
            raise tdcp.CheckpointError(f"torchrl-dcp diff exited with an error ({name})", path=path)
        return code

    def read_component() -> object:
        from torchrl_dcp.extract import read_component

        return read_component(path, "policy")

    return {
        "load": load,
        "verify": lambda: tdcp.verify(path),
        "read_component": read_component,
        "export_torchrl": lambda: tdcp.export_torchrl(path, tmp / "export.torchrl", ["policy"]),
        "resume": rotation_resume,
        "cli_diff": cli_diff,
    }


ENTRY_POINTS = ["load", "verify", "read_component", "export_torchrl", "resume", "cli_diff"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", KINDS)
def test_planted_special_files_are_refused_quickly(
    saved: tuple[Path, Path], tmp_path: Path, kind: str, target: str, entry: str
) -> None:
    with_tensors, json_only = saved
    source = json_only if target == "unlisted .metadata" else with_tensors
    if target == "unlisted .metadata" and entry in ("read_component", "export_torchrl", "resume"):
        pytest.skip("the JSON-only checkpoint has no tensor component to read, export or resume a policy from")
    rotation = tmp_path / "rot"
    shutil.copytree(source, rotation / "step-000000000001")
    path = Path(shutil.copytree(source, rotation / "step-000000000002"))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\x80\x04K\x01." * 100)  # bytes that are not a checkpoint file (a tiny pickle, too)
    name = ".metadata" if target == "unlisted .metadata" else target
    _plant(path / name, kind, outside)
    run = _entry_points(path, tmp_path, name, json_only=source == json_only)[entry]
    with deadline(20):
        if target == "unlisted .metadata" and entry == "cli_diff":
            run()  # a JSON-only checkpoint's diff reads no file: the planted one is never opened (no hang)
        else:
            with pytest.raises(tdcp.CheckpointError) as info:
                run()
            assert name in str(info.value), str(info.value)
    assert outside.read_bytes() == b"\x80\x04K\x01." * 100  # never written through

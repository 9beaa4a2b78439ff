"""What a permission the process lacks does to saves and resumes (run as root, each case in a child process with
the capabilities that bypass file permissions dropped, through ``setpriv``; as another user, directly)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp

_CAPS = "-dac_override,-dac_read_search,-fowner"


def _run_without_permission_bypass(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a Python child that file permissions apply to."""
    cmd = [sys.executable, "-c", textwrap.dedent(code)]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: permissions cannot be made to apply")
        cmd = [setpriv, "--bounding-set", _CAPS, "--inh-caps", _CAPS, *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": ""})


def _save(path: Path, step: int) -> None:
    tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2), no_dist=True).save(path, step=step)


def test_a_committed_save_over_a_read_only_checkpoint_succeeds_and_says_what_it_left(tmp_path: Path) -> None:
    """The old checkpoint's directory read-only: the new one was committed (exchanged in), then removing the old one
    failed and the save raised a bare ``PermissionError`` (and said "nothing was committed" before that): a caller
    retried a save that had succeeded. The commit stands; a warning names where the old one is left."""
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "step-1"
    _save(path, 1)
    old = json.loads((path / "manifest.json").read_text())["save_id"]
    path.chmod(0o555)
    try:
        done = _run_without_permission_bypass(
            f"""
            import warnings, torch, torchrl_dcp as tdcp
            with warnings.catch_warnings(record=True) as heard:
                warnings.simplefilter("always")
                tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2), no_dist=True).save({str(path)!r}, step=1)
            print("|".join(str(w.message) for w in heard if issubclass(w.category, tdcp.TorchrlDcpWarning)))
            """
        )
        # the leftover is read-only still: the next save used to fail on it ("preparing the staging directory
        # failed: ... 'manifest.json'"), naming neither the leftover nor what to do; it saves, and names it
        again = _run_without_permission_bypass(
            f"""
            import warnings, torch, torchrl_dcp as tdcp
            with warnings.catch_warnings(record=True) as heard:
                warnings.simplefilter("always")
                tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2), no_dist=True).save({str(path)!r}, step=2)
            print("|".join(str(w.message) for w in heard if issubclass(w.category, tdcp.TorchrlDcpWarning)))
            """
        )
    finally:
        for p in (tmp_path / "run").iterdir():
            p.chmod(0o755)
    assert again.returncode == 0, again.stderr[-2000:]
    assert ".step-1.tdcp-staging-" in again.stdout and "could not be removed" in again.stdout, again.stdout
    assert tdcp.read_manifest(path)["step"] == 2
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the save is committed, but the checkpoint it replaced could not be removed" in done.stdout, done.stdout
    assert json.loads((path / "manifest.json").read_text())["save_id"] != old
    tdcp.verify(path)
    _save(path, 1)  # the next save to the directory sweeps the leftover
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["step-1"]


def test_a_manifest_that_cannot_be_read_now_is_raised_never_skipped_for_an_older_step(tmp_path: Path) -> None:
    """The newest entry's manifest unreadable (EACCES): ``latest`` and ``resume`` took it for absent and resumed the
    step before, silently; a load said there was no manifest. A read that fails now is raised, naming the file and
    what to check (docs/archive.md, Rotation)."""
    run = tmp_path / "run"
    rotation = tdcp.CheckpointRotation(run)
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2), no_dist=True)
    rotation.save(ckpt, step=1)
    rotation.save(ckpt, step=2)
    manifest = run / "step-000000000002" / "manifest.json"
    manifest.chmod(0)
    done = _run_without_permission_bypass(
        f"""
        import torch, torchrl_dcp as tdcp
        rotation = tdcp.CheckpointRotation({str(run)!r})
        ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2), no_dist=True)
        for action in (rotation.latest, lambda: rotation.resume(ckpt), lambda: ckpt.load({str(manifest.parent)!r})):
            try:
                print("returned", action())
            except tdcp.CheckpointError as err:
                print("raised", type(err).__name__, err)
        """
    )
    manifest.chmod(0o644)
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("raised CheckpointError ") for line in lines), done.stdout
    assert all("step-000000000002/manifest.json" in line and "Permission denied" in line for line in lines)
    assert all("check the permissions" in line for line in lines)


def test_a_save_over_a_checkpoint_whose_manifest_cannot_be_read_says_so(tmp_path: Path) -> None:
    """Refused (as it must be: it cannot be proven ours), the save said "exists and is not a torchrl_dcp checkpoint"
    of a checkpoint whose manifest the process may not read, where a load says "permission denied"."""
    path = tmp_path / "ckpt"
    _save(path, 1)
    (path / "manifest.json").chmod(0o000)
    try:
        done = _run_without_permission_bypass(
            f"""
            import torch, torchrl_dcp as tdcp
            try:
                tdcp.DistributedCheckpoint(policy=torch.nn.Linear(3, 2), no_dist=True).save({str(path)!r}, step=2)
            except tdcp.CheckpointError as err:
                print(err)
            """
        )
    finally:
        (path / "manifest.json").chmod(0o644)
    assert "holds a checkpoint that cannot be read" in done.stdout and "permission" in done.stdout, done.stdout
    assert tdcp.read_manifest(path)["step"] == 1

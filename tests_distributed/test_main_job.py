"""The README's main job under a real ``torchrun``: killed after a checkpoint, resumed, identical result."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests_distributed.launch import run_main, torchrun_module


def torchrun(*args: str, nproc: int = 2, timeout: float = 240) -> subprocess.CompletedProcess:
    return torchrun_module("torchrl_dcp.examples.demo", *args, nproc=nproc, timeout=timeout)


def finals(out: str) -> dict[str, str]:
    return dict(re.findall(r"rank (\d+) final step \d+ (weights \S+ seen \S+)", out))


@pytest.mark.slow
def test_demo_killed_and_resumed_matches_uninterrupted(tmp_path: Path) -> None:
    ref = run_main(
        "torchrl_dcp.examples.demo", "--steps", "40", "--save-every", "10", "--ckpt-dir", str(tmp_path / "ref")
    )
    assert ref.returncode == 0, ref.stdout + ref.stderr
    killed = torchrun(
        "--steps", "40", "--save-every", "10", "--kill-at-step", "25", "--ckpt-dir", str(tmp_path / "run")
    )
    assert killed.returncode != 0 and "final step" not in killed.stdout
    resumed = torchrun("--steps", "40", "--save-every", "10", "--resume", "--ckpt-dir", str(tmp_path / "run"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "step 20" in resumed.stdout
    assert finals(resumed.stdout) == finals(ref.stdout) and len(finals(ref.stdout)) == 2

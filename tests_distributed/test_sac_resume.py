"""The main job (multi-rank SAC) killed with SIGKILL after a checkpoint resumes bit for bit."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests_distributed.launch import run_main, torchrun_module

ARGS = [
    "--iterations",
    "24",
    "--save-every",
    "8",
    "--frames-per-batch",
    "32",
    "--batch-size",
    "32",
    "--buffer-size",
    "256",
    "--updates-per-batch",
    "2",
    "--hidden",
    "16",
]  # the buffer wraps around before the kill


def torchrun(*args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    return torchrun_module("torchrl_dcp.examples.sac", *ARGS, *args, nproc=nproc, timeout=timeout)


def forked(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """The same ``main`` on forked ranks (no torchrun start-up): for the runs nothing interrupts."""
    return run_main("torchrl_dcp.examples.sac", *ARGS, *args, nproc=nproc)


def finals(out: str) -> dict[str, dict[str, str]]:
    return {rank: dict(re.findall(r"(\w+)=(\w+)", rest)) for rank, rest in re.findall(r"rank (\d+) final (.*)", out)}


@pytest.mark.slow
def test_sac_killed_and_resumed_is_bit_exact(tmp_path: Path) -> None:
    ref = forked("--ckpt-dir", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    killed = torchrun("--ckpt-dir", str(tmp_path / "run"), "--kill-at", "13")
    assert killed.returncode != 0 and "final" not in killed.stdout
    resumed = forked("--ckpt-dir", str(tmp_path / "run"), "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from step-000000000008" in resumed.stdout
    expected, got = finals(ref.stdout), finals(resumed.stdout)
    assert sorted(expected) == ["0", "1"]
    for rank in expected:
        assert set(expected[rank]) == {
            "learner",
            "optimizer",
            "buffer",
            "trees",
            "scheduler",
            "sampled",
            "batch",
            "rng",
        }
        assert got[rank] == expected[rank], f"rank {rank} differs: {got[rank]} vs {expected[rank]}"
    assert expected["0"]["buffer"] != expected["1"]["buffer"]  # each rank has its own shard
    assert expected["0"]["learner"] == expected["1"]["learner"]  # the learner is replicated

"""The main job (multi-rank SAC) killed with SIGKILL after a checkpoint resumes bit for bit, its log included."""

from __future__ import annotations

import csv
import importlib.util
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


def torchrun(*args: str, nproc: int = 2, timeout: float = 300, max_restarts: int = 0) -> subprocess.CompletedProcess:
    return torchrun_module(
        "torchrl_dcp.examples.sac", *ARGS, *args, nproc=nproc, timeout=timeout, max_restarts=max_restarts
    )


def forked(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """The same ``main`` on forked ranks (no torchrun start-up): for the runs nothing interrupts."""
    return run_main("torchrl_dcp.examples.sac", *ARGS, *args, nproc=nproc)


def finals(out: str) -> dict[str, dict[str, str]]:
    return {rank: dict(re.findall(r"(\w+)=(\w+)", rest)) for rank, rest in re.findall(r"rank (\d+) final (.*)", out)}


def progress(out: str) -> list[str]:
    """The progress lines without their timings: iteration, frames, the mean return and how many episodes it averages."""
    return re.findall(r"iteration +\d+ +frames +\d+ +return +\S+ per \d+-step episode \( *\d+ ended", out)


def curve(ckpt_dir: Path) -> list[dict[str, str]]:
    with open(ckpt_dir / "learning_curve.csv", newline="") as f:
        return list(csv.DictReader(f))


def assert_curve_continues(ref_dir: Path, run_dir: Path, resumed_at: int) -> None:
    """The resumed run's curve is the uninterrupted run's, with one ``resumed`` row and nothing logged twice."""
    ref, got = curve(ref_dir), curve(run_dir)
    assert [r["event"] for r in ref] == ["start"] + ["progress"] * (len(ref) - 1), ref
    resumed = [r for r in got if r["event"] == "resumed"]
    assert [r["iteration"] for r in resumed] == [str(resumed_at)], got
    assert [r for r in got if r["event"] != "resumed"] == ref  # rows a killed run logged after the checkpoint: dropped
    assert got.index(resumed[0]) == 1 + sum(int(r["iteration"]) <= resumed_at for r in ref[1:])  # in its place
    assert all(r["return"] for r in ref[1:])  # every progress row averages some episodes (the window is not empty)


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
            "episodes",
            "rng",
        }
        assert got[rank] == expected[rank], f"rank {rank} differs: {got[rank]} vs {expected[rank]}"
    assert expected["0"]["buffer"] != expected["1"]["buffer"]  # each rank has its own shard
    assert expected["0"]["learner"] == expected["1"]["learner"]  # the learner is replicated
    assert progress(resumed.stdout) == progress(ref.stdout)  # the return window continues across the resume
    assert_curve_continues(tmp_path / "ref", tmp_path / "run", resumed_at=8)


@pytest.mark.slow
def test_sac_learning_curve_and_return_window_continue_across_a_resume(tmp_path: Path) -> None:
    """A run that stopped after iteration 13 (its last checkpoint: 8) resumes with the curve and the return window
    of a run that never stopped: the progress lines after the resume average the episodes that ended before it
    (restored from the checkpoint), the rows logged after iteration 8 are replaced, the resume is marked."""
    ref = forked("--ckpt-dir", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    first = forked("--ckpt-dir", str(tmp_path / "run"), "--iterations", "13")  # logs iterations 10 and 13, saves 8
    assert first.returncode == 0, first.stdout + first.stderr
    assert [r["iteration"] for r in curve(tmp_path / "run")] == ["0", "10", "13"]
    resumed = forked("--ckpt-dir", str(tmp_path / "run"), "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from step-000000000008" in resumed.stdout
    lines = progress(ref.stdout)
    assert [line.split()[1] for line in lines] == ["10", "20", "24"]
    assert progress(resumed.stdout) == lines  # the window at 10 holds the episodes of iterations 1-8 too
    assert_curve_continues(tmp_path / "ref", tmp_path / "run", resumed_at=8)
    assert finals(resumed.stdout) == finals(ref.stdout)
    png = (tmp_path / "ref" / "learning_curve.png").is_file()
    assert png == (importlib.util.find_spec("matplotlib") is not None)  # the plot only with the optional matplotlib


@pytest.mark.slow
def test_sac_under_max_restarts_resumes_from_the_local_tier_and_finishes_bit_exact(tmp_path: Path) -> None:
    """``torchrun --max-restarts 1`` with a node-local tier: both workers SIGKILLed after iteration 13, restarted by
    the agent, resumed from local iteration 12 (the shared tier holds 8), finishing as the run that never stopped."""
    ref = forked("--ckpt-dir", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    local = ["--local-dir", str(tmp_path / "local"), "--local-every", "3"]
    run = torchrun("--ckpt-dir", str(tmp_path / "run"), *local, "--kill-at", "13", max_restarts=1)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "resumed from the local tier (iteration 12" in run.stdout
    assert finals(run.stdout) == finals(ref.stdout)


@pytest.mark.slow
def test_a_resume_from_the_local_tier_adopts_that_steps_options(tmp_path: Path) -> None:
    """``--resume`` read the saved options from the shared tier's newest entry only: resuming a local-tier step
    (the shared tier holding none yet) trained with the options of the command line, silently, and recorded the
    saved ones. The options are read from the step the resume restores."""
    local = ["--local-dir", str(tmp_path / "local"), "--local-every", "3"]
    run = str(tmp_path / "run")
    killed = torchrun("--ckpt-dir", run, *local, "--save-every", "100", "--kill-at", "7")
    assert killed.returncode != 0 and not any((tmp_path / "run").glob("step-*")), killed.stdout[-2000:]
    resumed = torchrun("--ckpt-dir", run, *local, "--updates-per-batch", "3", "--resume", "--iterations", "9")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "note: --updates-per-batch 3 ignored: the run was trained with 2" in resumed.stdout, resumed.stdout
    assert "resumed from the local tier (iteration 6" in resumed.stdout, resumed.stdout

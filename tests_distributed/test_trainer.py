"""torchrl's SACTrainer with DistributedCheckpoint + CheckpointRotation: placed right, resumes bit for bit."""

from __future__ import annotations

import ast
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from tests_distributed.launch import ROOT, run_main, torchrun_command


def torchrun(*args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """The example's ``main`` on forked ranks (what torchrun runs; the preemption case below uses torchrun itself)."""
    return run_main(
        "torchrl_dcp.examples.sac_trainer",
        "--frames-per-batch",
        "32",
        "--save-every",
        "128",
        "--hidden",
        "16",
        *args,
        nproc=nproc,
        timeout=timeout,
    )


def finals(out: str) -> dict[str, tuple[str, ...]]:
    pattern = r"rank (\d+) final learner=(\w+) optimizer=(\w+) buffer=(\w+) trees=(\w+) rng=(\w+) frames=(\d+)"
    return {m[0]: m[1:] for m in re.findall(pattern, out)}  # ranks' lines may interleave


@pytest.mark.slow
def test_sac_trainer_resumes_from_scheduled_and_preemption_checkpoints(tmp_path: Path) -> None:
    ref = torchrun("--frames", "512", "--ckpt-dir", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stdout + ref.stderr
    placements = ast.literal_eval(re.search(r"placements: (\{.*\})", ref.stdout).group(1))
    assert placements["replay_buffer"] == placements["collector"] == placements["rng"] == "per_rank"
    assert placements["policy"] == placements["loss_module"] == placements["optimizer"] == "replicated"
    assert placements["trainer_state"] == "replicated"

    first = torchrun("--frames", "256", "--ckpt-dir", str(tmp_path / "run"))
    assert first.returncode == 0, first.stdout + first.stderr
    entries = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert entries == ["step-000000000128", "step-000000000256"]  # scheduled saves, newest 2 kept
    manifest = tdcp.read_manifest(tmp_path / "run" / entries[-1])
    assert manifest["world_size"] == 2 and manifest["step"] == 256
    # the actor is stored once: the loss module's actor parameters refer to the policy component's
    assert "'xref'" in str(manifest["components"]["loss_module"]["state"])

    resumed = torchrun("--frames", "512", "--ckpt-dir", str(tmp_path / "run"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from frame 256" in resumed.stdout
    assert finals(resumed.stdout) == finals(ref.stdout) and len(finals(ref.stdout)) == 2

    # SIGTERM to torchrun at a random moment after the first scheduled save (async saves: one may be in flight):
    # the Trainer ends the iteration, saves it on every rank, leaves train(); the resume matches the reference
    seed = random.randrange(1 << 30)
    run = tmp_path / "preempted"
    cmd, env = torchrun_command(
        "torchrl_dcp.examples.sac_trainer", "--frames-per-batch", "32", "--save-every", "128", "--hidden", "16",
        "--frames", "512", "--async-saves", "--ckpt-dir", str(run),
    )  # fmt: skip
    agent = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run / "step-000000000128").exists():
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[0]
            time.sleep(0.01)
        time.sleep(random.Random(seed).uniform(0, 0.5))
        agent.send_signal(signal.SIGTERM)
        log = agent.communicate(timeout=120)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    note = f"(seed {seed})\n{log[-4000:]}"
    stopped = re.search(r"preempted: saved frame (\d+)", log)
    assert stopped is not None and "[rank" not in log and "exitcode" not in log, note  # workers left cleanly
    frame = int(stopped.group(1))
    assert 128 <= frame < 512 and len(finals(log)) == 2, note
    assert tdcp.CheckpointRotation(run).entries()[-1].step == frame, note
    again = torchrun("--frames", "512", "--async-saves", "--ckpt-dir", str(run))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from frame {frame}" in again.stdout, note
    assert finals(again.stdout) == finals(ref.stdout), note


@pytest.mark.slow
@pytest.mark.parametrize("new_world", [1, 3])
def test_trainer_checkpoint_with_hooks_and_logger_reshards(tmp_path: Path, new_world: int) -> None:
    """Hooks (``trainer_module.*``) and the logger are per rank and reshard: rank r takes saved rank r % 2's."""
    first = torchrun("--frames", "128", "--hooks", "--ckpt-dir", str(tmp_path / "run"))
    assert first.returncode == 0, first.stdout + first.stderr
    manifest = tdcp.read_manifest(tmp_path / "run" / "step-000000000128")
    placements = {n: c["placement"] for n, c in manifest["components"].items()}
    assert placements["trainer_module.lr_scheduler"] == "replicated"  # the learner's schedule: the same everywhere
    assert placements["trainer_module.count_frames_log"] == "per_rank"
    assert placements["logger"] == "per_rank"
    resumed = torchrun(
        "--frames", "192", "--hooks", "--reshard", "--ckpt-dir", str(tmp_path / "run"), nproc=new_world
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from frame 128" in resumed.stdout
    lrs = set(re.findall(r"rank \d+ final .* lr=(\S+)", resumed.stdout))
    assert len(re.findall(r"rank \d+ final", resumed.stdout)) == new_world
    assert len(lrs) == 1  # the LR schedule continued from the replicated value on every new rank

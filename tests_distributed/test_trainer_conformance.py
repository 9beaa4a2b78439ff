"""Every Trainer torchrl ships, on 2 ranks: SIGKILL after a scheduled save, resume in fresh processes, bit-exact.

The cases are generated from ``torchrl.trainers.algorithms`` (:func:`trainer_zoo.trainer_classes`): a Trainer
class torchrl adds is a failing case until ``trainer_zoo.BUILDERS`` builds it, or a skip with its reason. Each case
runs the job three times on forked ranks (:mod:`tests_distributed.scenarios_trainers`): straight to the end; again,
SIGKILLed by itself right after the first scheduled save committed on every rank; and resumed from that save.
Compared per rank:

- the state audit of the whole Trainer (:mod:`torchrl_dcp.audit`) at the save and right after the restore: every
  reachable attribute equal (parameters, optimizer, buffer rows, sampler, writer, env and transforms, hooks,
  counters), but for what :data:`torchrl_dcp.audit.NOT_STATE` lists with its reason;
- every iteration after the resume point against the straight run's: the collected batch and the learner;
- at the end: the audit of the whole Trainer, the counters, and the next draws of the torch, NumPy and Python RNGs.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from tests_distributed.launch import launch
from tests_distributed.scenarios_trainers import SAVE_EVERY, TOTAL_FRAMES
from tests_distributed.trainer_zoo import BUILDERS, SKIPS, trainer_classes
from torchrl_dcp.audit import state_differences

CLASSES = sorted(trainer_classes())
WORLD = 2


def _run(kind: str, ckpt: Path, mode: str, out: Path, variant: str = "") -> list:
    return launch(
        "tests_distributed.scenarios_trainers:run", WORLD, kind, str(ckpt), mode, str(out), variant, timeout=240,
        expect_failure=mode == "kill",
    )  # fmt: skip


def _listed(differences: list) -> str:
    return "\n".join(str(d) for d in differences[:40]) + (
        f"\n... {len(differences) - 40} more" * (len(differences) > 40)
    )


def test_every_trainer_class_torchrl_ships_is_built_or_skipped_with_a_reason() -> None:
    named = {"SACTrainer", "PPOTrainer", "A2CTrainer", "ReinforceTrainer", "DQNTrainer", "DDPGTrainer", "TD3Trainer"}
    named |= {"IQLTrainer", "CQLTrainer", "OfflineToOnlineTrainer"}
    assert named <= set(CLASSES)  # the enumeration finds (at least) every trainer the issue names
    assert not set(BUILDERS) & set(SKIPS)
    assert set(CLASSES) <= set(BUILDERS) | set(SKIPS), f"not covered: {set(CLASSES) - set(BUILDERS) - set(SKIPS)}"


@pytest.mark.slow
@pytest.mark.parametrize("kind", CLASSES)
def test_trainer_resumes_bit_exactly_after_a_kill(tmp_path: Path, kind: str) -> None:
    if kind in SKIPS:
        pytest.skip(SKIPS[kind])
    _check_kill_and_resume(tmp_path, kind)


@pytest.mark.slow
def test_a_trainer_logging_on_rank_0_alone_saves_and_resumes_bit_exactly(tmp_path: Path) -> None:
    """Rank 0 alone has a logger and logs an evaluation value (each rank's ``_last_log`` differs, one rank's
    ``logger`` is a ``NoLogger``): the saves are not refused, and every rank resumes its own logging schedule."""
    _check_kill_and_resume(tmp_path, "SACTrainer", variant="rank_0_logs")
    manifest = tdcp.read_manifest(tdcp.CheckpointRotation(tmp_path / "run").entries()[-1].path)
    assert manifest["components"]["trainer_rank_state"]["placement"] == manifest["components"]["logger"]["placement"]
    assert manifest["components"]["trainer_rank_state"]["placement"] == "per_rank"
    hook = manifest["components"]["trainer_module.count_frames_log"]  # (rank 0's hook: rank 1's state absent)
    assert hook["placement"] == "per_rank" and "_tdcp_absent_on_this_rank" in str(hook["ranks"]["1"])
    logged = json.loads((tmp_path / "out" / "straight.rank0.json").read_text())["final"]
    assert any("_last_log" in path and "eval" in path for path in logged), "rank 0 never logged: nothing tested"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["A2CTrainer", "ReinforceTrainer"])
def test_an_on_policy_trainer_of_one_epoch_resumes_where_its_buffer_iteration_stood(tmp_path: Path, kind: str) -> None:
    """torchrl's default ``num_epochs=1`` with as many optimisation steps as minibatches: each iteration's last
    batch runs the sampler out with the buffer's generator paused, so the next iteration draws nothing and trains
    nothing. The generator's position is saved (``trainer_rank_state``): a resumed Trainer trained that iteration
    with a fresh one, unlike the run that never stopped."""
    _check_kill_and_resume(tmp_path, kind, variant="one_epoch")
    manifest = tdcp.read_manifest(tmp_path / "run" / f"step-{SAVE_EVERY:012d}")
    assert "'paused'" in str(manifest["components"]["trainer_rank_state"]["ranks"])  # (what the test is about)


def _check_kill_and_resume(tmp_path: Path, kind: str, variant: str = "") -> None:
    out = tmp_path / "out"
    out.mkdir()
    _run(kind, tmp_path / "straight", "straight", out, variant)
    killed = _run(kind, tmp_path / "run", "kill", out, variant)
    assert [r.returncode for r in killed] == [-signal.SIGKILL] * WORLD, "\n".join(r.output[-3000:] for r in killed)
    _run(kind, tmp_path / "run", "resume", out, variant)
    for rank in range(WORLD):
        straight, saved, resumed = (json.loads((out / f"{m}.rank{rank}.json").read_text()) for m in (
            "straight", "kill", "resume"))  # fmt: skip
        assert saved["saved_step"] == resumed["resumed_step"] == SAVE_EVERY, (saved["saved_step"], resumed)
        restored = state_differences(saved["saved"], resumed["restored"])
        assert not restored, f"rank {rank}: the restore differs from the saved Trainer:\n{_listed(restored)}"
        after = [r for r in straight["records"] if r["frames"] > SAVE_EVERY]
        assert after and after[-1]["frames"] == TOTAL_FRAMES
        assert resumed["records"] == after, f"rank {rank}: training after the resume differs"
        assert resumed["counters"] == straight["counters"] and resumed["rng"] == straight["rng"]
        final = state_differences(straight["final"], resumed["final"])
        assert not final, f"rank {rank}: the Trainer at the end differs from the straight run's:\n{_listed(final)}"

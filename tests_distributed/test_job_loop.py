"""The job loop under ``torchrun``: SIGTERM to the agent at a random moment ends in one committed step, a clean exit
of every worker, and a resume bit-exact against a run that never stopped (also with an async save in flight)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from tests_distributed.launch import ROOT, launch, torchrun_command

MODULE = "tests_distributed.job_loop_train"
STEPS = 120


def ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def run(directory: Path, out: Path, *extra: str) -> list[dict]:
    """The loop without a signal (the reference and the resumes): forked ranks, the same code torchrun runs."""
    out.mkdir(parents=True, exist_ok=True)
    launch(f"{MODULE}:train", 2, "--dir", str(directory), "--out", str(out), "--steps", str(STEPS), *extra)
    return ranks(out)


def preempt(directory: Path, out: Path, trigger: str, delay: float, *extra: str) -> tuple[list[dict], str]:
    """Start the loop, send SIGTERM to the torchrun agent ``delay`` s after rank 0 logs a ``trigger`` line."""
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = torchrun_command(MODULE, "--dir", str(directory), "--out", str(out), "--steps", str(STEPS), *extra)
    agent = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    progress = out / "progress"
    deadline = time.monotonic() + 120
    try:
        while not (progress.exists() and any(line.startswith(trigger) for line in progress.read_text().splitlines())):
            assert agent.poll() is None, agent.communicate()[0]
            assert time.monotonic() < deadline, "the loop never reached its trigger"
            time.sleep(0.005)
        time.sleep(delay)
        agent.send_signal(signal.SIGTERM)
        log = agent.communicate(timeout=120)[0]
    finally:
        if agent.poll() is None:
            agent.kill()
    return ranks(out), log


def test_sigterm_to_torchrun_saves_one_step_exits_cleanly_and_resumes_exactly(tmp_path: Path) -> None:
    """One reference run; then, for a synchronous and an async rotation, SIGTERM at a random step (async: right
    after a background save started, so that it is in flight) and a resume compared with the reference."""
    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    reference = run(tmp_path / "ref", tmp_path / "ref-out")
    assert [r["last"] for r in reference] == [STEPS, STEPS] and not any(r["preempted"] for r in reference)
    for mode in ("sync", "async"):
        extra = ("--async-saves",) if mode == "async" else ()
        at = rnd.randrange(2, STEPS // 4 - 2) * 4 if mode == "async" else rnd.randrange(1, STEPS - 10)
        trigger = f"async {at}" if mode == "async" else f"step {at}"
        stopped, log = preempt(tmp_path / mode, tmp_path / f"{mode}-out", trigger, rnd.uniform(0, 0.01), *extra)
        note = f"({mode}, seed {seed}, signalled after {trigger!r})\n{log[-3000:]}"
        assert all(r["preempted"] for r in stopped), note
        step = stopped[0]["last"]
        assert [r["last"] for r in stopped] == [step, step] and at <= step < STEPS, note  # every rank, one step
        entries = tdcp.CheckpointRotation(tmp_path / mode).entries()
        assert entries[-1].step == step, note  # that step is committed, and is the newest
        # every worker left cleanly (the agent re-raises the signal it received: its own traceback and status)
        assert "[rank" not in log and "exitcode" not in log, note

        resumed = run(tmp_path / mode, tmp_path / f"{mode}-resume-out", *extra)
        assert [r["resumed_from"] for r in resumed] == [step, step], note
        assert [r["digest"] for r in resumed] == [r["digest"] for r in reference], note


def test_a_subgroup_saves_and_loads_while_another_rank_works_alone(tmp_path: Path) -> None:
    results = launch("tests_distributed.scenarios_job_loop:subgroup_saves_and_loads", 3, str(tmp_path), timeout=120)
    learners = [r.value for r in results[1:]]
    assert [(v["group_rank"], v["world"]) for v in learners] == [(0, 2), (1, 2)]
    assert all(v["loaded"] == v["saved"] and v["step"] == 5 for v in learners)
    assert learners[0]["saved"] != learners[1]["saved"]  # each rank's own buffer came back to it
    manifest = tdcp.read_manifest(tmp_path / "step-000000000005")
    assert manifest["world_size"] == 2
    assert all(r.value["later_groups"] for r in results)  # groups made by every rank afterwards: no deadlock
    assert tdcp.read_manifest(tmp_path / "world")["world_size"] == 3
    # errors name a group's ranks with their global ranks (said "rank 1" of global rank 2, where global 1 is another)
    differs, restore, steps, layouts = learners[0]["named"]
    assert "differs between rank 0 (global rank 1) and rank 1 (global rank 2)" in differs, differs
    assert "rank 1 (global rank 2) failed while restoring components" in restore, restore
    assert "rank 1 (global rank 2) passed step 9, rank 0 (global rank 1) step 8" in steps, steps
    assert "rank 0 (global rank 1) saves" in layouts and "rank 1 (global rank 2) {" in layouts, layouts
    # probe c2: a rank new_group left out passed its placeholder (an int): "must be a ProcessGroup, got int"
    assert "rank 0 is not a member of the process_group given" in results[0].value["outsider"]


def test_a_no_dist_load_on_one_rank_returns_while_the_other_waits(tmp_path: Path) -> None:
    results = launch(
        "tests_distributed.scenarios_job_loop:lone_load_while_the_other_rank_waits", 2, str(tmp_path), timeout=120
    )
    assert results[0].value == {"rank": 0, "loaded": ["model"], "same": True, "world": 1}


def test_preemption_of_one_rank_and_rank_0s_clock_decide_for_every_rank(tmp_path: Path) -> None:
    results = launch("tests_distributed.scenarios_job_loop:decisions_are_agreed", 2, str(tmp_path), timeout=120)
    want = [None, None, "step-000000000003", "step-000000000004"]
    assert [r.value for r in results] == [{"rank": r, "saved": want, "preempted": True} for r in range(2)]


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_refused_keep_best_metric_on_one_rank_raises_on_every_rank_at_once(tmp_path: Path, bad_rank: int) -> None:
    results = launch("tests_distributed.scenarios_job_loop:metric_on_one_rank", 2, str(tmp_path), bad_rank, timeout=120)
    errors = [r.value["error"] for r in results]
    if bad_rank == 0:  # the recorded metric: the same ValueError everywhere
        assert errors == ["ValueError", "ValueError"], results
        assert all("keep_best needs a finite number" in r.value["message"] for r in results)
    else:  # rank 1's NaN metadata is not what the manifest records: the save commits rank 0's
        assert errors == [None, None], results
    assert [r.value["next"] for r in results] == ["step-000000000003"] * 2
    steps = [e.step for e in tdcp.CheckpointRotation(tmp_path).entries()]
    assert steps == ([1, 3] if bad_rank == 0 else [1, 2, 3])
    if bad_rank == 1:
        assert tdcp.read_manifest(tmp_path / "step-000000000002")["metadata"] == {"reward": 2.0}


@pytest.mark.parametrize("how", ["rotation", "handle"])
def test_a_background_failure_waited_for_on_one_rank_keeps_the_ranks_in_step(tmp_path: Path, how: str) -> None:
    results = launch(
        "tests_distributed.scenarios_job_loop:failure_waited_for_on_one_rank", 2, str(tmp_path), how, timeout=180
    )
    by_rank = {r.value["rank"]: r.value for r in results}
    assert [s for s, _ in by_rank[0]["errors"]] == [4, 6], by_rank  # its wait, then the next call, with rank 1
    assert [s for s, _ in by_rank[1]["errors"]] == [6], by_rank
    assert by_rank[0]["entries"] == by_rank[1]["entries"] == [2, 7, 8, 10], by_rank  # (a failed step stays due)


def test_groups_of_the_same_ranks_checkpoint_and_a_timed_out_save_does_not_end_checkpointing(tmp_path: Path) -> None:
    results = launch(
        "tests_distributed.scenarios_job_loop:two_groups_of_the_same_ranks_and_a_timed_out_save",
        2,
        str(tmp_path),
        timeout=120,
    )
    for r in results:
        assert r.value["late"].startswith("CollectiveError"), r.value["late"]
        assert r.value["after"] == [str(tmp_path / "after-0"), str(tmp_path / "after-1")]
        assert r.value["exact"]
    assert not (tmp_path / "late").exists()
    assert tdcp.read_manifest(tmp_path / "b")["world_size"] == 2


def test_another_checkpoint_loads_and_saves_while_one_saves_in_the_background(tmp_path: Path) -> None:
    results = launch(
        "tests_distributed.scenarios_job_loop:two_checkpoints_one_saving_in_the_background",
        2,
        str(tmp_path),
        timeout=120,
    )
    assert all(r.value["exact"] for r in results)


@pytest.mark.parametrize("where", ["agreement", "resume", "exited"])
def test_a_rank_absent_from_an_unmonitored_exchange_is_named(tmp_path: Path, where: str) -> None:
    """The per-step agreement of ``maybe_save`` runs without a monitored barrier (it would double its cost): a rank
    that never came was reported as "a rank died ... or did not answer". The ranks whose exchange failed now say in
    the job's store that they came, and name the others; a load's or resume's failure no longer says "nothing was
    committed" (nothing was being saved)."""
    results = launch(
        "tests_distributed.scenarios_job_loop:a_rank_absent_from_the_step_agreement",
        2,
        str(tmp_path / "run"),
        where,
        timeout=120,
    )
    message = results[0].value["message"]
    if where == "exited":  # its process ended: said at once, not as a rank that did not come within the timeout
        assert "a rank died" in message and "stuck" not in message, message
    else:
        assert message.startswith("rank 1 did not reach the checkpoint collective"), message
        assert "within 4 s: stuck or dead" in message, message
    if where == "resume":
        assert "committed" not in message and "Nothing was saved" in message, message
    else:
        assert "Nothing was committed" in message, message


@pytest.mark.parametrize("via", ["load", "resume"])
def test_a_rank_stuck_in_a_restore_leaves_every_other_rank_as_it_was(tmp_path: Path, via: str) -> None:
    """The exchange after the restore failed (rank 1 stuck inside a component's ``load_state_dict`` past the
    timeout): the other ranks raised with their own components restored (a counter, the RNG streams), where a
    failed load changes nothing. They now roll back before raising, and say so. A resume then voted on whether the
    entry was damaged over the broken group, and that vote's error (blaming rank 0, naming no rank) replaced the
    load's: the resume now raises the load's, naming rank 1."""
    results = launch(
        "tests_distributed.scenarios_job_loop:a_rank_stuck_in_a_restore", 3, str(tmp_path), via, timeout=120
    )
    assert results[0].value["message"].startswith("rank 1 did not reach the checkpoint collective (restoring")
    for r in (results[0], results[2]):
        assert "every component this rank restored was rolled back" in r.value["message"], r.value
        assert "exchanging status" not in r.value["message"], r.value
        assert r.value["counter"] == 7 and r.value["rng_kept"], r.value


def test_arguments_one_rank_refuses_are_refused_on_every_rank_and_the_ranks_stay_in_step(tmp_path: Path) -> None:
    """A float step on rank 1 alone raised there, before the first exchange: rank 0 waited in the save and paired
    with rank 1's next call, and every later save and load failed. Rank 0's metadata alone naming the step was
    refused ("the ranks do not save alike"), where other ranks' metadata is ignored. Ranks passing other steps to
    maybe_save took other decisions, rank 0 then blaming rank 1 as stuck."""
    zero, one = (r.value for r in launch("tests_distributed.scenarios_job_loop:arguments_refused_on_one_rank", 2,
                                         str(tmp_path), timeout=120))  # fmt: skip
    assert one["save"].startswith("TypeError") and one["load"].startswith("ValueError"), one
    assert zero["save"].startswith("CollectiveError: rank 1 failed while encoding the state: TypeError"), zero
    assert zero["load"].startswith("CollectiveError: rank 1 failed while validating the checkpoint: ValueError"), zero
    for r in (zero, one):
        assert r["save again"] == r["load again"] == r["rank 0's metadata"] == r["maybe_save again"] == "ok", r
        assert r["saved step"] == 7, r
        assert "rank 1 passed step 19, rank 0 step 20: every rank must pass the same step" in r["maybe_save"], r
        # a step refused on one rank (maybe_save's exchange, rotation.save's): raised there, named elsewhere, and the
        # next calls work (rank 1's float step used to leave rank 0 in the exchange, paired with rank 1's next call)
        assert r["maybe_save after"] == r["rotation.save after"] == "ok" and r["steps"] == [30, 50, 70], r
    assert one["maybe_save refused"].startswith("ValueError: step must be a non-negative integer, got 3.5"), one
    assert zero["maybe_save refused"].startswith("CollectiveError: rank 1 failed while agreeing whether to save"), zero
    assert zero["rotation.save refused"].startswith("ValueError: step must be a non-negative integer, got -1"), zero
    assert one["rotation.save refused"].startswith("CollectiveError: rank 0 failed while encoding the state"), one
    # where maybe_save exchanges nothing: a refused step that is due by the integer it spells (2.0), or forced, meets
    # the other rank's save (it went into the save alone, and every later call failed)
    for what in ("quiet due", "quiet forced"):
        assert one[what].startswith("ValueError: step must be a non-negative integer"), one
        assert zero[what].startswith("CollectiveError: rank 1 failed while encoding the state"), zero
    assert zero["quiet after"] == one["quiet after"] == "ok" and zero["quiet steps"] == [4], (zero, one)

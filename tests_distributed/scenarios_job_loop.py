"""Rank functions for tests_distributed/test_job_loop.py: a checkpoint of a subgroup, and a lone ``no_dist`` load."""

from __future__ import annotations

import datetime
import hashlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

import torchrl_dcp as tdcp


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _learner_and_buffer(seed: int) -> tuple[torch.nn.Module, ReplayBuffer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    buffer = ReplayBuffer(storage=LazyTensorStorage(64), batch_size=4)
    buffer.extend(TensorDict(obs=torch.randn(10 + seed % 7, 4), batch_size=[10 + seed % 7]))
    return model, buffer


def _state(model: torch.nn.Module, buffer: ReplayBuffer) -> str:
    storage = buffer._storage._storage
    return _digest(*model.state_dict().values(), storage["obs"][: len(buffer)], torch.tensor(len(buffer)))


def subgroup_saves_and_loads(directory: str) -> dict[str, Any]:
    """Ranks 1 and 2 checkpoint as a group of two while rank 0 works alone, blocked on a key they set at the end.

    Rank 0 never calls into the checkpoint: were any collective to need it, ranks 1 and 2 would wait for it
    while it waits for them (a hang, turned into a timeout).
    """
    rank = dist.get_rank()
    learners = dist.new_group([1, 2])  # the user's learner-only group (creating it involves every rank)
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        try:  # (``learners`` is new_group's placeholder here: said to be no member, not "got int")
            tdcp.DistributedCheckpoint(process_group=learners)
            outsider = None
        except ValueError as err:
            outsider = str(err)
        work = torch.zeros(()).add_(sum(range(1000)))  # its own work
        store.wait(["learners-done"], datetime.timedelta(seconds=60))
        dist.barrier()
        return {
            "rank": 0,
            "work": float(work),
            "later_groups": _groups_after_a_subgroup(directory),
            "outsider": outsider,
        }
    model, buffer = _learner_and_buffer(7)  # the learner: the same on both ranks
    _, buffer = _learner_and_buffer(100 + rank)  # its own buffer
    ckpt = tdcp.DistributedCheckpoint(process_group=learners, timeout=30, model=model)
    ckpt.register("buffer", buffer)
    saved = _state(model, buffer)
    rotation = tdcp.CheckpointRotation(directory, keep_last=1, every_steps=5)
    assert rotation.maybe_save(ckpt, 5) is not None
    group_rank = ckpt.rank
    fresh_model, fresh_buffer = _learner_and_buffer(55)
    fresh = tdcp.DistributedCheckpoint(process_group=learners, model=fresh_model)
    fresh.register("buffer", fresh_buffer)
    info = rotation.resume(fresh)
    loaded = _state(fresh_model, fresh_buffer)
    named = _ranks_named_in_a_subgroup(learners, directory, rank)
    dist.barrier(group=learners)
    if rank == 1:
        store.set("learners-done", "1")
    dist.barrier()
    return {"rank": rank, "group_rank": group_rank, "world": ckpt.world_size, "saved": saved, "loaded": loaded,
            "step": info.step, "later_groups": _groups_after_a_subgroup(directory), "named": named}  # fmt: skip


def _ranks_named_in_a_subgroup(learners: Any, directory: str, rank: int) -> list[str]:
    """What the errors of the group's ranks 0 and 1 (global 1 and 2) say: a replicated value that differs, and a
    restore that raises on group rank 1."""
    said = []
    differs = tdcp.DistributedCheckpoint(process_group=learners, timeout=30, cfg={"lr": float(rank)})
    try:
        differs.save(f"{directory}/differs", step=1)
    except tdcp.CheckpointError as err:
        said.append(str(err))
    counter = _Stuck(stuck=False)
    ckpt = tdcp.DistributedCheckpoint(process_group=learners, timeout=30)
    ckpt.register("counter", counter, placement="per_rank")
    ckpt.save(f"{directory}/counter", step=1)
    counter.load_state_dict = _raising if rank == 2 else counter.load_state_dict  # type: ignore[method-assign]
    try:
        ckpt.load(f"{directory}/counter")
    except tdcp.CheckpointError as err:
        said.append(str(err))
    # probe t1: steps (and so save paths) differing between the ranks, said as bare group ranks
    for kw in ({"preemption_signals": ("SIGUSR1",)}, {}):  # (decided together; decided alone, then the save)
        rotation = tdcp.CheckpointRotation(f"{directory}/steps-{len(said)}", every_steps=1, **kw)
        try:
            rotation.maybe_save(tdcp.DistributedCheckpoint(process_group=learners, timeout=30, n={"n": 1}), 7 + rank)
        except tdcp.CheckpointError as err:
            said.append(str(err))
        rotation.close()
    return said


def _raising(state: dict[str, Any]) -> None:
    raise RuntimeError("this restore fails")


def _groups_after_a_subgroup(directory: str) -> bool:
    """Groups every rank creates after the subgroup's checkpoints: the user's own, and a world-wide checkpoint's
    (the subgroup's gloo group, made by its members only, once moved torch's group counter on them alone: the next
    group got other names on other ranks, a deadlock)."""
    timeout = datetime.timedelta(seconds=20)
    dist.barrier(group=dist.new_group([0, 1, 2], timeout=timeout))
    tdcp.DistributedCheckpoint(timeout=20, stats={"n": 1}).save(f"{directory}/world", step=1)
    return True


def decisions_are_agreed(directory: str) -> dict[str, Any]:
    """Only rank 1 receives the preemption signal: both save that step. Only rank 1's clock says a save is due:
    neither saves (rank 0's clock decides); rank 0's says so: both save."""
    rank = dist.get_rank()
    model, buffer = _learner_and_buffer(3)
    ckpt = tdcp.DistributedCheckpoint(model=model)
    ckpt.register("buffer", buffer)
    rotation = tdcp.CheckpointRotation(directory, every_seconds=3600, preemption_signals=(signal.SIGUSR1,))
    seen = []
    for step in range(1, 6):
        if step == 2 and rank == 1:
            rotation._last_time -= 7200  # rank 1 alone believes an hour has passed
        if step == 3 and rank == 0:
            rotation._last_time -= 7200
        if step == 4 and rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        saved = rotation.maybe_save(ckpt, step)
        seen.append(None if saved is None else Path(saved).name)
        if rotation.preempted:
            break
    rotation.close()
    return {"rank": rank, "saved": seen, "preempted": rotation.preempted}


def lone_load_while_the_other_rank_waits(directory: str) -> dict[str, Any]:
    """Both ranks save; rank 0 converts to an archive and loads it alone (``no_dist``) while rank 1 waits at a
    barrier; a load that needed rank 1 would fail after the checkpoint's 20 s timeout."""
    rank = dist.get_rank()
    model, buffer = _learner_and_buffer(3)
    ckpt = tdcp.DistributedCheckpoint(model=model)
    ckpt.register("buffer", buffer)
    path = ckpt.save(f"{directory}/step-1", step=1)
    dist.barrier()
    if rank == 1:
        dist.barrier()
        return {"rank": 1}
    archive = tdcp.to_archive(path, f"{directory}/step-1.zip")
    evaluation, _ = _learner_and_buffer(99)
    lone = tdcp.DistributedCheckpoint(no_dist=True, timeout=20, model=evaluation)
    result = lone.load(archive, components=["model"])
    same = all(torch.equal(a, b) for a, b in zip(evaluation.state_dict().values(), model.state_dict().values()))
    dist.barrier()
    return {"rank": 0, "loaded": sorted(result.loaded), "same": same, "world": lone.world_size}


def metric_on_one_rank(directory: str, bad_rank: int) -> dict[str, Any]:
    """Each rank passes its own ``keep_best`` metric; one rank's is NaN (no episode finished yet). The manifest
    records rank 0's metadata: rank 0's refused metric raises the same ValueError on every rank at once (it raised
    on rank 0 alone, the other waiting in the save's collective until the timeout); another rank's NaN is neither
    recorded nor checked: the save commits (it was refused on every rank, so a rank whose episodes had not
    finished stopped the job's checkpoints)."""
    rank = dist.get_rank()
    model, _ = _learner_and_buffer(3)
    ckpt = tdcp.DistributedCheckpoint(model=model, timeout=60)
    rotation = tdcp.CheckpointRotation(directory, every_steps=1, keep_best=("reward", "max"))
    rotation.maybe_save(ckpt, 1, {"reward": 1.0})
    try:
        rotation.maybe_save(ckpt, 2, {"reward": float("nan") if rank == bad_rank else 2.0})
    except Exception as err:  # noqa: BLE001 - what each rank got is the result
        outcome = {"error": type(err).__name__, "message": str(err)[:300]}
    else:
        outcome = {"error": None}
    saved = rotation.maybe_save(ckpt, 3, {"reward": 3.0})  # the job goes on: the next step saves
    rotation.close()
    return {"rank": rank, **outcome, "next": None if saved is None else Path(saved).name}


def failure_waited_for_on_one_rank(directory: str, how: str) -> dict[str, Any]:
    """An async save fails in the background (a file of the user's where its entry goes); rank 0 alone waits for
    it (``rotation.wait()``, or the handle's ``wait()``: to evaluate the newest entry) and sees the failure. The
    next save raises it on every rank alike (rank 0 again), so the ranks stay in step: the saves after it commit.
    Rank 1 used to raise it alone, before any collective, and stay a call ahead of rank 0 for good."""
    rank = dist.get_rank()
    model, _ = _learner_and_buffer(3)
    ckpt = tdcp.DistributedCheckpoint(model=model, timeout=60)
    rotation = tdcp.CheckpointRotation(directory, every_steps=2, async_saves=True)
    if rank == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "step-000000000004").write_text("a file of the user's")
    dist.barrier()
    log = []
    for step in range(1, 11):
        try:
            handle = rotation.maybe_save(ckpt, step)
            if rank == 0 and step == 4:
                rotation.wait() if how == "rotation" else handle.wait()
        except tdcp.CheckpointError as err:  # a failed checkpoint does not stop training
            log.append([step, type(err).__name__])
    rotation.close()
    return {"rank": rank, "errors": log, "entries": [e.step for e in rotation.entries()]}


def two_groups_of_the_same_ranks_and_a_timed_out_save(directory: str) -> dict[str, Any]:
    """Two user groups of the same two ranks each checkpoint (their gloo groups once got one name: torch's
    ValueError); then a save that times out (rank 1 late) and saves on time after it (the timed-out gloo group was
    kept and every later save failed)."""
    rank = dist.get_rank()
    first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
    model = torch.nn.Linear(3, 2)
    a = tdcp.DistributedCheckpoint(process_group=first, timeout=3, model=model)
    b = tdcp.DistributedCheckpoint(process_group=second, timeout=3, model=model)
    a.save(f"{directory}/a")
    b.save(f"{directory}/b")
    if rank == 1:
        time.sleep(6)  # past the 3 s timeout: both ranks must raise
    try:
        a.save(f"{directory}/late")
        late = "saved"
    except tdcp.CollectiveError as err:
        late = f"CollectiveError: {err}"
    dist.barrier()
    after = []
    for step in range(2):
        after.append(str(a.save(f"{directory}/after-{step}")))
    fresh = torch.nn.Linear(3, 2)
    tdcp.DistributedCheckpoint(process_group=second, timeout=3, model=fresh).load(f"{directory}/after-1")
    return {"late": late, "after": after, "exact": torch.equal(fresh.weight, model.weight)}


def two_checkpoints_one_saving_in_the_background(directory: str) -> dict[str, Any]:
    """One checkpoint's async save in flight while another checkpoint object (one timeout: one gloo group) loads
    and saves: its collectives waited for the background ones (they interleaved: both stalled to the timeout)."""
    model = torch.nn.Linear(64, 64)
    a = tdcp.DistributedCheckpoint(timeout=20, model=model)
    b = tdcp.DistributedCheckpoint(timeout=20, model=model)
    b.save(f"{directory}/b0")
    saved = model.weight.detach().clone()
    for _ in range(3):
        handle = a.async_save(f"{directory}/a{_}")
        with torch.no_grad():
            model.weight.add_(1)
        b.load(f"{directory}/b0")  # while a's save is (or may be) in flight
        b.save(f"{directory}/b{_ + 1}")
        handle.wait()
    a.close()
    return {"exact": torch.equal(model.weight, saved), "verified": [str(tdcp.verify(f"{directory}/a2")["path"])]}


def a_rank_absent_from_the_step_agreement(root: str, where: str) -> dict[str, Any]:
    """Rank 1 never reaches the rotation's per-step agreement (``maybe_save``, no monitored barrier there) or a
    resume's listing: the others' errors name it, and a resume's says nothing was saved."""
    rank = dist.get_rank()
    ckpt = tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2), timeout=4)
    rotation = tdcp.CheckpointRotation(root, every_steps=100, preemption_signals=("SIGUSR1",))
    rotation.maybe_save(ckpt, 1)  # (the checkpoint groups exist: the next failure is the exchange's own)
    rotation.save(ckpt, step=1)
    if rank == 1:
        if where != "exited":  # (exited: its process ends at once)
            time.sleep(20)
        return {"message": None}
    try:
        if where in ("agreement", "exited"):
            rotation.maybe_save(ckpt, 2)
        else:
            rotation.resume(ckpt)
    except tdcp.CollectiveError as err:
        return {"message": str(err)}
    return {"message": "no error"}


class _Counter:
    """A plain object with a state dict (restored through ``load_state_dict``, rolled back from a snapshot)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = state["n"]


class _Stuck(_Counter):
    """Blocks in ``load_state_dict`` on the rank told to (stuck past the checkpoint's timeout)."""

    def __init__(self, stuck: bool) -> None:
        super().__init__()
        self.stuck = stuck

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.stuck:
            time.sleep(10)
        super().load_state_dict(state)


def a_rank_stuck_in_a_restore(root: str, via: str) -> dict[str, Any]:
    """Rank 1 is stuck in a component's ``load_state_dict`` past the timeout, after the others restored theirs: the
    exchange after the restore fails, and every other rank rolls back what it restored before raising (``via``:
    ``load``, or a rotation's ``resume``, whose error must stay the load's)."""
    rank = dist.get_rank()
    counter, stuck = _Counter(), _Stuck(stuck=False)
    ckpt = tdcp.DistributedCheckpoint(timeout=4)
    ckpt.register("counter", counter)  # (restored first: registered first, not RNG-like)
    ckpt.register("rng", tdcp.RNGState())
    ckpt.register("stuck", stuck)
    counter.n = 5
    rotation = tdcp.CheckpointRotation(f"{root}/run")
    path = rotation.save(ckpt, step=1)
    counter.n = 7
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    stuck.stuck = rank == 1
    try:
        if via == "load":
            ckpt.load(path)
        else:
            rotation.resume(ckpt)
        message = "no error"
    except tdcp.CheckpointError as err:
        message = str(err)
    return {"message": message, "counter": counter.n, "rng_kept": torch.equal(torch.get_rng_state(), rng_before)}


def arguments_refused_on_one_rank(root: str) -> dict[str, Any]:
    """Arguments one rank alone refuses at the call (a float step, an unknown world_size_change), rank 0's metadata
    alone naming the step, and ranks passing other steps to maybe_save: every rank raises or saves alike, and the
    next calls on every rank work (the ranks used to stay one call apart for good)."""
    rank = dist.get_rank()
    ckpt = tdcp.DistributedCheckpoint(timeout=20, stats={"n": 1})
    out: dict[str, Any] = {}

    def attempt(what: str, call: Any) -> None:
        try:
            call()
            out[what] = "ok"
        except Exception as err:  # noqa: BLE001 - what each rank saw is the result
            out[what] = f"{type(err).__name__}: {err}"

    attempt("save", lambda: ckpt.save(f"{root}/c", step=2.5 if rank == 1 else 2))
    attempt("save again", lambda: ckpt.save(f"{root}/c", step=2))
    attempt("load", lambda: ckpt.load(f"{root}/c", world_size_change="bogus" if rank == 1 else "error"))
    attempt("load again", lambda: ckpt.load(f"{root}/c"))
    attempt("rank 0's metadata", lambda: ckpt.save(f"{root}/m", metadata={"step": 7} if rank == 0 else None))
    out["saved step"] = tdcp.read_manifest(f"{root}/m")["step"] if out["rank 0's metadata"] == "ok" else None
    rotation = tdcp.CheckpointRotation(f"{root}/run", every_steps=10, preemption_signals=("SIGUSR1",))
    attempt("maybe_save", lambda: rotation.maybe_save(ckpt, 20 if rank == 0 else 19))
    attempt("maybe_save again", lambda: rotation.maybe_save(ckpt, 30))
    attempt("maybe_save refused", lambda: rotation.maybe_save(ckpt, 3.5 if rank == 1 else 40))
    attempt("maybe_save after", lambda: rotation.maybe_save(ckpt, 50))
    attempt("rotation.save refused", lambda: rotation.save(ckpt, step=-1 if rank == 0 else 60))
    attempt("rotation.save after", lambda: rotation.save(ckpt, step=70))
    rotation.close()
    out["steps"] = [e.step for e in rotation.entries()]
    quiet = tdcp.CheckpointRotation(f"{root}/quiet", every_steps=1)  # no exchange in maybe_save's decision
    attempt("quiet due", lambda: quiet.maybe_save(ckpt, 2.0 if rank == 1 else 2))
    attempt("quiet forced", lambda: quiet.maybe_save(ckpt, 2.5 if rank == 1 else 3, force=True))
    attempt("quiet after", lambda: quiet.maybe_save(ckpt, 4))
    out["quiet steps"] = [e.step for e in quiet.entries()]
    return out

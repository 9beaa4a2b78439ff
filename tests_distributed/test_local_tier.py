"""The node-local tier on real ranks of one node: a save never loses a step to the node leader's prune, and a local
resume is all or nothing across ranks.

Each test runs its per-rank program (the functions below, started by :func:`tests_distributed.launch.launch`) on two
gloo ranks of one "node" (rank 0 is its leader, which prunes the node's tier). Interleavings are forced with
signal files, not with timing.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchrl_dcp as tdcp
from tests_distributed.launch import launch
from torchrl_dcp import local_tier

S = "tests_distributed.test_local_tier"


def test_the_leaders_prune_never_deletes_the_step_another_rank_of_its_node_is_writing(tmp_path: Path) -> None:
    zero, one = (r.value for r in launch(f"{S}:prune_while_the_next_step_is_written", 2, str(tmp_path)))
    assert zero["error"] is None and one["error"] is None
    both = ["rank-00000", "rank-00000.commit.json", "rank-00001", "rank-00001.commit.json"]
    assert zero["step_2"] == both  # rank 1's part, written while the leader pruned after step 1, is still there
    assert zero["steps"] == [1, 2]  # keep_last=2: the step before the newest stays
    assert zero["resumed"] == one["resumed"] == [2, "local"]


def test_a_local_resume_that_fails_on_one_rank_changes_nothing_on_any_rank(tmp_path: Path) -> None:
    """Rank 1's restore raises: every rank rolls back and the shared tier is next. It holds nothing yet, so every rank
    raises rank 1's error, and the local steps are kept (the resume started fresh and deleted them: the job's only
    checkpoints, gone for a failure that is not damage, such as a component registered since)."""
    zero, one = (r.value for r in launch(f"{S}:resume_fails_on_one_rank", 2, str(tmp_path), "restore_fails_on_rank_1"))
    assert zero["resumed"] is None and one["resumed"] is None
    for res in (zero, one):
        assert "injected failure on rank 1" in res["error"] and "the local tier's steps are kept" in res["error"]
    assert zero["steps"] == one["steps"] == [2, 3]  # (keep_last=2)
    assert zero["unchanged"] and one["unchanged"]  # not rank 0 restored and rank 1 fresh: both as they were


def test_a_part_damaged_on_one_rank_resumes_the_previous_local_step_on_every_rank(tmp_path: Path) -> None:
    """Rank 1's part of step 3 fails its verified load (its only copy: one node): step 2, which every rank holds
    whole, is the newest step every rank can obtain; never the shared tier's older one (here: none, a fresh start),
    and every rank is told which part failed."""
    zero, one = (r.value for r in launch(f"{S}:resume_fails_on_one_rank", 2, str(tmp_path), "part_damaged_on_rank_1"))
    assert zero["resumed"] == one["resumed"] == [2, "local"], (zero, one)
    assert zero["as_at_step_2"] and one["as_at_step_2"]
    assert zero["warned"] == one["warned"] and len(zero["warned"]) == 1, zero["warned"]
    assert "step 3" in zero["warned"][0] and "rank 1's part (its own copy) is damaged" in zero["warned"][0]
    assert "step 2 is next" in zero["warned"][0]


@pytest.mark.parametrize(
    "damaged", ["own copy", "every copy", "replica unreadable", "manifests", "user's directory", "linked step"]
)
def test_a_damaged_local_part_is_taken_from_its_replica_on_another_node(tmp_path: Path, damaged: str) -> None:
    """Two nodes, each rank's part of step 2 also on the other node. Rank 1's own copy fails its verified load (a
    flipped byte in a data file): rank 1 receives the replica from rank 0 and every rank resumes step 2, as when its
    node lost the part; with the replica damaged too (or unreadable: the send failed, which sent every rank to the
    shared tier and deleted the intact step 1), step 1, never the shared tier (which holds nothing). Parts whose
    manifests are damaged do not count, and every rank is told (they were dropped with a log line). Probe g3: a
    directory of the user's where rank 1's part was (no checkpoint in it) is never replaced by the received replica
    (it was moved into a hidden staging directory): it stays, and step 1 is resumed."""
    zero, one = (r.value for r in launch(f"{S}:damaged_own_copy", 2, str(tmp_path), damaged))
    if damaged == "linked step":  # (probe i1: the replica was written through the link, into the user's directory)
        assert zero["resumed"] == one["resumed"] == [1, "local"], (zero, one)
        assert sorted(os.listdir(tmp_path / "users")) == ["eval.txt"]
        assert zero["exact"] and one["exact"]
        return
    if damaged == "user's directory":
        assert zero["resumed"] == one["resumed"] == [1, "local"], (zero, one)
        assert (tmp_path / "node-1" / "step-000000000002" / "rank-00001" / "eval.txt").read_text() == "mine"
        assert zero["exact"] and one["exact"]
        assert any("a directory that is not a checkpoint this tier replaces" in w for w in one["warned"]), one["warned"]
        return
    if damaged == "own copy":
        assert zero["resumed"] == [2, "local"] and one["resumed"] == [2, "peer"], (zero, one)
        assert "step 2 is tried again with the other copies" in zero["warned"][0], zero["warned"]
    else:
        assert zero["resumed"] == one["resumed"] == [1, "local"], (zero, one)
        assert any("step 1 is next" in w for w in zero["warned"]) or damaged == "manifests", zero["warned"]
    assert zero["exact"] and one["exact"]
    for warned in (zero["warned"], one["warned"]):  # (every rank is told; its tier's path differs here)
        if damaged == "manifests":
            assert "parts found damaged do not count" in warned[0], warned
            assert "step 2 rank 1's part: its manifest is not the one its commit record names" in warned[0], warned
        else:
            assert "rank 1's part (its own copy) is damaged" in warned[0] and "__0_0.distcp: checksum" in warned[0]


def test_a_local_resume_that_succeeds_on_every_rank_restores_every_rank(tmp_path: Path) -> None:
    zero, one = (r.value for r in launch(f"{S}:resume_fails_on_one_rank", 2, str(tmp_path), "none"))
    assert zero["resumed"] == one["resumed"] == [3, "local"]
    assert zero["restored"] and one["restored"]


def test_ranks_passing_different_steps_commit_nothing_and_are_told_which(tmp_path: Path) -> None:
    """Rank 1's counter is 3 ahead: the local save exchanged parts and committed rank 0's part of step 1, received
    on node 1, as a replica of step 4 (its record said 4, its manifest 1), and a resume loaded it as step 4. Now
    nothing is committed and every rank is told which ranks differ (rank 1's warning said "rank 1 step 1": its
    errors were reworded as if its own part's)."""
    zero, one = (r.value for r in launch(f"{S}:steps_differ", 2, str(tmp_path)))
    for res in (zero, one):
        assert res["steps"] == [], res
        assert len(res["warned"]) == 2 and all("rank 1 passed step 4, rank 0 step 1" in w for w in res["warned"][:1])
        assert "rank 1 passed step 5, rank 0 step 2" in res["warned"][1], res["warned"]


def test_ranks_whose_shared_save_is_due_on_one_only_are_told_and_raise_no_bare_error(tmp_path: Path) -> None:
    """Probe m7: rank 0's step made the shared save due, rank 1's did not (per-rank counters). With the local save
    made after the shared save chose its counter, the ranks met different exchanges: rank 1 read rank 0's answer as
    its own and raised a bare ValueError. The local save comes first on every rank: both are told the steps differ,
    and rank 0's shared save, alone, fails as a CheckpointError naming rank 1."""
    zero, one = (r.value for r in launch(f"{S}:shared_due_on_one_rank", 2, str(tmp_path)))
    for res in (zero, one):
        assert res["bare"] is None, res
        assert any("rank 1 passed step 3, rank 0 step 4" in w for w in res["warned"]), res
    assert zero["error"] is not None and "rank 1" in zero["error"] and one["error"] is None, (zero, one)


# ---------------------------------------------------------------------- per-rank programs
def _rotation(root: str, **kw: Any) -> tdcp.CheckpointRotation:
    local = tdcp.LocalTier(Path(root) / "local", every_steps=1, **kw)
    return tdcp.CheckpointRotation(Path(root) / "shared", every_steps=100, local=local)  # no shared save here


def _wait_for(signal: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not signal.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{signal.name} never came")
        time.sleep(0.01)


class _Fragile:
    """Per-rank state whose ``load_state_dict`` of a value other than its own fails when told to."""

    def __init__(self, value: float, fail: bool = False) -> None:
        self.value = torch.tensor([value])
        self.fail = fail

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.fail and not torch.equal(state["value"], self.value):  # (a rollback to its own value succeeds)
            raise RuntimeError(f"injected failure on rank {dist.get_rank()}")
        self.value.copy_(state["value"])


def _objects(seed: int, fail: bool = False) -> tuple[dict[str, Any], tdcp.DistributedCheckpoint]:
    rank = dist.get_rank()
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    objs = {"model": model, "optimizer": optimizer, "shard": {"seen": 100 * rank + seed}}
    objs["fragile"] = _Fragile(float(10 * rank + seed), fail)
    ckpt = tdcp.DistributedCheckpoint(model=model, optimizer=optimizer)
    ckpt.register("shard", objs["shard"], placement="per_rank")
    ckpt.register("fragile", objs["fragile"], placement="per_rank")
    ckpt.register("rng", tdcp.RNGState())
    return objs, ckpt


def _train_step(objs: dict[str, Any]) -> None:
    objs["model"](torch.randn(2, 4)).sum().backward()
    objs["optimizer"].step()
    objs["shard"]["seen"] += 1
    objs["fragile"].value += 1


def _fingerprint(objs: dict[str, Any]) -> list[Any]:
    return [
        [v.tolist() for v in objs["model"].state_dict().values()],
        [
            [t.tolist() if isinstance(t, torch.Tensor) else t for t in s.values()]
            for s in objs["optimizer"].state.values()
        ],
        dict(objs["shard"]),
        objs["fragile"].value.tolist(),
        torch.get_rng_state().tolist(),
    ]


def prune_while_the_next_step_is_written(root: str) -> dict[str, Any]:
    """Rank 0 (the node's leader) prunes after step 1 only once rank 1 has written its part of step 2, and rank 1
    goes on with step 2 only once that prune is done."""
    rank, signals = dist.get_rank(), Path(root) / "signals"
    signals.mkdir(parents=True, exist_ok=True)
    written, pruned = signals / "rank-1-wrote-its-part-of-step-2", signals / "rank-0-pruned-after-step-1"
    if rank == 0:
        real_prune = local_tier.LocalTier._prune

        def prune(self: local_tier.LocalTier, keep_from: int) -> None:
            if keep_from == 1:
                _wait_for(written)
            real_prune(self, keep_from)
            if keep_from == 1:
                pruned.touch()

        local_tier.LocalTier._prune = prune  # type: ignore[method-assign]
    else:
        real_save = tdcp.DistributedCheckpoint.save

        def save(self: tdcp.DistributedCheckpoint, path: Any, **kw: Any) -> Path:
            out = real_save(self, path, **kw)
            if self.no_dist and kw.get("step") == 2:  # the local tier's part of step 2 is published
                written.touch()
                _wait_for(pruned)
            return out

        tdcp.DistributedCheckpoint.save = save  # type: ignore[method-assign]
    objs, ckpt = _objects(1)
    rotation = _rotation(root)
    error = None
    try:
        for step in (1, 2):
            _train_step(objs)
            rotation.maybe_save(ckpt, step)
    except Exception as err:  # noqa: BLE001 - what each rank saw is the result
        error = f"{type(err).__name__}: {err}"
    rotation.close()
    dist.barrier()
    step_2 = Path(root) / "local" / "step-000000000002"
    listed = sorted(p.name for p in step_2.iterdir()) if step_2.is_dir() else None
    dist.barrier()
    info = _rotation(root).resume(_objects(2)[1])
    return {
        "error": error,
        "step_2": listed,
        "steps": rotation.local.steps(),
        "resumed": None if info is None else [info.step, info.tier],
    }


def resume_fails_on_one_rank(root: str, case: str) -> dict[str, Any]:
    """Three local steps, no shared one; then rank 1's part of step 3 is damaged (``part_damaged_on_rank_1``: it
    fails its verification) or its restore raises (``restore_fails_on_rank_1``), and fresh objects resume."""
    rank = dist.get_rank()
    objs, ckpt = _objects(1)
    rotation = _rotation(root)
    at_step: dict[int, list[Any]] = {}
    for step in (1, 2, 3):
        _train_step(objs)
        rotation.maybe_save(ckpt, step)
        at_step[step] = _fingerprint(objs)
        dist.barrier()  # the leader's prune is done before the next save (its race: the test above)
    rotation.close()
    saved = _fingerprint(objs)
    dist.barrier()
    if case == "part_damaged_on_rank_1" and rank == 1:
        part = Path(root) / "local" / "step-000000000003" / "rank-00001"
        data = max((p for p in part.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    dist.barrier()
    fresh, fresh_ckpt = _objects(2, fail=case == "restore_fails_on_rank_1" and rank == 1)
    before = _fingerprint(fresh)
    info, error, rotation = None, None, _rotation(root)
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        try:
            info = rotation.resume(fresh_ckpt)
        except tdcp.CheckpointError as err:
            error = str(err)
    after = _fingerprint(fresh)
    return {
        "resumed": None if info is None else [info.step, info.tier],
        "error": error,
        "steps": rotation.local.steps(),
        "unchanged": after == before,
        "restored": after[:4] == saved[:4],
        "as_at_step_2": after[:4] == at_step[2][:4],
        "warned": [str(w.message) for w in heard if issubclass(w.category, tdcp.LocalTierWarning)],
    }


def _flip(part: Path, name: str | None = None) -> None:
    data = part / name if name else max(part.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))


def damaged_own_copy(root: str, damaged: str) -> dict[str, Any]:
    """Two nodes (each rank its own), local steps 1 and 2, each part replicated on the other node; then rank 1's own
    copy of its step-2 part is damaged (and, for ``every copy``, its replica on rank 0's node too)."""
    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank)

    def rotation() -> tdcp.CheckpointRotation:
        local = tdcp.LocalTier(Path(root) / f"node-{rank}", every_steps=1)
        return tdcp.CheckpointRotation(Path(root) / "shared", every_steps=100, local=local)

    objs, ckpt = _objects(1)
    saving = rotation()
    at_step: dict[int, list[Any]] = {}
    for step in (1, 2):
        _train_step(objs)
        saving.maybe_save(ckpt, step)
        at_step[step] = _fingerprint(objs)
        dist.barrier()
    saving.close()
    dist.barrier()
    own, replica = (Path(root) / f"node-{n}" / "step-000000000002" / "rank-00001" for n in (1, 0))
    if damaged == "manifests":  # both copies' manifests: neither part counts (their records name other bytes)
        if rank == 1:
            _flip(own, "manifest.json")
        else:
            _flip(replica, "manifest.json")
    elif damaged == "linked step":
        if rank == 1:  # (its node lost the step; a link to a directory of the user's was put in its place)
            shutil.rmtree(own.parent)
            (Path(root) / "users").mkdir()
            (Path(root) / "users" / "eval.txt").write_text("mine")
            own.parent.symlink_to(Path(root) / "users")
    elif damaged == "user's directory":
        if rank == 1:  # (its node lost the part; the user made a directory of their own there)
            shutil.rmtree(own)
            own.mkdir()
            (own / "eval.txt").write_text("mine")
    elif rank == 1:
        _flip(own)
    elif damaged == "every copy":
        _flip(replica)
    elif damaged == "replica unreadable":  # its data file replaced by a directory: the sender cannot send it
        data = max(replica.glob("*.distcp"), key=lambda p: p.stat().st_size)
        data.unlink()
        data.mkdir()
    dist.barrier()
    fresh, fresh_ckpt = _objects(2)
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        info = rotation().resume(fresh_ckpt)
    step = None if info is None else info.step
    return {
        "resumed": None if info is None else [info.step, info.tier],
        "exact": step is not None and _fingerprint(fresh) == at_step[step],
        "warned": [str(w.message) for w in heard if issubclass(w.category, tdcp.LocalTierWarning)],
    }


def damaged_newest_shared_entry(root: str) -> dict[str, Any]:
    """Local steps every 2 (keep_last=2), shared every 3, up to step 7: the local tier holds 4 and 6, the shared
    tier 3 and 6. Shared 6's data is damaged and local 6 lost on every node: the resume must take local 4 (newer than
    shared 3, which is all the shared tier still offers), never shared 3."""
    rank = dist.get_rank()
    objs, ckpt = _objects(1)
    local = tdcp.LocalTier(Path(root) / "local", every_steps=2)
    rotation = tdcp.CheckpointRotation(Path(root) / "shared", every_steps=3, local=local)
    for step in range(1, 8):
        _train_step(objs)
        rotation.maybe_save(ckpt, step)
        dist.barrier()
    rotation.close()
    dist.barrier()
    if rank == 0:  # bit rot in the shared tier's newest entry, and the local step 6 lost on every node
        for f in (Path(root) / "shared" / "step-000000000006").iterdir():
            if f.name.endswith(".distcp"):
                raw = bytearray(f.read_bytes())
                raw[len(raw) // 2] ^= 0xFF
                f.write_bytes(bytes(raw))
        import shutil

        shutil.rmtree(Path(root) / "local" / "step-000000000006")
    dist.barrier()
    fresh, fresh_ckpt = _objects(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the damaged entry is warned about)
        info = tdcp.CheckpointRotation(Path(root) / "shared", every_steps=3, local=local).resume(fresh_ckpt)
    return {"resumed": None if info is None else [info.step, info.tier], "local_steps": local.steps()}


def test_a_damaged_newest_shared_entry_resumes_the_newer_local_step_not_an_older_shared_one(tmp_path: Path) -> None:
    """The local step 4 was passed over for the shared tier's newest (6), which then proved damaged: the shared
    fallback (3) restored an older step and deleted local 4 as "newer than the one restored", where resume promises
    the newest step every rank can obtain from any tier."""
    zero, one = (r.value for r in launch(f"{S}:damaged_newest_shared_entry", 2, str(tmp_path)))
    assert zero["resumed"] == one["resumed"] == [4, "local"], (zero, one)
    assert zero["local_steps"] == one["local_steps"] == [4]


def steps_differ(root: str) -> dict[str, Any]:
    """Two nodes (each rank its own tier); rank 1 passes steps 3 more than rank 0's."""
    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank)
    objs, ckpt = _objects(1)
    rotation = _rotation(os.path.join(root, f"node{rank}"))
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        for step in (1, 2):
            _train_step(objs)
            rotation.maybe_save(ckpt, step + 3 * rank)
    rotation.close()
    return {
        "steps": rotation.local.steps(),
        "warned": [str(w.message) for w in heard if issubclass(w.category, tdcp.LocalTierWarning)],
    }


def shared_due_on_one_rank(root: str) -> dict[str, Any]:
    """Rank 0 passes step 4 (the shared save due, every 4), rank 1 step 3 (the local save only)."""
    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = str(rank)
    ckpt = tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 2), timeout=10)
    local = tdcp.LocalTier(Path(root) / f"node{rank}" / "local", every_steps=1)
    rotation = tdcp.CheckpointRotation(Path(root) / "shared", every_steps=4, local=local)
    error = bare = None
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        try:
            rotation.maybe_save(ckpt, 4 if rank == 0 else 3)
        except tdcp.CheckpointError as err:
            error = str(err)
        except Exception as err:  # noqa: BLE001 - what the test refuses
            bare = f"{type(err).__name__}: {err}"
    return {
        "error": error,
        "bare": bare,
        "warned": [str(w.message) for w in heard if issubclass(w.category, tdcp.LocalTierWarning)],
    }


def run_on_nodes(
    root: str, nodes: list[str], run: int, last_step: int, shared_every: int = 8, keep_last: int = 3
) -> dict[str, Any]:
    """Rank ``r`` on node ``nodes[r]`` (its tier ``node-<name>``): resume, then train to ``last_step`` with local
    saves every 2 steps and shared ones every ``shared_every``; the policy's weight says which run saved a step
    (100 * run + step)."""
    rank = dist.get_rank()
    os.environ["GROUP_RANK"] = nodes[rank]
    policy = torch.nn.Linear(2, 2)
    ckpt = tdcp.DistributedCheckpoint(policy=policy)
    local = tdcp.LocalTier(Path(root) / f"node-{nodes[rank]}", every_steps=2, keep_last=keep_last)
    rotation = tdcp.CheckpointRotation(Path(root) / "shared", every_steps=shared_every, keep_last=3, local=local)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (steps dropped as an abandoned future are warned about)
        info = rotation.resume(ckpt)
    resumed = None if info is None else [info.step, info.tier, float(policy.weight[0, 0])]
    for step in range(1 if info is None else info.step + 1, last_step + 1):
        with torch.no_grad():
            policy.weight.fill_(100 * run + step)
        rotation.maybe_save(ckpt, step)
    rotation.close()
    return {"resumed": resumed}


def test_a_node_back_with_an_abandoned_futures_steps_never_has_them_resumed(tmp_path: Path) -> None:
    """Run 1 (nodes A, B) saves local steps 10 and 12 (shared 8) and dies. Run 2 (A, its tier lost, and C; B away)
    resumes shared 8 and saves local 10. Run 3 (A, and B back with run 1's steps): run 1's step 12 was restored (the
    newest complete step, both naming shared commit 8), silently undoing run 2. A part saved before a later run
    resumed an older step is an abandoned future."""
    root = str(tmp_path)
    launch(f"{S}:run_on_nodes", 2, root, ["A", "B"], 1, 13)
    shutil.rmtree(tmp_path / "node-A")  # (rebooted: its tier empty)
    (tmp_path / "node-B").rename(tmp_path / "away")
    second = [r.value["resumed"] for r in launch(f"{S}:run_on_nodes", 2, root, ["A", "C"], 2, 11)]
    assert [s[:2] for s in second] == [[8, "shared"]] * 2, second
    (tmp_path / "away").rename(tmp_path / "node-B")
    third = [r.value["resumed"] for r in launch(f"{S}:run_on_nodes", 2, root, ["A", "B"], 3, 10)]
    assert [s[0] for s in third] == [10, 10] and [s[2] for s in third] == [210.0, 210.0], third


def test_a_run_resumed_from_the_local_tier_is_recorded_too(tmp_path: Path) -> None:
    """Run 1 (A, B) saves local 26, 28, 30 (shared 24). Run 2 (A empty, C) resumes shared 24 and saves 26'. Run 3 (A,
    C) resumes 26' from the local tier, saves 28'' and prunes 26' (keep_last=1): the one part saying that a run rolled
    back past run 1's steps. A run resumed from the local tier recorded nothing, and run 4 (A, B back) restored run
    1's step 30."""
    root = str(tmp_path)
    launch(f"{S}:run_on_nodes", 2, root, ["A", "B"], 1, 31)
    shutil.rmtree(tmp_path / "node-A")
    (tmp_path / "node-B").rename(tmp_path / "away")
    launch(f"{S}:run_on_nodes", 2, root, ["A", "C"], 2, 27, 100, 1)
    third = [r.value["resumed"] for r in launch(f"{S}:run_on_nodes", 2, root, ["A", "C"], 3, 29, 100, 1)]
    assert [s[0] for s in third] == [26, 26], third
    (tmp_path / "away").rename(tmp_path / "node-B")
    fourth = [r.value["resumed"] for r in launch(f"{S}:run_on_nodes", 2, root, ["A", "B"], 4, 28, 100, 1)]
    assert [s[0] for s in fourth] == [28, 28] and [s[2] for s in fourth] == [328.0, 328.0], fourth

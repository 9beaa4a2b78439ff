"""Several "nodes" on this machine: separate ``torchrun --nnodes N`` agents, c10d rendezvous, private temp dirs.

Ranks 0-1 run under one agent and ranks 2-3 under the other, each agent with its own
temporary directory and working directory (or its own mount namespace with a private
``/tmp``); only the checkpoint directory is shared (as on NFS or Lustre). Everything
that works on one node must work here: kill and resume, rotation, async saves,
archives, and resharding 4 ranks on 2 nodes onto 2 ranks (on one node or two).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

import torchrl_dcp as tdcp
from tests_distributed.launch import private_tmp_unavailable, torchrun_nodes

DEMO = "torchrl_dcp.examples.demo"
S = "tests_distributed.scenarios_multinode"
ARGS = ("--steps", "30")


def finals(runs: list) -> dict[str, str]:
    out: dict[str, str] = {}
    for run in runs:
        out.update(re.findall(r"rank (\d+) final step \d+ (weights \S+ seen \S+)", run.stdout))
    return out


def _ok(runs: list) -> bool:
    return all(r.returncode == 0 for r in runs)


def _text(runs: list) -> str:
    return "\n".join(
        f"--- node {i} (exit {r.returncode})\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}" for i, r in enumerate(runs)
    )


def _left_in_tmp(root: Path, nodes: int = 2) -> list[str]:
    """What the checkpoint machinery left in the nodes' private temporary directories (must be nothing)."""
    left = []
    for i in range(nodes):
        listing = root / f"node{i}" / "tmp-listing.json"  # a private /tmp (mount namespace), listed before it vanished
        paths = (
            json.loads(listing.read_text()) if listing.exists() else map(str, (root / f"node{i}" / "tmp").rglob("*"))
        )
        left += [p for p in paths if ".tdcp-" in p or "step-" in p]
    return left


def _scenario(fn: str, *args: Any, out: Path, root: Path, nodes: int = 2, nproc: int = 2) -> list[dict[str, Any]]:
    """Run ``scenarios_multinode.fn(*args)`` on ``nodes`` x ``nproc`` ranks; every rank's report, by rank."""
    runs = torchrun_nodes(S, fn, json.dumps(list(args)), str(out), nodes=nodes, nproc=nproc, root=root)
    assert _ok(runs), _text(runs)
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nodes * nproc)]
    for r in reports:  # torchrun numbered the ranks node by node: they really ran spread over the nodes
        assert (r["world"], r["local_world"]) == (nodes * nproc, nproc), r
        assert r["rank"] == r["node"] * nproc + r["local_rank"], r
    assert not _left_in_tmp(root, nodes)
    return reports


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Final fingerprints of an uninterrupted 2-node demo run (saves do not change the training)."""
    tmp = tmp_path_factory.mktemp("reference")
    ref = torchrun_nodes(DEMO, *ARGS, "--save-every", "10", "--ckpt-dir", str(tmp / "ckpts"), root=tmp / "a")
    assert _ok(ref), _text(ref)
    assert sorted(finals(ref)) == ["0", "1", "2", "3"], _text(ref)
    return finals(ref)


@pytest.mark.slow
@pytest.mark.parametrize("isolation", ["tmpdir", "mount-namespace"])
def test_two_nodes_killed_and_resumed_match_uninterrupted(
    tmp_path: Path, reference: dict[str, str], isolation: str
) -> None:
    private = None
    if isolation == "mount-namespace":
        reason = private_tmp_unavailable()
        if reason:
            pytest.skip(f"no private /tmp per node here: {reason}")
        private = tmp_path  # each node: its own tmpfs /tmp; only tmp_path (the "shared file system") is shared
    args = (*ARGS, "--save-every", "10", "--ckpt-dir", str(tmp_path / "run"))
    killed = torchrun_nodes(DEMO, *args, "--kill-at-step", "15", root=tmp_path / "b", private_tmp=private)
    assert not _ok(killed) and not finals(killed)
    resumed = torchrun_nodes(DEMO, *args, "--resume", root=tmp_path / "c", private_tmp=private)
    assert _ok(resumed), _text(resumed)
    assert any("resumed from" in r.stdout and "(step 10, saved by 4 ranks)" in r.stdout for r in resumed)
    assert finals(resumed) == reference
    assert not _left_in_tmp(tmp_path / "b") and not _left_in_tmp(tmp_path / "c")
    if private is not None:  # the namespaces were real: each node listed its own /tmp (torchrun's files included)
        assert all((tmp_path / x / f"node{i}" / "tmp-listing.json").exists() for x in "bc" for i in (0, 1))
        assert not list((tmp_path / "b" / "node0" / "tmp").glob("*"))


@pytest.mark.slow
def test_rotation_across_nodes_prunes_and_resumes_from_the_newest(tmp_path: Path, reference: dict[str, str]) -> None:
    run = tmp_path / "run"
    args = (*ARGS, "--rotation", "--save-every", "4", "--keep-last", "2", "--ckpt-dir", str(run))
    killed = torchrun_nodes(DEMO, *args, "--kill-at-step", "22", root=tmp_path / "b")
    assert not _ok(killed) and not finals(killed)
    # saves at 4, 8, ..., 20; rank 0 pruned all but the last two; no staging, trash or lock left
    assert sorted(p.name for p in run.iterdir()) == ["step-000000000016", "step-000000000020"]
    assert [e.step for e in tdcp.CheckpointRotation(run).entries()] == [16, 20]
    resumed = torchrun_nodes(DEMO, *args, "--resume", root=tmp_path / "c")
    assert _ok(resumed), _text(resumed)
    assert any(f"resumed from {run / 'step-000000000020'} (step 20, saved by 4 ranks)" in r.stdout for r in resumed)
    assert finals(resumed) == reference
    assert sorted(p.name for p in run.iterdir()) == ["step-000000000024", "step-000000000028"]
    assert tdcp.read_manifest(run / "step-000000000028")["world_size"] == 4
    assert not _left_in_tmp(tmp_path / "b") and not _left_in_tmp(tmp_path / "c")


def _same_state(loaded: list[dict[str, Any]], saved: list[dict[str, Any]]) -> None:
    assert len(loaded) == len(saved)
    for got, want in zip(loaded, saved):
        assert got["value"]["loaded"] == ["buffer", "optimizer", "policy", "rng"]
        assert got["value"]["saved"] == want["value"]["saved"], got["rank"]  # learner, shard, priorities, cursor
        assert got["value"]["next"] == want["value"]["next"], got["rank"]  # RNG streams, sample, next step


@pytest.mark.slow
def test_async_save_across_nodes_loads_exactly_from_its_directory_and_its_archive(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    saved = _scenario("async_save_state", str(path), 7, 2, out=tmp_path / "out-save", root=tmp_path / "a")
    assert {r["value"]["committed"] for r in saved} == {str(path)}
    assert len([p for p in path.iterdir() if p.suffix == ".distcp"]) >= 4  # every rank, on both nodes, wrote
    loaded = _scenario("load_state", str(path), 7, "error", out=tmp_path / "out-load", root=tmp_path / "b")
    _same_state(loaded, saved)
    # the checkpoint the two nodes wrote, as one ZIP archive, loads in place on two nodes (4 ranks) just as exactly
    archive = tdcp.to_archive(path, tmp_path / "ckpt.zip")
    loaded = _scenario("load_state", str(archive), 7, "error", out=tmp_path / "out-zip", root=tmp_path / "c")
    _same_state(loaded, saved)
    assert sorted(p.name for p in tmp_path.iterdir() if "ckpt" in p.name) == ["ckpt", "ckpt.zip"]  # nothing extracted


@pytest.mark.slow
def test_reshard_four_ranks_on_two_nodes_onto_two_ranks(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = _scenario("save_state", path, 5, 2, out=tmp_path / "out-save", root=tmp_path / "a")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for r in saved:  # writer threads: this node's CPUs shared by its 2 ranks (not by all 4)
        assert (r["cpus_per_rank"], r["threads"]) == (max(1, cpus // 2), max(1, min(4, cpus // 2))), r
    spread = _scenario("load_state", path, 5, "reshard", out=tmp_path / "out-2x1", root=tmp_path / "b", nproc=1)
    single = _scenario("load_state", path, 5, "reshard", out=tmp_path / "out-1x2", root=tmp_path / "c", nodes=1)
    want = saved[0]["value"]["saved"]
    assert all(r["value"]["saved"][k] == want[k] for r in saved for k in ("policy", "optimizer"))  # replicated
    old = [item for r in saved for item in r["value"]["saved"]["items"]]
    for layout in (spread, single):
        got = [r["value"] for r in layout]
        assert all(v["loaded"] == ["buffer", "optimizer", "policy", "rng"] for v in got)
        assert all((v["saved"]["policy"], v["saved"]["optimizer"]) == (want["policy"], want["optimizer"]) for v in got)
        # the saved shards in rank order, each oldest first, cut in 2 nearly equal parts: ids and priorities bit for bit
        assert [item for v in got for item in v["saved"]["items"]] == old
        sizes = [len(v["saved"]["items"]) for v in got]
        assert max(sizes) - min(sizes) <= 1 and all(v["saved"]["cursor"] == n for v, n in zip(got, sizes))
        assert got[0]["next"]["draws"] != got[1]["next"]["draws"]  # re-seeded streams differ between the new ranks
    # where the 2 new ranks run (2 nodes x 1 or 1 node x 2) changes nothing: the same state and continuation
    assert [r["value"] for r in spread] == [r["value"] for r in single]


@pytest.mark.slow
def test_rotation_order_survives_a_coordinator_node_with_a_clock_behind(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    first = _scenario("rotation_saves", run, [10, 20, 30], 0, out=tmp_path / "o1", root=tmp_path / "a", nproc=1)
    assert first[0]["value"] == {"kept": [20, 30], "latest": "step-000000000030"}
    # the job is restarted; torchrun puts rank 0 on a node whose clock is an hour behind
    second = _scenario("rotation_saves", run, [40, 50], 3600, out=tmp_path / "o2", root=tmp_path / "b", nproc=1)
    assert second[0]["value"] == {"kept": [40, 50], "latest": "step-000000000050"}


def test_a_node_keeps_the_interpreter_visible_when_it_lives_under_tmp(monkeypatch: pytest.MonkeyPatch) -> None:
    """A virtualenv under /tmp (CI, a scratch machine) must stay visible in a node's private /tmp, or the node's
    torchrun cannot start (the mount-namespace test failed instead of running)."""
    import sys

    from tests_distributed.nodens import _kept

    monkeypatch.setattr(sys, "prefix", "/tmp/some-venv")
    monkeypatch.setattr(sys, "executable", "/tmp/some-venv/bin/python")
    kept = _kept(Path("/tmp/some-venv/shared"))
    assert Path("/tmp/some-venv") in kept and Path("/tmp/some-venv/shared") not in kept  # (inside a kept path)

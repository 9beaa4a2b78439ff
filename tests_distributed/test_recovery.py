"""Recovery from the node-local tier: two ``torchrun --nnodes 2 --max-restarts 1`` agents, each node its own TMPDIR.

A worker fails on the first attempt; the agents restart every worker, which resume through
``CheckpointRotation(..., local=LocalTier(...))`` and finish. Local saves every 3 steps, shared
ones every 10: a failure after step 17 finds local step 15 and shared step 10. Every run must end
in the state of an uninterrupted one, bit for bit, whichever tier it resumed from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests_distributed.launch import torchrun_nodes

S = "tests_distributed.scenarios_recovery"
STEPS = 22
pytestmark = pytest.mark.slow


def _run(root: Path, *, kill_at: int | None, victim: int = 3, wipe: tuple[int, ...] = (), fault: str | None = None):
    out = root / "out"
    args = [str(root / "shared"), STEPS, kill_at, victim, list(wipe), fault]
    runs = torchrun_nodes(S, "train", json.dumps(args), str(out), root=root, max_restarts=1)
    text = "\n".join(
        f"--- node {i} (exit {r.returncode})\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}" for i, r in enumerate(runs)
    )
    assert all(r.returncode == 0 for r in runs), text
    return [json.loads((out / f"rank{r}.json").read_text())["value"] for r in range(4)]


def _finals(reports: list[dict[str, Any]]) -> list[Any]:
    return [(r["final"], r["next"]) for r in reports]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    reports = _run(tmp_path_factory.mktemp("reference"), kill_at=None)
    assert all(r["resumed"] is None for r in reports)
    return _finals(reports)


def test_a_killed_worker_resumes_every_rank_from_its_node_local_tier(tmp_path: Path, reference: list[Any]) -> None:
    reports = _run(tmp_path, kill_at=17)
    assert [r["resumed"] for r in reports] == [{"step": 15, "tier": "local", "start": 2}] * 4
    assert _finals(reports) == reference
    assert reports[0]["local_steps"] == [18, 21]  # keep_last=2 on each node


def test_every_worker_killed_at_once_resumes_from_the_local_tier(tmp_path: Path, reference: list[Any]) -> None:
    reports = _run(tmp_path, kill_at=17, victim=-1)
    assert [r["resumed"] for r in reports] == [{"step": 15, "tier": "local", "start": 2}] * 4
    assert _finals(reports) == reference


def test_a_replaced_node_recovers_its_ranks_from_replicas_on_the_other_node(
    tmp_path: Path, reference: list[Any]
) -> None:
    reports = _run(tmp_path, kill_at=17, wipe=(1,))
    assert [r["resumed"]["tier"] for r in reports] == ["local", "local", "peer", "peer"]
    assert {r["resumed"]["step"] for r in reports} == {15}
    assert _finals(reports) == reference


def test_both_tiers_wiped_resume_from_the_shared_tier(tmp_path: Path, reference: list[Any]) -> None:
    reports = _run(tmp_path, kill_at=17, wipe=(0, 1))
    assert [r["resumed"] for r in reports] == [{"step": 10, "tier": "shared", "start": 2}] * 4
    assert _finals(reports) == reference


@pytest.mark.parametrize("fault", ["save", "replicate"])
def test_a_worker_killed_inside_a_local_save_resumes_from_the_previous_local_step(
    tmp_path: Path, reference: list[Any], fault: str
) -> None:
    reports = _run(tmp_path, kill_at=15, victim=2, fault=fault)
    assert [r["resumed"] for r in reports] == [{"step": 12, "tier": "local", "start": 2}] * 4
    assert _finals(reports) == reference

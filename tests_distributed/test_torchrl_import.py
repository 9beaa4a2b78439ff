"""A torchrl.checkpoint checkpoint (one process's save) imported by every rank of a 2-rank job: every rank restores
the same state; a restore failing on one rank raises on both and rolls both back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_distributed.launch import launch


def test_every_rank_imports_the_same_state(tmp_path: Path) -> None:
    results = launch("tests_distributed.scenarios_torchrl_import:import_on_every_rank", 2, str(tmp_path), None)
    for r in results:
        assert r.value["error"] is None, r.value
        assert r.value["step"] == 7 and r.value["restored"], f"rank {r.rank}"


@pytest.mark.parametrize("fail_on", [0, 1])
def test_a_restore_failing_on_one_rank_is_rolled_back_on_both(tmp_path: Path, fail_on: int) -> None:
    results = launch("tests_distributed.scenarios_torchrl_import:import_on_every_rank", 2, str(tmp_path), fail_on)
    for r in results:
        assert r.value["error"] is not None and r.value["unchanged"], (r.rank, r.value)
        if r.rank == fail_on:
            assert "injected failure" in r.value["error"]
        else:
            assert f"rank {fail_on} failed" in r.value["error"]

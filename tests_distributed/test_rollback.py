"""A restore that fails on one rank raises on every rank, and every rank's objects are rolled back bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_distributed.launch import launch


@pytest.mark.parametrize("fail_on", [0, 1])
def test_a_restore_failing_on_one_rank_is_rolled_back_everywhere(tmp_path: Path, fail_on: int) -> None:
    results = launch("tests_distributed.scenarios_rollback:restore_fails_on_one_rank", 2, str(tmp_path), fail_on)
    for r in results:
        assert r.value["error"] is not None, r.value
        assert r.value["unchanged"], f"rank {r.rank} kept part of a failed load: {r.value['error']}"
        if r.rank == fail_on:
            assert "fragile" in r.value["error"] and "injected failure" in r.value["error"]
        else:
            assert f"rank {fail_on} failed" in r.value["error"]

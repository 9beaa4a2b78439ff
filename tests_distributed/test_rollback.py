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


def test_a_resharding_load_failing_after_the_buffer_puts_its_rows_back(tmp_path: Path) -> None:
    """A reshard writes the rows a rank receives into its live storage while restoring (they are not read in place):
    a later component failing rolled the buffer's length, sampler and writer back and left the new rows under them,
    without a word. The rows it writes over are copied first, and put back."""
    launch("tests_distributed.scenarios_rollback:reshard_fails_after_the_buffer", 1, str(tmp_path), "save")
    results = launch("tests_distributed.scenarios_rollback:reshard_fails_after_the_buffer", 2, str(tmp_path), "load")
    for r in results:
        assert r.value["error"] is not None and "injected failure" in r.value["error"], r.value
        assert r.value["rows"] == r.value["before"], f"rank {r.rank}: {r.value}"

"""Load: 3 ranks, 20 async saves with rotation, each loaded back and checked; memory stays flat."""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from tests_distributed.launch import launch
from torchrl_dcp.verification import verify

ROUNDS = 20
KEEP = 2
RSS_GROWTH_KIB = 16 * 1024  # allowed growth between round 5 and the last round, per rank


@pytest.mark.slow
def test_twenty_async_saves_with_rotation_on_three_ranks(tmp_path: Path) -> None:
    results = launch("tests_distributed.scenarios_soak:soak", 3, str(tmp_path), ROUNDS, KEEP, timeout=600)
    rotation = tdcp.CheckpointRotation(tmp_path, keep_last=KEEP)
    assert [e.step for e in rotation.entries()] == [ROUNDS - 1, ROUNDS]
    assert sorted(p.name for p in tmp_path.iterdir()) == [rotation.path_for(s).name for s in (ROUNDS - 1, ROUNDS)]
    for e in rotation.entries():
        verify(e.path)
    for r in results:
        rss = r.value["rss_kib"]
        assert len(rss) == ROUNDS
        # each rank saves ~3 MiB per round: keeping one round's state (staging buffers, blobs, a handle)
        # alive would add ~45 MiB over the last 15 rounds; 16 MiB leaves room for allocator noise
        growth = rss[-1] - rss[4]
        assert growth < RSS_GROWTH_KIB, f"rank {r.rank}: RSS grew by {growth} KiB from round 5 to {ROUNDS}: {rss}"

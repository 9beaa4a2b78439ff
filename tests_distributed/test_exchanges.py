"""A save and a load make the same few exchanges at any world size (design.md, invariant 11).

The ranks agree through fixed-size reductions (``_dist.agree``); what each rank holds is gathered
only to rank 0 at commit, and monitored barriers run only where a stuck rank must be named: before
the first exchange of a save or a load, and before the commit gather (a rank stuck writing).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_distributed.launch import launch

S = "tests_distributed.scenarios_exchanges"

SAVE = ["sync", "agree", "broadcast_from_0", "sync", "gather_to_0", "broadcast_from_0"]
# validate (monitored), read into fresh buffers, restore, read in place, restore in place
LOAD = ["sync", "agree", "agree", "agree", "agree", "agree"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_save_and_a_load_make_the_same_exchanges_at_any_world_size(tmp_path: Path, world: int) -> None:
    results = launch(f"{S}:save_and_load", world, str(tmp_path))
    for r in results:
        assert r.value["save"] == SAVE, r.value
        assert r.value["load"] == LOAD, r.value

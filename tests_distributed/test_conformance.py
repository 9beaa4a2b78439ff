"""Distributed slice of the conformance matrix: 2 and 3 real ranks, and a world-size change 2 -> 3 (reshard)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests_distributed.launch import launch

S = "tests_distributed.scenarios_conformance"
# a representative slice of the products (each launch costs ~30 s on 2 cores): both world sizes, both storages,
# both kinds of sampler state (priority trees, a mid-epoch permutation)
CASES = [
    c
    for c in itertools.product([2, 3], ["tensor", "memmap"], ["prioritized", "without_replacement"])
    if (c[1] == "memmap") == (c[2] == "prioritized")
]


@pytest.mark.parametrize("world, storage, sampler", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_ranks_continue_identically(tmp_path: Path, world: int, storage: str, sampler: str) -> None:
    path = str(tmp_path / "ckpt")
    saved = launch(f"{S}:save_and_continue", world, path, storage, sampler, timeout=180)
    loaded = launch(f"{S}:load_and_continue", world, path, storage, sampler, False, timeout=180)
    for s, got in zip(saved, loaded):
        assert got.value["len"] == s.value["len"]
        assert got.value["next"] == s.value["next"]  # collector batches, buffer samples, optimizer steps


def test_two_ranks_reshard_onto_three(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = launch(f"{S}:save_and_continue", 2, path, "tensor", "prioritized", timeout=180)
    loaded = launch(f"{S}:load_and_continue", 3, path, "tensor", "prioritized", True, timeout=180)
    assert sum(r.value["len"] for r in loaded) == sum(r.value["saved_len"] for r in saved)  # none lost or duplicated
    assert len({r.value["weights"] for r in loaded}) == 1  # the replicated learner everywhere

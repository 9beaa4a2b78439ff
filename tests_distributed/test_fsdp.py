"""FSDP2 (``fully_shard`` on CPU + gloo): model and optimizer saved after some steps load into freshly built ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_distributed.launch import launch

S = "tests_distributed.scenarios_fsdp"


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_fsdp2_optimizer_loads_into_fresh_optimizer_and_continues_bit_exact(tmp_path: Path, kind: str) -> None:
    path = str(tmp_path / "ckpt")
    saved = launch(f"{S}:save_and_continue", 2, path, kind, 3, timeout=180)
    loaded = launch(f"{S}:load_and_continue", 2, path, kind, 3, timeout=180)
    for s, got in zip(saved, loaded):
        assert got.value["loaded"] == ["model", "optimizer"]
        assert got.value["state"] == s.value["state"]  # weights and optimizer state, gathered
        assert got.value["next"] == s.value["next"]  # three more steps, bit for bit


def test_fsdp2_checkpoint_of_2_ranks_loads_on_3(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = launch(f"{S}:save_and_continue", 2, path, "adamw", 2, timeout=180)
    loaded = launch(f"{S}:load_and_continue", 3, path, "adamw", 2, timeout=180)
    for got in loaded:
        assert got.value["state"] == saved[0].value["state"]  # resharded by DCP: the same full tensors


def test_an_fsdp2_model_with_the_default_placement_is_told_to_use_sharded(tmp_path: Path) -> None:
    results = launch(f"{S}:default_placement_error", 2, str(tmp_path / "c"))
    for r in results:
        assert "placement='sharded'" in r.value and "'model'" in r.value, r.value
    assert not (tmp_path / "c").exists()

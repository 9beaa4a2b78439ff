"""Replicated means replicated: a save whose replicated state differs between ranks raises on every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_distributed.launch import launch

S = "tests_distributed.scenarios_replicas"


@pytest.mark.parametrize(
    ("differ", "mode", "component_mode", "refused"),
    [
        ("none", "sample", None, False),
        ("bias", "sample", None, True),
        ("bias", "full", None, True),
        ("bias", "sample", "off", False),  # turned off for this component
        ("bias", "off", None, False),
        ("dict", "sample", None, True),  # per-rank values registered as (default) replicated
        ("unsampled", "sample", None, False),  # documented limit of the cheap mode
        ("unsampled", "full", None, True),
    ],
)
def test_replicas_are_compared_before_anything_is_written(
    tmp_path: Path, differ: str, mode: str, component_mode: str | None, refused: bool
) -> None:
    results = launch(f"{S}:save_differing", 2, str(tmp_path), differ, mode, component_mode)
    for r in results:
        if not refused:
            assert r.value["error"] is None and r.value["exists"], r.value
            continue
        assert r.value["type"] in ("EncodingError", "CollectiveError"), r.value
        assert "differs between rank 0 and rank 1" in r.value["error"], r.value
        assert not r.value["exists"] and r.value["left"] == [], r.value  # nothing committed, nothing left
        component = "counters" if differ == "dict" else "model"
        assert repr(component) in r.value["error"]
        if differ == "dict":  # the value that differs is named, not only "its non-tensor values"
            assert "placement='per_rank'" in r.value["error"]
            assert "its non-tensor value at counters['opt']['lr']" in r.value["error"], r.value["error"]


@pytest.mark.parametrize("mode", ["sample", "off"])
def test_a_replicated_tensor_shaped_differently_on_one_rank_is_refused_naming_it(tmp_path: Path, mode: str) -> None:
    """The ranks only agree on a digest of their shared tensor lists; when it differs they gather the lists to name
    the key, even with the replica check off."""
    results = launch(f"{S}:save_differing", 2, str(tmp_path), "shape", mode, None)
    for r in results:
        assert r.value["type"] in ("EncodingError", "CollectiveError"), r.value
        assert "replicated/model/1." in r.value["error"] and "rank 1" in r.value["error"], r.value
        assert not r.value["exists"] and r.value["left"] == [], r.value


@pytest.mark.parametrize("differ", ["plain", "count", "none"])
def test_a_sharded_components_values_and_plain_tensors_are_compared_like_replicated_ones(
    tmp_path: Path, differ: str
) -> None:
    """``{"d": DTensor, "plain": tensor, "count": int}`` registered sharded: DCP writes its plain tensors and values
    once, so a ``plain`` or ``count`` differing on rank 1 was saved without a word and loaded as one rank's on every
    rank (``plain`` rank 1's, ``count`` rank 0's). Refused now, naming what differs; equal ones round-trip."""
    for r in launch(f"{S}:save_sharded_differing", 2, str(tmp_path), differ):
        if differ == "none":
            assert r.value["error"] is None and r.value["plain"] == [0.0] * 3 and r.value["count"] == 0, r.value
            assert r.value["d"] == sum(range(35)), r.value
            continue
        assert r.value["type"] in ("EncodingError", "CollectiveError") and not r.value["exists"], r.value
        assert "sharded component 's' differs between rank 0 and rank 1 outside its DTensors" in r.value["error"]
        named = "tensor 'sharded/s/plain'" if differ == "plain" else "its non-tensor value at s['count']"
        assert named in r.value["error"], r.value["error"]


@pytest.mark.parametrize("on_rank", [0, 1])
def test_a_tensor_one_rank_alone_holds_is_named_whichever_rank_it_is(tmp_path: Path, on_rank: int) -> None:
    """Only rank 0's keys were compared: a tensor rank 1 alone held gave "its non-tensor values (JSON state)"."""
    for r in launch(f"{S}:save_with_a_key_more", 2, str(tmp_path), on_rank):
        assert "differs between rank 0 and rank 1: tensor 'replicated/x/b'" in r.value["error"], r.value

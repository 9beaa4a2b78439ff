"""Object-store checkpoints with real ranks (gloo): every rank uploads its own data file to the local S3 server
(s3fs + moto, configured through fsspec's ``FSSPEC_S3_*`` environment), rank 0 commits; loads restore every rank."""

from __future__ import annotations

import pytest

import torchrl_dcp as tdcp
from tests_distributed.launch import launch
from torchrl_dcp.storage.objectstore import list_objects
from torchrl_dcp.storage.urls import resolve_path

S = "tests_distributed.scenarios_objectstore"


@pytest.mark.slow
@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_two_ranks_save_and_load_through_s3(s3, use_async: bool) -> None:  # type: ignore[no-untyped-def]
    url = s3.url("run/step-7")
    saved = launch(f"{S}:save", 2, url, 7, use_async, env={**s3.env, "TDCP_STORE_PART_SIZE": str(5 << 20)})
    assert {r.value["path"] for r in saved} == {url}
    path = resolve_path(url, s3.storage_options)
    names = sorted(list_objects(path))
    shared = [n for n in names if n.endswith("_shared.distcp")]  # the replicated policy (format 6)
    expected = [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest-0.json", "manifest-1.json", "manifest.json"]
    assert shared and names == sorted(expected + shared)  # each rank's manifest shard: it wrote its own (format 5)
    files = tdcp.read_manifest(path)["files"]
    assert len(shared) == 2 and all(files[n]["size"] > 5 << 20 for n in shared)  # both wrote the replicated in parts
    assert tdcp.verify(path)["files"] == 5 + len(shared)
    loaded = launch(f"{S}:load", 2, url, 7, env=s3.env)
    for s, got in zip(saved, loaded):
        assert got.value == {"step": 7, **{k: v for k, v in s.value.items() if k != "path"}}
    assert loaded[0].value["shard"] != loaded[1].value["shard"]  # each rank got its own state back


@pytest.mark.slow
def test_a_load_lists_the_prefix_once_and_every_rank_refuses_a_truncated_object(s3) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 lists the prefix (every object's size, nothing unlisted); the other ranks make no listing (1 LIST per
    load, not one per rank) and read their objects within the recorded sizes. An object of rank 1 cut short fails
    the load on every rank, naming it, with every object left as it was."""
    url = s3.url("run/lists")
    saved = launch(f"{S}:save", 2, url, 5, False, env=s3.env)
    loaded = launch(f"{S}:load_counting_lists", 2, url, 5, env=s3.env)
    assert [r.value["lists"] for r in loaded] == [1, 0]
    for s, got in zip(saved, loaded):
        assert {k: v for k, v in got.value.items() if k != "lists"} == {
            "step": 5,
            **{k: v for k, v in s.value.items() if k != "path"},
        }
    path = resolve_path(url, s3.storage_options)
    key = (path / "__1_0.distcp").key  # rank 1's per-rank data: only rank 1 reads it
    path.fs.pipe_file(key, path.fs.cat_file(key)[:-100])
    refused = launch(f"{S}:load_refused", 2, url, 5, env=s3.env)
    for r in refused:
        assert r.value["error"] and "__1_0.distcp" in r.value["error"], r.value
        assert "truncated" in r.value["error"] and r.value["unchanged"], r.value


def test_ranks_saving_to_stores_they_do_not_share_are_told_so() -> None:
    """``memory://`` on 2 ranks (one store per process): rank 0's check found rank 1's files absent and said "is
    not the object of N bytes this save uploaded", which reads as damage; it now says what to check."""
    for r in launch(f"{S}:save_to_a_store_of_each_process", 2, 5):
        assert "is absent, though its writer uploaded" in r.value["error"], r.value
        assert "do all ranks write to the same store" in r.value["error"], r.value

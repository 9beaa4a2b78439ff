"""Core behaviour with 2 and 3 real ranks (gloo): round trips, partial loads, commit under SIGKILL."""

from __future__ import annotations

from pathlib import Path

import pytest

import torchrl_dcp as tdcp
from tests_distributed.launch import launch
from torchrl_dcp.storage.filesystem import safe_load_metadata

S = "tests_distributed.scenarios_core"


@pytest.mark.parametrize("world_size", [2, 3])
def test_round_trip_each_rank_gets_its_own_state(tmp_path: Path, world_size: int) -> None:
    path = str(tmp_path / "ckpt")
    saved = launch(f"{S}:save_then_draw", world_size, path, 7)
    loaded = launch(f"{S}:load_then_draw", world_size, path, 7)
    for s, got in zip(saved, loaded):
        r = got.value["rank"]
        assert got.value["loaded"] == ["big", "model", "optimizer", "rng", "shard", "stats"]
        assert got.value["shard"] == [100 * r + 7 + i for i in range(5)]  # its own, never another rank's
        assert got.value["shard_rank"] == r
        assert got.value["stats"] == {"episodes": 10 + r + 7, "name": f"rank-{r}"}
        assert got.value["draws"] == s.value["draws"]  # RNG streams continue identically
        assert got.value["after_step"] == s.value["after_step"]  # model + optimizer continue identically
        assert got.value["big"] == [7.0 + i for i in range(8)]
        assert got.value["step"] == 1
    manifest = tdcp.read_manifest(path)
    assert manifest["world_size"] == world_size
    assert sorted(manifest["components"]["shard"]["ranks"]) == [str(r) for r in range(world_size)]
    tdcp.verify(path)
    # replicated state is written once, and its writes are spread over several ranks
    metadata = safe_load_metadata(Path(path) / ".metadata")
    writers = {
        info.relative_path.split("_")[2]
        for index, info in metadata.storage_data.items()
        if index.fqn.startswith("replicated/")
    }
    assert len(writers) > 1, writers
    replicated = [k for k in metadata.state_dict_metadata if k.startswith("replicated/big/")]
    assert len(replicated) == 8


def test_other_world_size_loads_replicated_and_refuses_per_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_then_draw", 3, path, 5)
    for r in launch(f"{S}:load_replicated_only", 2, path, 5):
        assert "saved by 3 ranks" in r.value["full_load"] and "this job has 2" in r.value["full_load"]
        assert "(components=[...] chooses what to load), or resume with 3 ranks" in r.value["full_load"], r.value
        assert r.value["loaded"] == ["big", "model"]
        assert r.value["unrequested"] == ["optimizer", "rng", "shard", "stats"]
        assert r.value["big"] == [5.0 + i for i in range(8)]


@pytest.mark.parametrize("phase", ["write", "checksum"])
def test_rank_killed_mid_save_keeps_previous_checkpoint(tmp_path: Path, phase: str) -> None:
    path = str(tmp_path / "ckpt")
    launch(f"{S}:save_then_draw", 2, path, 3)
    before = (Path(path) / "manifest.json").read_bytes()
    results = launch(f"{S}:save_and_die", 2, path, 4, phase, expect_failure=True, timeout=60)
    assert results[1].returncode == -9  # SIGKILL
    assert (Path(path) / "manifest.json").read_bytes() == before
    tdcp.verify(path)
    staged = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert all(".tdcp-staging-" in name for name in staged)  # invisible, and only as staging
    loaded = launch(f"{S}:load_then_draw", 2, path, 3)
    assert all(r.value["step"] == 1 for r in loaded)
    # the next save succeeds and removes what the killed one left
    launch(f"{S}:save_then_draw", 2, path, 9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert tdcp.read_manifest(path)["metadata"] == {"seed": 9}


def test_a_coordinator_killed_after_the_commit_is_not_said_to_have_committed_nothing(tmp_path: Path) -> None:
    """Rank 0 died in the prune, after publishing step 2: rank 1 was told "Nothing was committed; the previous
    checkpoint is intact", though step 2 is committed (it verifies, and a resume takes it)."""
    path = tmp_path / "run"
    results = launch(f"{S}:rotate_and_die", 2, str(path), expect_failure=True, timeout=90)
    assert results[0].returncode == -9
    error = results[1].value["error"]
    assert error is not None and "Nothing was committed" not in error and "may be committed" in error, error
    assert [e.step for e in tdcp.CheckpointRotation(path).entries()] == [2]


def test_failure_on_one_rank_raises_on_every_rank(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results = launch(f"{S}:raise_on_one_rank", 2, path, 1)
    assert results[1].value["error"] == "EncodingError"
    assert "stats/bad" in results[1].value["message"]
    assert results[0].value["error"] == "CollectiveError"
    assert "rank 1" in results[0].value["message"] and "stats/bad" in results[0].value["message"]
    assert not (tmp_path / "ckpt").exists()


def test_a_users_file_in_the_newest_entry_stops_every_ranks_resume_naming_it(tmp_path: Path) -> None:
    """Rank 0 finds the file (it checks the listing); the others heard only "rank 0 failed while validating". Every
    rank now raises the same error, naming the file and what to do; moved out, every rank resumes the newest."""
    for result in launch(f"{S}:resume_past_a_users_file", 2, str(tmp_path / "run"), 1):
        assert result.value["error"] == "CheckpointError", result.value
        assert "step-000000000002: holds 'eval_results.json', a file no save writes" in result.value["message"]
        assert "move it out of the entry" in result.value["message"]
        assert result.value["step"] == 2


def test_a_rank_late_for_the_first_checkpoint_call_is_a_collective_error_everywhere(tmp_path: Path) -> None:
    """The first checkpoint call of a process creates the checkpoint group: a rank late past the timeout there
    gave raw ``DistStoreError``/``DistNetworkError`` (not a ``CheckpointError``) on every rank."""
    results = launch(f"{S}:first_call_late", 2, str(tmp_path / "run"))
    assert [r.value["error"] for r in results] == ["CollectiveError"] * 2, results
    assert all("did not all reach their first checkpoint call" in r.value["message"] for r in results)


def test_a_checkpoint_group_creation_that_never_ends_is_given_up_after_the_timeout(tmp_path: Path) -> None:
    """A peer killed while the checkpoint group was created left the survivor blocked in gloo's rendezvous far past
    ``timeout`` (over 50 s with ``timeout=5``), where the docs promise a CollectiveError."""
    results = launch(f"{S}:group_creation_that_never_ends", 2, str(tmp_path / "ck"), timeout=90)
    assert [r.value["error"] for r in results] == ["CollectiveError"] * 2, results
    assert "did not all reach their first checkpoint call" in results[0].value["message"]
    assert "it did not end" in results[0].value["message"] and results[0].value["seconds"] < 30


@pytest.mark.parametrize("case", ["path", "components"])
def test_a_load_the_ranks_ask_differently_raises_on_every_rank_unchanged(tmp_path: Path, case: str) -> None:
    """Rank 1 loading another checkpoint, or fewer components, succeeded: the replicated model then differed by
    rank, silently. The ranks' loads are compared in the agreement they already make (the save loaded and the
    components): every rank raises the same error, nothing restored."""
    results = launch(f"{S}:load_unlike", 2, str(tmp_path / "ckpt"), case)
    messages = {r.value["message"] for r in results}
    assert [r.value["error"] for r in results] == ["CheckpointError"] * 2 and len(messages) == 1, results
    message = messages.pop()
    assert "the ranks do not agree" in message and all(r.value["unchanged"] for r in results)
    if case == "path":  # (each rank's path is named: save ids alone do not say which checkpoint a rank was given)
        assert f"reading {tmp_path / 'ckpt'}-a" in message and f"reading {tmp_path / 'ckpt'}-b" in message, message


def test_a_rank_saving_while_another_loads_raises_a_checkpoint_error_on_every_rank(tmp_path: Path) -> None:
    results = launch(f"{S}:save_while_loading", 2, str(tmp_path / "ckpt"))
    assert all(r.value["checkpoint_error"] for r in results), results
    assert any("was at another checkpoint exchange" in r.value["message"] for r in results), results
    assert not (tmp_path / "ckpt-b").exists()
    tdcp.verify(tmp_path / "ckpt")


@pytest.mark.parametrize("case", ["extra_component", "placement", "kind", "path", "step", "components", "chunking"])
def test_a_save_the_ranks_describe_differently_raises_on_every_rank_and_keeps_the_checkpoint(
    tmp_path: Path, case: str
) -> None:
    """The manifest is rank 0's description of the save: a rank that registered another component, placement or
    kind of object, or called save with another path, step or components, committed a checkpoint no load read (in
    place of the good one) or silently lost its state. Now every rank raises the same error naming the difference,
    before anything is written; the previous checkpoint still loads. Chunk sizes too (probe m6: ranks with another
    ``TDCP_CHUNK_BYTES`` committed a replicated tensor's chunks that no load read, refused as damaged or forged)."""
    path = str(tmp_path / "ckpt")
    results = launch(f"{S}:save_unlike", 2, path, case)
    messages = {r.value["message"] for r in results}
    assert [r.value["error"] for r in results] == ["CheckpointError"] * 2 and len(messages) == 1, results
    message = messages.pop()
    assert "the ranks do not save alike" in message and "nothing was written" in message
    expected = {
        "extra_component": "components only on rank 1: ['extra']",
        "placement": "component 'stats' is per_rank",
        "kind": "component 'stats' is per_rank (torchrl_dcp.json v1) on rank 0, per_rank (torchrl_dcp.tensor v1)",
        "path": "ckpt-elsewhere",
        "step": "'step': 3",
        "components": "components only on rank 0:",
        "chunking": "TDCP_CHUNK_BYTES=8388608 and TDCP_MIN_CHUNKED_BYTES=16777216 on rank 0, 4194304 and 8388608 on rank 1",
    }[case]
    assert expected in message, message
    assert tdcp.read_manifest(path)["step"] == 1 and not (tmp_path / "ckpt-elsewhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    tdcp.verify(path)


def _the_tools_say_which_ranks_hold_it(path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Probe d2: ``inspect`` listed rank 1 among the evaluator's ranks (it saved the absent marker), ``diff`` showed
    the marker as a value of the user's, ``read_component`` returned it as the state, and ``export_torchrl``'s
    refusal named "rank None"."""
    import json

    from torchrl_dcp.cli import main
    from torchrl_dcp.extract import read_component

    assert main(["inspect", "--json", path]) == 0
    evaluator = json.loads(capsys.readouterr().out)["components"]["evaluator"]
    assert evaluator["ranks"] == [0] and evaluator["absent_ranks"] == [1]
    assert main(["inspect", path]) == 0
    assert " ranks 0 " in capsys.readouterr().out
    with pytest.raises(KeyError, match="rank 1 registered none when it was saved .*: \\[0\\]"):
        read_component(path, "evaluator", rank=1)
    assert read_component(path, "evaluator", rank=0) == {"evaluations": 3, "best": 10.0}
    with pytest.raises(tdcp.CheckpointError, match="rank 1 registered none"):
        tdcp.export_torchrl(path, tmp_path / "exported", components=["evaluator"], rank=1)
    # diff: a rank that registered none, shown as such (not "/1/_tdcp_absent_on_this_rank (only in a)")
    import shutil

    from tests import forging

    other = tmp_path / "both"
    shutil.copytree(path, other)
    forging.edit(
        other, lambda m: m["components"]["evaluator"]["ranks"]["1"].update(m["components"]["evaluator"]["ranks"]["0"])
    )
    assert main(["diff", path, str(other)]) == 1
    out = capsys.readouterr().out
    assert "<not registered on this rank>" in out and "_tdcp_absent_on_this_rank" not in out, out


def test_a_per_rank_component_registered_on_some_ranks_is_saved_and_loaded_where_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 alone registers a per-rank component (an evaluation hook, a logger: the usual distributed job): the
    save was refused ("components only on rank 0"). Now the other ranks save it as absent: it loads on rank 0, rank 1
    loads nothing for it, and a rank 1 that registers it now keeps its own state, said; a replicated component on
    one rank alone is still refused."""
    path = str(tmp_path / "ckpt")
    assert [r.value["error"] for r in launch(f"{S}:per_rank_on_some_ranks", 2, path, "save")] == [None, None]
    manifest = tdcp.read_manifest(path)
    states = manifest["components"]["evaluator"]["ranks"]
    assert manifest["components"]["evaluator"]["placement"] == "per_rank" and sorted(states) == ["0", "1"]
    tdcp.verify(path)
    _the_tools_say_which_ranks_hold_it(path, tmp_path, capsys)
    loaded = [r.value for r in launch(f"{S}:per_rank_on_some_ranks", 2, path, "load")]
    assert loaded[0]["evaluator"] == {"evaluations": 3, "best": 10.0} and "evaluator" in loaded[0]["loaded"]
    assert "evaluator" not in loaded[1]["loaded"] and not loaded[0]["said"] and not loaded[1]["said"]
    assert loaded[0]["demos"] == [0, 1, 2] and "demos" in loaded[0]["loaded"]
    everywhere = [r.value for r in launch(f"{S}:per_rank_on_some_ranks", 2, path, "load_everywhere")]
    assert everywhere[0]["evaluator"] == {"evaluations": 3, "best": 10.0} and not everywhere[0]["said"]
    assert everywhere[1]["evaluator"] == {"evaluations": -1, "best": -1.0}  # (rank 1 saved none: kept as it is)
    assert everywhere[1]["demos"] == [100, 101, 102]  # (a buffer, a generator: not refused as forged, kept)
    assert everywhere[0]["draw"] == loaded[0]["draw"] != everywhere[1]["draw"]
    said = " ".join(everywhere[1]["said"])
    assert "rank 1 registered no ['demos', 'evaluator', 'generator']" in said, everywhere[1]
    resharded = [r.value for r in launch(f"{S}:per_rank_on_some_ranks", 3, path, "reshard")]
    assert [r["demos"] for r in resharded] == [[0], [1], [2]]  # (rank 0's rows shared out: refused before, as forged)
    assert not resharded[0]["said"] and not resharded[2]["said"]  # (they take saved rank 0's generator)
    said = " ".join(resharded[1]["said"])  # (saved rank 1 held none: probe d2, "rank 1 registered none" was wrong)
    assert "the saved rank that rank 1 takes ['generator'] from held none" in said, said
    refused = [r.value["error"] for r in launch(f"{S}:per_rank_on_some_ranks", 2, str(tmp_path / "r"), "replicated")]
    assert len(set(refused)) == 1 and "components only on rank 0: ['evaluator']" in refused[0]
    # the same components= on every rank, naming rank 0's: rank 1 raised KeyError (not registered); a name no rank
    # registered is refused on every rank alike
    selected = str(tmp_path / "selected")
    assert [r.value["error"] for r in launch(f"{S}:per_rank_on_some_ranks", 2, selected, "save_selected")] == [None] * 2
    assert sorted(tdcp.read_manifest(selected)["components"]) == ["evaluator", "model"]
    unknown = [
        r.value["error"] for r in launch(f"{S}:per_rank_on_some_ranks", 2, str(tmp_path / "u"), "select_unknown")
    ]
    assert len(set(unknown)) == 1 and "names ['nope'], which no rank registered" in unknown[0]
    # component_options naming rank 0's: rank 1 raised KeyError ("not saved") and the save failed everywhere
    optioned = str(tmp_path / "optioned")
    assert [r.value["error"] for r in launch(f"{S}:per_rank_on_some_ranks", 2, optioned, "save_options")] == [None] * 2
    assert "evaluator" in tdcp.read_manifest(optioned)["components"]
    unknown = [
        r.value["error"] for r in launch(f"{S}:per_rank_on_some_ranks", 2, str(tmp_path / "o"), "options_unknown")
    ]
    assert len(set(unknown)) == 1 and "component_options names ['nope'], which no rank registered" in unknown[0]
    # the same at a load (probe b1: rank 1 raised KeyError, "not loaded"); a name the checkpoint holds as no per-rank
    # component is refused on every rank
    optioned = [r.value for r in launch(f"{S}:per_rank_on_some_ranks", 2, path, "load_options")]
    assert optioned[0]["evaluator"] == {"evaluations": 3, "best": 10.0} and "error" not in optioned[1]
    unknown = [r.value["error"] for r in launch(f"{S}:per_rank_on_some_ranks", 2, path, "load_options_unknown")]
    assert unknown[0] and "component_options names ['nope'], which this rank did not register" in unknown[1]


def test_a_reshard_onto_ranks_some_without_the_buffer_is_refused_and_a_skipped_own_state_is_said(
    tmp_path: Path,
) -> None:
    """Probe a3: a reshard shares a buffer's transitions out among the new ranks; where only some registered the
    buffer, the parts of the others were lost, silently (3 of 6 rows kept). It is refused on every rank, the buffer
    left as it was. At the saved world size, a rank that registers none of its own saved per-rank state is told it
    is skipped (rank 0 alone warned, about its own: the other ranks' were dropped unsaid)."""
    path = str(tmp_path / "ckpt")
    assert [r.value["error"] for r in launch(f"{S}:per_rank_on_some_ranks", 2, path, "save")] == [None, None]
    refused = [r.value for r in launch(f"{S}:per_rank_on_some_ranks", 3, path, "reshard_rank_0")]
    assert len({r["error"] for r in refused}) == 1
    assert "shares the transitions of ['demos'] out among every new rank" in refused[0]["error"]
    assert "'demos' on ranks [1, 2]: not registered there" in refused[0]["error"]
    assert refused[0]["demos"] == []
    skipped = [r.value for r in launch(f"{S}:per_rank_on_some_ranks", 2, path, "skip_own")]
    assert skipped[0]["skipped"] == []
    assert len(skipped[1]["skipped"]) == 1 and "rank 1: " in skipped[1]["skipped"][0]
    assert "which this load skips: ['stats']" in skipped[1]["skipped"][0]  # (not rank 0's, saved absent on rank 1)

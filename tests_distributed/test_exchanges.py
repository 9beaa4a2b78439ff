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

# in the order entered (a monitored exchange enters its barrier, ``sync``, from inside): agree on the plan (monitored),
# staging, commit gather (monitored), confirm
SAVE = ["agree", "sync", "broadcast_from_0", "gather_to_0", "sync", "broadcast_from_0"]
# validate (monitored), read into fresh buffers, restore, read in place, restore in place
LOAD = ["agree", "sync", "agree", "agree", "agree", "agree"]


@pytest.mark.parametrize("world", [2, 3])
def test_a_save_and_a_load_make_the_same_exchanges_at_any_world_size(tmp_path: Path, world: int) -> None:
    results = launch(f"{S}:save_and_load", world, str(tmp_path))
    for r in results:
        assert r.value["save"] == SAVE, r.value
        assert r.value["load"] == LOAD, r.value


def test_a_rank_opens_its_own_data_files_and_rank_0_checks_the_listing(tmp_path: Path) -> None:
    """Sizes of every file the root lists and 'nothing unlisted' are checked once, on rank 0; every rank opens only
    the files it reads (at 1,000 ranks: its own, not 1,000 ranks' files each): its own data files and the shared files
    of the replicated policy (format 6), never another rank's per-rank data file; rank 0 counts and sizes the other
    ranks' own files from the directory listing against the root's rank table (format 8; ``rank_files`` in format 7)."""
    results = launch(f"{S}:own_files_only", 3, str(tmp_path), "")
    shared = set()
    for r in results:
        assert r.value["error"] is None, r.value
        shared |= {n for n in r.value["opened"] if n.endswith("_shared.distcp")}
        others = [n for n in r.value["opened"] if not n.startswith(f"__{r.rank}_") and not n.endswith("_shared.distcp")]
        assert others == [], r.value
        # the metadata a rank reads: the root and its own shard (format 5), never another rank's, never .metadata
        # (rank 0 opens every file the root lists for its size: the shards and .metadata too)
        if r.rank != 0:
            assert r.value["metadata_opened"] == sorted(["manifest.json", f"manifest-{r.rank}.json"]), r.value
    assert len(shared) >= 2  # the policy's tensors were written by more than one rank, and read by every rank


@pytest.mark.parametrize(
    ("tamper", "named", "says"),
    [
        ("plant", "__9_0.distcp", "not listed"),  # no rank 9: listed nowhere
        # counted, one byte short; one more than rank 2's shard lists: rank 0 then reads that rank's shard (only on
        # this failure path) to name the file, in the words a read of it would use
        ("truncate", "__1_0.distcp", "truncated or altered"),
        ("extra", "__2_", "not listed in the manifest"),
    ],
)
def test_a_planted_or_altered_file_is_refused_by_rank_0_and_the_load_fails_on_every_rank(
    tmp_path: Path, tamper: str, named: str, says: str
) -> None:
    """Rank 0 reads only the root and its own shard, yet refuses a file no shard could list, another rank's own file
    cut short, and one more file of another rank (format 7: the root counts each rank's own files and their bytes;
    when a count differs, that rank's shard is read to name the file)."""
    results = launch(f"{S}:own_files_only", 3, str(tmp_path), tamper)
    assert results[0].value["error"] == "CheckpointIntegrityError", results[0].value
    assert named in results[0].value["message"] and says in results[0].value["message"], results[0].value
    for r in results[1:]:
        assert r.value["error"] in ("CollectiveError", "CheckpointIntegrityError"), r.value
        assert says in r.value["message"] or "truncated" in r.value["message"], r.value


@pytest.mark.parametrize("world", [2, 3])
def test_a_rotation_save_sends_rank_0s_word_and_each_rank_its_part_of_the_base(tmp_path: Path, world: int) -> None:
    """Choosing the base (rank 0 lists the directory) and pruning (rank 0 deletes) send only rank 0's word; the
    incremental base is scattered (each rank its part); nothing is gathered to every rank."""
    results = launch(f"{S}:rotation_save", world, str(tmp_path))
    choose = ["broadcast_from_0", "sync"]  # rank 0 lists the directory: the base and the commit counter (monitored)
    incremental = ["agree", "sync", "scatter_from_0", "agree"]  # plan; each rank's part of the base; chunk plan
    for r in results:
        assert r.value == [*choose, *incremental, *SAVE[2:], "broadcast_from_0"], r.value  # + rank 0 prunes


def test_tdcp_monitor_all_puts_a_barrier_before_every_exchange(tmp_path: Path) -> None:
    results = launch(f"{S}:save_and_load", 2, str(tmp_path), env={"TDCP_MONITOR_ALL": "1"})
    for r in results:
        for kind in ("save", "load"):
            calls = r.value[kind]
            exchanges = [c for c in calls if c != "sync"]
            assert calls == [c for e in exchanges for c in (e, "sync")], calls  # each exchange enters its barrier

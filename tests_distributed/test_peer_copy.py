"""Copying checkpoint directories between real ranks: a failure on either side never leaves the other waiting."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests_distributed.launch import launch

S = "tests_distributed.scenarios_peer_copy"
FILES = {"a.distcp": 2500, "empty": 0, "manifest.json": 10}


def test_entries_arrive_whole_in_pieces(tmp_path: Path) -> None:
    zero, one = (r.value for r in launch(f"{S}:exchange", 2, str(tmp_path), "ok"))
    assert zero["error"] is None and one["error"] is None
    assert one["received"] == {"one": FILES, "two": FILES} and zero["received"] == {"back": FILES}
    for name in ("one", "two"):
        sent, got = tmp_path / "rank0" / name, tmp_path / "rank1" / name
        assert all((sent / f).read_bytes() == (got / f).read_bytes() for f in FILES)


@pytest.mark.parametrize("case", ["receiver_has_no_directory", "send_error", "sender_cannot_read_a_file"])
def test_a_failure_on_one_side_is_an_error_on_the_ranks_concerned_and_the_rest_goes_through(
    tmp_path: Path, case: str
) -> None:
    zero, one = (r.value for r in launch(f"{S}:exchange", 2, str(tmp_path), case, timeout=60))
    if case == "receiver_has_no_directory":  # rank 1 drained the first entry, then received the second
        assert "receiving a checkpoint from rank 0" in one["error"] and zero["error"] is None
        assert one["received"] == {"missing/one": None, "two": FILES}
    elif case == "send_error":  # rank 0 is told instead of waiting for rank 1's entry
        assert "rank 1 could not send it: " in zero["error"] and "disk full" in zero["error"]
        assert zero["received"] == {"back": None} and "disk full" in one["error"]
        assert one["received"] == {"one": FILES, "two": FILES}  # its own receives went through
    else:  # rank 0 padded what it could not read: rank 1 got every declared byte (no load would accept them)
        assert "a.distcp could not be read whole while it was sent to rank 1" in zero["error"]
        assert one["error"] is None and one["received"] == {"one": FILES, "two": FILES}
        assert (tmp_path / "rank1" / "one" / "a.distcp").read_bytes() == bytes(2500)
    assert zero["staging_left"] == [] and one["staging_left"] == []


def test_a_local_save_that_fails_on_one_rank_warns_every_rank_without_a_hang(tmp_path: Path) -> None:
    zero, one = (
        r.value for r in launch(f"{S}:local_save_fails_on_one_rank", 2, str(tmp_path / "shared"), str(tmp_path / "l"))
    )
    assert zero["error"] is None and one["error"] is None  # the job goes on
    assert len(one["warned"]) == 1 and "this component cannot be saved" in one["warned"][0]
    # said from the rank that failed (its part is saved as a world of one, whose errors said "rank 0"), with what to do
    assert one["warned"][0].startswith("rank 1: step 2 was not saved") and "rank 0" not in one["warned"][0]
    assert "keep_last=2" in one["warned"][0] and "tried again at step 3" in one["warned"][0]
    assert len(zero["warned"]) == 1 and "step 2 was not saved to the local tier" in zero["warned"][0]
    assert zero["steps"] == one["steps"] == [1]  # step 2 was never committed on either node

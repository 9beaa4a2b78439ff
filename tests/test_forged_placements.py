"""Forged placements of tensors, resealed (every record, shard and seal rewritten, as tests/forging.py does): a
tensor placed twice, or a file of a rank the checkpoint never had, is refused by loads and ``verify`` alike."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import torchrl_dcp as tdcp
from tests import forging


def _saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    torch.manual_seed(0)
    state = {"a": torch.randn(16), "b": torch.randn(16)}
    big = {"big": torch.randn(1 << 20, 4)}  # 16 MiB of rows: chunk files (8 MiB chunks)
    ckpt = tdcp.DistributedCheckpoint(big=big)
    ckpt.register("per", state, placement="per_rank")
    return ckpt.save(tmp_path / "ck"), {**state, **big}


def _entry_twice(m: dict[str, Any]) -> None:
    """A second entry for ``per``'s ``a``, pointing at ``b``'s record (the last entry won: ``a`` loaded ``b``)."""
    entries = m["index"]["entries"]
    a = next(e for e in entries if e[0].endswith("/per/a"))
    b = next(e for e in entries if e[0].endswith("/per/b"))
    entries.append([a[0], b[1], b[2], b[3]])


def _whole_and_chunked(m: dict[str, Any]) -> None:
    """``big`` placed whole over its first chunk's record besides its chunk table (the entry was ignored)."""
    key, chunks = next(iter(m["chunks"].items()))
    first = chunks[0]
    m["index"]["entries"].append([key, first["file"], first["offset"], first["length"]])


FORGERIES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "an entry twice": (_entry_twice, r"place tensor 'rank/0/per/a' twice"),
    "whole and in chunks": (_whole_and_chunked, r"placed both whole \(a storage entry\) and in chunks"),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_tensor_placed_twice_is_refused(tmp_path: Path, name: str) -> None:
    path, _ = _saved(tmp_path)
    forge, match = FORGERIES[name]
    forging.edit(path, forge)
    with pytest.raises(tdcp.CheckpointFormatError, match=match):
        tdcp.verify(path)
    state: dict[str, Any] = {"a": torch.zeros(16), "b": torch.zeros(16)}
    ckpt = tdcp.DistributedCheckpoint(big={"big": torch.zeros(1 << 20, 4)})
    ckpt.register("per", state, placement="per_rank")
    with pytest.raises(tdcp.CheckpointFormatError, match=match):
        ckpt.load(path)
    assert not state["a"].any()  # (nothing restored)


def test_a_file_of_a_rank_the_checkpoint_never_had_is_refused(tmp_path: Path) -> None:
    """A 1-rank checkpoint whose replicated tensors sit in ``__1_shared.distcp`` (its trailer rewritten to rank 1,
    every record resealed) loaded and verified: a file name only had to agree with its trailer."""
    from torchrl_dcp.format.layout import TRAILER_SIZE, identity_trailer, read_identity

    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 2)
    path = tdcp.DistributedCheckpoint(policy=policy).save(tmp_path / "ck")
    old, new = "__0_shared.distcp", "__1_shared.distcp"
    data = (path / old).read_bytes()
    save_id, _ = read_identity(data[-TRAILER_SIZE:])
    (path / new).write_bytes(data[:-TRAILER_SIZE] + identity_trailer(save_id, 1))
    (path / old).unlink()

    def move(m: dict[str, Any]) -> None:
        m["files"][new] = m["files"].pop(old)
        m["index"]["entries"] = [[k, new if f == old else f, o, n] for k, f, o, n in m["index"]["entries"]]

    forging.edit(path, move)
    forging.reseal(path, new)
    match = r"files lists '__1_shared.distcp', a file of rank 1, in a checkpoint of 1 rank\(s\)"
    with pytest.raises(tdcp.CheckpointFormatError, match=match):
        tdcp.verify(path)
    with pytest.raises(tdcp.CheckpointFormatError, match=match):
        tdcp.DistributedCheckpoint(policy=torch.nn.Linear(4, 2)).load(path)
    shutil.rmtree(path)

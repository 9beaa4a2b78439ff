"""Rows written while a save writes them (a collector's thread, an async save of a memory-mapped buffer) may or may
not be in the checkpoint, but the checkpoint it commits verifies and loads: every checksum is of the bytes written.
The concurrent writer is simulated deterministically: the live tensor changes between two writes of the save."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrl_dcp as tdcp
from torchrl_dcp.format.checksums import crc32
from torchrl_dcp.format.record import template
from torchrl_dcp.storage import chunk_writer, writer


def _changing(monkeypatch: pytest.MonkeyPatch, module: Any, live: torch.Tensor) -> list[int]:
    """Make ``module``'s writes change ``live`` after each write (as a thread writing rows would)."""
    original = module.pwrite_all
    calls: list[int] = []

    def pwrite_all(fd: int, data: Any, offset: int) -> None:
        original(fd, data, offset)
        calls.append(offset)
        live.add_(1)  # every element, so that whatever is read next differs from what was read before

    monkeypatch.setattr(module, "pwrite_all", pwrite_all)
    return calls


@pytest.mark.parametrize("kind", ["large record", "chunk files", "small records"])
def test_a_state_written_during_the_save_commits_a_checkpoint_that_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    if kind == "chunk files":  # >= 16 MiB: one file per 8 MiB chunk of rows (chunking.py)
        live, module = torch.zeros(5 << 20, dtype=torch.float32), chunk_writer
    elif kind == "large record":  # >= 1 MiB in the rank's data file, written in 1 MiB pieces
        live, module = torch.zeros(3 << 18, dtype=torch.float32), writer
    else:
        live, module = torch.zeros(64, dtype=torch.float32), writer
    state = {"rows": live}
    if kind == "small records":  # packed records: the live tensor changes right after a checksum is taken
        original, calls = writer.crc32, []

        def changing_crc32(data: Any, value: int = 0) -> int:
            out = original(data, value)
            calls.append(0)
            live.add_(1)
            return out

        monkeypatch.setattr(writer, "crc32", changing_crc32)
    else:
        calls = _changing(monkeypatch, module, live)
    path = tdcp.DistributedCheckpoint(no_dist=True, app=state).save(tmp_path / "c")
    assert calls  # the writes happened through the patched function
    tdcp.verify(path)
    fresh: dict[str, Any] = {}
    tdcp.DistributedCheckpoint(no_dist=True, app=fresh).load(path)
    plain = torch.empty_like(live)  # plain dcp.load reads it too
    dcp.load({"replicated/app/rows": plain}, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(plain, fresh["rows"])
    for key, name, offset, length in tdcp.read_manifest(path)["index"]["entries"]:  # the record's own CRC (ZIP)
        tpl = template(live.dtype, tuple(live.shape))
        record = (Path(path) / name).read_bytes()[offset : offset + length]
        stored = struct.unpack_from("<I", record, tpl.head_crc_at)[0]
        assert stored == crc32(record[len(tpl.head) : len(tpl.head) + tpl.nbytes]), key
    values = set(fresh["rows"].unique().tolist())
    assert values <= set(range(len(calls) + 1))  # each element old or newer, never bytes of nothing

"""Direct reads (storage/direct.py): plain tensors read from their records without dcp.load, chunked ones too."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import torchrl_dcp as tdcp
from torchrl_dcp import load_engine, load_plan
from torchrl_dcp.errors import CheckpointIntegrityError, IncompatibleComponentError, UnsafeCheckpointError
from torchrl_dcp.format.checksums import crc32, format_crc
from torchrl_dcp.storage.direct import read_direct
from torchrl_dcp.storage.reader import InPlaceFileSystemReader


def _record(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.clone().contiguous(), buf)
    return buf.getvalue()


def chunked(root: Path, full: torch.Tensor, cuts: list[tuple[int, int]], dim: int = 0) -> tuple[Metadata, dict]:
    """A plain-DCP-style checkpoint of ``full`` split into chunks (rows ``[a, b)`` along ``dim``), each chunk a
    torch.save record in a data file of its own (``__0_c<k>.distcp``, after some leading bytes)."""
    chunks, storage, checksums = [], {}, {}
    for k, (a, b) in enumerate(cuts):
        part = full.narrow(dim, a, b - a)
        offsets = [0] * full.dim()
        offsets[dim] = a
        name = f"__0_c{k}.distcp"
        pad = b"x" * (7 + k)  # a record need not start at the file's beginning
        data = pad + _record(part) + b"trailer"
        (root / name).write_bytes(data)
        checksums[name] = format_crc(crc32(data))
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=part.shape))
        storage[MetadataIndex("w", torch.Size(offsets))] = _StorageInfo(name, len(pad), len(data) - len(pad) - 7)
    props = TensorProperties(dtype=full.dtype)
    md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(props, full.shape, chunks)}, storage_data=storage)
    return md, checksums


@pytest.mark.parametrize("cuts", [[(0, 3), (3, 7), (7, 10)], [(7, 10), (0, 7)], [(0, 10)]])
def test_multi_chunk_tensor_is_read_in_place_chunk_by_chunk(tmp_path: Path, cuts: list[tuple[int, int]]) -> None:
    full = torch.arange(10 * 6, dtype=torch.float64).reshape(10, 6)
    md, checksums = chunked(tmp_path, full, cuts)
    reader = InPlaceFileSystemReader(tmp_path, metadata=md, verify=checksums)
    dest = torch.full_like(full, -1.0)
    ptr = dest.data_ptr()
    assert read_direct(reader, md, {"w": dest}) == {}
    assert torch.equal(dest, full) and dest.data_ptr() == ptr
    assert reader.stats["in_place"] == len(cuts) and reader.stats["fallback"] == 0
    assert reader.stats["verified_files"] == len(cuts)


def test_a_damaged_chunk_file_is_refused(tmp_path: Path) -> None:
    full = torch.arange(40, dtype=torch.int32).reshape(8, 5)
    md, checksums = chunked(tmp_path, full, [(0, 4), (4, 8)])
    path = tmp_path / "__0_c1.distcp"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # in the record's central directory, not in the tensor bytes
    path.write_bytes(bytes(data))
    reader = InPlaceFileSystemReader(tmp_path, metadata=md, verify=checksums)
    with pytest.raises(CheckpointIntegrityError, match="checksum"):
        read_direct(reader, md, {"w": torch.zeros(8, 5, dtype=torch.int32)})


def test_chunks_not_split_along_dim_0_are_left_to_dcp(tmp_path: Path) -> None:
    full = torch.arange(24.0).reshape(4, 6)
    md, _ = chunked(tmp_path, full, [(0, 2), (2, 6)], dim=1)
    dest = torch.zeros(4, 6)
    rest = read_direct(InPlaceFileSystemReader(tmp_path, metadata=md), md, {"w": dest})
    assert list(rest) == ["w"] and rest["w"] is dest and not dest.any()


def test_missing_or_overlapping_chunks_are_left_to_dcp(tmp_path: Path) -> None:
    full = torch.arange(24.0).reshape(6, 4)
    md, _ = chunked(tmp_path, full, [(0, 4), (2, 6)])  # rows 2..3 twice
    assert list(read_direct(InPlaceFileSystemReader(tmp_path, metadata=md), md, {"w": torch.zeros(6, 4)})) == ["w"]
    md, _ = chunked(tmp_path, full, [(0, 2), (3, 6)])  # row 2 nowhere
    assert list(read_direct(InPlaceFileSystemReader(tmp_path, metadata=md), md, {"w": torch.zeros(6, 4)})) == ["w"]


def test_destinations_are_checked_against_the_metadata(tmp_path: Path) -> None:
    full = torch.arange(12.0).reshape(3, 4)
    md, _ = chunked(tmp_path, full, [(0, 3)])
    reader = InPlaceFileSystemReader(tmp_path, metadata=md)
    with pytest.raises(IncompatibleComponentError, match="destination is torch.float64"):
        read_direct(reader, md, {"w": torch.zeros(3, 4, dtype=torch.float64)})
    with pytest.raises(IncompatibleComponentError, match="not in the checkpoint"):
        read_direct(reader, md, {"v": torch.zeros(3, 4)})
    md.state_dict_metadata["b"] = BytesStorageMetadata()
    with pytest.raises(UnsafeCheckpointError):
        read_direct(reader, md, {"b": torch.zeros(1)})


def test_non_contiguous_destinations_go_through_the_fallback(tmp_path: Path) -> None:
    full = torch.arange(12.0).reshape(3, 4)
    md, _ = chunked(tmp_path, full, [(0, 1), (1, 3)])
    dest = torch.zeros(4, 3).t()  # (3, 4), not contiguous
    reader = InPlaceFileSystemReader(tmp_path, metadata=md)
    assert read_direct(reader, md, {"w": dest}) == {}
    assert torch.equal(dest, full) and reader.stats["fallback"] == 2


def _no_dcp_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("dcp.load was called for plain tensors")

    monkeypatch.setattr(load_engine.dcp, "load", refuse)


def test_plain_components_load_without_dcp_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {f"t{i}": torch.randn(4) for i in range(50)}
    model = torch.nn.Linear(3, 2)
    path = tdcp.DistributedCheckpoint(w=state, m=model).save(tmp_path / "c")
    archive = tdcp.to_archive(path, tmp_path / "c.zip")
    _no_dcp_load(monkeypatch)
    for where in (path, archive):
        fresh_state = {k: torch.zeros(4) for k in state}
        fresh_model = torch.nn.Linear(3, 2)
        result = tdcp.DistributedCheckpoint(w=fresh_state, m=fresh_model).load(where)
        assert result.loaded == {"w", "m"}
        assert all(torch.equal(fresh_state[k], v) for k, v in state.items())
        assert torch.equal(fresh_model.weight, model.weight) and torch.equal(fresh_model.bias, model.bias)


def test_a_file_changed_after_verification_is_caught_by_the_final_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files read into live tensors are checksummed before the load changes anything and again while read in
    place: a file changed in between is refused; what was restored first is rolled back, the error names what
    the final read may have left (tensors large enough to be read from the file in place, not prefetched)."""
    monkeypatch.setattr(load_plan, "PREFETCH_MAX", 0)
    state = {"a": torch.arange(6.0)}
    model = torch.nn.Linear(4, 3)
    path = tdcp.DistributedCheckpoint(w=state, m=model).save(tmp_path / "c")
    # "a" of another shape: read into a fresh tensor, restored before the final in-place read
    source = tdcp.DistributedCheckpoint(w={"a": torch.zeros(5)}, m=torch.nn.Linear(4, 3))
    keep = {"a": source._components["w"].value["a"]}
    original = load_engine._restore_all
    calls = []

    def restore_then_change(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if not calls:  # after the components read into fresh buffers, before the final in-place read
            data = path / "__0_shared.distcp"
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            data.write_bytes(bytes(raw))
        calls.append(1)
        return out

    monkeypatch.setattr(load_engine, "_restore_all", restore_then_change)
    with pytest.raises(CheckpointIntegrityError) as info:
        source.load(path)
    assert "changed meanwhile" in info.value.message and "['m'] may hold partly loaded values" in info.value.message
    assert source._components["w"].value == keep  # the dict restored first was rolled back
    assert info.value.result is not None and not info.value.result.loaded


def test_small_live_tensors_are_prefetched_and_copied_in_at_the_in_place_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module's small tensors are read (and checked) with the fresh buffers, and copied into the live tensors at
    the in-place read: the final read reads no file, a file changed after the first read changes nothing, the
    parameters are the same objects with the saved values, and autograd hears of the write. Past the budget, the
    rest is read in place from the file."""
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    path = tdcp.DistributedCheckpoint(m=saved).save(tmp_path / "c")
    reads: list[set[str]] = []
    original_read, original_restore = load_engine.read, load_engine._restore_all

    def recording_read(src: Any, request: Any, tensors: dict, *args: Any, **kwargs: Any) -> Any:
        reads.append(set(tensors))
        return original_read(src, request, tensors, *args, **kwargs)

    def restore_then_change(*args: Any, **kwargs: Any) -> Any:
        out = original_restore(*args, **kwargs)
        if len(reads) == 1:  # before the in-place read: the file no longer matters
            data = path / "__0_shared.distcp"
            raw = bytearray(data.read_bytes())
            raw[len(raw) // 2] ^= 0x01
            data.write_bytes(bytes(raw))
        return out

    monkeypatch.setattr(load_engine, "read", recording_read)
    monkeypatch.setattr(load_engine, "_restore_all", restore_then_change)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    versions = [p._version for p in params]
    tdcp.DistributedCheckpoint(m=model).load(path)
    assert len(reads[0]) == 4 and reads[1] == set()  # every tensor read first, none from the file in place
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values()))
    assert all(p._version > v for p, v in zip(params, versions))

    reads.clear()
    monkeypatch.setattr(load_engine, "_restore_all", original_restore)
    monkeypatch.setattr(load_plan, "PREFETCH_BUDGET", 3 * 4 * 4)  # the first weight only (48 bytes)
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    path = tdcp.DistributedCheckpoint(m=saved).save(tmp_path / "d")
    tdcp.DistributedCheckpoint(m=other).load(path)
    assert len(reads[0]) == 1 and len(reads[1]) == 3
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), saved.state_dict().values()))


@pytest.mark.parametrize("order", ["owner first", "reference first"])
def test_a_prefetched_tensor_another_component_refers_to_is_read_once_for_both(tmp_path: Path, order: str) -> None:
    """An exploration module registered beside the policy that holds it: its tensors are saved once, the second
    component refers to them. Planned before the policy, the reference got a fresh buffer, and prefetching the
    policy's tensor gave it a second one: the reference's was never read (garbage restored)."""
    from tensordict.nn import TensorDictModule, TensorDictSequential
    from torchrl.data import OneHot
    from torchrl.modules import EGreedyModule

    def build() -> tuple[Any, Any]:
        torch.manual_seed(0)
        greedy = EGreedyModule(OneHot(2), eps_init=1.0, eps_end=0.05, annealing_num_steps=200)
        return TensorDictSequential(TensorDictModule(torch.nn.Linear(2, 2), ["obs"], ["action"]), greedy), greedy

    policy, greedy = build()
    greedy.step()
    greedy.eps_init.fill_(0.7)
    path = tdcp.DistributedCheckpoint(policy=policy, exploration=greedy).save(tmp_path / "c")
    policy2, greedy2 = build()
    components = {"policy": policy2, "exploration": greedy2}
    if order == "reference first":
        components = dict(reversed(components.items()))
    tdcp.DistributedCheckpoint(**components).load(path)
    assert all(torch.equal(a, b) for a, b in zip(greedy2.state_dict().values(), greedy.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(policy2.state_dict().values(), policy.state_dict().values()))


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("order", ["owner first", "reference first"])
def test_a_reference_to_a_tensor_read_in_place_gets_the_saved_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prefetch: bool, order: str
) -> None:
    """Two components that shared a module at save (the second stored as references to the first's tensors) load
    into objects that do not share: the referring one was restored from the owner's live tensor before the final
    in-place read filled it (its old values, silently)."""
    if not prefetch:
        monkeypatch.setattr(load_plan, "PREFETCH_MAX", 0)
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3)
    path = tdcp.DistributedCheckpoint(a=lin, b=torch.nn.Sequential(lin)).save(tmp_path / "c")
    torch.manual_seed(5)
    lin2, other = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    components = {"a": lin2, "b": torch.nn.Sequential(other)}
    if order == "reference first":
        components = dict(reversed(components.items()))
    tdcp.DistributedCheckpoint(**components).load(path)
    for module in (lin2, other):
        assert torch.equal(module.weight, lin.weight) and torch.equal(module.bias, lin.bias)


@pytest.mark.parametrize("damage", [False, True])
def test_large_records_are_read_by_threads_in_turn_and_checksummed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: bool
) -> None:
    """Large records: pieces dealt to two threads in turn through one handle, pages mapped ahead, each piece
    checksummed as it lands (thresholds shrunk so that a small tensor takes that path)."""
    from torchrl_dcp.storage import reader as reader_module
    from torchrl_dcp.storage import readitems

    monkeypatch.setattr(readitems, "SMALL", 1 << 10)
    monkeypatch.setattr(reader_module, "SMALL", 1 << 10)
    monkeypatch.setattr(reader_module, "PARALLEL", 64 << 10)
    monkeypatch.setattr(reader_module, "READ_PIECE", 16 << 10)
    monkeypatch.setattr(readitems, "_POPULATE_STEP", 64 << 10)
    full = torch.randn(250_000 // 5, 5)  # ~1 MiB: 62 pieces
    md, checksums = chunked(tmp_path, full, [(0, 20_000), (20_000, 50_000)])
    if damage:
        path = tmp_path / "__0_c1.distcp"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10  # inside the tensor bytes
        path.write_bytes(bytes(data))
    reader = InPlaceFileSystemReader(tmp_path, metadata=md, verify=checksums, threads=2)
    dest = torch.zeros_like(full)
    if damage:
        with pytest.raises(CheckpointIntegrityError, match="checksum"):
            read_direct(reader, md, {"w": dest})
        return
    assert read_direct(reader, md, {"w": dest}) == {}
    assert torch.equal(dest, full) and reader.stats["in_place"] == 2 and reader.stats["verified_files"] == 2

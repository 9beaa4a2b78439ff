"""The in-place storage reader: no intermediate tensors, bit-identical results, fallbacks, checksums while reading."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrl_dcp as tdcp
from torchrl_dcp.format.record import zip_data_offset
from torchrl_dcp.storage import reader as reader_mod
from torchrl_dcp.storage.backends import open_source
from torchrl_dcp.storage.filesums import file_checksum
from torchrl_dcp.storage.reader import InPlaceFileSystemReader
from torchrl_dcp.storage.writer import write_state

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {
        "f32": torch.randn(3, 5, generator=g),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4, dtype=torch.int64),
        "bool": torch.rand(7, generator=g) > 0.5,
        "bf16": torch.randn(4, 3, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "f64": torch.randn(2, 2, 2, generator=g, dtype=torch.float64),
        "i8": torch.randint(-128, 127, (33,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (3, 84, 84), generator=g, dtype=torch.uint8),
        "i32": torch.randint(-(2**31), 2**31 - 1, (5,), generator=g, dtype=torch.int32),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        "large": torch.randn(3 << 20, generator=g),  # 12 MiB: read in chunks, not batched
        # records of 1-32 MiB next to each other: read one per thread at a time
        "mid_a": torch.randn(400_000, generator=g),
        "mid_b": torch.randint(0, 255, (2 << 20,), generator=g, dtype=torch.uint8),
        "mid_c": torch.randn(300_000, generator=g, dtype=torch.float64),
    }
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _count_fallbacks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    original = InPlaceFileSystemReader.fallback

    def counted(self, req, planner, data):  # type: ignore[no-untyped-def]
        calls.append(req.storage_index.fqn)
        return original(self, req, planner, data)

    monkeypatch.setattr(InPlaceFileSystemReader, "fallback", counted)
    return calls


def test_our_files_are_read_in_place_bit_identical_to_dcp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    (tmp_path / "c").mkdir()
    out = write_state(state, tmp_path / "c")
    reference = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(reference, checkpoint_id=str(tmp_path / "c"), no_dist=True)  # DCP's own reader

    fallbacks = _count_fallbacks(monkeypatch)
    loads: list[int] = []
    original_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(1) or original_load(*a, **k))
    dest = {k: torch.full_like(v, 7) if v.dtype != torch.bool else torch.zeros_like(v) for k, v in state.items()}
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    reader = InPlaceFileSystemReader(tmp_path / "c", verify={"__0_0.distcp": out.files["__0_0.distcp"]["checksum"]})
    dcp.load(dest, storage_reader=reader, no_dist=True)

    assert fallbacks == [] and loads == []  # no intermediate tensor, no torch.load
    assert {k: v.data_ptr() for k, v in dest.items()} == ptrs  # read into the destinations themselves
    assert reader.stats["in_place"] >= len(state) - 1 and reader.stats["verified_files"] == 1
    for k in state:
        assert torch.equal(_bits(dest[k]), _bits(reference[k])), k
        assert torch.equal(_bits(dest[k]), _bits(state[k])), k


def test_plain_dcp_save_is_read_in_place_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    fallbacks = _count_fallbacks(monkeypatch)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    reader = InPlaceFileSystemReader(tmp_path / "d")
    dcp.load(dest, storage_reader=reader, no_dist=True)
    assert fallbacks == [] and reader.stats["in_place"] >= len(state) - 1
    assert all(torch.equal(_bits(dest[k]), _bits(state[k])) for k in state)


def test_fallback_for_unknown_layouts_and_non_contiguous_destinations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    fallbacks = _count_fallbacks(monkeypatch)

    # a non-contiguous destination: DCP's path (torch.load + copy)
    dest = {"f32": torch.empty(5, 3).t(), "large": torch.empty(3 << 20)}
    dcp.load(dest, storage_reader=InPlaceFileSystemReader(tmp_path / "d"), no_dist=True)
    assert fallbacks == ["f32"]
    assert torch.equal(dest["f32"], state["f32"]) and torch.equal(dest["large"], state["large"])

    # a record layout the reader does not recognise: DCP's path for every record, same result
    fallbacks.clear()
    monkeypatch.setattr(reader_mod, "record_data_offset", lambda *a, **k: None)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(dest, storage_reader=InPlaceFileSystemReader(tmp_path / "d"), no_dist=True)
    assert len(fallbacks) >= len(state) - 1
    assert all(torch.equal(_bits(dest[k]), _bits(state[k])) for k in state)


def test_record_parser_refuses_what_it_does_not_know() -> None:
    import io

    buf = io.BytesIO()
    torch.save(torch.arange(6.0).reshape(2, 3), buf)
    raw = buf.getvalue()

    def read(o: int, n: int) -> bytes:
        return raw[o : o + n]

    at = zip_data_offset(read, len(raw), torch.float32, (2, 3))
    assert at is not None and torch.frombuffer(bytearray(raw[at : at + 24]), dtype=torch.float32).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    assert zip_data_offset(read, len(raw), torch.float32, (3, 2)) is None  # another shape
    assert zip_data_offset(read, len(raw), torch.int32, (2, 3)) is None  # another dtype
    assert zip_data_offset(read, len(raw) - 1, torch.float32, (2, 3)) is None  # not a ZIP end
    buf = io.BytesIO()
    torch.save(torch.arange(6.0)[1:4], buf)  # a view: storage larger than the tensor
    raw = buf.getvalue()
    assert zip_data_offset(read, len(raw), torch.float32, (3,)) is None


def _model_ckpt(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))
    return tdcp.DistributedCheckpoint(model=model).save(tmp_path / "m"), model


def test_load_checksums_while_reading_and_refuses_a_flipped_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torchrl_dcp import load_plan

    monkeypatch.setattr(load_plan, "PREFETCH_MAX", 0)  # every tensor read in place (small ones are read ahead)
    path, model = _model_ckpt(tmp_path)
    from torchrl_dcp.storage.directory import DirectoryContainer

    checked: list[object] = []
    original = DirectoryContainer.check
    monkeypatch.setattr(
        DirectoryContainer, "check", lambda self, checksum: checked.append(checksum) or original(self, checksum)
    )
    torch.manual_seed(1)
    live = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))
    tdcp.DistributedCheckpoint(model=live).load(path)
    assert checked == [{"__0_shared.distcp"}]  # read straight into the live module: checksummed before that
    assert all(torch.equal(a, b) for a, b in zip(live.state_dict().values(), model.state_dict().values()))

    data = path / "__0_shared.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    torch.manual_seed(2)
    live = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(tdcp.CheckpointIntegrityError, match="checksum") as info:
        tdcp.DistributedCheckpoint(model=live).load(path)
    assert "__0_shared.distcp" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())  # nothing restored


def test_live_in_place_destinations_are_checksummed_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    def buffer(seed: int) -> ReplayBuffer:
        rb = ReplayBuffer(storage=LazyTensorStorage(64), batch_size=4)
        g = torch.Generator().manual_seed(seed)
        rb.extend(TensorDict({"obs": torch.randn(40, 3, generator=g)}, [40]))
        return rb

    path = tdcp.DistributedCheckpoint(rb=buffer(0)).save(tmp_path / "rb")
    from torchrl_dcp.storage.directory import DirectoryContainer

    checked: list[object] = []
    original = DirectoryContainer.check
    monkeypatch.setattr(
        DirectoryContainer, "check", lambda self, checksum: checked.append(checksum) or original(self, checksum)
    )
    target = buffer(1)
    tdcp.DistributedCheckpoint(rb=target).load(path)
    # read into the live storage: verified before that read, by the read of the sampler and writer state (fresh
    # buffers) from the same file, which checksums it whole before anything is restored
    assert checked == [set()]
    assert torch.equal(target.storage._storage["obs"][:40], buffer(0).storage._storage["obs"][:40])

    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    target = buffer(1)
    # rows 40..63 were never written (torch.empty) and may hold NaN bit patterns: compare bits, not values
    before = target.storage._storage["obs"].view(torch.int32).clone()
    with pytest.raises(tdcp.CheckpointIntegrityError, match="checksum"):
        tdcp.DistributedCheckpoint(rb=target).load(path)
    assert torch.equal(target.storage._storage["obs"].view(torch.int32), before)


def test_archive_loads_in_place_and_refuses_a_damaged_member(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, model = _model_ckpt(tmp_path)
    archive = tdcp.to_archive(path, tmp_path / "m.zip")
    fallbacks = _count_fallbacks(monkeypatch)
    live = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))
    tdcp.DistributedCheckpoint(model=live).load(archive)
    assert fallbacks == []
    assert all(torch.equal(a, b) for a, b in zip(live.state_dict().values(), model.state_dict().values()))

    src = open_source(archive)
    m = src.container.member("__0_shared.distcp")
    raw = bytearray(archive.read_bytes())
    raw[m.data_offset + m.size // 2] ^= 0x01
    archive.write_bytes(bytes(raw))
    src = open_source(archive)
    flat = {}
    meta = src.dcp_metadata()
    for key, item in meta.state_dict_metadata.items():
        flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
    reader = src.storage_reader(verify=["__0_shared.distcp"])
    with pytest.raises(BaseException, match="checksum"):
        dcp.load(flat, storage_reader=reader, no_dist=True)
    assert file_checksum(path / "__0_shared.distcp") == src.manifest()["files"]["__0_shared.distcp"]["checksum"]


def test_fast_load_plan_equals_dcps(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from torchrl_dcp.planner import SafeLoadPlanner
    from torchrl_dcp.storage.filesystem import SafeFileSystemReader

    state = _state()
    state["param"] = torch.nn.Parameter(torch.ones(5))
    dcp.save(state, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    metadata = SafeFileSystemReader(tmp_path / "d").read_metadata()
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    ours, theirs = SafeLoadPlanner(), DefaultLoadPlanner(flatten_state_dict=False)
    ours.set_up_planner(dest, metadata, True)
    theirs.set_up_planner(dest, metadata, True)
    assert ours.create_local_plan().items == theirs.create_local_plan().items
    item = ours.create_local_plan().items[0]
    assert ours.resolve_tensor(item) is dest[item.dest_index.fqn]


@pytest.mark.parametrize("where", [0.1, 0.3, 0.5, 0.7, 0.9, 1.0])
def test_a_flipped_byte_anywhere_fails_the_inline_checksum(tmp_path: Path, where: float) -> None:
    """Records read in one thread, in several at once, split between threads, and the bytes between them."""
    state = _state()
    (tmp_path / "c").mkdir()
    out = write_state(state, tmp_path / "c")
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[min(int(len(raw) * where), len(raw) - 1)] ^= 0x10
    data.write_bytes(bytes(raw))
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    reader = InPlaceFileSystemReader(
        tmp_path / "c", verify={"__0_0.distcp": out.files["__0_0.distcp"]["checksum"]}, threads=2
    )
    with pytest.raises(dcp.api.CheckpointException) as info:
        dcp.load(dest, storage_reader=reader, no_dist=True)
    (failure,) = info.value.failures.values()
    failure = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(failure, tdcp.CheckpointIntegrityError) and "the file is damaged" in str(failure)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io")
def test_a_file_read_fresh_and_in_place_is_checksummed_once_before_the_in_place_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file holding tensors read into fresh buffers (a dict, most of the file) and tensors read in place (a module)
    is checksummed whole by the fresh read, which ends before anything is restored: no separate pass before it (the
    file is read twice, not three times). A flipped byte still fails the load with every object unchanged."""
    torch.manual_seed(0)
    model, stats = torch.nn.Linear(64, 64), {"t": torch.arange(300_000.0)}
    path = tdcp.DistributedCheckpoint(model=model, stats=stats).save(tmp_path / "c")
    data = path / "__0_shared.distcp"
    size = data.stat().st_size
    assert size > 1 << 20  # both components are replicated: one shared file holds them

    def load(seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        torch.manual_seed(seed)
        live, fresh = torch.nn.Linear(64, 64), {"t": torch.zeros(300_000)}
        tdcp.DistributedCheckpoint(model=live, stats=fresh).load(path)
        return live, fresh

    load(1)  # warm: modules imported, pages cached
    before = _rchar()
    live, fresh = load(2)
    read = _rchar() - before
    assert torch.equal(live.weight, model.weight) and torch.equal(fresh["t"], stats["t"])
    assert 2 * size <= read < 2.5 * size, (read, size)  # the fresh read (whole, checksummed), the in-place read

    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    torch.manual_seed(3)
    live, fresh = torch.nn.Linear(64, 64), {"t": torch.zeros(300_000)}
    weight = live.weight.detach().clone()
    with pytest.raises(tdcp.CheckpointIntegrityError, match="checksum") as info:
        tdcp.DistributedCheckpoint(model=live, stats=fresh).load(path)
    assert "__0_shared.distcp" in str(info.value)
    assert torch.equal(live.weight, weight) and torch.equal(fresh["t"], torch.zeros(300_000))  # nothing restored


def test_small_records_read_in_place_are_checked_in_runs_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a load reads into live tensors it compares every record with our writer's layout: small records are
    compared in runs read whole (2,001 records of a module: one read), not with two reads each (4,002 before)."""
    from torchrl_dcp.storage.source import CheckpointSource

    def module(seed: int) -> torch.nn.Module:
        g = torch.Generator().manual_seed(seed)
        m = torch.nn.Module()
        for i in range(2000):
            m.register_buffer(f"b{i}", torch.randn(64, generator=g))
        m.register_buffer("flags", torch.rand(16, generator=g) > 0.5)
        return m

    saved = module(0)
    path = tdcp.DistributedCheckpoint(model=saved).save(tmp_path / "c")
    spans: list[tuple[int, int]] = []
    read_many = CheckpointSource.read_many

    def counted(self: CheckpointSource, name: str, asked: list[tuple[int, int]]) -> list[bytes]:
        spans.extend(asked)
        return read_many(self, name, asked)

    monkeypatch.setattr(CheckpointSource, "read_many", counted)
    live = module(1)
    tdcp.DistributedCheckpoint(model=live).load(path)
    assert all(torch.equal(a, b) for a, b in zip(live.state_dict().values(), saved.state_dict().values()))
    assert 1 <= len(spans) <= 2, len(spans)

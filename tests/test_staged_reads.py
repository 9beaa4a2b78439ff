"""Reads into tensors off the CPU go through host windows (``storage/staging.py``), never through ``torch.load``.

No GPU here: the staged path is forced for CPU destinations (``staged`` patched to say yes), which runs every line
of it but the page-locked window. The matrix crosses dtypes, record sizes (batched small records, large records,
records split between threads), component kinds (a dict read into fresh tensors and checksummed while read, a module
read in place after its files were checksummed, a tensor cut into chunk files) and verification; each load must be
bit for bit the saved state, read without the fallback, with host windows of at most one read piece. A damaged file
is refused and changes nothing; loads from object stores (memory, S3) are staged too. On a machine with CUDA the last
test does the same for real.
"""

from __future__ import annotations

import itertools
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrl_dcp as tdcp
from torchrl_dcp import chunking
from torchrl_dcp.storage import objectstore_read, readitems, staging
from torchrl_dcp.storage import reader as reader_mod
from torchrl_dcp.storage.reader import InPlaceFileSystemReader
from torchrl_dcp.storage.writer import write_state

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")

PIECE = 4096  # read piece (window size) in these tests
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.int8, torch.bool, torch.complex64, torch.int64]
SIZES = {"small": 300, "large": 40_000, "split": 200_000}  # bytes of the tensor: batched / one thread / split


def _tensor(dtype: torch.dtype, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(n // 2 if n % 2 == 0 and n > 1 else n, -1).clone()


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _holding(kind: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``tensors`` as a dict of clones, or as the buffers of a module (``kind``)."""
    if kind != "module":
        return {k: v.clone() for k, v in tensors.items()}
    module = torch.nn.Module()
    for k, v in tensors.items():
        module.register_buffer(k, v.clone())
    return module


class Spy:
    """Counts staged reads, fallbacks and window sizes while the staged path is forced for CPU destinations."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.staged = 0
        self.small = 0
        self.fallbacks: list[Any] = []
        self.windows: list[int] = []
        forced = staticmethod(lambda t: t.device.type != "meta")
        monkeypatch.setattr(readitems, "staged", forced)
        monkeypatch.setattr(reader_mod, "staged", forced)
        monkeypatch.setattr(staging, "READ_PIECE", PIECE)
        monkeypatch.setattr(reader_mod, "SMALL", 8192)
        monkeypatch.setattr(readitems, "SMALL", 8192)
        monkeypatch.setattr(reader_mod, "PARALLEL", 65536)
        self.store_copies = 0
        real_read, real_copy, real_window = staging.read_staged, staging.copy_record, staging.host_window
        real_into = staging.copy_into
        real_fallback = InPlaceFileSystemReader.fallback

        def read(*a: Any, **k: Any) -> Any:
            self.staged += 1
            return real_read(*a, **k)

        def copy(*a: Any, **k: Any) -> Any:
            self.small += 1
            return real_copy(*a, **k)

        def window(size: int, device: torch.device) -> torch.Tensor:
            self.windows.append(size)
            return real_window(size, device)

        def fallback(this: Any, req: Any, *a: Any, **k: Any) -> Any:
            self.fallbacks.append(req.storage_index.fqn)
            return real_fallback(this, req, *a, **k)

        def into(*a: Any, **k: Any) -> Any:
            self.store_copies += 1
            return real_into(*a, **k)

        monkeypatch.setattr(objectstore_read, "copy_into", into)
        monkeypatch.setattr(reader_mod, "read_staged", read)
        monkeypatch.setattr(staging, "copy_record", copy)
        monkeypatch.setattr(staging, "host_window", window)
        monkeypatch.setattr(InPlaceFileSystemReader, "fallback", fallback)


CASES = list(itertools.product(DTYPES, SIZES, ["dict", "module", "chunked"], [True, False]))


@pytest.mark.parametrize(
    "dtype,size,kind,verify", CASES, ids=[f"{str(d)[6:]}-{s}-{k}-{'v' if v else 'nv'}" for d, s, k, v in CASES]
)
def test_staged_loads_are_bit_exact_without_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, size: str, kind: str, verify: bool
) -> None:
    monkeypatch.setenv("TDCP_READ_THREADS", "3")
    if kind == "chunked":  # cut along the first dimension into chunk files of 8 KiB
        monkeypatch.setattr(chunking, "CHUNK_BYTES", 8192)
        monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 16384)
    saved = {"w": _tensor(dtype, SIZES[size], 0), "b": _tensor(dtype, 64, 1)}
    if kind == "module":
        obj: Any = torch.nn.Module()
        for k, v in saved.items():
            obj.register_buffer(k, v.clone())
    else:
        obj = {k: v.clone() for k, v in saved.items()}
    path = tdcp.DistributedCheckpoint(state=obj).save(tmp_path / "ck")
    if kind == "module":
        live: Any = torch.nn.Module()
        for k, v in saved.items():
            live.register_buffer(k, torch.zeros_like(v))
    else:
        live = {k: torch.zeros_like(v) for k, v in saved.items()}

    spy = Spy(monkeypatch)
    tdcp.DistributedCheckpoint(state=live).load(path, verify=verify)

    got = dict(live.named_buffers()) if kind == "module" else live
    for k, v in saved.items():
        assert _bits(got[k]) == _bits(v), k
    assert spy.fallbacks == []
    assert spy.staged + spy.small >= 2  # both tensors went through the staged path
    assert spy.staged >= (size != "small") and max(spy.windows, default=0) <= PIECE


@pytest.mark.parametrize("kind", ["dict", "module"])
@pytest.mark.parametrize("where", [0.3, 0.9])
def test_a_damaged_file_read_through_host_windows_is_refused_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, where: float
) -> None:
    saved = torch.randn(50_000)
    obj: Any = {"w": saved.clone()}
    if kind == "module":
        obj = torch.nn.Module()
        obj.register_buffer("w", saved.clone())
    path = tdcp.DistributedCheckpoint(state=obj).save(tmp_path / "ck")
    data = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[int(len(raw) * where)] ^= 0x10
    data.write_bytes(bytes(raw))
    before = torch.full_like(saved, 7.0)
    live: Any = {"w": before.clone()}
    if kind == "module":
        live = torch.nn.Module()
        live.register_buffer("w", before.clone())
    Spy(monkeypatch)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=data.name):
        tdcp.DistributedCheckpoint(state=live).load(path)
    now = live.w if kind == "module" else live["w"]
    assert torch.equal(now, before)


@pytest.mark.parametrize("kind", ["dict", "module"])
def test_a_damaged_batch_of_small_records_bound_for_a_device_is_refused_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Small records copied to the device per batch (``copy_batch``): a flipped byte in the data of one of them is
    refused (the file's checksum), naming the file, and the live tensors keep their values."""
    saved = {f"p{i}": torch.randn(30 + i) for i in range(40)}
    path = tdcp.DistributedCheckpoint(state=_holding(kind, saved)).save(tmp_path / "ck")
    data = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    needle = saved["p20"].numpy().tobytes()[:16]
    raw[raw.index(needle) + 5] ^= 0x01  # inside p20's bytes, not a header a parser would trip on
    data.write_bytes(bytes(raw))
    before = {k: torch.full_like(v, 7.0) for k, v in saved.items()}
    live = _holding(kind, before)
    Spy(monkeypatch)
    with pytest.raises(tdcp.CheckpointIntegrityError, match=data.name):
        tdcp.DistributedCheckpoint(state=live).load(path)
    now = dict(live.named_buffers()) if kind == "module" else live
    for k, v in before.items():
        assert torch.equal(now[k], v), k


def test_dcp_planned_reads_are_staged_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``dcp.load`` (DCP's planner resolves the destinations), as for DTensors and unusual chunkings."""
    state = {str(d)[6:]: _tensor(d, s, i) for i, (d, s) in enumerate(itertools.product(DTYPES, SIZES.values()))}
    (tmp_path / "c").mkdir()
    out = write_state(state, tmp_path / "c")
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    spy = Spy(monkeypatch)
    reader = InPlaceFileSystemReader(tmp_path / "c", verify={"__0_0.distcp": out.files["__0_0.distcp"]["checksum"]})
    dcp.load(dest, storage_reader=reader, no_dist=True)
    for k, v in state.items():
        assert _bits(dest[k]) == _bits(v), k
    assert spy.fallbacks == [] and reader.stats["staged"] == len(state) and reader.stats["verified_files"] == 1


@pytest.mark.parametrize("backend", ["memory", "s3"])
@pytest.mark.parametrize("verify", [True, False])
def test_object_store_loads_are_staged_too(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, backend: str, verify: bool
) -> None:
    """Responses of ranged GETs are copied into the destinations through a host window: records within one GET
    (small ones, a module's weights) and a record larger than a GET (1 MiB here), chunk records and whole ones."""
    if backend == "memory":
        url, options = f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}", {}
    else:
        s3 = request.getfixturevalue("s3")
        url, options = s3.url(), s3.storage_options
    monkeypatch.setenv("TDCP_STORE_RANGE_SIZE", str(1 << 20))
    g = torch.Generator().manual_seed(3)
    saved = {"big": torch.randn(3 << 20, generator=g), "mid": torch.randn(70_000, generator=g).to(torch.bfloat16)}
    policy = torch.nn.Linear(32, 64)
    saving = tdcp.DistributedCheckpoint(
        state={k: v.clone() for k, v in saved.items()}, policy=policy, storage_options=options
    )
    path = saving.save(f"{url}/c")
    live = {k: torch.zeros_like(v) for k, v in saved.items()}
    fresh_policy = torch.nn.Linear(32, 64)
    spy = Spy(monkeypatch)
    tdcp.DistributedCheckpoint(state=live, policy=fresh_policy, storage_options=options).load(path, verify=verify)
    for k, v in saved.items():
        assert _bits(live[k]) == _bits(v), k
    for a, b in zip(policy.state_dict().values(), fresh_policy.state_dict().values()):
        assert _bits(a) == _bits(b)
    assert spy.fallbacks == [] and spy.store_copies >= 4
    assert max(spy.windows, default=0) <= PIECE


@pytest.mark.parametrize("kind", ["dict", "module"])
def test_small_records_of_a_batch_are_copied_to_the_device_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Many small tensors (a many-parameter model): one batch read, its records copied from one staged copy of the
    batch (``copy_batch``), each at its own offset, bit for bit; mixed dtypes and sizes, an empty tensor among them."""
    g = torch.Generator().manual_seed(5)
    saved = {f"p{i}": _tensor(DTYPES[i % len(DTYPES)], 40 + 37 * i, i) for i in range(60)}
    saved["empty"] = torch.zeros(0)
    path = tdcp.DistributedCheckpoint(state=_holding(kind, saved)).save(tmp_path / "ck")
    live = _holding(kind, {k: torch.randint(0, 9, v.shape, generator=g).to(v.dtype) for k, v in saved.items()})
    spy = Spy(monkeypatch)
    batches: list[int] = []
    real_batch = staging.copy_batch

    def batch(copies: Any, *a: Any, **k: Any) -> Any:
        batches.append(len(copies))
        return real_batch(copies, *a, **k)

    monkeypatch.setattr(reader_mod, "copy_batch", batch)
    tdcp.DistributedCheckpoint(state=live).load(path)
    got = dict(live.named_buffers()) if kind == "module" else live
    for k, v in saved.items():
        assert _bits(got[k]) == _bits(v), k
    assert spy.fallbacks == [] and sum(batches) == spy.small == 60 and max(batches) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_destinations_are_read_through_page_locked_windows(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    saved = {"big": torch.randn(3 << 20, generator=g), "small": torch.randn(7, generator=g)}
    saved.update({f"p{i}": torch.randn(1 + i, generator=g).to(DTYPES[i % 4]) for i in range(300)})  # one batch
    module = torch.nn.Module()
    for k, v in saved.items():
        module.register_buffer(k, v.clone())
    path = tdcp.DistributedCheckpoint(policy=module).save(tmp_path / "ck")
    live = torch.nn.Module()
    for k, v in saved.items():
        live.register_buffer(k, torch.zeros_like(v, device="cuda"))
    tdcp.DistributedCheckpoint(policy=live).load(path)
    for k, v in saved.items():
        assert torch.equal(getattr(live, k).cpu(), v), k

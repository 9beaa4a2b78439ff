"""Writes of tensors off the CPU: the small ones of a device are brought to host memory together (writes, replica
fingerprints, async staging).

No GPU here: the device path is forced for CPU tensors (``record.on_device`` / ``async_save.staged_together``
patched to say yes), which runs every line of it but the CUDA stream (the gather of their bytes, in one piece or
several, one copy each, the split). Each save must load back bit for bit, through our loader and through a plain
``dcp.load`` of the files, with every small tensor taken from the gathered copy. On a machine with CUDA the last test
does the same for real.
"""

from __future__ import annotations

import uuid
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import torchrl_dcp as tdcp
from torchrl_dcp import async_save, replicas
from torchrl_dcp.format import record
from torchrl_dcp.storage import writer


def _bits(t: torch.Tensor) -> bytes:
    flat = t.resolve_conj().resolve_neg().reshape(-1).clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy().tobytes()


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    out: dict[str, torch.Tensor] = {}
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.float64, torch.int64]):
        out[f"t{i}"] = torch.randint(0, 100, (7 + i, 3), generator=g).to(dtype)
    out["transposed"] = torch.randn(5, 4, generator=g).t()  # not contiguous
    out["conj"] = torch.randn(6, dtype=torch.complex64, generator=g).conj()  # a conjugate bit to resolve
    out["scalar"] = torch.tensor(2.5)
    out["expanded"] = torch.tensor(3.0).expand(1)  # stride 0
    out["empty"] = torch.zeros(0, 4)
    out["large"] = torch.randn((2 << 20) // 4, generator=g)  # 2 MiB: written on its own
    return out


def _forced_gathers(monkeypatch: pytest.MonkeyPatch, user: Any) -> list[int]:
    """Force the device path for CPU tensors and count, per call, the tensors ``user``'s ``host_bytes`` gathered."""
    gathered: list[int] = []
    real = record.host_bytes

    def spy(tensors: Any, small: int) -> Any:
        out = real(tensors, small)
        gathered.append(len(out))
        return out

    monkeypatch.setattr(record, "on_device", lambda t: True)
    monkeypatch.setattr(user, "host_bytes", spy)
    return gathered


@pytest.mark.parametrize("gather", [None, 256], ids=["one-gather", "gathers-of-256-bytes"])
@pytest.mark.parametrize("kind", ["dict", "module"])
def test_small_device_tensors_are_copied_to_the_host_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, gather: int | None
) -> None:
    saved = _state()
    obj: Any = {k: v.clone() for k, v in saved.items()}
    if kind == "module":
        obj = torch.nn.Module()
        for k, v in saved.items():
            obj.register_buffer(k, v.clone())
    gathered = _forced_gathers(monkeypatch, writer)
    if gather is not None:  # the device memory of one gather bounded: several gathers
        monkeypatch.setattr(record, "GATHER_BYTES", gather)
    path = tdcp.DistributedCheckpoint(state=obj).save(tmp_path / "ck")
    monkeypatch.undo()
    if gather is None:
        assert sum(gathered) == len(saved) - 2  # every tensor but the empty one and the large one
    else:  # in several gathers; a tensor alone in its gather (or over the bound) is copied on its own
        assert 2 <= sum(gathered) < len(saved) - 2

    live: Any = {k: torch.zeros_like(v) for k, v in saved.items()}
    if kind == "module":
        live = torch.nn.Module()
        for k, v in saved.items():
            live.register_buffer(k, torch.zeros_like(v))
    tdcp.DistributedCheckpoint(state=live).load(path)
    got = dict(live.named_buffers()) if kind == "module" else live
    prefix = "replicated/state/"
    plain = {f"{prefix}{k}": torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    for k, v in saved.items():
        assert _bits(got[k]) == _bits(v), k
        assert _bits(plain[f"{prefix}{k}"]) == _bits(v), k


@pytest.mark.parametrize("where", ["directory", "object store"])
def test_large_device_tensors_reach_host_memory_a_window_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A sync save copies each large device tensor of a data file to the host one window at a time, as it writes it,
    not all of them before writing: at most one window per writer is in host memory. Forced for CPU tensors, each
    window a fresh copy whose lifetime is tracked; the checkpoint loads bit for bit (ours, and plain ``dcp.load``)."""
    g = torch.Generator().manual_seed(5)
    saved = {f"w{i}": torch.randn(3 + i, (1 << 20) // 4, generator=g)[:1].clone() for i in range(4)}  # 1 row each
    saved["odd"] = torch.randint(0, 9, ((5 << 20) // 4 + 3,), generator=g, dtype=torch.int32)  # not a multiple
    saved["transposed"] = torch.randn(512, 600, generator=g).t()  # not contiguous: copied whole
    saved["small"] = torch.arange(10.0)
    live, peak, windows = [0], [0], []

    def spy(self: Any, start: int, length: int) -> memoryview:
        copy = np.array(real(self, start, length))  # a fresh host buffer, as a device's copy would be
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        weakref.finalize(copy, lambda: live.__setitem__(0, live[0] - 1))
        windows.append(length)
        return memoryview(copy)

    real = record.DeviceBytes.window
    monkeypatch.setattr(record, "on_device", lambda t: True)
    monkeypatch.setattr(record.DeviceBytes, "window", spy)
    monkeypatch.setattr(writer, "DEVICE_WINDOW", 1 << 20)
    target: Any = tmp_path / "ck" if where == "directory" else f"memory://tdcp-staged/{uuid.uuid4().hex}/ck"
    path = tdcp.DistributedCheckpoint(state={k: v.clone() for k, v in saved.items()}).save(target)
    monkeypatch.undo()
    big = sum(v.numel() * v.element_size() for k, v in saved.items() if k not in ("transposed", "small"))
    assert sum(windows) == big * (1 if where == "directory" else 2)  # an upload reads a window for its CRC, then again
    assert max(windows) == 1 << 20 and len(windows) > 8
    assert 1 <= peak[0] <= 2  # a window per writer (two write threads at most), never the file's tensors at once
    got = {k: torch.zeros_like(v) for k, v in saved.items()}
    tdcp.DistributedCheckpoint(state=got).load(path)
    for k, v in saved.items():
        assert _bits(got[k]) == _bits(v), k
    if where == "directory":
        plain = {f"replicated/state/{k}": torch.zeros_like(v) for k, v in saved.items()}
        dcp.load(plain, checkpoint_id=path, no_dist=True)
        for k, v in saved.items():
            assert _bits(plain[f"replicated/state/{k}"]) == _bits(v), k


def test_device_bytes_copy_on_the_stream_current_where_they_were_made() -> None:
    """The windows of a tensor are its bytes, any range (on the CPU: views of it)."""
    t = torch.arange(1000, dtype=torch.int16)
    source = record.DeviceBytes(t)
    assert bytes(source.window(0, 2000)) == _bits(t)
    assert bytes(source.window(1998, 2)) == _bits(t[-1:])
    assert source.stream is None
    assert not record.streamed(t)  # on the CPU: written from where it is
    with pytest.MonkeyPatch.context() as m:
        m.setattr(record, "on_device", lambda t: True)
        assert (
            record.streamed(t)
            and not record.streamed(t.view(10, 100).t())
            and not record.streamed(torch.randn(4, dtype=torch.complex64).conj())
        )


def test_one_small_tensor_of_a_device_is_copied_on_its_own() -> None:
    assert record.host_bytes([torch.ones(3)], 1 << 20) == {}  # on the CPU: written from where it is
    with pytest.MonkeyPatch.context() as m:
        m.setattr(record, "on_device", lambda t: True)
        assert record.host_bytes([torch.ones(3), torch.ones(1 << 20)], 1 << 20) == {}  # one small, one large
        both = record.host_bytes([torch.ones(3), torch.arange(2, dtype=torch.int8)], 1 << 20)
    assert [bytes(both[0]), bytes(both[1])] == [_bits(torch.ones(3)), b"\x00\x01"]


@pytest.mark.parametrize("mode", ["sample", "full"])
def test_replica_digests_of_small_device_tensors_are_the_same_gathered(
    monkeypatch: pytest.MonkeyPatch, mode: replicas.ReplicaCheck
) -> None:
    """Every rank fingerprints its replicated tensors; small ones on a device are copied to the host together,
    with the same fingerprints as one copy each (ranks on other devices must agree)."""
    flat = {f"replicated/state/{k}": v for k, v in _state().items()}
    flat["replicated/state/mid"] = torch.arange(50_000, dtype=torch.int32)  # sampled in "sample", whole in "full"
    rec = SimpleNamespace(placement="replicated", state={"t": "dict"}, inventory=dict.fromkeys(flat))
    alone = replicas.digest({"state": rec}, flat, {"state": mode})
    gathered = _forced_gathers(monkeypatch, replicas)
    assert replicas.digest({"state": rec}, flat, {"state": mode}) == alone
    assert gathered == [len(flat) - 2 - (mode == "sample")]  # not the empty one, the large one, "mid" when sampled


@pytest.mark.parametrize("gather", [None, 64], ids=["one-gather", "gathers-of-64-bytes"])
def test_async_staging_gathers_small_device_tensors_into_one_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gather: int | None
) -> None:
    """An async save stages the small tensors of a device together (one gather, one copy into a reused host buffer,
    a view each at an aligned offset); forced for CPU tensors here. The checkpoint holds the state at the call,
    bit for bit, as a sync save does; the buffer is reused by the next save."""
    saved = {k: v for k, v in _state().items() if k != "large"}
    obj = torch.nn.Module()
    for k, v in saved.items():
        obj.register_buffer(k, v.clone())

    def forced(t: torch.Tensor) -> bool:
        return 0 < t.numel() * t.element_size() < (1 << 16) and record.can_write_fast(t)

    monkeypatch.setattr(async_save, "staged_together", forced)
    gathered: list[dict[str, torch.Tensor]] = []
    real = async_save.AsyncSaver._stage_together

    def spy(self: Any, tensors: Any, stream: Any) -> Any:
        out = real(self, tensors, stream)
        gathered.append(out)
        return out

    monkeypatch.setattr(async_save.AsyncSaver, "_stage_together", spy)
    if gather is not None:
        monkeypatch.setattr(async_save, "GATHER_BYTES", gather)
    ckpt = tdcp.DistributedCheckpoint(state=obj)
    handle = ckpt.async_save(tmp_path / "a")
    for v in obj.buffers():
        v.zero_() if v.dtype != torch.bool else v.fill_(False)  # after the call: not in the checkpoint
    handle.wait()
    ckpt.async_save(tmp_path / "b").wait()
    ckpt.close()
    assert len(gathered) == 2 and len(gathered[0]) == len(saved) - 1  # every tensor but the empty one
    first = gathered[0]
    storages = {t.untyped_storage().data_ptr() for t in first.values()}
    assert len(storages) == 1 and all(
        t.storage_offset() * t.element_size() % async_save.ALIGN == 0 for t in first.values()
    )
    assert {t.untyped_storage().data_ptr() for t in gathered[1].values()} == storages  # reused
    for k, t in first.items():
        assert t.dtype == saved[k.split("/")[-1]].dtype and t.shape == saved[k.split("/")[-1]].shape, k
    live = torch.nn.Module()
    for k, v in saved.items():
        live.register_buffer(k, torch.ones_like(v))
    tdcp.DistributedCheckpoint(state=live).load(tmp_path / "a")
    for k, v in saved.items():
        assert _bits(getattr(live, k)) == _bits(v), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_saved_sync_and_async_load_bit_exact(tmp_path: Path) -> None:
    """On a GPU (``benchmarks/gpu.sh`` runs it): many small CUDA tensors and a large one, saved, async-saved (the
    live tensors changed right after the call, on the current stream) and replica-fingerprinted, load bit for bit."""
    g = torch.Generator().manual_seed(2)
    dtypes = [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64]
    saved = {f"p{i}": torch.randint(0, 2, (1 + i % 17, 3), generator=g).to(dtypes[i % 5]) for i in range(300)}
    saved["large"] = torch.randn(1 << 20, generator=g)
    module = torch.nn.Module()
    for k, v in saved.items():
        module.register_buffer(k, v.cuda())
    ckpt = tdcp.DistributedCheckpoint(policy=module)
    ckpt.save(tmp_path / "sync")
    handle = ckpt.async_save(tmp_path / "async")
    for v in module.buffers():
        v.bitwise_not_() if v.dtype in (torch.bool, torch.int8) else v.mul_(2)
    handle.wait()
    ckpt.close()
    for name in ("sync", "async"):
        live = torch.nn.Module()
        for k, v in saved.items():
            live.register_buffer(k, torch.zeros_like(v))
        tdcp.DistributedCheckpoint(policy=live).load(tmp_path / name)
        for k, v in saved.items():
            assert _bits(getattr(live, k)) == _bits(v), (name, k)

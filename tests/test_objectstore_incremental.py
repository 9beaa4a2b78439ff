"""Incremental saves into object stores: unchanged chunk objects are copied server-side from the base's prefix.

Each case saves a replay buffer to a store, changes it, then saves incrementally and in
full from the same live state: the two checkpoints hold the same tensors (read back by
loads, and by plain ``dcp.load`` of downloaded copies), the kept objects were copied (never
uploaded) and record their ``origin``, and the incremental checkpoint stands alone once
the base is deleted. Backends: ``memory://`` and s3fs against a local moto server.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import torchrl_dcp as tdcp
from torchrl_dcp import chunking
from torchrl_dcp.storage import objectstore_save
from torchrl_dcp.storage.filesystem import safe_load_metadata
from torchrl_dcp.storage.objectstore_save import remove_prefix
from torchrl_dcp.storage.objectstore_tools import download_checkpoint
from torchrl_dcp.storage.urls import resolve_path

CAPACITY = 1000


@pytest.fixture(params=["memory", "s3"])
def store(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if request.param == "memory":
        return f"memory://tdcp-tests/{uuid.uuid4().hex[:12]}", {}
    s3 = request.getfixturevalue("s3")
    return s3.url(), s3.storage_options


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunking, "CHUNK_BYTES", 4096)  # 64 obs rows per chunk object
    monkeypatch.setattr(chunking, "MIN_CHUNKED_BYTES", 8192)


@pytest.fixture
def uploads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the objects uploaded by saves (copies are not uploads)."""
    names: list[str] = []
    orig = objectstore_save.upload_pieces

    def recording(path: Any, pieces: Any, size: int) -> None:
        names.append(path.name)
        orig(path, pieces, size)

    monkeypatch.setattr(objectstore_save, "upload_pieces", recording)
    return names


def batch(n: int, start: int) -> TensorDict:
    idx = torch.arange(start, start + n)
    return TensorDict({"obs": (idx[:, None] * 1000 + torch.arange(16)).float(), "done": idx % 5 == 0}, [n])


def buffer() -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=8)


def tensors_of(path: Any, tmp: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, downloaded and read by plain ``dcp.load``."""
    local = download_checkpoint(path, tmp / uuid.uuid4().hex[:8])
    md = safe_load_metadata(local / ".metadata")
    dest = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
    dcp.load(dest, checkpoint_id=str(local), no_dist=True)
    return dest


def kept(path: Any) -> dict[str, str]:
    """``{file: origin}`` of the objects kept from an earlier save."""
    return {n: r["origin"] for n, r in tdcp.read_manifest(path)["files"].items() if "origin" in r}


def chunk_objects(path: Any, key_part: str = "obs") -> set[str]:
    chunks = tdcp.read_manifest(path)["chunks"]
    return {e["file"] for k, es in chunks.items() if key_part in k for e in es}


def same_buffer(a: TensorDictReplayBuffer, b: TensorDictReplayBuffer) -> bool:
    return len(a) == len(b) and (a[: len(a)].exclude("index") == b[: len(b)].exclude("index")).all()


def w_extend(rb: TensorDictReplayBuffer) -> None:
    rb.extend(batch(10, 5000))


def w_setitem(rb: TensorDictReplayBuffer) -> None:
    rb[torch.tensor([3, 400, 877])] = batch(3, 8000)


def w_in_place(rb: TensorDictReplayBuffer) -> None:
    rb._storage._storage["obs"][512] += 1.0  # bypassing the storage's API: found by content


@pytest.mark.parametrize("write", [w_extend, w_setitem, w_in_place], ids=lambda f: f.__name__[2:])
def test_incremental_save_to_a_store_equals_a_full_save(
    store: tuple[str, dict[str, Any]], uploads: list[str], tmp_path: Path, write: Any
) -> None:
    url, options = store
    rb = buffer()
    rb.extend(batch(900, 0))
    ckpt = tdcp.DistributedCheckpoint(buffer=rb, storage_options=options)
    base = ckpt.save(f"{url}/base")
    write(rb)
    uploads.clear()
    inc = ckpt.save(f"{url}/inc", incremental_from=base)
    inc_uploads = set(uploads)
    full = ckpt.save(f"{url}/full")
    a, b = tensors_of(inc, tmp_path), tensors_of(full, tmp_path)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    obs, kept_now = chunk_objects(inc), kept(inc)
    assert obs & set(kept_now) and obs - set(kept_now)  # some chunk objects kept, the changed ones written
    assert set(kept_now.values()) == {tdcp.read_manifest(base)["save_id"]}
    assert not set(kept_now) & inc_uploads and (obs - set(kept_now)) <= inc_uploads  # kept ones were copied
    remove_prefix(resolve_path(str(base), options))  # the incremental checkpoint stands alone
    assert tdcp.verify(inc, storage_options=options)["unchecked"] == []
    restored = buffer()
    tdcp.DistributedCheckpoint(buffer=restored, storage_options=options).load(inc)
    assert same_buffer(restored, rb)


def test_base_in_another_store_or_local_means_a_full_save(
    store: tuple[str, dict[str, Any]], uploads: list[str], tmp_path: Path
) -> None:
    url, options = store
    rb = buffer()
    rb.extend(batch(900, 0))
    ckpt = tdcp.DistributedCheckpoint(buffer=rb, storage_options=options)
    local = ckpt.save(tmp_path / "local")
    assert kept(ckpt.save(f"{url}/a", incremental_from=local)) == {}
    if url.startswith("s3://"):  # a base in another store (memory://): no server-side copy between them
        other = tdcp.DistributedCheckpoint(buffer=rb).save(f"memory://tdcp-other/{uuid.uuid4().hex[:8]}/b")
        assert kept(ckpt.save(f"{url}/c", incremental_from=other)) == {}


def base_and_victim(url: str, options: dict[str, Any]) -> tuple[TensorDictReplayBuffer, Any, Any, str, Any]:
    """A buffer saved at ``<url>/base``, and the first of its chunk objects (name and path): the one to forge."""
    rb = buffer()
    rb.extend(batch(900, 0))
    ckpt = tdcp.DistributedCheckpoint(buffer=rb, storage_options=options)
    base = ckpt.save(f"{url}/base")
    victim = sorted(chunk_objects(base))[0]
    return rb, ckpt, base, victim, resolve_path(f"{url}/base/{victim}", options)


@pytest.mark.parametrize("when", ["before the save", "between check and copy"])
def test_replaced_base_object_is_uploaded_again(
    store: tuple[str, dict[str, Any]], uploads: list[str], monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    url, options = store
    if when == "between check and copy":  # the check finds every object as recorded: the copy is checked again
        monkeypatch.setattr(objectstore_save, "keepable_objects", lambda keeps: keeps)
    rb, ckpt, base, victim, obj = base_and_victim(url, options)
    data = bytearray(obj.fs.cat_file(obj.key))
    data[-1] ^= 1  # its identity trailer no longer names the base's save
    obj.fs.pipe_file(obj.key, bytes(data))
    uploads.clear()
    inc = ckpt.save(f"{url}/inc", incremental_from=base)
    assert victim in uploads and victim not in kept(inc) and len(kept(inc)) >= 10
    restored = buffer()
    tdcp.DistributedCheckpoint(buffer=restored, storage_options=options).load(inc)
    assert same_buffer(restored, rb)


def test_rotation_saves_incrementally_into_a_store(store: tuple[str, dict[str, Any]], uploads: list[str]) -> None:
    url, options = store
    rotation = tdcp.CheckpointRotation(f"{url}/run", keep_last=2, storage_options=options)
    rb = buffer()
    rb.extend(batch(900, 0))
    ckpt = tdcp.DistributedCheckpoint(buffer=rb, storage_options=options)
    ids = []
    for step in range(1, 5):
        rb.extend(batch(20, 1000 * step))
        uploads.clear()
        path = rotation.save(ckpt, step=step)
        ids.append(tdcp.read_manifest(path)["save_id"])
        if step > 1:  # kept objects come from earlier saves (copied again from copies: the first writer's origin)
            assert kept(path) and set(kept(path).values()) <= set(ids[:-1]) and not set(kept(path)) & set(uploads)
    assert [e.step for e in rotation.entries()] == [3, 4]  # the older ones pruned: the survivors stand alone
    for e in rotation.entries():
        assert tdcp.verify(e.path, storage_options=options)["unchecked"] == []
    restored = buffer()
    info = tdcp.CheckpointRotation(f"{url}/run", storage_options=options).resume(
        tdcp.DistributedCheckpoint(buffer=restored, storage_options=options)
    )
    assert info is not None and info.step == 4 and same_buffer(restored, rb)


@pytest.mark.parametrize("remembered", [True, False], ids=["same_process", "fresh_process"])
def test_base_object_rewritten_and_resealed_is_uploaded_again(
    store: tuple[str, dict[str, Any]], uploads: list[str], remembered: bool
) -> None:
    """A forger rewrites a base chunk object's rows (its trailer intact) and reseals the manifest: the object is
    not the version this process wrote, so its rows are uploaded, never copied; objects unknown to the process
    (a resumed job) are uploaded too."""
    import json

    from torchrl_dcp.format.checksums import crc32, format_crc
    from torchrl_dcp.format.manifest import seal
    from torchrl_dcp.format.shards import record_shards
    from torchrl_dcp.storage import proven

    url, options = store
    rb, ckpt, base, victim, obj = base_and_victim(url, options)
    data = bytearray(obj.fs.cat_file(obj.key))
    data[len(data) // 2] ^= 0x40  # inside the rows
    obj.fs.pipe_file(obj.key, bytes(data))
    manifest_obj = resolve_path(f"{url}/base/manifest.json", options)
    m = json.loads(manifest_obj.fs.cat_file(manifest_obj.key))
    shard_obj = resolve_path(f"{url}/base/manifest-0.json", options)
    shard = json.loads(shard_obj.fs.cat_file(shard_obj.key))
    assert victim in shard["files"]  # the buffer's chunk objects are rank 0's own: listed in its shard (format 7)
    shard["files"][victim]["checksum"] = format_crc(crc32(bytes(data)))
    shard_bytes = json.dumps(shard).encode()
    shard_obj.fs.pipe_file(shard_obj.key, shard_bytes)
    record_shards(m, {0: {"size": len(shard_bytes), "checksum": format_crc(crc32(shard_bytes))}})
    manifest_obj.fs.pipe_file(manifest_obj.key, json.dumps(seal(m)).encode())
    if not remembered:
        proven.forget_all()
    uploads.clear()
    inc = ckpt.save(f"{url}/inc", incremental_from=base)
    assert victim in uploads and victim not in kept(inc)
    assert bool(kept(inc)) == remembered  # the genuine objects are still copied, by a process that wrote them
    restored = buffer()
    tdcp.DistributedCheckpoint(buffer=restored, storage_options=options).load(inc)
    assert same_buffer(restored, rb)


@pytest.mark.parametrize("how", ["sync", "async"])
def test_a_save_onto_its_own_base_in_a_store_is_whole(store: tuple[str, dict[str, Any]], how: str) -> None:
    """``async_save(p, incremental_from=p)`` on a store: the save retires the destination's objects before it copies
    the kept chunks, and an async save had not staged their rows: it failed and the checkpoint at ``p`` was gone
    (a local directory hard-links before it replaces). Saved in full, it commits and loads exactly."""
    url, options = store
    rb = buffer()
    rb.extend(batch(900, 0))
    ckpt = tdcp.DistributedCheckpoint(buffer=rb, storage_options=options)
    path = ckpt.save(f"{url}/c", step=1)
    rb.extend(batch(5, 5000))
    if how == "sync":
        ckpt.save(path, step=2, incremental_from=path)
    else:
        ckpt.async_save(path, step=2, incremental_from=path).wait()
    restored = buffer()
    assert tdcp.DistributedCheckpoint(buffer=restored, storage_options=options).load(path).step == 2
    assert same_buffer(restored, rb)

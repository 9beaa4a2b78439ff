"""Forged files whose parse would cost far more than their size: refused before they cost it.

- DCP's ``.metadata`` (pickle opcodes, read by the allow-list unpickler): a file of 1-byte ``EMPTY_SET`` opcodes
  built ~224x its size in sets before it was refused; a 20-byte ``BYTEARRAY8`` claiming gigabytes allocated them.
  Now every opcode is charged what it builds, refused past ``METADATA_PARSE_RATIO`` times the file's size.
- A manifest's state skeleton: a mapping (or set) of int, float or tuple keys that all share one hash (ints
  ``k + i * (2**61 - 1)``) took quadratic time to build (40,000 keys: 26 s in ``verify`` and ``load``). Now the
  hashes of non-str keys of large containers are counted, and a hash repeated too often is refused.
"""

from __future__ import annotations

import gc
import pickle
import pickletools
import struct
import tracemalloc
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError
from torchrl_dcp.format import codec, dcp_metadata, key_hashes
from torchrl_dcp.format.codec import TensorSink, decode
from torchrl_dcp.format.dcp_metadata import metadata_fragments, parse_metadata, spliced_metadata

P = (1 << 61) - 1  # ints k + i * P all hash to k
PROTO = pickle.PROTO + bytes([4])
RATIO, FLOOR = 64, 1 << 20  # the documented bound: objects of at most 64x a .metadata's size, plus 1 MiB
MAX_EQUAL_HASHES = 8  # keys of one hash a large container may hold
REFUSED = r"x/\.metadata: refused to unpickle DCP metadata of \d+ bytes: .*the file is damaged or forged"


def _budget(data: bytes) -> int:
    return RATIO * len(data) + FLOOR


def _charged(data: bytes) -> int:
    """What the unpickler charges ``data``'s opcodes (all of them: the file is parsed whole)."""
    costs = dcp_metadata._OPCODE_COST
    return sum(costs[op.code.encode("latin-1")[0]] for op, _, _ in pickletools.genops(data))


# ---------------------------------------------------------------------- .metadata: memory bounded by its size
def test_a_few_mib_of_empty_set_opcodes_are_refused_before_the_bound_is_built(monkeypatch: Any) -> None:
    """2 MiB of ``EMPTY_SET`` (~470 MB of sets unbounded): refused, naming the file, after at most the bound's
    worth of sets (64x the file: 129 MiB)."""
    built = 0

    def counted_empty_set(self: Any) -> None:
        nonlocal built
        built += 1
        self.append(set())

    monkeypatch.setitem(dcp_metadata._MetadataUnpickler.dispatch, pickle.EMPTY_SET[0], counted_empty_set)
    data = PROTO + pickle.EMPTY_SET * (2 << 20) + pickle.STOP
    with pytest.raises(CheckpointIntegrityError, match="over 129 MiB of objects, more than 64x its size") as err:
        parse_metadata(data, "x/.metadata")
    assert err.value.path == "x/.metadata" and "damaged or forged" in str(err.value)
    assert 0 < built <= _budget(data) // 224 < len(data) // 3


@pytest.mark.parametrize(
    "body",
    [
        pickle.EMPTY_SET * (128 << 10),  # 1 byte, a 216-byte set each
        pickle.EMPTY_LIST + (pickle.EMPTY_SET + pickle.APPEND) * (64 << 10),  # the sets kept in a list
        (pickle.EMPTY_DICT + pickle.MEMOIZE) * (128 << 10),  # dicts, each in a new memo entry
    ],
    ids=["sets", "sets-in-a-list", "memoized-dicts"],
)
def test_dense_metadata_builds_at_most_its_bound_in_memory(body: bytes) -> None:
    """Measured with tracemalloc: whatever a forged ``.metadata`` builds before it is refused (or fails) stays
    within 64x its size plus 1 MiB (the sets alone cost ~112-224x unbounded)."""
    data = PROTO + body + pickle.STOP
    gc.collect()
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointIntegrityError, match=REFUSED):
            parse_metadata(data, "x/.metadata")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= _budget(data) + (256 << 10), f"built {peak >> 10} KiB from {len(data) >> 10} KiB"


def test_a_bytearray_longer_than_the_file_is_refused_before_it_is_allocated() -> None:
    """``BYTEARRAY8`` allocates (and zeroes) the length it claims before reading its bytes: 20 bytes claiming
    2**62 bytes are refused, not handed to the allocator (2 GiB claimed took 2 GiB of memory)."""
    data = PROTO + pickle.BYTEARRAY8 + struct.pack("<Q", 1 << 62) + pickle.STOP
    with pytest.raises(CheckpointIntegrityError, match=r"a bytearray of 4611686018427387904 bytes, more than the"):
        parse_metadata(data, "x/.metadata")
    honest = PROTO + pickle.BYTEARRAY8 + struct.pack("<Q", 3) + b"abc" + pickle.STOP
    with pytest.raises(CheckpointFormatError, match="holds a bytearray, not a Metadata"):
        parse_metadata(honest, "x/.metadata")  # (the bytes are read as before)


def _chunked_metadata(tensors: int, chunks: int) -> Metadata:
    """DCP's metadata of ``tensors`` tensors in ``chunks`` row chunks each, one file per chunk (what a large
    replay buffer's chunk files make: the densest layout this library writes)."""
    state, storage = {}, {}
    for t in range(tensors):
        fqn = f"replicated/buffer/_storage/t{t}"
        parts = []
        for c in range(chunks):
            parts.append(ChunkStorageMetadata(offsets=torch.Size([c * 100, 0]), sizes=torch.Size([100, 8])))
            storage[MetadataIndex(fqn, torch.Size([c * 100, 0]))] = _StorageInfo(f"c_{t}_{c}.distcp", 0, 3200)
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([chunks * 100, 8]), parts)
    return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta(save_id="0" * 32))


def test_the_metadata_saves_write_is_charged_well_under_the_bound(tmp_path: Path) -> None:
    """No false refusal: the metadata of a save (500 tensors), and of 20 tensors in 50 row chunks pickled both as
    DCP pickles it and as the commit splices it, are charged at most half the bound (measured: ~10x, ~22x and ~17x
    their size), and parse."""
    assert (dcp_metadata.METADATA_PARSE_RATIO, dcp_metadata.METADATA_PARSE_FLOOR) == (RATIO, FLOOR)
    assert key_hashes.MAX_EQUAL_HASHES == MAX_EQUAL_HASHES
    state = {f"layer{i}.weight": torch.zeros(i % 7 + 1, 3) for i in range(500)}
    path = tdcp.DistributedCheckpoint(no_dist=True, model=state).save(tmp_path / "c")
    chunked = _chunked_metadata(20, 50)
    shared = Metadata(state_dict_metadata={}, storage_data={}, storage_meta=chunked.storage_meta)
    for data in (
        (path / ".metadata").read_bytes(),
        pickle.dumps(chunked),
        spliced_metadata(shared, [metadata_fragments(chunked)]),
    ):
        assert _charged(data) <= RATIO * len(data) // 2, _charged(data) / len(data)
        assert isinstance(parse_metadata(data, "x/.metadata"), Metadata)


# ---------------------------------------------------------------------- skeletons: keys of one hash
class _CountingSink(TensorSink):
    """Counts the values :func:`decode` reaches (each value below is a tensor node)."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = 0

    def take(self, node: dict[str, Any]) -> Any:
        self.taken += 1
        return None


VALUE = {"t": "tensor", "key": "v", "dtype": "float32", "shape": [1], "device": "cpu"}


def _mapping(keys: list[Any], kind: str = "dict") -> dict[str, Any]:
    return {"t": kind, "items": [[k, VALUE] for k in keys]}


def _colliding(n: int) -> list[int]:
    """``n`` ints of hash 5 (past 2**61: an int below is its own hash, and is not counted)."""
    return [5 + i * P for i in range(1, n + 1)]


@pytest.mark.parametrize(
    "keys",
    [
        _colliding(20_000),
        [{"t": "tuple", "items": [k]} for k in _colliding(20_000)],  # a tuple of one int hashes as the int does
        [2.0 ** (61 * e) for e in range(-16, 17)] + list(range(2, 300)),  # 33 floats of hash 1 (2**61 % P == 1)
    ],
    ids=["int", "tuple", "float"],
)
@pytest.mark.parametrize("kind", ["dict", "odict"])
def test_a_mapping_of_keys_sharing_one_hash_is_refused_before_it_is_built(keys: list[Any], kind: str) -> None:
    """Refused at the ninth key of one hash: the values of the first eight only were decoded (20,000 int keys
    took ~6 s, quadratic, and were then loaded)."""
    sink = _CountingSink()
    with pytest.raises(CheckpointFormatError, match="more than 8 distinct .* keys of one hash") as err:
        decode(_mapping(keys, kind), sink)
    assert "damaged or forged" in str(err.value)
    assert sink.taken == MAX_EQUAL_HASHES


@pytest.mark.parametrize("kind", ["set", "frozenset"])
def test_a_set_of_items_sharing_one_hash_is_refused(kind: str) -> None:
    with pytest.raises(CheckpointFormatError, match="more than 8 distinct int keys of one hash"):
        decode({"t": kind, "items": _colliding(20_000)}, {})


def test_large_containers_of_honest_non_str_keys_decode_as_before() -> None:
    """Indices (-1 and -2 share a hash), big ints, floats, tuples: decoded exactly; up to 8 keys of one hash in a
    large container are accepted (the bound), not 9."""
    value = {
        "ints": {i: i for i in range(-2, 1000)},
        "big": {2**70 + i: None for i in range(500)},
        "floats": {i + 0.5: i for i in range(500)},
        "tuples": {(i, j): None for i in range(30) for j in range(30)},
        "od": OrderedDict((i, None) for i in range(300)),
        "set": set(range(1000)),
        "fs": frozenset((i, str(i)) for i in range(500)),
        "eight": {k: None for k in [*_colliding(8), *range(6, 400)]},
    }
    skeleton, tensors = codec.encode(value)
    assert decode(skeleton, tensors) == value
    nine = codec.encode({k: None for k in [*_colliding(9), *range(6, 400)]})[0]
    with pytest.raises(CheckpointFormatError, match="keys of one hash"):
        decode(nine, {})
    small = {k: None for k in _colliding(200)}  # (a container of at most 256 keys is cheap whatever its hashes)
    assert decode(codec.encode(small)[0], {}) == small


def test_verify_and_load_refuse_a_forged_state_of_colliding_keys(tmp_path: Path) -> None:
    """A resealed manifest whose state holds a mapping of 20,000 int keys of one hash: ``verify`` and ``load``
    refuse it naming the checkpoint (both took ~7 s each, then loaded it), and the live objects are unchanged."""
    stats = {"table": torch.arange(4.0), "n": 1}
    path = tdcp.DistributedCheckpoint(no_dist=True, stats=stats).save(tmp_path / "c")

    def plant(manifest: dict[str, Any]) -> None:
        items = manifest["components"]["stats"]["state"]["items"]
        items.append(["lut", {"t": "dict", "items": [[k, None] for k in _colliding(20_000)]}])

    forging.edit(path, plant)
    with pytest.raises(CheckpointFormatError, match="keys of one hash") as err:
        tdcp.verify(path)
    assert str(path) in str(err.value)
    live = {"table": torch.zeros(4), "n": 0}
    with pytest.raises(CheckpointFormatError, match="keys of one hash") as err:
        tdcp.DistributedCheckpoint(no_dist=True, stats=live).load(path)
    assert str(path) in str(err.value)
    assert torch.equal(live["table"], torch.zeros(4)) and live["n"] == 0 and "lut" not in live


@pytest.mark.parametrize("container", ["dict", "set", "frozenset", "odict"])
def test_metadata_holding_keys_of_one_hash_is_refused_before_the_container_is_built(container: str) -> None:
    """``.metadata`` (parsed by ``verify``) holding a container of int keys sharing one hash was unpickled in quadratic
    time (60,000 keys: 14 s, then accepted); the codec's refusal did not reach the unpickler."""
    from collections import OrderedDict

    from torchrl_dcp.format.dcp_metadata import parse_metadata

    keys = [k * ((1 << 61) - 1) for k in range(1, 2001)]
    held = {"dict": dict.fromkeys(keys), "set": set(keys), "frozenset": frozenset(keys)}.get(container)
    if held is None:
        held = OrderedDict.fromkeys(keys)
    metadata = Metadata(state_dict_metadata={})
    metadata.planner_data = held
    with pytest.raises(tdcp.CheckpointIntegrityError, match="share one hash"):
        parse_metadata(pickle.dumps(metadata), "x/.metadata")
    metadata.planner_data = {k: None for k in range(2000)}  # many int keys, each its own hash: parsed
    assert len(parse_metadata(pickle.dumps(metadata), "x/.metadata").planner_data) == 2000

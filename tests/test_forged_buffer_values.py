"""Forged replay-buffer states and manifest numbers, resealed as docs/format.md documents: every one refused by
``verify`` and by a load alike, naming the problem, with the live buffer left as it was.

Each forgery is one no save writes: a writer cursor past the rows of a buffer that was never full (its next write
would make unwritten memory part of the buffer), counts that are not integers (which disarmed the count checks),
a prioritized sampler's max-priority index or the storage's last cursor outside the buffer (values of tensors,
checked once they are read, before anything is restored), a JSON number beyond the float range (read as an
infinity), a storage entry stretched over a data file's save identity.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

import torchrl_dcp as tdcp
from tests import forging
from torchrl_dcp.storage.filesums import file_checksum


def _buffer(rows: int, seed: int) -> TensorDictPrioritizedReplayBuffer:
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=LazyTensorStorage(32), batch_size=4, priority_key="td_error"
    )
    if rows:
        g = torch.Generator().manual_seed(seed)
        data = TensorDict(
            {"obs": torch.randn(rows, 3, generator=g), "td_error": torch.rand(rows, generator=g)}, batch_size=[rows]
        )
        rb.extend(data)
        rb.update_tensordict_priority(rb.sample())
    return rb


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rb") / "ckpt"
    tdcp.DistributedCheckpoint(rb=_buffer(10, 0)).save(path, step=1)
    return path


def _items(node: dict[str, Any]) -> dict[str, Any]:
    """A saved dict node's items, by key (the list entries themselves: edits go into the manifest)."""
    return {k: entry for entry in node["items"] for k in [entry[0]]}


def _value(node: dict[str, Any], *path: str) -> list[Any]:
    """The ``[key, value]`` entry at ``path`` in a saved state (dict nodes all the way down)."""
    entry: Any = None
    for key in path:
        entry = _items(node)[key]
        node = entry[1]
    return entry


def _state(m: dict[str, Any]) -> dict[str, Any]:
    return m["components"]["rb"]["ranks"]["0"]["state"]  # (a buffer is per_rank by default: rank 0's shard)


def _writer_cursor(m: dict[str, Any]) -> None:
    _value(_state(m), "writer", "state", "_cursor")[1] = 20
    _value(_state(m), "writer", "state", "_write_count")[1] = 20


def _float_max_size(m: dict[str, Any]) -> None:
    _value(_state(m), "storage", "max_size")[1] = 32.0


def _tensor_value(m: dict[str, Any], path: tuple[str, ...], at: int | None, value: int, where: Path) -> None:
    """Set the first element of the int64 tensor at ``path`` (``at``: its position in a saved tuple) to ``value``
    in its record, and record the data file's new CRC-32."""
    from torchrl_dcp.extract import read_tensors

    node = _value(_state(m), *path)[1]
    if at is not None:
        node = node["items"][at]
    assert node["dtype"] == "int64"
    key = f"rank/0/rb/{node['key']}"
    saved = read_tensors(where, {key: (tuple(node["shape"]), torch.int64)})[key]
    (entry,) = [e for e in m["index"]["entries"] if e[0] == key]
    data = bytearray((where / entry[1]).read_bytes())
    payload = saved.numpy().tobytes()
    start = entry[2] + bytes(data[entry[2] : entry[2] + entry[3]]).index(payload)
    data[start : start + 8] = value.to_bytes(8, "little", signed=True)
    (where / entry[1]).write_bytes(bytes(data))
    m["files"][entry[1]] = {"size": len(data), "checksum": file_checksum(where / entry[1])}


def _large_number(m: dict[str, Any]) -> str:
    _value(_state(m), "sampler", "alpha")[1] = 1234.5
    return "1e400"


def _forge(path: Path, name: str) -> None:
    m = forging.read_parts(path)
    if name == "writer cursor past the rows":
        _writer_cursor(m)
    elif name == "writer cursor inside the rows":  # (probe u3: the next write overwrote rows 3.. and counted 25..)
        _value(_state(m), "writer", "state", "_cursor")[1] = 3
    elif name == "max_size not an integer":
        _float_max_size(m)
    elif name == "max-priority index past the capacity":
        _tensor_value(m, ("sampler", "max_priority"), 1, 1000, path)
    elif name == "last cursor past max_size":
        _tensor_value(m, ("storage", "last_cursor"), None, 1000, path)
    elif name == "a number beyond the float range":
        _large_number(m)
        forging.write_parts(path, m)
        _respell_shard(path, "1234.5", "1e400")
        return
    elif name == "an entry over the save identity":
        entries = sorted(m["index"]["entries"], key=lambda e: (e[1], e[2]))
        last = [e for e in entries if e[1] == entries[-1][1]][-1]
        last[3] += 64
        assert forging.mirror_into_metadata(path, m)
    forging.write_parts(path, m)


def _respell_shard(path: Path, old: str, new: str) -> None:
    """Spell a number of rank 0's shard otherwise (``json`` never writes ``1e400``), then record the shard's new
    size and CRC-32 in the root and reseal it, as a forger editing the text would."""
    import json

    from torchrl_dcp.format.manifest import dumps, seal
    from torchrl_dcp.format.shards import record_shards

    shard = path / "manifest-0.json"
    shard.write_text(shard.read_text().replace(old, new))
    root = json.loads((path / "manifest.json").read_text())
    record_shards(root, {0: {"size": shard.stat().st_size, "checksum": file_checksum(shard)}})  # (its rank table)
    (path / "manifest.json").write_bytes(dumps(seal(root)))


FORGERIES = [
    "writer cursor past the rows",
    "writer cursor inside the rows",
    "max_size not an integer",
    "max-priority index past the capacity",
    "last cursor past max_size",
    "an entry over the save identity",
]


def _snapshot(rb: TensorDictPrioritizedReplayBuffer) -> Any:
    return (
        len(rb),
        rb._writer._cursor,
        rb._sampler._max_priority,
        rb._sampler._sum_tree[torch.arange(32)].clone(),
        rb._storage._storage[: len(rb)].clone() if rb._storage.initialized else None,  # (the rest: never written)
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, TensorDict):
        return isinstance(b, TensorDict) and (a == b).all()
    return a == b


@pytest.mark.parametrize("name", FORGERIES)
def test_a_forged_buffer_state_is_refused_by_verify_and_load(saved: Path, tmp_path: Path, name: str) -> None:
    path = tmp_path / "forged"
    shutil.copytree(saved, path)
    _forge(path, name)
    with pytest.raises(tdcp.CheckpointError) as by_verify:
        tdcp.verify(path)
    live = _buffer(5, 7)
    before = _snapshot(live)
    with pytest.raises(tdcp.CheckpointError) as by_load:
        tdcp.DistributedCheckpoint(rb=live).load(path)
    for err in (by_verify.value, by_load.value):
        assert "forged" in str(err) or "inconsistent" in str(err), str(err)
    assert "keep the loaded values" not in str(by_load.value)  # refused before anything was read in place
    assert _same(_snapshot(live), before)


def test_the_unforged_copy_loads_exactly(saved: Path, tmp_path: Path) -> None:
    """The control: the same copy and load, unforged, restores the saved buffer."""
    path = tmp_path / "plain"
    shutil.copytree(saved, path)
    tdcp.verify(path)
    live = _buffer(5, 7)
    tdcp.DistributedCheckpoint(rb=live).load(path)
    assert _same(_snapshot(live), _snapshot(_buffer(10, 0)))


def test_a_json_number_beyond_the_float_range_is_refused(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "forged"
    shutil.copytree(saved, path)
    _forge(path, "a number beyond the float range")
    assert "1e400" in (path / "manifest-0.json").read_text()
    for attempt in (lambda: tdcp.verify(path), lambda: tdcp.DistributedCheckpoint(rb=_buffer(0, 0)).load(path)):
        with pytest.raises(tdcp.CheckpointFormatError, match="out of the float range"):
            attempt()


def test_an_honest_infinity_still_round_trips(tmp_path: Path) -> None:
    """Infinities are saved as tagged values, never as numbers: refusing ``1e400`` costs no honest value."""
    values = {"lr": float("inf"), "low": float("-inf"), "big": 1e308}
    tdcp.DistributedCheckpoint(cfg=values).save(tmp_path / "c")
    got: dict[str, Any] = {}
    tdcp.DistributedCheckpoint(cfg=got).load(tmp_path / "c")
    assert got == values


def _set(*path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        _value(_state(m), *path)[1] = value

    return edit


def _last_cursor_as_rows(m: dict[str, Any]) -> None:
    """The last cursor's node made to name a storage row tensor of its dtype and shape (its own entries dropped):
    one tensor at two places, the cursor's value then the rows' (read in place after the values are checked)."""
    node = _value(_state(m), "storage", "last_cursor")[1]
    rows = _value(_state(m), "storage", "data")[1]
    index = _value(rows, "index")[1] if "items" in rows else None
    assert index is not None and index["dtype"] == node["dtype"] == "int64" and index["shape"] == node["shape"]
    own = f"rank/0/rb/{node['key']}"
    m["components"]["rb"]["inventory"].pop(own)
    m["index"]["entries"] = [e for e in m["index"]["entries"] if e[0] != own]
    node["key"] = index["key"]


SETTINGS = {
    "batch size -1": _set("batch_size", value=-1),
    "batch size a string": _set("batch_size", value="4"),
    "alpha a string": _set("sampler", "alpha", value="0.7"),
    "beta negative": _set("sampler", "beta", value=-0.5),
    "writer kind unknown": _set("writer", "kind", value="other"),
    "last cursor names the storage's rows": _last_cursor_as_rows,
}


@pytest.mark.parametrize("name", SETTINGS)
def test_a_forged_buffer_setting_is_refused_by_verify_and_load(saved: Path, tmp_path: Path, name: str) -> None:
    path = tmp_path / "forged"
    shutil.copytree(saved, path)
    m = forging.read_parts(path)
    SETTINGS[name](m)
    forging.mirror_into_metadata(path, m)
    forging.write_parts(path, m)
    with pytest.raises(tdcp.CheckpointError, match="forged"):
        tdcp.verify(path)
    live = _buffer(5, 7)
    before = _snapshot(live)
    with pytest.raises(tdcp.CheckpointError, match="forged"):
        tdcp.DistributedCheckpoint(rb=live).load(path)
    assert _same(_snapshot(live), before)


def _two_dim_buffer() -> Any:
    from torchrl.data import ReplayBuffer, SliceSampler

    rb = ReplayBuffer(storage=LazyTensorStorage(20, ndim=2), sampler=SliceSampler(num_slices=2), batch_size=4)
    steps = torch.arange(20).reshape(2, 10)  # 2 envs x 10 steps: a storage of 10 rows of 2
    data = TensorDict(
        {"obs": steps.float(), "episode": torch.zeros(2, 10, dtype=torch.long) + torch.arange(2)[:, None]},
        batch_size=[2, 10],
    )
    rb.extend(data)
    assert tuple(rb._storage._storage.shape) == (10, 2)
    return rb


def test_a_cursor_past_the_rows_of_a_two_dimensional_storage_is_refused(tmp_path: Path) -> None:
    """``max_size`` counts elements (20 = 10 rows x 2 envs): cursors index rows, so 15 is past them."""
    path = tdcp.DistributedCheckpoint(rb=_two_dim_buffer()).save(tmp_path / "c")
    assert tdcp.verify(path)
    forging.edit(path, lambda m: _value(_state(m), "writer", "state", "_cursor").__setitem__(1, 15))
    with pytest.raises(tdcp.CheckpointIntegrityError, match="its writer's cursor is 15, its storage's rows 10"):
        tdcp.verify(path)
    live = _two_dim_buffer()
    with pytest.raises(tdcp.CheckpointIntegrityError, match="rows 10"):
        tdcp.DistributedCheckpoint(rb=live).load(path)

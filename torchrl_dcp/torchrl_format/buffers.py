"""A replay buffer saved by ``torchrl.checkpoint`` (its ``dump``), read without a pickle, as our adapter's state.

``ReplayBuffer.dumps`` (torchrl 0.14) writes ``storage/`` (a TensorDict memory-map folder of
``max_size`` rows, or one ``_-single-tensor-_.memmap``, with ``storage_metadata.json``),
``sampler/``, ``writer/metadata.json``, ``rng_state/``, ``buffer_metadata.json``,
``transform.t`` (``torch.save``) and ``prefetch.pkl`` (a pickle of the prefetch queue).

What is read here, and how it maps onto
:class:`~torchrl_dcp.adapters.replay_buffer.ReplayBufferAdapter`'s state:

- storages: ``TensorStorage`` and its subclasses with one batch dimension (``LazyTensorStorage``,
  ``LazyMemmapStorage``): the written rows (``len``), the rest of the ``max_size`` rows dropped;
- samplers: ``RandomSampler`` (no state), ``SamplerWithoutReplacement`` (its state dict),
  ``PrioritizedSampler`` (its trees' leaves and parameters);
- writers: ``RoundRobinWriter`` / ``TensorDictRoundRobinWriter`` (cursor and write count; not
  generation tracking);
- the buffer's batch size and generator.

``prefetch.pkl`` is parsed opcode by opcode (:func:`read_prefetch_state`; nothing is
unpickled) and must describe an empty queue; ``transform.t`` (a pickle) is refused. Any
other storage, sampler or writer class is refused naming it (the live buffer's classes
say what the files hold: torchrl's files do not name them).

Example:
    >>> import tempfile, torch
    >>> from tensordict import TensorDict
    >>> from torchrl.checkpoint import Checkpoint
    >>> from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    >>> from torchrl_dcp.torchrl_format.reader import TorchrlContainer
    >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
    >>> _ = rb.extend(TensorDict({"x": torch.arange(3.0)}, [3]))
    >>> path = Checkpoint(rb=rb).save(tempfile.mkdtemp() + "/c")
    >>> saved = read_buffer(TorchrlContainer.open(path), "rb", rb)
    >>> saved.state["storage"]["len"], saved.rows["x"].tolist()
    (3, [0.0, 1.0, 2.0])
"""

from __future__ import annotations

import math
import pickletools
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data.replay_buffers.samplers import PrioritizedSampler, RandomSampler, SamplerWithoutReplacement
from torchrl.data.replay_buffers.storages import TensorStorage
from torchrl.data.replay_buffers.writers import RoundRobinWriter

from torchrl_dcp.errors import CheckpointFormatError, CheckpointIntegrityError, IncompatibleComponentError
from torchrl_dcp.torchrl_format.reader import (
    META_KEYS,
    TorchrlContainer,
    check_entry_name,
    dtype_named,
    leaf_spec,
    read_memmap_folder,
    tensor_from_bytes,
)

__all__ = [
    "SavedBuffer",
    "apply_buffer",
    "check_buffer",
    "put_rows_back",
    "read_buffer",
    "read_prefetch_state",
    "rows_to_overwrite",
]

SINGLE_TENSOR = "_-single-tensor-_"


@dataclass
class SavedBuffer:
    """A buffer's state as :class:`ReplayBufferAdapter` restores it, plus the rows to write into its storage."""

    state: dict[str, Any]
    rows: Any  # a dict of tensors (nested), or one tensor; ``len`` rows


def check_buffer_files(box: TorchrlContainer, name: str) -> None:
    """Refuse what component ``name`` (a ``torchrl.dump_load`` replay buffer) holds that torchrl_dcp never loads:
    transforms saved with ``torch.save`` (a pickle), a prefetch state other than an empty one (read without
    unpickling), prefetched batches. What a load and ``verify`` both check."""
    rec = box.record(name)
    base, files = rec["path"], set(rec["files"])
    if "transform.t" in files:
        raise CheckpointFormatError(
            f"component {name!r}: the buffer's transforms were saved with torch.save (a pickle), which torchrl_dcp "
            "never loads: load this checkpoint with torchrl.checkpoint in a process you trust and save it again "
            "with DistributedCheckpoint",
            path=box.where(f"{base}/transform.t"),
        )
    if "prefetch.pkl" in files:
        prefetch = read_prefetch_state(box.read(f"{base}/prefetch.pkl", 1 << 20), box.where(f"{base}/prefetch.pkl"))
        if prefetch.get("queue"):
            raise CheckpointFormatError(
                f"component {name!r}: the buffer was saved with prefetched batches, which this importer does not "
                "read; save it again with torchrl.checkpoint after the prefetch queue is drained",
                path=box.where(f"{base}/prefetch.pkl"),
            )


def read_buffer(box: TorchrlContainer, name: str, rb: Any) -> SavedBuffer:
    """Read component ``name`` (a ``torchrl.dump_load`` replay buffer) for the live buffer ``rb``."""
    from torchrl_dcp.adapters.buffer_state import initialized_buffer

    rb = initialized_buffer(rb)
    base = box.record(name)["path"]
    check_buffer_files(box, name)
    settings = box.read_json(box_need(box, name, "buffer_metadata.json"))
    if not isinstance(settings, dict) or not _batch_size_ok(settings.get("batch_size")):
        raise CheckpointFormatError("buffer_metadata.json is malformed", path=box.where(f"{base}/buffer_metadata.json"))
    storage, rows = _read_storage(box, name, rb._storage)
    return SavedBuffer(
        state={
            "type": type(rb).__name__,
            "storage": storage,
            "sampler": _read_sampler(box, name, rb._sampler, settings["batch_size"]),
            "writer": _read_writer(box, name, rb._writer),
            "transform": None,
            "batch_size": settings["batch_size"],
            "generator": _read_generator(box, name),
        },
        rows=rows,
    )


def check_dumped_sizes(box: TorchrlContainer, name: str) -> None:
    """What ``verify`` checks of a dumped replay buffer without a live buffer to read it into: every tensor file of
    its memory-map folders (``meta.json``) and a prioritized sampler's trees (``sampler_metadata.json``) holds the
    bytes its description says (a truncated file was refused only by a load)."""
    listed = box.component_files(name)
    expected: dict[str, int] = {}
    for member in listed:
        folder = member.rsplit("/", 1)[0]
        if member.endswith("/meta.json"):
            meta = box.read_json(member)
            for key, entry in meta.items() if isinstance(meta, dict) else ():
                if key not in META_KEYS:  # (what a load refuses: a name of no entry)
                    check_entry_name(key, box.where(member))
                if key not in META_KEYS and isinstance(entry, dict) and "dtype" in entry:  # (nested: own meta.json)
                    dtype, shape = leaf_spec(entry, box.where(member))
                    expected[f"{folder}/{key}.memmap"] = math.prod(shape) * dtype.itemsize
        elif member.endswith("/sampler_metadata.json"):
            meta = box.read_json(member)
            if not isinstance(meta, dict):
                raise CheckpointFormatError("a sampler's metadata is not a JSON object", path=box.where(member))
            capacity = meta.get("_max_capacity")
            if isinstance(capacity, (int, float)) and float(capacity).is_integer() and 0 <= capacity < 1 << 48:
                expected.update({f"{folder}/{t}tree.memmap": int(capacity) * 8 for t in ("sum", "min")})
    for member, nbytes in sorted(expected.items()):
        if nbytes == 0 and member not in listed:
            continue  # tensordict writes no file for a tensor without elements
        size = box.size(member)
        if size != nbytes:
            raise CheckpointIntegrityError(
                f"holds {size} bytes, its description needs {nbytes}", path=box.where(member)
            )


def box_need(box: TorchrlContainer, name: str, relative: str) -> str:
    return box.need(name, relative, "not a replay buffer torchrl 0.14 dumped")


def _batch_size_ok(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)


def _unsupported(name: str, what: str, obj: Any) -> IncompatibleComponentError:
    return IncompatibleComponentError(
        f"component {name!r}: a torchrl.checkpoint replay buffer with a {type(obj).__name__} {what} cannot be "
        "imported (supported: TensorStorage with one batch dimension; RandomSampler, SamplerWithoutReplacement, "
        "PrioritizedSampler; RoundRobinWriter): load it with torchrl.checkpoint in a process you trust and save it "
        "again with DistributedCheckpoint"
    )


# ---------------------------------------------------------------------- storage
def _read_storage(box: TorchrlContainer, name: str, storage: Any) -> tuple[dict[str, Any], Any]:
    if not isinstance(storage, TensorStorage) or type(storage).__name__ == "StorageEnsemble":
        raise _unsupported(name, "storage", storage)
    if storage.ndim != 1:
        raise _unsupported(name, "storage of several batch dimensions", storage)
    base = box.record(name)["path"] + "/storage"
    meta_name = box_need(box, name, "storage/storage_metadata.json")
    meta = box.read_json(meta_name)
    n = meta.get("len") if isinstance(meta, dict) else None
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise CheckpointFormatError("storage_metadata.json has no valid len", path=box.where(meta_name))
    if meta.get("is_pytree"):
        data = _single_tensor(box, name, meta, base)
    elif box.component_file(name, "storage/meta.json") is not None:
        data = read_memmap_folder(box, base)
    elif n == 0:
        data = None
    else:
        raise CheckpointFormatError("the storage holds rows but no tensors", path=box.where(base))
    _check_rows(data, n, int(storage.max_size), name, box.where(base))
    rows = None if data is None else _head(data, n)
    state = {
        "type": type(storage).__name__,
        "initialized": data is not None,
        "len": n if data is not None else 0,
        "max_size": int(storage.max_size),
        "ndim": 1,
        "rows": n,
        "is_tensordict": isinstance(data, dict),
        "last_cursor": None,
    }
    return state, rows


def _single_tensor(box: TorchrlContainer, name: str, meta: dict[str, Any], base: str) -> torch.Tensor:
    leaves = meta.get("metadata")
    if not isinstance(leaves, dict) or set(leaves) != {SINGLE_TENSOR}:
        raise IncompatibleComponentError(
            f"component {name!r}: a storage of pytree leaves other than one tensor cannot be imported"
        )
    spec = leaves[SINGLE_TENSOR]
    dtype = dtype_named(spec.get("dtype")) if isinstance(spec, dict) else None
    shape = spec.get("shape") if isinstance(spec, dict) else None
    if dtype is None or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise CheckpointFormatError("the storage's tensor description is malformed", path=box.where(base))
    member = f"{base}/{SINGLE_TENSOR}.memmap"
    return tensor_from_bytes(box.read(member), dtype, shape, box.where(member))


def _leaves(data: Any) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        return [data]
    return [t for v in data.values() for t in _leaves(v)]


def _check_rows(data: Any, n: int, capacity: int, name: str, where: str) -> None:
    if data is None:
        return
    sizes = {t.shape[0] if t.dim() else None for t in _leaves(data)}
    if len(sizes) != 1 or None in sizes:
        raise CheckpointFormatError(f"the storage's tensors hold different numbers of rows: {sizes}", path=where)
    (saved_size,) = sizes
    if not n <= saved_size:
        raise CheckpointFormatError(f"the storage says {n} rows, its tensors hold {saved_size}", path=where)
    if saved_size != capacity:
        raise IncompatibleComponentError(
            f"component {name!r}: the buffer was saved with a storage of {saved_size} rows, this buffer's holds "
            f"{capacity}: build it with the capacity it was saved with",
            path=where,
        )


def _head(data: Any, n: int) -> Any:
    if isinstance(data, torch.Tensor):
        return data[:n].clone()
    return {k: _head(v, n) for k, v in data.items()}


# ---------------------------------------------------------------------- sampler, writer, generator
def _saved_sampler(box: TorchrlContainer, name: str) -> str:
    """The kind of sampler a dumped buffer had, from the files its dump wrote."""
    files = set(box.record(name)["files"])
    if "sampler/sampler_metadata.json" in files:
        return "PrioritizedSampler"
    if "sampler/meta.json" in files:
        return "SamplerWithoutReplacement"
    return "RandomSampler"  # (its dump writes nothing)


def _read_sampler(box: TorchrlContainer, name: str, sampler: Any, batch_size: int | None) -> dict[str, Any]:
    kind = type(sampler)
    saved = _saved_sampler(box, name)
    if kind in (RandomSampler, SamplerWithoutReplacement, PrioritizedSampler) and kind.__name__ != saved:
        raise IncompatibleComponentError(
            f"component {name!r}: sampler was {saved}, the buffer has {kind.__name__}: build the buffer with the "
            "sampler it was saved with"
        )
    if kind is RandomSampler:
        return {"kind": "state_dict", "type": kind.__name__, "state": {}}
    if kind is SamplerWithoutReplacement:
        box_need(box, name, "sampler/meta.json")
        state = read_memmap_folder(box, box.record(name)["path"] + "/sampler", flat=True)
        # scalars a memory-mapped TensorDict holds as tensors: the values of the sampler's state_dict(), as its
        # load_state_dict makes them (what our checks and a save of ours see); anything else is checked as it is
        for key, as_value in (("len_storage", int), ("drop_last", bool), ("_ran_out", bool)):
            value = state.get(key)
            if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
                state[key] = as_value(value.item())
        out = {"kind": "state_dict", "type": kind.__name__, "state": state}
        left = state.get("_sample_list")
        if isinstance(left, torch.Tensor) and batch_size:  # not in torchrl's files; what sampling set it to
            n, drop_last = left.numel(), bool(state.get("drop_last", False))
            out["extra"] = {"_remaining_batches": n // batch_size if drop_last else -(n // -batch_size)}
        return out
    if kind is PrioritizedSampler:
        return _prioritized(box, name, sampler)
    raise _unsupported(name, "sampler", sampler)


def _prioritized(box: TorchrlContainer, name: str, sampler: PrioritizedSampler) -> dict[str, Any]:
    meta_name = box_need(box, name, "sampler/sampler_metadata.json")
    meta = box.read_json(meta_name)
    where = box.where(meta_name)
    try:
        alpha, beta, eps = (float(meta[k]) for k in ("_alpha", "_beta", "_eps"))
        capacity = meta["_max_capacity"]
        max_priority = meta["_max_priority"]
        value, index = max_priority
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointFormatError(f"sampler_metadata.json is malformed ({err})", path=where) from None
    if meta.get("_schema_version", 0) != 1:
        raise CheckpointFormatError(
            f"prioritized sampler state of schema version {meta.get('_schema_version', 0)!r}: torchrl 0.14 "
            "(version 1) is read",
            path=where,
        )
    if not float(capacity).is_integer() or int(capacity) != int(sampler._max_capacity):
        raise IncompatibleComponentError(
            f"component {name!r}: prioritized sampler capacity was {capacity}, the buffer's is "
            f"{sampler._max_capacity}: build the buffer with the capacity it was saved with",
            path=where,
        )
    capacity = int(capacity)
    trees = {}
    for tree in ("sum", "min"):
        member = box_need(box, name, f"sampler/{tree}tree.memmap")
        trees[tree] = tensor_from_bytes(box.read(member), torch.float64, [capacity], box.where(member))
    return {
        "kind": "prioritized",
        "type": type(sampler).__name__,
        "alpha": alpha,
        "beta": beta,
        "eps": eps,
        "max_priority": _max_priority(sampler, value, index),
        "capacity": capacity,
        "sum": trees["sum"].to(torch.float32),
        "min": trees["min"].to(torch.float32),
    }


def _max_priority(sampler: PrioritizedSampler, value: float, index: float) -> tuple[Any, Any]:
    """As the sampler held it: a float32 value and an int64 index, in the sampler's own tensors' dtypes when it
    has them (torchrl's own ``loads`` leaves Python floats in a fresh sampler)."""
    live = tuple(sampler._max_priority)
    dtypes = [torch.float32 if live[0] is None else live[0].dtype, torch.int64 if live[1] is None else live[1].dtype]
    if not float(index).is_integer():
        raise CheckpointFormatError(f"the max priority's index {index!r} is not an integer")
    return torch.tensor(float(value), dtype=dtypes[0]), torch.tensor(int(index), dtype=dtypes[1])


def _read_writer(box: TorchrlContainer, name: str, writer: Any) -> dict[str, Any]:
    if not isinstance(writer, RoundRobinWriter) or type(writer).__name__ not in (
        "RoundRobinWriter",
        "TensorDictRoundRobinWriter",
    ):
        raise _unsupported(name, "writer", writer)
    meta_name = box_need(box, name, "writer/metadata.json")
    meta = box.read_json(meta_name)
    cursor = meta.get("cursor") if isinstance(meta, dict) else None
    count = meta.get("write_count", 0) if isinstance(meta, dict) else None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (cursor, count)):
        raise CheckpointFormatError("writer/metadata.json is malformed", path=box.where(meta_name))
    if meta.get("generation_shape") is not None:
        raise _unsupported(name, "writer tracking generations (a", writer)
    state = writer.state_dict()
    state.update({"_cursor": cursor, "_write_count": count})
    return {"kind": "state_dict", "type": type(writer).__name__, "state": state}


def _read_generator(box: TorchrlContainer, name: str) -> dict[str, Any] | None:
    if box.component_file(name, "rng_state/meta.json") is None:
        return None
    folder = read_memmap_folder(box, box.record(name)["path"] + "/rng_state", flat=True)
    state = folder.get("rng_state")
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise CheckpointFormatError(
            "the buffer's generator state is malformed", path=box.where(box.record(name)["path"] + "/rng_state")
        )
    return {"state": state, "device": "cpu"}


# ---------------------------------------------------------------------- applying
def check_buffer(rb: Any, saved: SavedBuffer, name: str) -> None:
    """Refuse (before anything changes) rows the live storage cannot take: other keys, shapes or dtypes."""
    from torchrl_dcp.adapters.buffer_state import initialized_buffer

    storage = initialized_buffer(rb)._storage
    if saved.rows is None or not storage.initialized:
        return
    live = storage._storage
    if isinstance(saved.rows, torch.Tensor) != isinstance(live, torch.Tensor):
        raise IncompatibleComponentError(f"component {name!r}: the saved storage and this one hold different kinds")
    if isinstance(live, torch.Tensor):
        pairs = [("", saved.rows, live)]
    else:
        flat = TensorDict(saved.rows, batch_size=[]).flatten_keys(".")
        live_keys = {".".join(k) if isinstance(k, tuple) else k for k in live.keys(True, True)}
        if set(flat.keys()) != live_keys:
            raise IncompatibleComponentError(
                f"component {name!r}: the saved storage holds {sorted(flat.keys())}, this one {sorted(live_keys)}"
            )
        pairs = [(k, flat[k], live.get(tuple(k.split(".")))) for k in flat.keys()]
    for key, got, have in pairs:
        if got.dtype != have.dtype or tuple(got.shape[1:]) != tuple(have.shape[1:]):
            raise IncompatibleComponentError(
                f"component {name!r}: storage entry {key!r} was {got.dtype} {list(got.shape[1:])} per row, this "
                f"buffer's is {have.dtype} {list(have.shape[1:])}"
            )


def rows_to_overwrite(rb: Any, saved: SavedBuffer) -> Any:
    """A copy of the live storage's rows the import writes (``None`` when the storage is not allocated yet)."""
    from torchrl_dcp.adapters.buffer_state import initialized_buffer

    storage = initialized_buffer(rb)._storage
    n = saved.state["storage"]["len"]
    if saved.rows is None or not n or not storage.initialized:
        return None
    return storage._storage[:n].clone()


def put_rows_back(rb: Any, rows: Any) -> None:
    """Write back what :func:`rows_to_overwrite` copied."""
    from torchrl_dcp.adapters.buffer_state import initialized_buffer

    storage = initialized_buffer(rb)._storage
    storage._storage[: rows.shape[0]] = rows


def apply_buffer(rb: Any, saved: SavedBuffer, adapter: Any, ctx: Any) -> None:
    """Write the rows into the live storage (allocating a lazy one), then restore the rest through the adapter."""
    from torchrl_dcp.adapters.buffer_state import initialized_buffer

    storage = initialized_buffer(rb)._storage
    n = saved.state["storage"]["len"]
    if saved.rows is not None and n:
        rows = saved.rows
        if isinstance(rows, dict):
            rows = TensorDict(rows, batch_size=[n])
        storage.set(torch.arange(n), rows, set_cursor=False)
    adapter.restore(rb, saved.state, ctx)


# ---------------------------------------------------------------------- prefetch.pkl, without unpickling
_PICKLE_OPS = {
    "PROTO", "FRAME", "EMPTY_DICT", "EMPTY_TUPLE", "EMPTY_LIST", "MEMOIZE", "MARK", "SHORT_BINUNICODE",
    "BINUNICODE", "BININT1", "BININT2", "BININT", "NONE", "SETITEMS", "SETITEM", "TUPLE", "STOP",
    "NEWTRUE", "NEWFALSE", "APPENDS",
}  # fmt: skip


def read_prefetch_state(data: bytes, where: str) -> dict[str, Any]:
    """``prefetch.pkl`` as the dict it holds, read by walking its opcodes: only plain containers, numbers and
    strings are accepted (no global, no call), so nothing runs and nothing is imported."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: list[Any] = []
    try:
        for op, arg, _pos in pickletools.genops(data):
            if op.name not in _PICKLE_OPS:
                raise CheckpointFormatError(
                    f"prefetch.pkl holds a {op.name} opcode: only an empty prefetch queue is read", path=where
                )
            _step(op.name, arg, stack, marks, memo)
            if op.name == "STOP":
                break
    except CheckpointFormatError:
        raise
    except Exception as err:  # a truncated or malformed stream
        raise CheckpointFormatError(f"prefetch.pkl is malformed ({err})", path=where) from None
    if len(stack) != 1 or not isinstance(stack[0], dict):
        raise CheckpointFormatError("prefetch.pkl does not hold one mapping", path=where)
    return stack[0]


def _step(name: str, arg: Any, stack: list[Any], marks: list[int], memo: list[Any]) -> None:
    if name in ("PROTO", "FRAME", "STOP"):
        return
    if name == "MEMOIZE":
        memo.append(stack[-1])
    elif name == "MARK":
        marks.append(len(stack))
    elif name in ("EMPTY_DICT", "EMPTY_TUPLE", "EMPTY_LIST"):
        stack.append({"EMPTY_DICT": {}, "EMPTY_TUPLE": (), "EMPTY_LIST": []}[name])
    elif name in ("NONE", "NEWTRUE", "NEWFALSE"):
        stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[name])
    elif name in ("SETITEMS", "TUPLE", "APPENDS"):
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        if name == "TUPLE":
            stack.append(tuple(items))
        elif name == "APPENDS":
            stack[-1].extend(items)
        else:
            stack[-1].update(zip(items[::2], items[1::2]))
    elif name == "SETITEM":
        value, key = stack.pop(), stack.pop()
        stack[-1][key] = value
    else:  # numbers and strings
        stack.append(arg)

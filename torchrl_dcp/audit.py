"""State audit: everything reachable from an object, flattened to ``{path: fingerprint}``, and what differs.

A restore is exact when the restored object holds the same state as the saved one, not only the state its adapter
writes. :func:`state_snapshot` walks the object graph (tensors, numbers, strings, containers with deques, byte
arrays and ``array.array`` among them, modules, TensorDicts and the attributes of plain objects, following references
once: a second path to the same object is recorded as a reference to the first) and fingerprints every leaf, and the
type of every object and non-empty container;
:func:`state_differences` lists the paths whose fingerprints differ between two snapshots. Snapshots are JSON-safe,
so the saved process and the process that restored can compare them after the first one has exited (how the
conformance suites use them).

What is not state is not walked: functions and bound methods, classes and modules, threads, locks, files, sockets,
processes and generators, and the attributes :data:`NOT_STATE` lists with the reason (a collector's output buffer,
torchrl's key caches, the Trainer's logging buffers, the checkpoint objects themselves). A replay storage's state is
its written rows (the rows past its length are unset memory). ``skip`` names further attributes to leave out, as
``name`` (anywhere) or ``ClassName.name`` (on instances of that class or a subclass).

Example:
    >>> import torch
    >>> class Counter:
    ...     def __init__(self): self.steps, self.weights = 0, torch.zeros(2)
    >>> saved, restored = Counter(), Counter()
    >>> saved.steps = 3
    >>> [d.path for d in state_differences(state_snapshot(saved), state_snapshot(restored))]
    ['obj.steps']
"""

from __future__ import annotations

import array
import collections
import hashlib
import io
import math
import threading
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["StateDifference", "state_differences", "state_snapshot"]

MISSING = "<missing>"
_MAX_DEPTH = 64
_MAX_NODES = 1_000_000
#: types never walked: behaviour and process-local handles, not state
_OPAQUE: tuple[type, ...] = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.BuiltinMethodType,
    types.ModuleType,
    types.GeneratorType,
    types.CoroutineType,
    types.FrameType,
    type,
    property,
    staticmethod,
    classmethod,
    io.IOBase,
    threading.Thread,
    type(threading.Lock()),
    type(threading.RLock()),
    threading.Event,
    threading.Condition,
)
_OPAQUE_NAMES = frozenset(
    {"weakref", "ReferenceType", "socket", "Process", "Popen", "Queue", "Connection", "SimpleQueue", "Pool"}
)


#: Attributes that are not training state, as ``ClassName.attribute``, and why: the audit leaves them out.
NOT_STATE: dict[str, str] = {
    "BaseCollector._final_rollout": "the collector's output buffer: every batch rewrites all of it",
    "BaseCollector._iteration_started": "whether the collector's iterator started: a new process starts it again",
    "BaseCollector.iterator": "the collector's running iterator (a generator; after a load, torchrl_dcp's hand-over "
    "of the steps the saved collector held, which are compared as its trajectory assembly)",
    "BaseCollector._policy_output_keys": "the policy's output keys, found from its specs: a set, listed in an order "
    "that depends on the process's hash seed",
    "MultiStepTransform._validated": "a one-time check of the buffer's keys, made again on first use",
    "BatchedEnvBase.shared_tensordict_parent": "a batched env's output buffer: every step rewrites it",
    "BatchedEnvBase._shared_tensordict_parent_next": "a batched env's output buffer: every step rewrites it",
    "BatchedEnvBase._shared_tensordict_parent_root": "a batched env's output buffer: every step rewrites it",
    "BatchedEnvBase.shared_tensordicts": "views of a batched env's output buffer, one per sub-env",
    "TransformedEnv._input_spec": "a transformed env's cache of its transformed specs, rebuilt on use",
    "TransformedEnv._output_spec": "a transformed env's cache of its transformed specs, rebuilt on use",
    "EnvBase._cache": "torchrl's cache of an env's key lists, recomputed on use",
    "Trainer._log_dict": "the history of logged values (an EarlyStopping hook saves the last one of its metric)",
    "Trainer._pbar": "the progress bar",
    "CSVExperiment.files": "the open handles of a CSV logger's files (opened again, for appending, at its next write)",
    "Trainer._pbar_str": "the progress bar's text",
    "Trainer.checkpoint": "the checkpoint object, not what it saves",
    "Trainer.checkpoint_rotation": "the checkpoint rotation: its clock and directory, not training state",
    "Trainer._tdcp_rotation": "the rotation bound to the Trainer (see Trainer.checkpoint_rotation)",
    "Trainer._tdcp_preempted": "set with a preemption's stop request (saved as none: the requeued job goes on)",
    "Trainer._tdcp_mid_iteration": "whether train() is inside an iteration (a save there is saved as such, said at "
    "its loads; a resume starts the next iteration)",
    "Trainer._tdcp_tracks_iterations": "set once the iteration steps are wrapped to track it",
    "Trainer._tdcp_in_train": "whether train() runs (a load from a hook keeps the iteration's mark)",
    "LossModule._in_keys": "a loss's input keys, found from its modules on first use",
    "LossModule._cache": "a loss's cache of detached parameters, rebuilt on use",
    "ValueEstimatorBase._vmap_randomness": "a value estimator's vmap mode, found from its modules on first use",
    "ValueEstimatorBase._tensor_keys": "a value estimator's key names, built from its defaults on first use",
    "HERReplayBuffer._episode_ends_cache": "the episode ends found in the storage, rebuilt when the storage changes",
    "HERReplayBuffer._last_cache_key": "what the episode-ends cache was built for (the storage's length and rows)",
    "HERReplayBuffer._keys_validated": "a one-time check of the storage's keys, made again on first use",
    "BatchedEnvBase._dummy_env_str": "a batched env's description of its sub-envs (for heterogeneous ones, the repr "
    "of an object, with its address)",
    "Transform._parent": "a transform's cached view of its parent env, rebuilt on use",
    "Transform._all_done_keys": "key lists a transform computes on first use",
    "Transform._all_truncated_keys": "key lists a transform computes on first use",
    "Optimizer._opt_called": "a flag LR schedulers set on the optimizer to warn about the call order",
    "ReplayBuffer._warned_batch_size_conflict": "whether torchrl has shown a warning once",
    "Storage._mutation_revision_value": "a counter invalidating caches derived from the rows (a load bumps it too)",
    "TensorStorage._storage_keys": "a storage's cache of its keys",
    "TensorStorage._total_shape_value": "a storage's cache of its allocated shape",
    "LazyMemmapStorage.scratch_dir": "where this job keeps the memmap files (its own choice, not saved state)",
    "SliceSamplerWithoutReplacement._storage_len_buffer": "the trajectory count, recomputed by every sample first",
    "Storage.set": "torchrl_dcp's write tracking around the storage's set (see Storage._tdcp_row_tracker)",
    "Storage._tdcp_row_tracker": "torchrl_dcp's record of the rows written since the last save (for incremental "
    "saves; its epoch is random per process)",
}


@dataclass(frozen=True)
class StateDifference:
    """One path whose state differs: its fingerprint in the saved and in the restored snapshot."""

    path: str
    saved: str
    restored: str

    def __str__(self) -> str:
        return f"{self.path}: saved {self.saved}, restored {self.restored}"


def state_snapshot(obj: Any, name: str = "obj", *, skip: Iterable[str] = ()) -> dict[str, str]:
    """``{path: fingerprint}`` of everything reachable from ``obj`` (see the module docstring).

    Paths read like Python (``obj.collector.env._step_count``, ``obj.buffer['key']``, ``obj.items[2]``);
    ``skip`` leaves out more attributes (``name`` or ``ClassName.name``) besides :data:`NOT_STATE`.

    Example:
        >>> snap = state_snapshot({"lr": 0.1, "betas": (0.9, 0.99)}, "hparams")
        >>> snap["hparams['betas'][1]"]
        'float 0.99'
    """
    walker = _Walker([*NOT_STATE, *([skip] if isinstance(skip, str) else skip)])  # one name: not its letters
    walker.walk(obj, name, 0)
    return walker.out


def state_differences(saved: Mapping[str, str], restored: Mapping[str, str]) -> list[StateDifference]:
    """Every path present in either snapshot whose fingerprints differ (absent on one side: ``<missing>``).

    Example:
        >>> state_differences({"obj.n": "int 3"}, {"obj.n": "int 0", "obj.m": "int 1"})[0].path
        'obj.m'
    """
    paths = sorted(set(saved) | set(restored))
    return [
        StateDifference(p, saved.get(p, MISSING), restored.get(p, MISSING))
        for p in paths
        if saved.get(p, MISSING) != restored.get(p, MISSING)
    ]


class _Walker:
    def __init__(self, skip: Iterable[str]) -> None:
        self.anywhere = frozenset(s for s in skip if "." not in s)
        self.on_class: dict[str, set[str]] = {}
        for entry in skip:
            if "." in entry:
                klass, _, attr = entry.rpartition(".")
                self.on_class.setdefault(attr, set()).add(klass)
        self.out: dict[str, str] = {}
        self.seen: dict[int, str] = {}
        self.keep: list[Any] = []  # objects walked stay alive: their ids are not reused during the walk

    def walk(self, obj: Any, path: str, depth: int, owner: frozenset[str] = frozenset()) -> None:
        """Walk ``obj``; ``owner``: class names its keys also belong to (a module's ``_parameters``, ``_buffers``
        and ``_modules`` dicts hold the module's attributes, so ``Linear.weight`` skips them there)."""
        leaf = _leaf(obj)
        if leaf is not None:
            self.out[path] = leaf
            return
        if _opaque(obj):
            return
        if id(obj) in self.seen:
            self.out[path] = f"ref {self.seen[id(obj)]}"
            return
        if depth >= _MAX_DEPTH or len(self.out) >= _MAX_NODES:
            self.out[path] = f"<not walked: deeper than {_MAX_DEPTH} or over {_MAX_NODES} entries>"
            return
        if not isinstance(obj, tuple):  # a tuple's identity is no state (load_state_dict rebuilds them)
            self.seen[id(obj)] = path
        self.keep.append(obj)
        if not (isinstance(obj, (list, tuple, dict, set, frozenset)) and not obj):
            # its kind (a list is no tuple), but nothing for an empty container: its kind carries no state, and an
            # empty attribute may stand for one on the class (torchrl's Trainer keeps ``_last_log = {}`` on its
            # class until a load sets one on the instance)
            self.out[path] = f"<{type(obj).__qualname__}>"
        classes = frozenset(k.__name__ for k in type(obj).__mro__)
        owners = classes | owner
        for key, sub, value in _children(obj, path):
            if isinstance(key, str) and (key in self.anywhere or owners & self.on_class.get(key, set())):
                continue
            inner = classes if key in ("_parameters", "_buffers", "_modules") and "Module" in classes else frozenset()
            self.walk(value, sub, depth + 1, inner)


def _opaque(obj: Any) -> bool:
    return isinstance(obj, _OPAQUE) or type(obj).__name__ in _OPAQUE_NAMES


def _leaf(obj: Any) -> str | None:  # noqa: PLR0911 - one return per leaf kind
    if obj is None or isinstance(obj, (bool, int, str, bytes, complex)):
        return f"{type(obj).__name__} {obj!r}"
    if isinstance(obj, (bytearray, array.array)):  # (bytes held in place: their content, not attributes)
        raw = obj.tobytes() if isinstance(obj, array.array) else bytes(obj)
        kind = f"array {obj.typecode!r}" if isinstance(obj, array.array) else "bytearray"
        return f"{kind} {len(obj)} {hashlib.blake2b(raw, digest_size=8).hexdigest()}"
    if isinstance(obj, float):
        if math.isnan(obj):  # (a NaN keeps its sign through a save: the audit tells them apart too)
            return f"float {'-' if math.copysign(1.0, obj) < 0 else ''}nan"
        return f"float {obj!r}" if math.isfinite(obj) else f"float {obj}"
    if type(obj).__name__ in ("Synchronized", "SynchronizedArray", "SynchronizedString"):  # multiprocessing.Value
        value = obj.value if hasattr(obj, "value") else list(obj[:])
        return f"{type(obj).__name__} {value!r}"  # (its shared memory's place is the process's own)
    import torch

    if isinstance(obj, torch.Tensor):
        return _tensor_fingerprint(obj)
    if isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        return f"{type(obj).__name__} {obj}"
    stream = _generator_state(obj)
    if stream is not None:  # (a generator's state is no attribute: fingerprinted, as a tensor is)
        return f"{type(obj).__name__} state {hashlib.blake2b(repr(stream).encode(), digest_size=8).hexdigest()}"
    module = type(obj).__module__ or ""
    if module.startswith("numpy"):
        import numpy as np

        if isinstance(obj, np.ndarray):
            return _tensor_fingerprint(torch.from_numpy(np.ascontiguousarray(obj)) if obj.dtype != object else None)
        if isinstance(obj, np.generic):
            return f"{type(obj).__name__} {obj!r}"
        if isinstance(obj, np.dtype):
            return f"dtype {obj}"
    return None


def _generator_state(obj: Any) -> Any:
    """The state of a torch, NumPy (new or legacy) or Python generator (``None``: not one, or one without state)."""
    import random

    import torch

    if isinstance(obj, torch.Generator):
        return obj.get_state().tolist()
    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        return obj.getstate()
    if (type(obj).__module__ or "").startswith("numpy"):
        import numpy as np

        if isinstance(obj, np.random.Generator):
            return obj.bit_generator.state
        if isinstance(obj, np.random.RandomState):
            kind, keys, pos, has_gauss, gauss = obj.get_state(legacy=True)
            return kind, keys.tolist(), pos, has_gauss, gauss
    return None


def _tensor_fingerprint(t: Any) -> str:
    if t is None:
        return "ndarray of objects (not fingerprinted)"
    import torch

    if t.layout == torch.sparse_coo and not t.is_meta:  # its entries as held (uncoalesced: order and repeats)
        data = t.detach()
        parts = f"{_tensor_fingerprint(data._indices())} {_tensor_fingerprint(data._values())}"
        return f"tensor {t.dtype} {tuple(t.shape)} sparse_coo coalesced={t.is_coalesced()} {parts}"
    if t.is_meta or getattr(t, "is_nested", False) or t.layout != torch.strided:
        return f"tensor {t.dtype} {tuple(t.shape)} {t.layout}{' meta' if t.is_meta else ''}"
    data = t.detach()
    if hasattr(data, "full_tensor"):  # DTensor: this rank's shard
        data = data.to_local()
    flat = torch.empty(data.numel(), dtype=data.dtype)  # fresh strides (a stride-0 view does not view as bytes)
    flat.copy_(data.cpu().reshape(-1))
    digest = hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()[:16]
    return f"tensor {t.dtype} {tuple(t.shape)} {digest}"


def _tensordict_children(obj: Any, path: str) -> Iterable[tuple[Any, str, Any]]:
    """A TensorDict's batch size and leaves; a lazy stack's parts (a ragged one cannot stack its entries)."""
    yield "batch_size", f"{path}.batch_size", obj.batch_size
    parts = getattr(obj, "tensordicts", None)
    if isinstance(parts, list):
        yield "stack_dim", f"{path}.stack_dim", getattr(obj, "stack_dim", None)
        for i, part in enumerate(parts):
            yield i, f"{path}.tensordicts[{i}]", part
        return
    for key in obj.keys(include_nested=True, leaves_only=True, is_leaf=_is_td_leaf):
        yield key, f"{path}[{key!r}]", obj.get(key)


def _children(obj: Any, path: str) -> Iterable[tuple[Any, str, Any]]:
    """``(key or attribute name, path, value)`` of what ``obj`` holds."""
    from tensordict import TensorDictBase

    if isinstance(obj, TensorDictBase):
        yield from _tensordict_children(obj, path)
        return
    if isinstance(obj, Mapping):
        for i, (key, value) in enumerate(list(obj.items())):
            if not (isinstance(key, str) and key.startswith("__")):
                shown = repr(key) if _plain_key(key) else f"<{type(key).__name__} #{i}>"  # a tensor key: its place
                yield key, f"{path}[{shown}]", value
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield i, f"{path}[{i}]", value
        return
    if isinstance(obj, collections.deque):  # (torchrl's queued slices and prefetched samples: no attributes)
        yield "maxlen", f"{path}.maxlen", obj.maxlen
        for i, value in enumerate(list(obj)):
            yield i, f"{path}[{i}]", value
        return
    if isinstance(obj, (set, frozenset)):
        for i, value in enumerate(sorted(obj, key=_by_value)):  # (the same order in every process)
            yield i, f"{path}{{{i}}}", value
        return
    if any(k.__name__ == "TensorStorage" for k in type(obj).__mro__) and getattr(obj, "initialized", False):
        for name, sub, value in _attributes(obj, path):  # only the written rows of a replay storage are its state
            if name == "_storage":
                yield name, f"{sub}[:{obj._len_along_dim0}]", _written_rows(obj, value)
            else:
                yield name, sub, value
        return
    yield from _attributes(obj, path)


def _written_rows(storage: Any, data: Any) -> Any:
    rows = storage._len_along_dim0
    try:
        return data[:rows]
    except (TypeError, IndexError):
        return data


def _plain_key(key: Any) -> bool:
    if isinstance(key, tuple):
        return all(_plain_key(k) for k in key)
    return key is None or isinstance(key, (str, int, float, bool))


def _is_td_leaf(cls: type) -> bool:
    from tensordict import TensorDictBase

    return not issubclass(cls, TensorDictBase)


def _attributes(obj: Any, path: str) -> Iterable[tuple[str, str, Any]]:
    attrs: dict[str, Any] = {}
    try:
        attrs.update(vars(obj))
    except TypeError:
        pass
    for klass in type(obj).__mro__:
        for slot in getattr(klass, "__slots__", ()):
            if slot not in attrs and slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                attrs[slot] = getattr(obj, slot)
    for name, value in attrs.items():
        yield name, f"{path}.{name}", value


def _by_value(value: Any) -> str:
    """A set item's place in a snapshot: ``repr``, but a frozenset's items sorted (its own ``repr`` follows string
    hashing, randomised per process: two snapshots of one set would differ)."""
    if isinstance(value, (set, frozenset)):
        return "{" + ",".join(sorted(map(_by_value, value))) + "}"
    if isinstance(value, tuple):
        return "(" + ",".join(map(_by_value, value)) + ")"
    return repr(value)

"""Loading a ``torchrl.checkpoint`` checkpoint into a :class:`~torchrl_dcp.DistributedCheckpoint`'s objects.

Read-only, under the rules of our own loads: nothing executed (no pickle, no class a
file names), damage refused naming the file, all-or-nothing (every requested component
is read and checked before any object changes; a failure while restoring puts back
every object already restored, from the snapshot our adapter took first). Components
map by name; each is restored as torchrl would restore it:

- ``torchrl.state_dict``: ``obj.load_state_dict(state, *load_args, **load_kwargs)``;
- ``torchrl.json``: a mutable mapping or list is updated in place, any other value goes
  to ``LoadResult.values``;
- ``torchrl.dump_load``: replay buffers (:mod:`torchrl_dcp.torchrl_format.buffers`).

Replay buffers are restored after the other components (their rows are written into the
live storage; the rows they overwrite are copied first, so a rollback puts them back), and
RNG-like components (our adapters that restore last) last of the rest. In a job of
several ranks every rank reads the same (single-process) checkpoint: replicated
components load as usual, and per-rank ones give every rank the same state (said in
the log). Collective: a failure on any rank raises on every rank.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl.checkpoint import Checkpoint
    >>> path = Checkpoint(policy=torch.nn.Linear(2, 1)).save(tempfile.mkdtemp() + "/c")
    >>> sorted(tdcp.DistributedCheckpoint(policy=torch.nn.Linear(2, 1)).load(path).loaded)
    ['policy']
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from torchrl_dcp._log import get_logger
from torchrl_dcp.adapters.base import Adapter
from torchrl_dcp.collective import failures, run_agreed
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CollectiveError,
    EncodingError,
    IncompatibleComponentError,
    InexactResumeWarning,
)
from torchrl_dcp.load_components import compare_components
from torchrl_dcp.load_engine import LoadRequest, LoadResult, compare_versions, report_issues
from torchrl_dcp.torchrl_format.buffers import (
    SavedBuffer,
    apply_buffer,
    check_buffer,
    check_buffer_files,
    check_dumped_sizes,
    put_rows_back,
    read_buffer,
    rows_to_overwrite,
)
from torchrl_dcp.torchrl_format.reader import ADAPTERS, MANIFEST, TorchrlContainer, reading

__all__ = ["import_load", "inspect_torchrl", "verify_torchrl"]

logger = get_logger(__name__)


@dataclass
class _Planned:
    name: str
    value: Any
    adapter: Any  # our adapter for the object (its snapshot and rollback), or None
    ctx: Any
    kind: str
    payload: Any = None
    snapshot: Any = None
    has_snapshot: bool = False
    options: Any = None
    rows_before: Any = None  # a replay buffer's storage rows the import overwrites (put back by a rollback)

    @property
    def order(self) -> tuple[bool, bool]:
        """Replay buffers (rows written into live storage) after the rest, RNG-like components last of those."""
        return self.kind == "torchrl.dump_load", bool(getattr(self.adapter, "restore_last", False))


def import_load(request: LoadRequest) -> LoadResult:
    """Restore ``request``'s components from the torchrl checkpoint at ``request.path`` (collective)."""
    result = LoadResult(path=request.path)
    planned: list[_Planned] = []

    def prepare() -> None:
        with TorchrlContainer.open(request.path) as box:
            result.manifest = _as_manifest(box)
            result.comparison = compare_versions(box.manifest.get("versions") or {})
            saved = box.components()
            compare_components(request, result, saved, stacklevel=6)  # (one frame less than our loads: at load)
            for name in request.requested:
                if name in saved:
                    p = _plan(box, name, request, result)
                    if p is not None:
                        planned.append(p)
            report_issues(result, request.strict, request.path)

    run_agreed(request.group, "reading the torchrl checkpoint", prepare)
    if request.world_size > 1 and request.rank == 0:
        per_rank = [p.name for p in planned if request.registered[p.name].placement == "per_rank"]
        if per_rank:
            logger.info("torchrl checkpoint %s: every rank restores the same %s", request.path, per_rank)
    _restore(planned, request, result)
    return result


def _as_manifest(box: TorchrlContainer) -> dict[str, Any]:
    m = box.manifest
    metadata = m.get("metadata") or {}
    step = metadata.get("step") if type(metadata.get("step")) is int else None
    return {**m, "source_format": "torchrl.checkpoint", "metadata": metadata, "step": step}


def _plan(box: TorchrlContainer, name: str, request: LoadRequest, result: LoadResult) -> _Planned | None:
    reg = request.registered[name]
    rec = box.record(name)
    kind = rec["adapter"]
    where = box.where(rec["path"])
    if kind not in ADAPTERS or rec["adapter_version"] != 1:
        result.incompatible[name] = f"torchrl adapter {kind!r} version {rec['adapter_version']} is not read"
        return None
    ctx = reg.make_ctx(saved_world_size=1, source_rank=0)
    p = _Planned(name, reg.value, reg.adapter, ctx, kind, options=ctx.options)
    with reading(f"component {name!r}", where):
        if not _read_payload(box, name, kind, reg, ctx, p, result):
            return None
    if reg.adapter is None:
        raise CheckpointFormatError(f"component {name!r}: {reg.error}", path=where)
    try:
        p.snapshot, p.has_snapshot = reg.adapter.snapshot(reg.value, ctx), True
    except Exception:  # nothing to roll back to (an object whose state fails before first use)
        p.snapshot, p.has_snapshot = None, False
    return p


def _read_payload(
    box: TorchrlContainer, name: str, kind: str, reg: Any, ctx: Any, p: _Planned, result: LoadResult
) -> bool:
    """Read and check ``name``'s payload into ``p``; ``False`` (said in ``result``) where the registered object
    cannot take it."""
    box.check_sizes(name)
    if kind == "torchrl.json":
        p.payload = box.json_payload(name)
    elif kind == "torchrl.state_dict":
        if not callable(getattr(reg.value, "load_state_dict", None)):
            result.incompatible[name] = (
                f"saved as a state dict, the registered {type(reg.value).__name__} has no load_state_dict"
            )
            return False
        p.payload = box.state_dict_payload(name, ctx.device_for)
        if reg.adapter is not None and reg.adapter.state_is_state_dict:
            where = box.where(box.record(name)["path"])
            try:
                state = reg.adapter.from_torchrl_state_dict(p.payload)
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointIntegrityError(
                    f"component {name!r}: its state is not what {type(reg.value).__name__}.state_dict() returns "
                    f"({type(err).__name__}: {err})",
                    path=where,
                ) from None
            return _check_as_saved(reg, state, name, where, result)
    else:
        if not _is_buffer(reg.value):
            result.incompatible[name] = (
                f"saved with dump/load, which is read for replay buffers only (the registered object is a "
                f"{type(reg.value).__name__})"
            )
            return False
        try:
            p.payload = read_buffer(box, name, reg.value)
            check_buffer(reg.value, p.payload, name)
        except IncompatibleComponentError as err:
            result.incompatible[name] = err.message
            return False
        if reg.adapter is None:
            return True  # (refused by the caller, naming why)
        saved = p.payload
        state = {**saved.state, "storage": {**saved.state["storage"], "data": saved.rows}}
        return _check_as_saved(reg, state, name, box.where(box.record(name)["path"]), result)
    return True


def _check_as_saved(reg: Any, state: Any, name: str, where: Any, result: LoadResult) -> bool:
    """Run the registered adapter's checks on ``state`` (what torchrl saved, in the adapter's own layout) as a load
    of ours runs them on a saved state, before anything changes: :meth:`~Adapter.check_saved`, :meth:`~Adapter.
    validate` (against the live object, with a context of its own: nothing it notes reaches the restore) and
    :meth:`~Adapter.check_values`. A state no save writes raises; one the live object cannot take is said in
    ``result`` (``False``)."""
    from torchrl_dcp.format.codec import encode
    from torchrl_dcp.load_plan import plan_view

    adapter = reg.adapter
    try:
        skeleton, tensors = encode(state, name)
    except EncodingError as err:  # a state our format cannot hold (a scheduler's milestones keyed by NumPy ints)
        if type(adapter).check_saved is Adapter.check_saved and type(adapter).check_values is Adapter.check_values:
            logger.info("component %r: not checked as a state of ours (%s): restored as torchrl restores it", name, err)
            return True  # (the generic adapter checks only the kinds of values: its object's load_state_dict decides)
        raise CheckpointIntegrityError(
            f"component {name!r}: {err.message}: no save of this {type(reg.value).__name__} writes that state; the "
            "checkpoint is damaged or forged",
            path=where,
        ) from None
    try:
        view = plan_view(skeleton)[0]
        adapter.check_saved(view)
        adapter.check_values(view, lambda spec: tensors[spec.key])
    except CheckpointError:
        raise
    except Exception as err:  # (the adapter's ValueError, TypeError, KeyError: what our loads refuse as forged)
        raise CheckpointIntegrityError(
            f"component {name!r}: {err}: no save writes that state; the checkpoint is damaged or forged", path=where
        ) from None
    try:
        adapter.validate(reg.value, {0: view}, reg.make_ctx(saved_world_size=1, source_rank=0))
    except (CheckpointFormatError, CheckpointIntegrityError):  # damaged or forged: never skipped (strict)
        raise
    except IncompatibleComponentError as err:
        result.incompatible[name] = err.message
        return False
    except Exception as err:  # (as our loads say it: the live object cannot take the state)
        result.incompatible[name] = f"cannot be loaded: {type(err).__name__}: {err}"
        return False
    return True


def _is_buffer(obj: Any) -> bool:
    from torchrl.data import ReplayBuffer

    return isinstance(obj, ReplayBuffer)


def _restore(planned: list[_Planned], request: LoadRequest, result: LoadResult) -> None:
    failure: BaseException | None = None
    done: list[_Planned] = []
    for p in sorted(planned, key=lambda p: p.order):
        try:
            value = _restore_one(p)
        except Exception as err:
            if request.strict == "error":
                failure = err
                done.append(p)
                break
            problem = _rollback(p)  # strict="warn"/"ignore": this one is skipped, as it was before the load
            result.incompatible[p.name] = f"{type(err).__name__}: {err}" + (
                f"; could not roll back {problem}" if problem else ""
            )
            continue
        done.append(p)
        result.loaded.add(p.name)
        if value is not None:
            result.values[p.name] = value
    statuses = failures(failure, request.group, "restoring components")
    if statuses is None:
        if result.incompatible:
            report_issues(result, request.strict if request.strict != "error" else "warn", request.path)
        return
    problems = [r for r in (_rollback(p) for p in reversed(done)) if r]
    result.loaded.clear()
    note = f"; could not roll back: {', '.join(problems)}" if problems else "; every restored component was rolled back"
    if failure is not None:
        raise CheckpointError(
            f"restoring a torchrl checkpoint failed: {type(failure).__name__}: {failure}{note}",
            path=request.path,
            result=result,
        ) from failure
    rank = next(i for i, s in enumerate(statuses) if s is not None)
    raise CollectiveError(
        f"rank {rank} failed while restoring: {statuses[rank][1]}{note}", path=request.path, result=result
    )


def _restore_one(p: _Planned) -> Any:
    if p.kind == "torchrl.json":
        value = p.payload
        if isinstance(p.value, MutableMapping) and isinstance(value, Mapping):
            p.value.clear()
            p.value.update(value)
            return p.value
        if isinstance(p.value, list) and isinstance(value, list):
            p.value[:] = value
            return p.value
        return value
    if p.kind == "torchrl.state_dict":
        left = p.adapter.load_torchrl_state_dict(p.value, p.payload, p.ctx)
        if left:
            warnings.warn(
                f"component {p.name!r} (importing a torchrl.checkpoint): torchrl saved its state_dict() only; "
                f"{'; '.join(left)} are left as they are, so the run goes on differently from the one saved: save "
                "it with torchrl_dcp for an exact resume",
                InexactResumeWarning,
                stacklevel=5,
            )
        return None
    assert isinstance(p.payload, SavedBuffer)
    p.rows_before = rows_to_overwrite(p.value, p.payload)
    apply_buffer(p.value, p.payload, p.adapter, p.ctx)
    return None


def _rollback(p: _Planned) -> str | None:
    if not p.has_snapshot:
        return f"{p.name!r} (its state could not be captured before the load)"
    try:
        if p.rows_before is not None:
            put_rows_back(p.value, p.rows_before)
        p.adapter.rollback(p.value, p.snapshot, p.ctx)
    except Exception as err:
        return f"{p.name!r} ({type(err).__name__}: {err})"
    return None


# ---------------------------------------------------------------------- tools
def _verify_component(
    box: TorchrlContainer, name: str, rec: Mapping[str, Any], path: Any, total: int, tensors: int
) -> tuple[int, int]:
    """:func:`verify_torchrl`'s checks of one component; the bytes and tensors counted so far, plus its own."""
    total += box.check_sizes(name)
    if rec["adapter"] in ADAPTERS and rec["adapter_version"] != 1:  # (what a load refuses, said alike)
        raise CheckpointFormatError(
            f"component {name!r}: torchrl adapter {rec['adapter']!r} version {rec['adapter_version']} is not "
            "read (torchrl 0.14 writes version 1): written by a newer torchrl, or the manifest was altered",
            path=path,
        )
    if rec["adapter"] == "torchrl.json":
        box.json_payload(name)
    elif rec["adapter"] == "torchrl.state_dict":
        tensors += _count_tensors(box.state_dict_payload(name))
    elif rec["adapter"] == "torchrl.dump_load":
        for member in box.component_files(name):
            if member.endswith(".json"):
                box.read_json(member)
        check_dumped_sizes(box, name)
        check_buffer_files(box, name)  # (what a load refuses: pickled transforms, prefetched batches)
    else:
        raise CheckpointFormatError(f"component {name!r} has unknown adapter {rec['adapter']!r}", path=path)
    return total, tensors


def verify_torchrl(path: Any) -> dict[str, Any]:
    """``verify`` of a torchrl checkpoint: every listed file present with its size, every JSON file parsed, every
    state-dict payload decoded (its tensors' bytes against their descriptions). torchrl's format has no
    checksums, so a changed byte inside a tensor cannot be found: ``unchecked`` says so.

    Raises a :class:`CheckpointError` naming the file on any damage.
    """
    with TorchrlContainer.open(path) as box:
        total = tensors = 0
        for name, rec in box.components().items():
            with reading(f"component {name!r}", box.where(rec["path"])):
                total, tensors = _verify_component(box, name, rec, path, total, tensors)
        return {
            "path": str(box.path),
            "files": sum(len(r["files"]) for r in box.components().values()) + 1,
            "bytes": total,
            "tensors": tensors,
            "unchecked": [
                "torchrl.checkpoint format: no checksums (a changed byte inside a tensor is not detected); "
                "replay buffers' rows are decoded only by a load into a live buffer"
            ],
        }


def _count_tensors(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, Mapping):
        return sum(_count_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return sum(_count_tensors(v) for v in value)
    return 0


def inspect_torchrl(path: Any) -> dict[str, Any]:
    """What ``inspect`` prints for a torchrl checkpoint (the keys of our own checkpoints' summary)."""
    with TorchrlContainer.open(path) as box:
        m = box.manifest
        comps = {
            name: {
                "adapter": rec["adapter"],
                "adapter_version": rec["adapter_version"],
                "placement": "torchrl",
                "ranks": None,
                "tensors": sum(f.endswith(".memmap") for f in rec["files"]),
                "bytes": box.check_sizes(name),
                "shared": {},
            }
            for name, rec in box.components().items()
        }
        data = sum(c["bytes"] for c in comps.values())
        metadata = m.get("metadata") or {}
        return {
            "path": str(box.path),
            "container": f"torchrl.checkpoint {m.get('container', 'directory')}",
            "format_version": m.get("format_version"),
            "created_at": m.get("created_at"),
            "step": metadata.get("step") if type(metadata.get("step")) is int else None,
            "world_size": 1,
            "versions": m.get("versions") or {},
            "components": comps,
            "files": sum(len(r["files"]) for r in box.components().values()) + 1,
            "bytes": box.path.stat().st_size if box.is_archive else data + box.size(MANIFEST),
            "data_bytes": data,
            "metadata": metadata,
        }

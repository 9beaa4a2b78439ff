"""The phases of a load: open → manifest → plan → verify → read → restore. Nothing changes before restore.

1. **open** the container (directory or ZIP archive) at the path;
2. **read and validate** the manifest (migrations of older formats included);
3. **plan** every requested component (:mod:`torchrl_dcp.load_plan`): versions,
   placements, resharding and capacity, dtype/shape, destinations; each object's
   rollback snapshot is taken here;
4. **verify** the bytes that will be read (CRC-32 of the files, before anything is
   read into a live object; files read into fresh buffers are checked while read, in
   phase 5, also those that hold tensors read in place too: that read ends before
   anything is restored);
5. **read** every tensor into fresh buffers (collective): plain tensors straight from
   their records (:mod:`torchrl_dcp.storage.direct`), the rest through ``dcp.load``;
6. **restore** every component read into fresh buffers from its decoded state
   (RNG-like ones last); then read the tensors adapters asked to receive in place
   (module weights, optimizer state, replay-buffer storages, objects' ``state_dict``
   tensors), checksumming those files again as they are read, and restore those
   components.

Every phase up to 5 is collective through :mod:`torchrl_dcp.collective`: a failure on
any rank raises on every rank, and no object has changed. A failure while restoring
(on any rank) rolls every restored component back to its snapshot, on every rank.

**What a failure during the final in-place read can leave.** Its files passed their
checksums in phase 4, so a damaged checkpoint never gets there; what can fail is an I/O
error, or a file changed between phase 4 and the read (caught by the second checksum,
:data:`LIVE_MISMATCH`). Then every component restored before is rolled back, and the
tensors read in place (listed in the error) hold, in any mix, their old values, values
read before the failure, or bytes of the changed file; their other state (a module's
non-in-place tensors, an optimizer's param groups, a buffer's cursor) is rolled back.
Keeping a copy of those tensors to undo the read would double the memory a load needs.

Example (one process):
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> policy = torch.nn.Linear(2, 2)
    >>> path = tdcp.DistributedCheckpoint(policy=policy).save(tempfile.mkdtemp() + "/c")
    >>> fresh = torch.nn.Linear(2, 2)
    >>> sorted(tdcp.DistributedCheckpoint(policy=fresh).load(path).loaded)
    ['policy']
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.autograd.graph import increment_version
from torch.distributed.checkpoint.api import CheckpointException

from torchrl_dcp._log import get_logger
from torchrl_dcp.adapters.base import Adapter
from torchrl_dcp.adapters.rng import RNGState
from torchrl_dcp.collective import failures, run_agreed
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointReplacedError,
    CollectiveError,
    IncompatibleComponentError,
    InexactResumeWarning,
    PartialLoadWarning,
)
from torchrl_dcp.format.codec import TensorSpec
from torchrl_dcp.format.manifest import library_versions
from torchrl_dcp.format.metadata_checks import record_index
from torchrl_dcp.format.record import template
from torchrl_dcp.live_sharing import refuse_conflicting_live
from torchrl_dcp.load_components import compare_components, refuse_options_elsewhere, unshared_parts
from torchrl_dcp.load_plan import (
    ComponentPlan,
    LoadPlan,
    Registered,
    SavedState,
    check_backed,
    check_sparse,
    decode_states,
    plan_components,
    rollback_one,
)
from torchrl_dcp.load_rollback import (
    fail,
    planned_changes,
    rollback_and_raise,
    rollback_refused,
    undo,
    with_planned,
)
from torchrl_dcp.planner import SafeLoadPlanner
from torchrl_dcp.save_support import failure_inside, quiet_single_process, summarize
from torchrl_dcp.storage.backends import open_source
from torchrl_dcp.storage.direct import read_direct
from torchrl_dcp.storage.source import CheckpointSource

logger = get_logger(__name__)
Strictness = Literal["error", "warn", "ignore"]


@dataclass
class LoadResult:
    """What a load did, component by component (as ``torchrl.checkpoint.CheckpointLoadResult``).

    Attributes:
        loaded: components restored.
        missing: requested components the checkpoint does not hold.
        incompatible: components that could not be restored, with the reason.
        unrequested: components in the checkpoint that were not requested.
        values: what adapters returned (e.g. JSON values).
        manifest: the checkpoint's manifest.
        comparison: ``{"versions": {lib: {checkpoint, runtime, matches}}, "version_skew": bool}``.
        path: the checkpoint that was read.
    """

    loaded: set[str] = field(default_factory=set)
    missing: set[str] = field(default_factory=set)
    incompatible: dict[str, str] = field(default_factory=dict)
    unrequested: set[str] = field(default_factory=set)
    values: dict[str, Any] = field(default_factory=dict)
    manifest: dict[str, Any] = field(default_factory=dict)
    comparison: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @property
    def step(self) -> int | None:
        return self.manifest.get("step")

    def __repr__(self) -> str:  # the manifest and values stay out of it: a printed result reads in one line
        parts = [f"path={str(self.path)!r}", f"step={self.step!r}", f"loaded={sorted(self.loaded)!r}"]
        for name in ("missing", "unrequested"):
            if getattr(self, name):
                parts.append(f"{name}={sorted(getattr(self, name))!r}")
        if self.incompatible:
            parts.append(f"incompatible={self.incompatible!r}")
        if self.version_skew:
            parts.append("version_skew=True")
        return f"LoadResult({', '.join(parts)})"

    @property
    def version_skew(self) -> bool:
        return bool(self.comparison.get("version_skew"))


@dataclass
class LoadRequest:
    """What the caller asked for."""

    path: Path
    requested: list[str]
    registered: Mapping[str, Registered]
    strict: Strictness
    reshard: bool
    verify: bool
    group: Any
    rank: int
    world_size: int
    chosen: bool = False  # the caller named the components (a subset is then what it asked for)
    options_elsewhere: list[str] = field(default_factory=list)  # component_options for names other ranks registered


# ---------------------------------------------------------------------- phases 1-4
def prepare(request: LoadRequest, result: LoadResult) -> tuple[CheckpointSource, LoadPlan]:
    """Open, read the manifest, plan every component, verify the bytes (collective; nothing changes)."""
    found: dict[str, Any] = {}

    def local() -> dict[str, Any]:
        src = found["src"] = open_source(request.path, whole=request.rank == 0)  # 1. open
        if src.container.root()["world_size"] == request.world_size:  # this rank's shard (a reshard reads all)
            src.restrict([request.rank])
        manifest = src.manifest()  # 2. read and validate
        result.manifest = manifest
        result.comparison = compare_versions(manifest["versions"])
        if result.version_skew:
            logger.warning("checkpoint %s was saved with other library versions: %s", request.path, skew_text(result))
        compare_components(request, result, manifest["components"], saved_world_size=manifest["world_size"])
        refuse_options_elsewhere(request, manifest["components"])
        metadata = src.dcp_metadata()
        found["plan"] = plan_components(  # 3. plan
            manifest,
            request.requested,
            request.registered,
            rank=request.rank,
            world_size=request.world_size,
            reshard_allowed=request.reshard,
            metadata=metadata,
            incompatible=result.incompatible,
            source=request.path,
        )
        refuse_conflicting_live(
            found["plan"],
            lambda key: saved_crcs(src, metadata, key),
            request.path,
            lambda specs: read_fresh(src, specs),
        )
        if found["plan"].not_saved_here:
            names = sorted(found["plan"].not_saved_here)
            why = (
                f"rank {request.rank} registered no {names} when the checkpoint was saved (other ranks did)"
                if manifest["world_size"] == request.world_size
                else f"after the world-size change, the saved rank that rank {request.rank} takes {names} from held "
                "none (other saved ranks did)"
            )
            warnings.warn(InexactResumeWarning(f"{request.path}: {why}: left as they are"), stacklevel=6)
        report_issues(result, request.strict, request.path)
        verify_bytes(src, found["plan"], request.verify, metadata, whole=request.rank == 0)  # 4. verify
        # what every rank must share: the checkpoint (its save and its root's very bytes, wherever each rank mounts
        # it) and what it restores
        root = src.container.root_digest() if request.world_size > 1 else None
        return {
            "save": manifest["save_id"],
            "root": root,
            # (the per-rank ones are each rank's own: a rank may hold one another lacks, a logger on rank 0 alone)
            "components": sorted(n for n in request.requested if request.registered[n].placement != "per_rank"),
            # (but a reshard shares a buffer's transitions out among the new ranks: a rank without it would lose its
            # part, so every rank must hold it)
            "shared_out_by_the_reshard": sorted(
                n for n, comp in found["plan"].components.items() if comp.reshard and comp.adapter.reshard_shares_out
            ),
            "reshard": request.reshard,
        }

    try:
        run_agreed(
            request.group,
            "validating the checkpoint",
            local,
            alike=lambda described: described,
            shown=lambda: f"reading {request.path}",
            explain=lambda described: unshared_parts(request.path, described),
        )
    except BaseException as err:
        if "plan" in found:  # this rank planned (and may have allocated lazily built storages): undo it
            rollback_refused(planned_changes(found["plan"]), err)
        raise
    return found["src"], found["plan"]


def verify_bytes(
    src: CheckpointSource, load_plan: LoadPlan, verify: bool, metadata: Any, *, whole: bool = True
) -> None:
    """Every record to read holds the dtype and shape DCP's metadata says and every file to read carries this save's
    identity; files holding tensors read into live objects are checksummed now, the others while they are read
    into fresh buffers (phase 5, before anything is restored), and so are files that hold both, when the source
    reads files (``verify=False``: sizes, identities and records only). ``whole``: the sizes of every listed file
    and nothing unlisted (rank 0 of a load); otherwise the sizes of the files this rank reads alone, so that a rank's load opens
    its own files, not every rank's."""
    if metadata is None:
        src.check(False)
        return
    live = load_plan.live_reads()
    fresh = load_plan.fresh_reads()
    needed_live = files_for(metadata, live)
    needed_fresh = files_for(metadata, fresh)
    # a file that also holds tensors read into fresh buffers is checksummed whole by that read (phase 5), which ends
    # before anything is restored: checksummed here too, it would be read three times (the file reader checksums whole
    # files; other sources go on checking here)
    by_fresh_read = needed_live & needed_fresh if src.reads_files else set()
    # sizes (of every file, or of those read here), and checksums of those read in place
    src.check(needed_live - by_fresh_read if verify else False, only=None if whole else needed_live | needed_fresh)
    src.check_identity(needed_live | needed_fresh)
    # the records read into live objects, before any is read; the others are checked as they arrive, before anything
    # is restored from them: every reader compares a record with its layout before taking its bytes (files: the
    # same record_data_offset / decode_record; 5,000 small tensors: 20 ms of Python and 10,000 preads less). Bool
    # records are checked here wherever they go: a file reader takes their bytes without looking at their values
    keys = set(live)
    if src.reads_files:
        keys.update(k for k, t in fresh.items() if t.dtype == torch.bool)
    if keys:  # (none: nothing to check, and 5,000 records not walked for it)
        src.check_records(metadata, keys)
    if verify:
        load_plan.verify_inline = (needed_fresh - needed_live) | by_fresh_read
        load_plan.verify_live = needed_live  # checked again during the final read: a file changed since is caught


def saved_crcs(src: CheckpointSource, metadata: Any, key: str) -> tuple[int, ...] | None:
    """The data CRCs recorded in the heads of ``key``'s records (our writer's layout), in chunk order; ``None``
    where they cannot be read (another layout, a damaged file: the verification says more)."""
    md = None if metadata is None else metadata.state_dict_metadata.get(key)
    records = record_index(metadata).get(key) if md is not None else None
    if not records or not hasattr(md, "chunks"):
        return None
    sizes = {tuple(c.offsets): tuple(c.sizes) for c in md.chunks}
    out = []
    try:
        for offsets, info in sorted(records.items()):
            tpl = template(md.properties.dtype, sizes[offsets])
            (raw,) = src.read_many(info.relative_path, [(info.offset + tpl.head_crc_at, 4)])
            if len(raw) != 4 or info.length != tpl.length:
                return None
            out.append(int.from_bytes(raw, "little"))
    except (CheckpointError, OSError, KeyError, ValueError, TypeError):
        return None
    return tuple(out)


def files_for(metadata: Any, flat: Mapping[str, torch.Tensor]) -> set[str]:
    """The data files that hold any of ``flat``'s keys."""
    records = record_index(metadata)
    return {info.relative_path for key in flat for info in records.get(key, {}).values()}


# ---------------------------------------------------------------------- phase 5: read
LIVE_MISMATCH = (
    "found while reading it into live tensors, after it had passed its checksum before the load changed anything: "
    "the file changed meanwhile"
)


def read(
    src: CheckpointSource,
    request: LoadRequest,
    tensors: dict[str, torch.Tensor],
    verify: set[str],
    result: LoadResult,
    mismatch_note: str | None = None,
) -> None:
    """Every rank reads its tensors (collective, even with nothing to read).

    Plain tensors are read straight from their records (:func:`~torchrl_dcp.storage.direct.read_direct`);
    what that leaves (DTensors, unusual chunking) goes through ``dcp.load`` on every rank, when any rank has some.
    """

    def local() -> bool:
        metadata = src.dcp_metadata()
        if metadata is None or not tensors or not src.reads_files:  # stores: through dcp.load
            left.update(tensors)
        else:
            reader = src.storage_reader(verify, mismatch_note)
            try:
                left.update(read_direct(reader, metadata, tensors, checked=True))  # the plan checked them
            except CheckpointIntegrityError:
                if verify and not mismatch_note:  # a damaged file (its checksum) says more than its record does
                    src.check(verify)
                raise
        return bool(left)

    left: dict[str, torch.Tensor] = {}
    try:
        _, pending = run_agreed(request.group, "reading tensors", local, flag=bool, monitored=False)
    except CheckpointError as err:
        err.result = result
        raise
    if not pending:
        return
    try:
        with quiet_single_process():
            dcp.load(
                left,
                storage_reader=src.storage_reader(verify, mismatch_note),
                planner=SafeLoadPlanner(),
                process_group=request.group,
                no_dist=request.group is None,
            )
    except CheckpointException as err:
        exc = failure_inside(err)  # a file failed its checksum: say so
        if isinstance(exc, CheckpointIntegrityError):
            raise CheckpointIntegrityError(exc.message, path=exc.path, result=result) from None
        raise CollectiveError(f"DCP load failed: {summarize(err)}", path=request.path, result=result) from None


def read_fresh(
    src: CheckpointSource, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *, verify: bool = True
) -> dict[str, torch.Tensor]:
    """Read the tensors ``{dcp_key: (shape, dtype)}`` of ``src`` into fresh CPU tensors, in this process alone (no
    process group): each checked against DCP's metadata before anything is allocated, every file that holds them
    sized, of this save, and (``verify``) checksummed while read. What the tools read through
    (:func:`~torchrl_dcp.extract.read_tensors`, ``verify``'s value checks)."""
    if not specs:
        return {}
    metadata = src.dcp_metadata()
    if metadata is None:
        raise CheckpointFormatError("the checkpoint holds no tensors", path=src.path)
    for key, (shape, dtype) in specs.items():  # before anything is allocated: no more than the files hold
        check_backed(metadata, key, TensorSpec(key, tuple(shape), dtype, "cpu"), src.path)
    try:
        flat = {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in specs.items()}
    except RuntimeError as err:  # e.g. out of memory
        raise CheckpointError(f"cannot allocate the tensors to read ({err})", path=src.path) from None
    keys = set(flat)
    holding = {info.relative_path for index, info in metadata.storage_data.items() if index.fqn in keys}
    files = holding if verify else set()
    src.check(False)  # sizes of every listed file, nothing unlisted
    src.check_identity(holding)  # as a load does: a file copied in from another save is refused, resealed or not
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        note = "found while reading it"  # (a tool's read: no object is restored from it)
        try:
            rest = read_direct(src.storage_reader(files, note), metadata, flat) if src.reads_files else flat
            if rest:  # e.g. chunks not split along dim 0: DCP's own planning
                reader = src.storage_reader(files, note)
                dcp.load(rest, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if isinstance(err, (CheckpointError, KeyboardInterrupt)):
                raise
            raise failure_inside(err) or CheckpointError(
                f"reading tensors failed: {summarize(err)}", path=src.path
            ) from None
    return flat


# ---------------------------------------------------------------------- phase 6: restore
def restore(src: CheckpointSource, request: LoadRequest, load_plan: LoadPlan, result: LoadResult) -> None:
    """Restore every component; on any rank's failure (strict='error') every rank rolls back and raises.

    Order: components read into fresh buffers (RNG-like ones last), then the in-place
    read, then the components read in place; the RNG-like ones are then set again (their
    restore sets a state: doing it twice is harmless), so an in-place restore that draws
    random numbers (an object's own ``load_state_dict``) leaves the streams as saved. Up
    to the in-place read, a failure leaves every object as it was.
    """
    streams = RNGState().state_dict()  # a restore may draw random numbers (an object's own load_state_dict)
    try:
        _restore(src, request, load_plan, result)
    except BaseException:
        RNGState().load_state_dict(streams)  # a failed load leaves the global streams as they were, too
        raise


def _restore(src: CheckpointSource, request: LoadRequest, load_plan: LoadPlan, result: LoadResult) -> None:
    first = sorted((c for c in load_plan.components.values() if not c.in_place), key=lambda c: c.restore_last)
    in_place = [c for c in load_plan.components.values() if c.in_place]
    done: list[ComponentPlan] = []

    failure = check_values(load_plan, src, request.path) or _restore_all(first, load_plan, request, result, done)
    statuses = _statuses(failure, request.group, with_planned(done, load_plan), result)
    if statuses is not None:
        fail(with_planned(done, load_plan), statuses, failure, "restoring components", result, group=request.group)
    if load_plan.live or request.group is not None:
        try:
            read(src, request, load_plan.live_reads(), load_plan.verify_live, result, LIVE_MISMATCH)
            load_plan.copy_prefetched()
        except BaseException as err:
            rollback_and_raise(done, err, in_place, result)
        finally:  # written by address: autograd is told, as copy_ would (a graph that saved one refuses backward)
            increment_version([t for t in load_plan.live.values() if not t.is_inference()])
    last = [c for c in done if c.restore_last] if in_place else []
    failure = _restore_all(in_place, load_plan, request, result, done)
    if failure is None and last:
        failure = _restore_again(last, load_plan, request, result)
    statuses = _statuses(failure, request.group, with_planned(done, load_plan), result, partial=in_place)
    if statuses is not None:
        fail(
            with_planned(done, load_plan),
            statuses,
            failure,
            "restoring components",
            result,
            partial=in_place,
            group=request.group,
        )


def _statuses(
    failure: BaseException | None,
    group: Any,
    done: list[ComponentPlan],
    result: LoadResult,
    partial: list[ComponentPlan] = (),  # type: ignore[assignment]
) -> list[Any] | None:
    """Every rank's status after a restore step (``None``: every rank succeeded). When the exchange itself fails (a
    rank died or is stuck), no rank can know whether the others restored: this one rolls back what it restored
    (``done``) and raises, as every rank that reaches the exchange does."""
    try:
        return failures(failure, group, "restoring components")
    except BaseException as err:
        problems = undo(done, result)
        if isinstance(err, CheckpointError):
            note = "every component this rank restored was rolled back"
            if partial:
                note += f", but rows read in place into {sorted(c.name for c in partial)} keep the loaded values"
            if problems:
                note += f"; could not roll back {', '.join(problems)}"
            err.extend(note)
            err.result = result
        raise


def check_values(load_plan: LoadPlan, src: CheckpointSource, path: Any) -> BaseException | None:
    """The adapters' checks of the values read (:meth:`~torchrl_dcp.adapters.base.Adapter.check_values`), on every
    state to restore, after the fresh reads and before anything is restored (a tensor read in place later is read
    from ``src`` for the check alone); returns the first failure."""
    for comp in load_plan.components.values():
        checks_values = type(comp.adapter).check_values is not Adapter.check_values
        if not checks_values and not any(state.sparse for state in comp.sources.values()):
            continue
        for state in comp.sources.values():

            def read(spec: TensorSpec, state: SavedState = state) -> torch.Tensor:
                key = f"{state.prefix}/{spec.key}"
                ahead = load_plan.prefetched.get(key)
                if ahead is not None:  # read already, not yet copied into the live tensor
                    return ahead
                if key in load_plan.live:  # not read yet (it holds the live object's values): its saved ones
                    return read_fresh(src, {key: (spec.shape, spec.dtype)}, verify=False)[key]
                return load_plan.destination(key)

            try:
                check_sparse(state, read, comp.name, path)
            except CheckpointError as err:
                return err
            if not checks_values:
                continue
            try:
                comp.adapter.check_values(state.view, read)
            except Exception as err:  # (an adapter's own error too: every rank hears of it, nothing restored)
                return CheckpointIntegrityError(
                    f"component {comp.name!r}: {err}: no save writes that state; the checkpoint is damaged or forged",
                    path=path,
                )
    return None


def _restore_all(
    comps: list[ComponentPlan], load_plan: LoadPlan, request: LoadRequest, result: LoadResult, done: list[ComponentPlan]
) -> BaseException | None:
    for comp in comps:
        try:
            states = decode_states(comp, load_plan, request.rank)
            if comp.reshard:
                value = comp.adapter.reshard(comp.value, states, comp.ctx)
            else:
                value = comp.adapter.restore(comp.value, states[comp.ctx.source_rank], comp.ctx)
        except Exception as err:
            problem = rollback_one(comp)
            why = f"{type(err).__name__}: {err}"
            if problem:  # (whatever strict is: the object is left half-restored, and the result says so)
                why += f"; could not roll back {problem}"
            result.incompatible[comp.name] = why
            if request.strict == "error":
                message = f"component {comp.name!r} could not be restored ({why})"
                # (damaged or forged stays what it is: a restore's own check found it)
                kind = type(err) if isinstance(err, (CheckpointIntegrityError, CheckpointFormatError)) else None
                error = (kind or IncompatibleComponentError)(message, path=request.path, result=result)
                error.__cause__ = err
                return error
            if request.strict == "warn":
                warnings.warn(
                    f"{request.path}: component {comp.name!r} could not be restored: {err}"
                    + (f"; could not roll back {problem}" if problem else ""),
                    PartialLoadWarning,
                    stacklevel=4,
                )
            continue
        done.append(comp)
        result.loaded.add(comp.name)
        if value is not None or comp.adapter.returns_values:
            result.values[comp.name] = value
    return None


def _restore_again(
    comps: list[ComponentPlan], load_plan: LoadPlan, request: LoadRequest, result: LoadResult
) -> BaseException | None:
    """Set RNG-like components again after the in-place restores (same decoded state, same result)."""
    for comp in comps:
        try:
            states = decode_states(comp, load_plan, request.rank)
            if comp.reshard:
                comp.adapter.reshard(comp.value, states, comp.ctx)
            else:
                comp.adapter.restore(comp.value, states[comp.ctx.source_rank], comp.ctx)
        except Exception as err:
            error = IncompatibleComponentError(
                f"component {comp.name!r} could not be restored again after the components read in place "
                f"({type(err).__name__}: {err})",
                path=request.path,
                result=result,
            )
            error.__cause__ = err
            return error
    return None


# ---------------------------------------------------------------------- reporting
def report_issues(result: LoadResult, strict: str, source: Path) -> None:
    """Missing or incompatible requested components: raise (strict='error'), warn, or only record them."""
    if not (result.missing or result.incompatible):
        return
    problems = [f"missing {sorted(result.missing)}"] if result.missing else []
    problems += [f"{n}: {why}" for n, why in sorted(result.incompatible.items())]
    text = "; ".join(problems)
    if strict == "error":
        raise IncompatibleComponentError(
            f"cannot load the requested components ({text}); pass components=[...] to choose, or strict='warn'",
            path=source,
            result=result,
        )
    if strict == "warn":
        warnings.warn(f"{source}: {text}", PartialLoadWarning, stacklevel=5)


def compare_versions(saved: Mapping[str, Any]) -> dict[str, Any]:
    runtime = library_versions()
    versions = {
        lib: {"checkpoint": saved.get(lib), "runtime": now, "matches": saved.get(lib) == now}
        for lib, now in runtime.items()
        if isinstance(saved.get(lib), str)
    }
    return {"versions": versions, "version_skew": any(not v["matches"] for v in versions.values())}


def skew_text(result: LoadResult) -> str:
    return ", ".join(
        f"{lib} {v['checkpoint']} -> {v['runtime']}"
        for lib, v in result.comparison["versions"].items()
        if not v["matches"]
    )


def load(request: LoadRequest) -> LoadResult:
    """All phases, in order (collective)."""
    result = LoadResult(path=request.path)
    try:
        src, load_plan = prepare(request, result)
        try:
            read(src, request, load_plan.fresh_reads(), load_plan.verify_inline, result)  # 5. read
        except BaseException as err:
            rollback_refused(planned_changes(load_plan), err)
            raise
        restore(src, request, load_plan, result)  # 6. restore
    except CheckpointError as err:  # (a file gone is wrapped as it was met: the validation's listing, a read)
        if isinstance(err, CollectiveError) and getattr(err, "failed_rank", None) is None:
            raise  # the exchange itself failed (a rank dead or stuck): that is what the error says
        replaced = replaced_meanwhile(request.path, result.manifest, err)
        if replaced is None:
            raise
        replaced.result = getattr(err, "result", None)
        raise replaced from err
    return result


def replaced_meanwhile(
    path: Any, manifest: Mapping[str, Any] | None, err: CheckpointError
) -> CheckpointReplacedError | None:
    """The error to raise instead of a load's failure ``err`` when the checkpoint at ``path`` is no longer the one
    whose ``manifest`` the load read (another process saved over it or removed it meanwhile: a file missing, or of
    another save, is then no damage); ``None`` when it still is (or the manifest names no save: an older format)."""
    save_id = manifest.get("save_id") if isinstance(manifest, Mapping) else None
    if not save_id:
        return None
    try:
        now = open_source(path).container.root().get("save_id")
    except (CheckpointError, OSError):
        now = None
    if now == save_id:
        return None
    return CheckpointReplacedError(
        f"was {'removed' if now is None else 'replaced by another save'} while this load read it (another process "
        f"saved over it or a rotation pruned it): nothing is damaged; load it again (what the read found: {err})",
        path=path,
    )

"""Planning a load: for every requested component, what to read, from which saved ranks, into which tensors.

:func:`plan_components` runs every check that can fail before anything changes:
adapter and payload versions (migrations), placements, world-size changes (can the
adapter reshard, does this rank have the capacity), references to other
components' tensors, and the destination of every tensor (dtype, shape, device,
bytes actually backed by the file). It takes each component's rollback snapshot
*before* asking adapters for in-place destinations (which may allocate a lazily
built storage), so a load that fails later can put every object back as it was.

Example (one process):
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp.load_plan import ComponentPlan
    >>> ComponentPlan.__dataclass_fields__.keys() >= {"name", "sources", "reshard", "in_place"}
    True
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrl_dcp.adapters import Adapter, AdapterContext, adapter_by_id
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    IncompatibleComponentError,
    WorldSizeMismatchError,
)
from torchrl_dcp.format.codec import (
    TensorSink,
    TensorSpec,
    decode,
    dtype_from_name,
    dtype_name,
    encode,
    is_dtensor,
    node_spec,
    xref_key,
)
from torchrl_dcp.format.metadata_checks import WholeTensor, record_index, whole_tensor
from torchrl_dcp.format.migrations import migrate_component
from torchrl_dcp.format.sparse_nodes import check_sparse_indices
from torchrl_dcp.placement import Placement, is_absent, key_prefix


@dataclass
class SavedState:
    """One saved state of a component: its skeleton, the DCP key prefix of its tensors, and what was
    derived from it once while checking it (its tensor specs and its planning view)."""

    skeleton: Any
    prefix: str
    specs: list[TensorSpec] = field(default_factory=list)
    view: Any = None
    refs: list[tuple[str, TensorSpec]] = field(default_factory=list)  # tensors of other components it refers to
    sparse: list[dict[str, Any]] = field(default_factory=list)  # its sparse tensors' nodes (indices checked once read)


@dataclass
class ComponentPlan:
    """How one component is loaded on this rank."""

    name: str
    value: Any
    adapter: Adapter
    ctx: AdapterContext
    sources: dict[int, SavedState]  # saved rank -> its state (one entry unless resharding)
    reshard: bool
    in_place: bool = False  # tensors read straight into the live object (adapter destinations)
    snapshot: Any = None
    has_snapshot: bool = False
    planned: bool = False  # its snapshot was taken (or tried): planning may have changed the object since

    @property
    def restore_last(self) -> bool:
        return bool(getattr(self.adapter, "restore_last", False))


@dataclass
class LoadPlan:
    """Every component's plan and every destination tensor, by DCP key."""

    components: dict[str, ComponentPlan] = field(default_factory=dict)
    fresh: dict[str, torch.Tensor] = field(default_factory=dict)  # new buffers, read before anything changes
    live: dict[str, torch.Tensor] = field(default_factory=dict)  # live objects' tensors, read in the final phase
    verify_inline: set[str] = field(default_factory=set)  # files checksummed while read into fresh buffers
    verify_live: set[str] = field(default_factory=set)  # files checksummed before, and again while read in place
    # small live tensors' saved values, read (and checked as they arrive) with the fresh buffers, copied into the
    # live tensors at the in-place read (:func:`prefetch`): no record check or checksum pass before that read
    prefetched: dict[str, torch.Tensor] = field(default_factory=dict)
    prefetched_bytes: int = 0
    # per-rank components this rank's saved state holds none of (the rank had not registered them): left as they are
    not_saved_here: list[str] = field(default_factory=list)

    def destination(self, key: str) -> torch.Tensor:
        found = self.fresh.get(key)
        return self.live[key] if found is None else found

    def fresh_reads(self) -> dict[str, torch.Tensor]:
        """What the read before anything changes fills: the fresh buffers and the prefetched ones."""
        return {**self.fresh, **self.prefetched} if self.prefetched else self.fresh

    def live_reads(self) -> dict[str, torch.Tensor]:
        """What the final read fills in place, from the files: the live tensors that are not prefetched."""
        if not self.prefetched:
            return self.live
        return {k: t for k, t in self.live.items() if k not in self.prefetched}

    def copy_prefetched(self) -> None:
        """Copy each prefetched buffer into its live tensor (both CPU, contiguous, of one dtype and shape)."""
        live, move = self.live, ctypes.memmove
        for key, buf in self.prefetched.items():
            t = live.get(key)
            if t is not None:
                move(t.data_ptr(), buf.data_ptr(), buf.nbytes)


PREFETCH_MAX = 64 << 10  # live tensors below this many bytes are prefetched (per-tensor costs dominate their reads)
PREFETCH_BUDGET = 16 << 20  # at most this many bytes prefetched per load (memory held until the in-place read)


def prefetch(plan: LoadPlan, key: str, spec: TensorSpec, dest: torch.Tensor) -> None:
    """Read ``dest`` (a live tensor for ``key``) ahead, into a buffer, when it is small, on the CPU and plain.

    Its record is then checked as it arrives, with the fresh reads, instead of by a check of every record and a
    checksum of its file before the final read (5,000 tensors of 1 KiB read into a module: about 13 % of the load).
    What a load promises is unchanged: everything is read and checked before anything is restored, and the prefetched
    bytes reach the live tensor at the in-place read, as they would from the file."""
    nbytes = dest.nbytes
    if (
        0 < nbytes < PREFETCH_MAX
        and plan.prefetched_bytes + nbytes <= PREFETCH_BUDGET
        and type(dest) in _PLAIN
        and dest.is_cpu
        and not spec.dtensor
        and dest.layout is torch.strided
        and not dest.is_quantized
        and dest.is_contiguous()
    ):
        held = plan.fresh.get(key)  # a fresh buffer of another component's reference to it: read once, into it
        if held is None:
            held = torch.empty(*spec.shape, dtype=spec.dtype) if spec.shape else spec.empty("cpu")
        elif held.device.type != "cpu":
            return
        plan.prefetched[key] = held
        plan.prefetched_bytes += nbytes


_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass
class Registered:
    """What the checkpoint knows of a registered component."""

    value: Any
    adapter: Adapter | None  # None: no adapter for its type
    placement: Placement
    make_ctx: Callable[..., AdapterContext]
    adapter_error: str = ""
    optional: bool = False  # registered by the library itself (a Trainer's register_op hooks): may be absent


def plan_components(
    manifest: Mapping[str, Any],
    requested: list[str],
    registered: Mapping[str, Registered],
    *,
    rank: int,
    world_size: int,
    reshard_allowed: bool,
    metadata: Any,
    incompatible: dict[str, str],
    source: Any,
) -> LoadPlan:
    """Plan every requested component the checkpoint holds; incompatibilities go to ``incompatible``.

    Raises:
        WorldSizeMismatchError: per-rank state saved by another number of ranks that may not be resharded.
        CheckpointFormatError: the manifest contradicts itself or DCP's metadata.
    """
    load_plan = LoadPlan()
    planning: list[ComponentPlan] = []  # the component being planned, if any (before it joins the plan)
    try:
        saved = manifest["components"]
        for name in requested:
            if name not in saved:
                continue
            reg = registered[name]
            rec = _compatible_record(name, saved[name], reg, incompatible, source)
            if rec is None:
                continue
            assert reg.adapter is not None
            checked = check_states(name, rec, metadata, source, adapter=reg.adapter, world_size=manifest["world_size"])
            if rec["placement"] != "per_rank" or len(rec["ranks"]) == manifest["world_size"]:  # every rank's here
                check_totals(name, rec, source)
            reshard = rec["placement"] == "per_rank" and manifest["world_size"] != world_size
            if reshard and not (reshard_allowed and reg.adapter.can_reshard):
                saved = manifest["world_size"]
                why = (
                    "pass world_size_change='reshard' to redistribute it"
                    if reg.adapter.can_reshard
                    else f"its adapter {reg.adapter.adapter_id!r} cannot be resharded: leave it out"
                )
                raise WorldSizeMismatchError(
                    f"component {name!r} is per_rank and was saved by {saved} rank{'s' if saved != 1 else ''}, this "
                    f"job has {world_size}: {why} (components=[...] chooses what to load), or resume with {saved} "
                    f"rank{'s' if saved != 1 else ''}",
                    path=source,
                )
            ctx = reg.make_ctx(saved_world_size=manifest["world_size"])
            comp = ComponentPlan(name, reg.value, reg.adapter, ctx, {}, reshard)
            planning[:] = [comp]
            try:
                sources = _sources(comp, rec, rank, checked)
                if sources is None or any(is_absent(s.view) for s in sources.values()):
                    load_plan.not_saved_here.append(name)  # (the rank whose state this rank takes registered none)
                    planning.clear()
                    continue
                comp.sources = sources
                views = {r: s.view for r, s in comp.sources.items()}
                reg.adapter.validate(reg.value, views, ctx)
                _take_snapshot(comp)
                _destinations(comp, views, load_plan, metadata, source)
            except (CheckpointFormatError, CheckpointIntegrityError) as err:  # damaged or forged: never skipped
                err.place(source)  # (an adapter's check names the component, the load names the checkpoint)
                raise
            except Exception as err:
                # (the others: nothing changed them)
                problem = rollback_one(comp) if comp.adapter.allocates_when_planned and comp.planned else None
                planning.clear()
                incompatible[name] = f"cannot be loaded: {_text(err)}"
                if problem:
                    incompatible[name] += f"; could not roll back {problem}"
                continue
            load_plan.components[name] = comp
            planning.clear()
        for comp in load_plan.components.values():  # (once every component is planned: in any registration order,
            _references(comp, saved, load_plan, rank, metadata, source)  # a tensor takes its owner's destination)
    except BaseException as err:  # a refusal part-way: what planning allocated so far is undone before it propagates
        problems = [
            problem
            for comp in reversed([*load_plan.components.values(), *planning])
            if comp.adapter.allocates_when_planned and comp.planned and (problem := rollback_one(comp))
        ]
        if problems and isinstance(err, CheckpointError):
            err.extend(f"could not roll back {', '.join(problems)}")
        raise
    return load_plan


def _held(checked: dict[int, SavedState]) -> dict[int, SavedState]:
    """The saved states of the ranks that held the component (a reshard takes no :data:`ABSENT_STATE`)."""
    return {r: s for r, s in checked.items() if not is_absent(s.view)}


def _text(err: BaseException) -> str:
    return err.message if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"


def _compatible_record(
    name: str, rec: dict[str, Any], reg: Registered, incompatible: dict[str, str], source: Any
) -> dict[str, Any] | None:
    adapter = reg.adapter
    if adapter is None:
        incompatible[name] = reg.adapter_error
        return None
    if rec["adapter"] == adapter.adapter_id and rec["adapter_version"] != adapter.version:
        try:  # upgrade an older payload through registered migrations (docs/migrations.md)
            rec = migrate_component(name, rec, adapter.version, source)
        except CheckpointError as err:
            incompatible[name] = err.message
            return None
    if rec["adapter"] != adapter.adapter_id or rec["adapter_version"] != adapter.version:
        incompatible[name] = (
            f"saved with adapter {rec['adapter']!r} v{rec['adapter_version']}, "
            f"the registered object uses {adapter.adapter_id!r} v{adapter.version}"
        )
        return None
    if rec["placement"] != reg.placement:
        incompatible[name] = f"saved as {rec['placement']!r}, registered as {reg.placement!r}"
        return None
    return rec


def _sources(
    comp: ComponentPlan, rec: dict[str, Any], rank: int, checked: dict[int, SavedState]
) -> dict[int, SavedState] | None:
    """Which saved states this rank reads: ``{source_rank: SavedState}`` (``checked``: every saved state, checked);
    ``None`` where the ranks it would take from held none of the component (saved absent)."""
    if rec["placement"] != "per_rank":
        comp.ctx.source_rank = rank
        state = checked[0]
        prefix = key_prefix(rec["placement"], comp.name, rank)
        return {rank: SavedState(state.skeleton, prefix, state.specs, state.view, state.refs, state.sparse)}
    if not comp.reshard:
        comp.ctx.source_rank = rank
        return {rank: checked[rank]}
    held = _held(checked)  # (a reshard takes its states from the ranks that held the component)
    if not held:
        return None
    wanted = comp.adapter.reshard_sources({r: s.view for r, s in held.items()}, comp.ctx)
    if wanted and all(r in checked and r not in held for r in wanted):
        return None  # (the ranks it takes from held none: this rank's object is left as it is, said)
    bad = [r for r in wanted if r not in held]
    if bad:
        raise IncompatibleComponentError(
            f"component {comp.name!r}: adapter asked for saved ranks {bad} that do not exist"
        )
    comp.ctx.source_rank = wanted[0] if wanted else None
    return {r: held[r] for r in wanted}


def _destinations(comp: ComponentPlan, views: dict[int, Any], plan: LoadPlan, metadata: Any, source: Any) -> None:
    """Allocate (or take from the adapter) a destination for every tensor the component's saved states hold."""
    live_state: dict[str, Any] | None = None
    devices: dict[str, torch.device] = {}
    for src_rank, state in comp.sources.items():
        given = (None if comp.reshard else comp.adapter.destinations(comp.value, views[src_rank], comp.ctx)) or {}
        for spec in state.specs:  # each checked against DCP's metadata already (check_states)
            key = f"{state.prefix}/{spec.key}"
            dest = given.get(spec.key)
            if dest is not None:
                _check_destination(comp.name, spec, dest)
                plan.live[key] = dest
                prefetch(plan, key, spec, dest)
                comp.in_place = True
                continue
            if spec.dtensor:
                if live_state is None:
                    live_state = encode(comp.adapter.state(comp.value, comp.ctx), where=comp.name)[1]
                live = live_state.get(spec.key)
                if live is None or not is_dtensor(live):
                    raise IncompatibleComponentError(f"no live DTensor for sharded tensor {spec.key!r}")
                if live.dtype != spec.dtype or tuple(live.shape) != spec.shape:  # (while planning: strict="warn"
                    raise IncompatibleComponentError(  # skips the component, as for any other tensor)
                        f"component {comp.name!r}: sharded tensor {spec.key!r} was saved as {spec.dtype} "
                        f"{spec.shape}, the live DTensor is {live.dtype} {tuple(live.shape)}"
                    )
                dest = torch.empty_like(live)
            else:
                device = devices.get(spec.device)
                if device is None:
                    device = devices[spec.device] = comp.ctx.device_for(spec.device)
                # sizes as arguments: parsed 30 % faster than one tuple (0.75 µs a tensor; 5,000-tensor loads)
                if spec.shape and spec.stride is None:
                    dest = torch.empty(*spec.shape, dtype=spec.dtype, device=device)
                else:
                    dest = spec.empty(device)
            plan.fresh[key] = dest


def _check_destination(name: str, spec: TensorSpec, dest: torch.Tensor) -> None:
    """Every tensor an adapter offers to be read in place (a module's weights, a bare tensor, an optimizer's or a
    buffer's own state) passes here: the saved dtype and shape, and memory to read into."""
    if dest.is_meta:  # DCP "reads" into it without a byte moving: the load would claim success, restoring nothing
        what = "its tensor" if spec.key == "_" else f"tensor {spec.key!r}"  # "_": the component is the tensor
        raise IncompatibleComponentError(
            f"component {name!r}: {what} is on the meta device (it has no memory to load into): "
            "materialise the object before loading, e.g. module.to_empty(device=...) for a module built under "
            "torch.device('meta'), or build it on a real device"
        )
    if dest.dtype != spec.dtype or tuple(dest.shape) != spec.shape:
        raise IncompatibleComponentError(
            f"component {name!r}: tensor {spec.key!r} was saved as {spec.dtype} {spec.shape}, its destination is "
            f"{dest.dtype} {tuple(dest.shape)}"
        )


def check_backed(metadata: Any, key: str, spec: TensorSpec, source: Any) -> None:
    """The DCP metadata holds ``key`` with the manifest's dtype and shape, in records large enough for its bytes.

    Checked before the destination is allocated: a forged manifest cannot make a load
    allocate more memory than the checkpoint's files hold.
    """
    saved = None if metadata is None else metadata.state_dict_metadata.get(key)
    props = getattr(saved, "properties", None)
    if saved is None or props is None:
        raise CheckpointFormatError(f"tensor {key!r} of the manifest is absent from DCP's metadata", path=source)
    if props.dtype != spec.dtype or tuple(saved.size) != spec.shape:
        raise CheckpointFormatError(
            f"tensor {key!r} is {spec.dtype} {spec.shape} in the manifest but {props.dtype} {tuple(saved.size)} in "
            "DCP's metadata: the checkpoint is inconsistent or forged",
            path=source,
        )
    if spec.dtensor:
        return  # sharded: its chunks are checked by DCP's planner against the live shards
    nbytes = math.prod(spec.shape) * spec.dtype.itemsize
    records = record_index(metadata).get(key) or {}
    if len(saved.chunks) != 1:
        backed = sum(info.length for info in records.values())
    else:  # the record at the chunk's offsets (else any record of the key)
        info = records.get(tuple(saved.chunks[0].offsets))
        if info is None:
            info = next(iter(records.values()), None)
        backed = 0 if info is None else info.length
    if backed < nbytes:
        raise CheckpointIntegrityError(
            f"tensor {key!r} claims {nbytes} bytes but its records hold {backed}: the checkpoint is damaged or forged",
            path=source,
        )


def _backed_whole(saved: Any, records: Any, key: str, spec: TensorSpec, wholes: dict[int, WholeTensor | None]) -> bool:
    """What :func:`check_backed` checks, for a tensor of one chunk at the origin with its record there (5,000
    tensors: 6 ms less a load); ``False`` for anything else (then checked, and explained, by it). ``wholes``:
    :func:`whole_tensor` of each metadata object met (tensors of one dtype and shape share theirs)."""
    md = None if saved is None or spec.dtensor else saved.get(key)
    whole = wholes.get(id(md), False)
    if whole is False:
        whole = wholes[id(md)] = whole_tensor(md)
    if whole is None or whole.dtype != spec.dtype or whole.shape != spec.shape:
        return False
    info = (records.get(key) or {}).get(whole.offsets)
    return info is not None and info.length >= whole.nbytes


def check_totals(name: str, rec: Mapping[str, Any], source: Any) -> None:
    """A component's ``num_tensors`` and ``nbytes`` count its inventory (every rank's tensors: loads check it where
    the manifest they read holds them all, ``verify`` always), as a save writes them (what ``inspect`` shows)."""
    inventory = rec["inventory"]
    nbytes = sum(math.prod(t["shape"]) * dtype_from_name(t["dtype"]).itemsize for t in inventory.values())
    found = (rec.get("num_tensors"), rec.get("nbytes"))
    if found != (len(inventory), nbytes):
        raise CheckpointIntegrityError(
            f"component {name!r} claims {found[0]} tensors of {found[1]} bytes, its inventory holds "
            f"{len(inventory)} of {nbytes}: no save writes that; the manifest is damaged or forged",
            path=source,
        )


def check_states(
    name: str,
    rec: dict[str, Any],
    metadata: Any,
    source: Any,
    *,
    adapter: Adapter | None = None,
    world_size: int | None = None,
) -> dict[int, SavedState]:
    """The same checks for ``load`` and ``verify``, on every saved state of a component: its inventory agrees with
    its states, every state decodes (bounded), and every tensor is in DCP's metadata with its dtype and shape,
    backed by enough bytes, and the saving adapter's own checks pass (``adapter``: the one the load restores with,
    registered on the checkpoint or for all; otherwise the one registered for all under the saved id, as
    ``verify`` knows it). A rank's :data:`~torchrl_dcp.placement.ABSENT_STATE` (it registered no such component)
    holds no tensors and is not the adapter's to check; a replicated or sharded component never has one, nor a
    per-rank one on every rank (``world_size``: the saved world, when every rank's state is here). Returns
    ``{saved rank: SavedState}`` (rank 0 for replicated and sharded components)."""
    placement = rec["placement"]
    if placement == "per_rank":
        states = [(int(r), s["state"]) for r, s in rec["ranks"].items()]
    else:
        states = [(0, rec["state"])]
    recorded = rec["inventory"]
    seen: set[str] = set()
    out: dict[int, SavedState] = {}
    saved = None if metadata is None else metadata.state_dict_metadata
    records = None if metadata is None else record_index(metadata)
    names: dict[torch.dtype, str] = {}
    wholes: dict[int, WholeTensor | None] = {}
    for r, skeleton in states:
        try:
            view, specs, refs, sparse = plan_view(skeleton)  # every value decodes (numeric dtypes, bounded nesting)
        except CheckpointFormatError as err:
            raise CheckpointFormatError(f"component {name!r}: {err.message}", path=err.path or source) from None
        prefix = key_prefix(placement, name, r)
        for spec in specs:
            key = f"{prefix}/{spec.key}"
            entry = recorded.get(key)
            dtype = names.get(spec.dtype) or names.setdefault(spec.dtype, dtype_name(spec.dtype))
            if entry is None or entry["dtype"] != dtype or tuple(entry["shape"]) != spec.shape:
                _inventory_error(name, [key], source)
            seen.add(key)
            if not _backed_whole(
                saved, records, key, spec, wholes
            ):  # the common case in a few lookups, else every check
                check_backed(metadata, key, spec, source)
        if is_absent(view):
            if placement != "per_rank":
                raise CheckpointIntegrityError(
                    f"component {name!r} is {placement} and its state says no rank held it: a save writes that for a "
                    "per-rank component a rank did not register only; the checkpoint is damaged or forged",
                    path=source,
                )
        else:
            _check_saved(rec, skeleton, view, name, source, adapter)
        out[r] = SavedState(skeleton, prefix, specs, view, refs, sparse)
    if len(seen) != len(recorded):  # every tensor matched its entry: the others have no tensor
        _inventory_error(name, sorted(set(recorded) - seen), source)
    if out and len(out) == world_size and all(is_absent(s.view) for s in out.values()):
        raise CheckpointIntegrityError(
            f"component {name!r}: its state on every rank says the rank did not hold it: a save writes the component "
            "only where some rank registered it; the checkpoint is damaged or forged",
            path=source,
        )
    return out


def _check_saved(
    rec: dict[str, Any], skeleton: Any, view: Any, name: str, source: Any, adapter: Adapter | None = None
) -> None:
    """The saving adapter's own checks of a state (:meth:`Adapter.check_saved`, and no repeated tensor where its
    states never share one: :attr:`Adapter.shares_tensors`), when this process knows the adapter: ``adapter`` when
    it is the saving one (its id), else the one registered for all under the saved id."""
    if adapter is None or adapter.adapter_id != rec["adapter"]:
        adapter = adapter_by_id(rec["adapter"])
    if adapter is None or rec.get("adapter_version") != adapter.version:
        return  # an unknown adapter: refused where the component is planned (or left to the tools)
    try:
        if repeated := adapter.refused_repeats(skeleton):
            raise ValueError(f"its state holds one tensor twice (or another component's) at {repeated[:3]}")
        adapter.check_saved(view)
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointIntegrityError(
            f"component {name!r}: {err}: no save writes that state; the checkpoint is damaged or forged", path=source
        ) from None
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - the adapter's own failure: named, not "validating ... failed"
        raise CheckpointError(
            f"component {name!r}: its adapter ({adapter.adapter_id}) failed checking the saved state "
            f"({type(err).__name__}: {err})",
            path=source,
        ) from err


def plan_view(skeleton: Any) -> tuple[Any, list[TensorSpec], list[tuple[str, TensorSpec]], list[dict[str, Any]]]:
    """What a load plans from, in one walk: the decoded state with every tensor replaced by its
    :class:`TensorSpec`, the specs, the references to other components' tensors ``(component, spec)``, and the
    nodes of its sparse tensors.

    Raises :class:`CheckpointFormatError` exactly where :func:`decode` does.

    Example:
        >>> import torch
        >>> view, specs, refs, sparse = plan_view(encode({"w": torch.zeros(2)})[0])
        >>> view["w"].shape, len(specs), refs, sparse
        ((2,), 1, [], [])
    """
    sink = _SpecSink()
    view = decode(skeleton, sink)
    if sink.pending:  # an alias met before the tensor it names: decode again, every spec known
        view = decode(skeleton, {**sink, **{xref_key(c, spec.key): spec for c, spec in sink.refs}})
    parts = {part.get("key") for node in sink.sparse for part in (node.get("indices"), node.get("values"))}
    if shared := sorted(map(str, parts & sink.aliased)):  # (a save stores a sparse tensor's parts apart, never shared)
        raise CheckpointFormatError(
            f"malformed state skeleton: an alias names {shared[0]!r}, a part of a sparse tensor (its indices or values "
            "are never shared with another value)"
        )
    return view, sink.specs, sink.refs, sink.sparse


def check_sparse(state: SavedState, read: Callable[[TensorSpec], torch.Tensor], name: str, source: Any) -> None:
    """The indices of every sparse tensor of ``state`` (of component ``name``), read (``read(spec)``: the saved
    tensor, as the value checks read it), pass torch's invariant checks: what a load and ``verify`` run before
    anything is restored. Raises :class:`CheckpointFormatError` naming the component and ``source``."""
    for node in state.sparse:
        try:
            check_sparse_indices(node, read(node_spec(node["indices"])))
        except CheckpointFormatError as err:
            raise CheckpointFormatError(f"component {name!r}: {err.message}", path=source) from None


class _SpecSink(TensorSink):
    """``tensors`` of :func:`decode` while planning: a tensor leaf decodes to its spec (collected)."""

    def __init__(self) -> None:
        super().__init__()
        self.specs: list[TensorSpec] = []
        self.refs: list[tuple[str, TensorSpec]] = []
        self.sparse: list[dict[str, Any]] = []
        self.aliased: set[Any] = set()
        self.pending = False

    def saw_sparse(self, node: dict[str, Any]) -> None:
        self.sparse.append(node)

    def take(self, node: dict[str, Any]) -> Any:
        kind = node["t"]
        if kind == "alias":
            self.aliased.add(node["key"])
            found = self.get(node["key"])
            self.pending = self.pending or found is None
            return found
        spec = node_spec(node)
        if kind == "xref":
            if not isinstance(node.get("component"), str):
                raise CheckpointFormatError(f"malformed tensor reference {node!r}")
            self.refs.append((node["component"], spec))
        else:
            self.specs.append(spec)
            self[spec.key] = spec
        return spec


def _inventory_error(name: str, differ: list[str], source: Any) -> None:
    raise CheckpointIntegrityError(
        f"component {name!r}: the tensor inventory disagrees with its saved state at {differ[:3]} "
        "(damaged or forged manifest)",
        path=source,
    )


def _references(
    comp: ComponentPlan, saved: Mapping[str, Any], plan: LoadPlan, rank: int, metadata: Any, source: Any
) -> None:
    """Tensors shared with a replicated component (stored once, as references) get a destination too."""
    for state in comp.sources.values():
        for ref_name, spec in state.refs:
            ref = saved.get(ref_name)
            if ref is None or ref["placement"] != "replicated":
                raise CheckpointFormatError(
                    f"component {comp.name!r} refers to tensors of {ref_name!r}, which is not a replicated "
                    "component of this checkpoint",
                    path=source,
                )
            ref_key = f"{key_prefix('replicated', ref_name, rank)}/{spec.key}"
            if ref_key not in plan.fresh and ref_key not in plan.live:
                check_backed(metadata, ref_key, spec, source)
                plan.fresh[ref_key] = spec.empty(comp.ctx.device_for(spec.device))
                continue
            if ref_key not in plan.fresh and ref_key in plan.live:
                # the component that stores it reads it in place, last: this one is restored after that read too
                # (it takes the live tensor, filled then: shared as saved, or its values copied)
                comp.in_place = True
            held = plan.destination(ref_key)  # planned by the component that stores it: the shapes must agree
            if tuple(held.shape) != spec.shape or held.dtype != spec.dtype:
                raise CheckpointIntegrityError(
                    f"component {comp.name!r} refers to {ref_key!r} as {spec.dtype} {list(spec.shape)}, which is "
                    f"{held.dtype} {list(held.shape)}: the manifest is inconsistent or forged",
                    path=source,
                )


def decode_states(comp: ComponentPlan, plan: LoadPlan, rank: int) -> dict[int, Any]:
    """The component's saved states with their tensors (the destinations, read or about to be read)."""
    states = {}
    for src_rank, state in comp.sources.items():
        tensors = {spec.key: plan.destination(f"{state.prefix}/{spec.key}") for spec in state.specs}
        for spec in state.specs:  # saved while autograd tracked them: the fresh tensors read for them (not live ones)
            if spec.grad and f"{state.prefix}/{spec.key}" not in plan.live:
                _track(tensors[spec.key])
        for ref_name, spec in state.refs:
            tensors[xref_key(ref_name, spec.key)] = plan.destination(
                f"{key_prefix('replicated', ref_name, rank)}/{spec.key}"
            )
        states[src_rank] = decode(state.skeleton, tensors)
    return states


def _track(value: torch.Tensor) -> None:
    """Make ``value``, a fresh tensor read for one saved while autograd tracked it (``grad`` in its node), tracked
    again, where autograd can track it (never a live tensor: :func:`decode_states` calls it on fresh ones only)."""
    if not value.requires_grad and value.is_leaf and (value.is_floating_point() or value.is_complex()):
        if not value.is_inference():
            value.requires_grad_(True)


# ---------------------------------------------------------------------- snapshots
def _take_snapshot(comp: ComponentPlan) -> None:
    comp.planned = True
    try:
        comp.snapshot = comp.adapter.snapshot(comp.value, comp.ctx)
        comp.has_snapshot = True
    except Exception:  # e.g. an object whose state() fails before its first use: nothing to roll back to
        comp.snapshot, comp.has_snapshot = None, False


def rollback_one(comp: ComponentPlan) -> str | None:
    """Put ``comp``'s object back as it was before the load; returns a problem, or ``None``."""
    if not comp.has_snapshot:
        return f"{comp.name!r} (its state could not be captured before the load)"
    try:
        comp.adapter.rollback(comp.value, comp.snapshot, comp.ctx)
    except Exception as err:
        return f"{comp.name!r} ({type(err).__name__}: {err})"
    return None

"""The steps of a save: encode → plan writes → write → commit.

- :func:`encode` (every rank, locally): each component's adapter state is split into
  a JSON skeleton and tensors under their DCP keys; the tensor inventory of each
  component is computed here, once.
- :func:`plan` (collective): ranks exchange what they hold and compute the same
  :class:`~torchrl_dcp.planner.WritePlan` (who writes which key).
- :func:`write` (collective): rank 0 prepares the destination's staging area
  (:meth:`Location.prepare_save <torchrl_dcp.storage.base.Location.prepare_save>`: a
  staging directory under the destination's lock, or a marked object-store prefix),
  every other rank attaches to it, then every rank writes its share at once through
  one :class:`StateWriter`: ours (:class:`FastStateWriter`) or DCP's
  (:class:`DCPStateWriter`, for DTensor state), both returning a
  :class:`~torchrl_dcp.storage.base.WriteOutcome`.
- :func:`commit` (collective): rank 0 gathers every rank's files and per-rank
  records, writes DCP's ``.metadata``, then ``manifest.json`` last, and publishes
  (:class:`~torchrl_dcp.storage.base.SaveTarget`); every rank learns the outcome.

The steps are the same for every backend: the location decides only where bytes go.

A failure at any step raises on every rank (:mod:`torchrl_dcp.collective`); nothing
is published, and the previous checkpoint at the destination stays intact.

Example (one process):
    >>> import tempfile, torch
    >>> from torchrl_dcp.adapters import AdapterContext, ModuleAdapter
    >>> from torchrl_dcp.save_engine import EncodeItem, encode
    >>> item = EncodeItem("policy", torch.nn.Linear(2, 1), ModuleAdapter(), "replicated", AdapterContext("policy"))
    >>> encoded = encode([item], rank=0)
    >>> sorted(encoded.flat), encoded.records["policy"].num_tensors
    (['replicated/policy/bias', 'replicated/policy/weight'], 2)
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchrl_dcp import _dist, chunking
from torchrl_dcp._gc import gc_paused
from torchrl_dcp._log import get_logger
from torchrl_dcp.adapters import Adapter, AdapterContext
from torchrl_dcp.adapters.modules import warn_networks_left_out
from torchrl_dcp.collective import broadcast_step, error_status, raise_if_failed, run_step
from torchrl_dcp.commit_records import RankPart, metadata_bytes, root_manifest, write_rank_part
from torchrl_dcp.errors import CheckpointError, CollectiveError, EncodingError
from torchrl_dcp.format.codec import dtype_name, escape_key, is_dtensor, tensor_identity
from torchrl_dcp.format.codec import encode as encode_value
from torchrl_dcp.format.layout import DCP_METADATA
from torchrl_dcp.placement import ABSENT_SKELETON, ABSENT_STATE, Placement, is_absent_skeleton, key_prefix
from torchrl_dcp.planner import (
    SavePlanner,
    WritePlan,
    is_own_key,
    plan_local,
    plan_writes,
    shared_digest,
    tensor_infos,
)
from torchrl_dcp.replicas import ReplicaCheck, with_value_paths
from torchrl_dcp.replicas import compare as compare_replicas
from torchrl_dcp.replicas import digest as replica_digest
from torchrl_dcp.save_support import quiet_single_process, save_failure, summarize
from torchrl_dcp.storage.base import Location, SaveTarget, ShareWrite, WriteOutcome
from torchrl_dcp.storage.chunk_writer import ChunkJob, KeptChunk

logger = get_logger(__name__)
_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


# ---------------------------------------------------------------------- records
@dataclass
class ComponentRecord:
    """One component as encoded on this rank: what the manifest records of it (this rank's part)."""

    adapter: str
    adapter_version: int
    placement: Placement
    state: Any  # JSON skeleton (this rank's, for per_rank components)
    inventory: dict[str, dict[str, Any]]  # {dcp_key: {"dtype", "shape"}} of this rank's tensors

    @property
    def num_tensors(self) -> int:
        return len(self.inventory)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(t["shape"]) * _DTYPES[f"torch.{t['dtype']}"].itemsize for t in self.inventory.values())

    def manifest_entry(self) -> dict[str, Any]:
        """The root manifest's record of a replicated or sharded component (a per-rank one's states go to the
        shards: :mod:`torchrl_dcp.commit_records`)."""
        return {
            "adapter": self.adapter,
            "adapter_version": self.adapter_version,
            "placement": self.placement,
            "state": self.state,
            "inventory": dict(sorted(self.inventory.items())),
            "num_tensors": self.num_tensors,
            "nbytes": self.nbytes,
        }


@dataclass
class EncodeItem:
    """A component to encode: its name, object, adapter, placement and adapter context."""

    name: str
    value: Any
    adapter: Adapter
    placement: Placement
    ctx: AdapterContext


@dataclass
class Encoded:
    """This rank's encoded save: component records and the flat ``{dcp_key: tensor}`` state.

    ``changes`` maps DCP keys to what the adapters tracked of their written rows
    (:mod:`torchrl_dcp.tracking`); each snapshot is committed or given back with the save.
    """

    records: dict[str, ComponentRecord]
    flat: dict[str, torch.Tensor]
    changes: dict[str, Any] = field(default_factory=dict)
    snapshots: list[Any] = field(default_factory=list)

    def settle(self, save_id: str | None, where: Any = None) -> None:
        """The save committed as ``save_id`` at ``where`` (or failed: ``None``): tell the row trackers."""
        from torchrl_dcp.incremental import epoch_of

        snapshots, self.snapshots = self.snapshots, []
        for snap in snapshots:
            if save_id is None:
                snap.tracker.abort(snap)
            else:
                snap.tracker.commit(snap, epoch_of(save_id, where))


@dataclass
class SaveJob:
    """An encoded and planned save, ready to be written: what every rank holds after the encode step."""

    destination: Any  # a Path, or a StorePath (what messages and the result name)
    location: Location
    step: int | None
    metadata: dict[str, Any]
    encoded: Encoded
    plan: WritePlan
    group: Any
    rank: int
    world_size: int
    stage_event: Any = None  # CUDA event the async writer waits for before reading staged tensors
    save_id: str = ""  # chosen by rank 0 with the staging directory: in the manifest, .metadata, every data file
    keeps: dict[str, KeptChunk] = field(default_factory=dict)  # chunk files kept from the incremental base
    kept_from: frozenset[str] = frozenset()  # the saves whose chunk files any rank may keep (the base's origins)
    chunk_rows: dict[str, torch.Tensor | None] = field(default_factory=dict)  # rows of each chunk file to write
    outcome: WriteOutcome | None = None  # what this rank wrote, once committed
    sequence: int | None = None  # commit order in a rotation directory (manifest ``sequence``)


# ---------------------------------------------------------------------- step 1: encode
def encode(items: list[EncodeItem], rank: int) -> Encoded:
    """Encode every component on this rank (no collective).

    Replicated components are encoded first, so a tensor another component shares with
    one of them (a collector's policy, a loss's actor) is stored once, as a reference.
    """
    out = Encoded({}, {})
    shared: dict[tuple[Any, ...], tuple[str, str]] = {}
    try:
        for item in sorted(items, key=lambda it: it.placement != "replicated"):
            _encode_item(item, rank, out, shared)
    except BaseException:
        out.settle(None)
        raise
    out.records = {it.name: out.records[it.name] for it in items}
    warn_networks_left_out({it.name: it.value for it in items}, "saving")
    return out


def _adapter_state(item: EncodeItem, prefix: str, out: Encoded) -> Any:
    """The component's tracked row changes (into ``out``), then its state, as its adapter gives them; what the
    object's own code raises is an :class:`EncodingError` naming the component."""
    try:
        changes = item.adapter.row_changes(item.value, item.ctx) or {}
        for path, snap in changes.items():
            key = f"{prefix}/" + "/".join(escape_key(p) for p in path)
            out.changes[key] = snap
            snap.keys.add(key)
            if not any(s is snap for s in out.snapshots):
                out.snapshots.append(snap)
        state = item.adapter.state(item.value, item.ctx)
    except EncodingError as err:  # (an adapter's own refusal: named for the component, when it does not say whose)
        if not err.message.startswith("component "):
            err.reword(f"component {item.name!r}: {err.message}")
        raise
    except (CheckpointError, Warning):  # (a warning turned into an error is the caller's choice: raised as is)
        raise
    except Exception as err:  # the object's own code (its state_dict, ...) failed: say whose, and what to do
        why = f"{type(err).__name__}: {err}"
        if isinstance(err, NotImplementedError) and not str(err):  # (a base class's abstract state_dict)
            why = "its state_dict is not implemented (NotImplementedError); write state_dict and load_state_dict"
        raise EncodingError(
            f"component {item.name!r} ({type(item.value).__name__}, adapter {item.adapter.adapter_id}) could not "
            f"give its state: {why}; fix the object, or register it with an adapter that can save it "
            "(register(name, obj, adapter=...))"
        ) from err
    return state


def _encode_item(item: EncodeItem, rank: int, out: Encoded, shared: dict[tuple[Any, ...], tuple[str, str]]) -> None:
    """One component: its tracked row changes (first), then its state as skeleton + tensors under DCP keys."""
    prefix = key_prefix(item.placement, item.name, rank)
    state = _adapter_state(item, prefix, out)
    skeleton, tensors = encode_value(state, where=item.name, shared=shared)
    if is_absent_skeleton(skeleton):  # (what a rank that registered no such component saves: loads would skip it)
        raise EncodingError(
            f"the state of component {item.name!r} is {ABSENT_STATE}, the value torchrl_dcp saves for a rank that "
            "registered no such component (reserved): a load would skip it, and verify would refuse it; rename the "
            "key or wrap the state (e.g. {'state': ...})"
        )
    if repeated := item.adapter.refused_repeats(skeleton):
        raise EncodingError(
            f"component {item.name!r} holds one tensor twice (or another component's tensor) at {repeated[:3]}: "
            f"{item.adapter.adapter_id} states never share tensors, and a load would refuse it; clone the tensor "
            "where it is shared"
        )
    inventory: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        if item.placement != "sharded" and is_dtensor(tensor):
            raise EncodingError(
                f"component {item.name!r} ({item.placement}) holds a DTensor at {key!r} (FSDP2 or tensor "
                f"parallelism: each rank holds a shard): register it with placement='sharded'"
            )
        if item.placement == "replicated":
            ident = tensor_identity(tensor)
            if ident is not None:
                shared.setdefault(ident, (item.name, key))
        out.flat[f"{prefix}/{key}"] = tensor
        inventory[f"{prefix}/{key}"] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}
    if item.placement == "sharded" and tensors and not any(is_dtensor(t) for t in tensors.values()):
        raise EncodingError(  # DCP writes a plain tensor of every rank under one key once: other ranks' are lost
            f"component {item.name!r} is registered as sharded but holds no DTensor (sharded placement is for FSDP2 "
            "or tensor-parallel state): register it with placement='replicated' (the same on every rank) or "
            "'per_rank' (each rank's own)"
        )
    out.records[item.name] = ComponentRecord(
        item.adapter.adapter_id, item.adapter.version, item.placement, skeleton, inventory
    )


# ---------------------------------------------------------------------- step 2: plan
def plan(
    group: Any,
    encode_step: Any,
    replica_checks: Mapping[str, ReplicaCheck] | None = None,
    call: Any = None,
    options: Collection[str] = (),
) -> tuple[Encoded, WritePlan]:
    """Encode on every rank (``encode_step()``), agree, plan the writes (collective).

    The ranks agree in one small exchange (:func:`torchrl_dcp._dist.agree`: did any rank fail,
    does any need DCP's writer, is the digest of the shared tensor list and of the replica
    digests the same everywhere); each rank then plans its own writes alone
    (:func:`~torchrl_dcp.planner.plan_local`). Only when a rank failed or the digests differ do
    the ranks gather what each holds, to raise the same error everywhere naming the rank, the
    component or the key (:func:`_plan_gathered`). Any rank's encoding failure raises on every
    rank before anything is written; so does replicated state that differs between ranks
    (:mod:`torchrl_dcp.replicas`), and a save the ranks do not describe alike (:func:`save_layout`: the
    components, their placements and adapters, and ``call``, the arguments every rank passes alike; ``options``,
    the names ``component_options`` gives on this rank, are each rank's own).
    """
    mine: list[Encoded] = []
    several = _dist.group_size(group) > 1
    held: list[Any] = []  # this rank's (tensor infos, replica digests), once encoded
    error: BaseException | None = None
    try:
        mine.append(encode_step())
        replicas = replica_digest(mine[0].records, mine[0].flat, replica_checks or {}) if several else {}
        held.append((tensor_infos(mine[0].flat), replicas, save_layout(mine[0], call, options)))
    except BaseException as err:  # reported to every rank (below), then re-raised here
        error = err
    try:
        if not several:
            raise_if_failed([], "encoding the state", error)
            return mine[0], plan_local(held[0][0], 0, 1)
        infos, replicas, layout = held[0] if held else (None, {}, None)
        (failed, needs_dcp), same = _dist.agree(
            [error is not None, bool(held) and infos is None],
            shared_digest(infos, {"replicas": replicas, "layout": layout}),
            group,
            "encoding the state",
        )
        if failed or not same:
            records = mine[0].records if mine else {}  # (the non-tensor values' digests, to name one that differs)
            gathered_plan = _plan_gathered(group, held, error, records)  # raises what failed or differs, everywhere
            return mine[0], gathered_plan
        refuse_unregistered([layout])  # (every rank's layout is this one: the same answer everywhere)
        return mine[0], plan_local(None if needs_dcp else infos, _dist.group_rank(group), _dist.group_size(group))
    except BaseException:
        for encoded in mine:
            encoded.settle(None)
        raise


def _plan_gathered(group: Any, held: list[Any], error: BaseException | None, records: Mapping[str, Any]) -> WritePlan:
    """The plan from every rank's gathered tensor list and replica digests, when they did not agree: raises
    what differs (or the failed rank's error) on every rank; a plan for what merely differs in who holds it."""

    def local() -> Any:
        if error is not None:
            raise error
        infos, replicas, layout = held[0]
        return infos, with_value_paths(records, replicas), layout

    gathered = run_step(group, "encoding the state", local, monitored=False)
    layouts = [layout for _, _, layout in gathered]
    absent = absent_here(layouts, _dist.group_rank(group))
    for name, (placement, adapter, version) in absent.items():  # (another rank's per-rank component: held as none)
        skeleton = copy.deepcopy(ABSENT_SKELETON)
        records[name] = ComponentRecord(adapter, version, placement, skeleton, {})  # (``records``: this rank's own)
    compare_layouts(with_absent(layouts), group)
    refuse_unregistered(layouts)
    compare_replicas([replicas for _, replicas, _ in gathered], group)
    return plan_writes([infos for infos, _, _ in gathered])


def save_layout(encoded: Encoded, call: Any, options: Collection[str] = ()) -> dict[str, Any]:
    """What every rank of a save must describe alike (JSON-safe): ``call`` (the save's destination and step) and
    each component's placement and adapter. The manifest is rank 0's description of them: a rank that registered
    another component, placement or adapter would commit a checkpoint no load reads. ``options`` (the names
    ``component_options`` gives) are each rank's own: not compared, but one no rank registered is refused
    (:func:`refuse_unregistered`). ``chunking``: the chunk sizes this rank cuts large tensors by (``TDCP_CHUNK_BYTES``,
    ``TDCP_MIN_CHUNKED_BYTES``): each rank plans the chunks of the replicated tensors it writes by its own."""
    components = {n: [r.placement, r.adapter, r.adapter_version] for n, r in sorted(encoded.records.items())}
    sizes = [chunking.CHUNK_BYTES, chunking.MIN_CHUNKED_BYTES]
    return {"call": call, "components": components, "options": sorted(options), "chunking": sizes}


def _absent_ones(layouts: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The per-rank components some ranks registered and others did not, each described alike by every rank holding
    it: ``{name: [placement, adapter, version]}``. Any other difference is :func:`compare_layouts`' to refuse."""
    described: dict[str, list[list[Any]]] = {}
    for layout in layouts:
        for name, entry in layout["components"].items():
            described.setdefault(name, []).append(entry)
    return {
        name: entries[0]
        for name, entries in described.items()
        if len(entries) < len(layouts) and entries[0][0] == "per_rank" and all(e == entries[0] for e in entries)
    }


def absent_here(layouts: list[dict[str, Any]], rank: int) -> dict[str, list[Any]]:
    """What this rank saves as :data:`~torchrl_dcp.placement.ABSENT_STATE`: the per-rank components other ranks
    registered and it did not (a logger, an evaluation hook on rank 0 alone), so that every rank's manifest shard
    holds every per-rank component."""
    return {n: e for n, e in _absent_ones(layouts).items() if n not in layouts[rank]["components"]}


def with_absent(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The layouts as the manifest describes them: each holding the per-rank components some ranks lack."""
    absent = _absent_ones(layouts)
    return [{**layout, "components": dict(sorted({**absent, **layout["components"]}.items()))} for layout in layouts]


def refuse_unregistered(layouts: list[dict[str, Any]]) -> None:
    """Raise the same :class:`CheckpointError` on every rank when the save's ``components=`` selection, or any rank's
    ``component_options``, names a component no rank registered (each rank leaves out the names it did not register:
    per-rank components of other ranks)."""
    chosen = (layouts[0]["call"] or {}).get("components") if isinstance(layouts[0]["call"], Mapping) else None
    held = {name for layout in layouts for name in layout["components"]}
    unknown = sorted(set(chosen or ()) - held)
    if unknown:
        raise CheckpointError(
            f"components={list(chosen)} names {unknown}, which no rank registered: register them, or leave them out of "
            "components=; nothing was written"
        )
    optioned = sorted({n for layout in layouts for n in layout.get("options", ())} - held)
    if optioned:
        raise CheckpointError(
            f"component_options names {optioned}, which no rank registered: register them, or leave them out of "
            "component_options; nothing was written"
        )


def compare_layouts(layouts: list[dict[str, Any]], group: Any = None) -> None:
    """Raise the same :class:`CheckpointError` on every rank when the ranks' :func:`save_layout` differ, naming the
    first rank that differs from rank 0 (of ``group``, with its global rank in a subgroup) and what."""
    first, zero = layouts[0], _dist.ranks_named(group, "0") if group is not None else "0"
    for r, layout in enumerate(layouts):
        rank = _dist.ranks_named(group, str(r)) if group is not None else str(r)
        if layout["chunking"] != first["chunking"]:
            (a, b), (c, d) = first["chunking"], layout["chunking"]
            raise CheckpointError(
                f"the ranks do not save alike: they cut large tensors into chunk files of different sizes (TDCP_CHUNK_BYTES={a} and "
                f"TDCP_MIN_CHUNKED_BYTES={b} on rank {zero}, {c} and {d} on rank {rank}): set these variables alike on "
                "every rank (in the launcher's environment, for every node), or on none; nothing was written"
            )
        if (layout["call"], layout["components"]) == (first["call"], first["components"]):
            continue
        why = []
        if layout["call"] != first["call"]:
            why.append(f"rank {zero} saves {first['call']}, rank {rank} {layout['call']}")
        a, b = first["components"], layout["components"]
        for who, x, y in ((zero, a, b), (rank, b, a)):
            if set(x) - set(y):
                why.append(f"components only on rank {who}: {sorted(set(x) - set(y))}")
        why += [
            f"component {n!r} is {a[n][0]} ({a[n][1]} v{a[n][2]}) on rank {zero}, {b[n][0]} ({b[n][1]} v{b[n][2]}) on rank {rank}"
            for n in sorted(set(a) & set(b))
            if a[n] != b[n]
        ]
        raise CheckpointError(
            f"the ranks do not save alike ({'; '.join(why)}): every rank must call save with the same path and step "
            "and register the same components, with the same placements and kinds of objects; nothing was written"
        )


def plan_chunks(job: SaveJob, base: Any, staged: bool = False) -> None:
    """Which of this rank's chunk files are kept from the incremental ``base``, and the rows of the others.

    With ``staged`` (async saves) kept chunks get no rows (they are not copied into
    staging buffers); otherwise every chunk keeps a view of its live rows, written
    instead when the base file turns out not to be the one recorded.
    """
    from torchrl_dcp.incremental import plan_keeps

    job.keeps = plan_keeps(base, job.plan, job.encoded.flat, job.encoded.changes, job.rank)
    job.chunk_rows = {
        c.file: None if staged and c.file in job.keeps else job.encoded.flat[c.key].detach().narrow(0, c.start, c.rows)
        for c in job.plan.chunk_share(job.rank)
    }


# ---------------------------------------------------------------------- step 3: write
class StateWriter(Protocol):
    """Writes this rank's share of a planned save into the save's staging area."""

    def write(self, job: SaveJob, target: SaveTarget) -> WriteOutcome:
        """Write; return the files written (with size and checksum) and DCP storage entries."""


class FastStateWriter:
    """Our writer: packed records, parallel writes, inline checksums (the backend writes them where they go)."""

    def write(self, job: SaveJob, target: SaveTarget) -> WriteOutcome:
        chunks = job.plan.chunk_share(job.rank)
        if not job.chunk_rows and chunks:  # not planned by plan_chunks: write every chunk
            job.chunk_rows = {c.file: job.encoded.flat[c.key].detach().narrow(0, c.start, c.rows) for c in chunks}
        jobs = [
            ChunkJob(c.file, c.key, c.start, c.rows, job.chunk_rows.get(c.file), job.keeps.get(c.file)) for c in chunks
        ]
        keys = job.plan.share(job.rank)
        own = [(k, job.encoded.flat[k]) for k in keys if is_own_key(k)]
        shared = [(k, job.encoded.flat[k]) for k in keys if not is_own_key(k)]
        return target.write(ShareWrite(own, jobs, job.save_id, job.rank, shared))


class DCPStateWriter:
    """DCP's own writer, for state ours does not encode (DTensors): collective, writes ``.metadata`` itself."""

    def write(self, job: SaveJob, target: SaveTarget) -> WriteOutcome:
        try:
            with quiet_single_process():
                dcp.save(
                    job.encoded.flat,
                    storage_writer=target.dcp_writer(),
                    planner=SavePlanner(),
                    process_group=job.group,
                    no_dist=job.group is None,
                )
        except CheckpointException as err:
            raise CollectiveError(f"DCP save failed: {summarize(err)}", path=job.destination) from None
        return target.seal_dcp_files(job.rank, job.save_id)


def writer_for(write_plan: WritePlan) -> StateWriter:
    return FastStateWriter() if write_plan.backend == "fast" else DCPStateWriter()


def prepare(job: SaveJob) -> SaveTarget:
    """Rank 0 prepares the destination's staging area (and picks the save id); every other rank attaches to it."""
    prepared: list[SaveTarget] = []

    def on_rank_0() -> tuple[str, str]:
        save_id = uuid.uuid4().hex
        try:
            prepared.append(job.location.prepare_save(save_id, kept_from=job.kept_from))
        except Exception as err:
            raise save_failure(err, "preparing the staging directory", job.destination) from err
        return prepared[0].token, save_id

    token, job.save_id = broadcast_step(
        job.group, "preparing the staging directory", on_rank_0, rank=job.rank, monitored=False
    )
    return prepared[0] if prepared else job.location.attach_save(token)


def write(job: SaveJob, target: SaveTarget) -> tuple[WriteOutcome, BaseException | None]:
    """Every rank writes its share at once; a local failure is returned, to be reported at commit."""
    try:
        return writer_for(job.plan).write(job, target), None
    except CollectiveError:
        raise
    except Exception as err:
        return WriteOutcome(), save_failure(
            err, f"rank {job.rank} writing its data file", _failed_file(err, job, target)
        )


def _failed_file(err: BaseException, job: SaveJob, target: SaveTarget) -> Any:
    """What a failed write names: the file it was writing, as the destination will hold it (the staging directory is
    removed by then), else the destination."""
    name = getattr(err, "filename", None)
    if isinstance(name, str) and os.path.dirname(name) == str(target.where):
        return job.destination / os.path.basename(name)
    return name if isinstance(name, str) and name else job.destination


# ---------------------------------------------------------------------- step 4: commit
def commit(job: SaveJob, target: SaveTarget, outcome: WriteOutcome, write_error: BaseException | None) -> Any:
    """Every rank writes its manifest shard; rank 0 writes DCP's metadata and the root manifest last, then
    publishes; every rank learns the outcome."""
    part, error = _rank_part(job, target, outcome, write_error)
    gathered = _dist.gather_to_0(part, job.group, "collecting file records")
    if job.rank == 0:
        try:
            assert gathered is not None
            raise_if_failed([p.status for p in gathered], "writing data files", None, job.group)
            with gc_paused():  # thousands of small objects: metadata and manifest
                manifest, files = manifest_bytes(job, target, gathered)
                target.commit(manifest, files)
        except BaseException as err:
            error = save_failure(err, "committing the checkpoint", job.destination)
    # only rank 0 can fail here: each rank receives its one status, not an all_gather of every rank's
    status = _dist.broadcast_from_0(error_status(error), job.group, "confirming the commit", monitored=False)
    raise_if_failed([status], "committing the checkpoint", error or write_error, job.group)
    return job.destination


def _rank_part(
    job: SaveJob, target: SaveTarget, outcome: WriteOutcome, error: BaseException | None
) -> tuple[RankPart, BaseException | None]:
    """This rank's manifest shard written, and what rank 0 receives of it (a failure becomes its status)."""
    if error is None:
        try:
            part = write_rank_part(
                records=job.encoded.records,
                outcome=outcome,
                target=target,
                rank=job.rank,
                save_id=job.save_id,
                indexed=job.plan.backend == "fast",
                checkpoint_id=target.checkpoint_id,
            )
            return part, None
        except Exception as err:
            error = save_failure(err, f"rank {job.rank} writing its manifest shard", target.where)
    return RankPart(error_status(error), {}, [], {}, []), error


def manifest_bytes(job: SaveJob, target: SaveTarget, gathered: list[RankPart]) -> tuple[bytes, dict[str, Any]]:
    """Writes DCP's ``.metadata`` into the staging area; returns the sealed root manifest to commit and the file
    records it lists (rank 0)."""
    files = {name: rec for p in gathered for name, rec in p.files.items()}
    indexed = job.plan.backend == "fast"
    if indexed:  # DCP's metadata, as dcp.save would have written it
        shared = {k: (_DTYPES[t.dtype], t.shape) for k, t in job.plan.tensors.items() if not is_own_key(k)}
        data = metadata_bytes(shared, gathered, target.checkpoint_id, job.save_id)
        files[DCP_METADATA] = target.write_member(DCP_METADATA, data)
    else:
        metadata = target.read_dcp_metadata()  # DCP wrote it (our own file, just written)
        if metadata is not None:  # give it this save's identity
            metadata.storage_meta.save_id = job.save_id
            files[DCP_METADATA] = target.write_member(DCP_METADATA, pickle.dumps(metadata))
    manifest = root_manifest(
        records=job.encoded.records,
        parts=gathered,
        files=files,
        indexed=indexed,
        world_size=job.world_size,
        metadata=job.metadata,
        step=job.step,
        save_id=job.save_id,
        sequence=job.sequence,
    )
    return manifest, files


def run(job: SaveJob) -> Any:
    """Steps 3 and 4 (collective): prepare, write, commit, publish; whatever a failure left is removed and the
    destination released, for every backend alike."""
    try:
        job.location.check_writer(job.plan.backend)
        target = prepare(job)
    except BaseException:
        job.encoded.settle(None)
        raise
    try:
        outcome, error = write(job, target)
        path = commit(job, target, outcome, error)
    except BaseException:
        job.encoded.settle(None)
        if job.rank == 0:
            try:
                target.abandon()
            except OSError as err:  # (the save's own failure is the one to raise; this one is said)
                logger.warning("%s: removing what the failed save left failed: %s", job.location.path, err)
        raise
    finally:
        target.release()
    job.encoded.settle(job.save_id, job.location.path)
    if outcome.copied:
        logger.warning(
            "incremental save %s copied %d of %d kept chunk files (hard links were impossible, e.g. across "
            "file systems, or the base's files are not this user's alone): it is complete, but wrote those bytes "
            "again",
            path,
            outcome.copied,
            outcome.kept,
        )
    logger.info(
        "saved checkpoint %s (step %s, %d components, %d bytes written by rank %d, %d chunk files kept)",
        path,
        job.step,
        len(job.encoded.records),
        outcome.bytes_written,
        job.rank,
        outcome.kept,
    )
    job.outcome = outcome
    return path

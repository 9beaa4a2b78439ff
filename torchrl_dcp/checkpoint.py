"""``DistributedCheckpoint``: register components, save them from every rank, load them back.

Example (one process; under ``torchrun`` every rank runs the same lines):
    >>> import tempfile, torch
    >>> import torchrl_dcp as tdcp
    >>> policy = torch.nn.Linear(3, 2)
    >>> ckpt = tdcp.DistributedCheckpoint(policy=policy)
    >>> ckpt.register("rng", tdcp.RNGState())              # per_rank by default
    >>> ckpt.register("stats", {"episodes": 3}, placement="per_rank")
    >>> path = ckpt.save(tempfile.mkdtemp() + "/step-100", step=100)
    >>> result = ckpt.load(path)
    >>> sorted(result.loaded)
    ['policy', 'rng', 'stats']
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import os
import re
import warnings
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from torchrl_dcp import _dist
from torchrl_dcp._gc import gc_paused
from torchrl_dcp.async_save import AsyncSaver, SaveHandle
from torchrl_dcp.adapters import Adapter, AdapterContext, CheckpointOptions, RNGState, resolve_adapter
from torchrl_dcp.codec import TensorSpec, decode, encode, tensor_identity, tensor_specs, xref_key, xrefs
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CollectiveError,
    EncodingError,
    IncompatibleComponentError,
    WorldSizeMismatchError,
)
from torchrl_dcp.manifest import MANIFEST, dumps, library_versions, migrate_component, new_manifest, read_manifest
from torchrl_dcp.placement import Placement, check_placement, key_prefix
from torchrl_dcp.planner import SafeLoadPlanner, SavePlanner
from torchrl_dcp.storage.checksums import describe_file
from torchrl_dcp.storage.commit import (
    DestinationLock,
    publish,
    remove_tree,
    stale_entries,
    staging_path,
    sweep_stale_locks,
    write_file_durably,
)
from torchrl_dcp.storage.filesystem import DCP_METADATA, make_writer
from torchrl_dcp.storage.source import open_source
from torchrl_dcp.storage.writer import assign_writers, build_metadata, can_write_fast, describe, write_metadata, write_share

logger = logging.getLogger("torchrl_dcp")

Strictness = Literal["error", "warn", "ignore"]
WorldSizeChange = Literal["error", "reshard"]
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}


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

    @property
    def version_skew(self) -> bool:
        return bool(self.comparison.get("version_skew"))


@dataclass
class _SaveJob:
    """An encoded save, ready to be written: what every rank holds after the encode step."""

    destination: Path
    names: list[str]
    records: dict[str, Any]
    flat: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    step: int | None
    group: Any
    rank: int
    world_size: int
    stage_event: Any = None  # CUDA event the async writer waits for before reading staged tensors
    plans: list[tuple[bool, Any]] = field(default_factory=list)  # every rank's (fast, describe(flat))
    owner: dict[str, int] | None = None  # which rank writes each key (our writer); None: DCP's writer decides


@dataclass
class _Registration:
    value: Any
    placement: Placement
    adapter: Adapter | None
    options: CheckpointOptions
    resolved: Adapter | None = None


class DistributedCheckpoint:
    """Saves and restores named components from every rank of a job through DCP.

    Args:
        strict: default reaction to missing or incompatible requested components:
            ``"error"`` raises :class:`CheckpointError`, ``"warn"`` logs a warning,
            ``"ignore"`` only records them in the :class:`LoadResult`.
        save_components: default selection for :meth:`save` (e.g. leave the replay
            buffer out of frequent saves); ``None`` saves everything.
        timeout: timeout of the checkpoint's own gloo process group.
        **components: components registered with their adapter's default placement
            (``replicated`` for modules, optimizers and state dicts).

    Every public method that touches a checkpoint is collective: all ranks call it.
    """

    def __init__(
        self,
        *,
        strict: Strictness = "error",
        save_components: Collection[str] | None = None,
        timeout: datetime.timedelta | None = None,
        **components: Any,
    ) -> None:
        _check_strict(strict)
        self.strict = strict
        self.save_components = None if save_components is None else frozenset(save_components)
        self.timeout = timeout
        self._components: dict[str, _Registration] = {}
        self._local_adapters: dict[type, Adapter] = {}
        self._async = AsyncSaver()
        for name, value in components.items():
            self.register(name, value)

    # ------------------------------------------------------------------ registration
    @property
    def components(self) -> Mapping[str, Any]:
        """Read-only view of the registered objects by name."""
        return {name: reg.value for name, reg in self._components.items()}

    def placement(self, name: str) -> Placement:
        return self._components[name].placement

    def __contains__(self, name: object) -> bool:
        return name in self._components

    def register(
        self,
        name: str,
        component: Any,
        *,
        placement: Placement | None = None,
        adapter: Adapter | None = None,
        options: CheckpointOptions | None = None,
    ) -> DistributedCheckpoint:
        """Register ``component`` under ``name``; returns ``self``.

        Args:
            placement: ``"replicated"``, ``"per_rank"`` or ``"sharded"``; default: the adapter's.
            adapter: explicit adapter (otherwise chosen by type at save/load time).
            options: arguments forwarded to the component's state methods.
        """
        if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
            raise ValueError(f"component name {name!r} must match {_NAME.pattern} (no '/' and no '..')")
        if name in self._components:
            raise KeyError(f"component {name!r} is already registered")
        if adapter is not None and not isinstance(adapter, Adapter):
            raise TypeError("adapter must be a torchrl_dcp.Adapter instance")
        resolved = adapter or self._adapter_for_value(component)
        if placement is None:
            placement = _trainer_placement(name) or (resolved.default_placement if resolved is not None else "replicated")
        self._components[name] = _Registration(
            component, check_placement(placement), adapter, options or CheckpointOptions(), resolved
        )
        if name == _TRAINER_MARKER and not any(isinstance(r.value, RNGState) for r in self._components.values()):
            # a torchrl Trainer is binding this checkpoint: give every rank its RNG streams too
            if "rng" not in self._components:
                self.register("rng", RNGState())
        return self

    def unregister(self, name: str) -> None:
        del self._components[name]

    def register_adapter(self, component_type: type, adapter: Adapter) -> DistributedCheckpoint:
        """Use ``adapter`` for instances of ``component_type`` in this checkpoint only."""
        if not isinstance(component_type, type) or not isinstance(adapter, Adapter):
            raise TypeError("register_adapter(type, Adapter instance)")
        self._local_adapters[component_type] = adapter
        for reg in self._components.values():
            if reg.adapter is None:
                reg.resolved = self._adapter_for_value(reg.value)
        return self

    def _adapter_for_value(self, value: Any) -> Adapter | None:
        try:
            return resolve_adapter(value, self._local_adapters)
        except TypeError:
            return None

    def _adapter(self, name: str) -> Adapter:
        reg = self._components[name]
        if reg.adapter is not None:
            return reg.adapter
        if reg.resolved is None:
            reg.resolved = resolve_adapter(reg.value, self._local_adapters)
        return reg.resolved

    def _ctx(self, name: str, options: CheckpointOptions | None, **kw: Any) -> AdapterContext:
        reg = self._components[name]
        return AdapterContext(
            name=name,
            rank=_dist.rank(),
            world_size=_dist.world_size(),
            options=reg.options.merged(options),
            components=self.components,
            **kw,
        )

    def _select(self, components: Collection[str] | None, default: Collection[str] | None) -> list[str]:
        chosen = components if components is not None else default
        if chosen is None:
            return list(self._components)
        if isinstance(chosen, str):
            chosen = [chosen]
        unknown = sorted(set(chosen) - set(self._components))
        if unknown:
            raise KeyError(f"not registered: {unknown}; registered components are {sorted(self._components)}")
        return [n for n in self._components if n in set(chosen)]

    # ------------------------------------------------------------------ save
    def save(
        self,
        path: str | os.PathLike,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        components: Collection[str] | None = None,
        component_options: Mapping[str, CheckpointOptions] | None = None,
    ) -> Path:
        """Save the selected components to the directory ``path`` (collective).

        Every rank writes its own bytes at the same time into a staging directory
        next to ``path``; rank 0 then writes ``manifest.json`` and moves the
        directory into place atomically (replacing a checkpoint already there).

        Args:
            step: training step recorded in the manifest (default: ``metadata["step"]``).
            metadata: JSON-safe user metadata stored in the manifest.
            components: names to save (default: ``save_components`` or all).
            component_options: per-component :class:`CheckpointOptions` overrides.

        Returns:
            The absolute checkpoint path.
        """
        self._async.wait_pending()
        with gc_paused():
            return self._write_and_commit(self._prepare_save(path, step, metadata, components, component_options))

    def async_save(
        self,
        path: str | os.PathLike,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        components: Collection[str] | None = None,
        component_options: Mapping[str, CheckpointOptions] | None = None,
        stage_memmap: bool = False,
    ) -> SaveHandle:
        """Like :meth:`save`, but return once the state is staged in host memory (collective).

        Tensors are copied into host buffers reused from the previous save (pinned, on
        a side CUDA stream, for GPU tensors); a background thread then writes and
        commits the checkpoint atomically. One save is in flight at a time: the next
        ``save``/``async_save``/``load`` waits for it first, and re-raises its failure.

        Args:
            stage_memmap: also copy tensors backed by memory-mapped files (replay
                buffers on ``LazyMemmapStorage``); by default they are written from the
                file in place, so entries written to them meanwhile may or may not be saved.

        Returns:
            A :class:`SaveHandle`: ``wait()`` returns the path or raises a
            :class:`CheckpointError` on every rank; ``done()`` polls.

        Example:
            >>> import tempfile, torch, torchrl_dcp as tdcp
            >>> ckpt = tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2))
            >>> handle = ckpt.async_save(tempfile.mkdtemp() + "/c", step=3)
            >>> handle.wait().name
            'c'
        """
        self._async.wait_pending()
        with gc_paused():
            job = self._prepare_save(
                path, step, metadata, components, component_options,
                stage=lambda f: self._async.stage(f, stage_memmap=stage_memmap),
            )  # fmt: skip
        event, job.stage_event = job.stage_event, None
        return self._async.submit(job.destination, job.step, lambda: self._write_and_commit(job), event)

    def _prepare_save(
        self,
        path: str | os.PathLike,
        step: int | None,
        metadata: Mapping[str, Any] | None,
        components: Collection[str] | None,
        component_options: Mapping[str, CheckpointOptions] | None,
        stage: Any = None,
    ) -> _SaveJob:
        """Select, encode (and stage) on every rank; any rank's failure raises on all (collective).

        With ``stage`` (async saves), each rank stages only the tensors it will write.
        """
        destination = Path(path).expanduser().absolute()
        names = self._select(components, self.save_components)
        options = dict(component_options or {})
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise KeyError(f"options given for components that are not saved: {unknown}")
        metadata = dict(metadata or {})
        if step is None and isinstance(metadata.get("step"), int):
            step = metadata["step"]
        group = _dist.checkpoint_group(self.timeout)
        rank, world = _dist.rank(), _dist.world_size()

        # 1. encode locally; every rank learns of any rank's failure before anything is written, and what
        #    every rank holds (to plan which rank writes each replicated tensor)
        try:
            records, flat = self._encode(names, options, rank)
            _check_json(metadata, "metadata")
            fast = all(can_write_fast(t) for t in flat.values())
            plan, error = (fast, describe(flat) if fast else None), None
        except Exception as err:  # reported collectively below
            records, flat, plan, error = {}, {}, (False, None), err
        gathered = _dist.all_gather((_describe_error(error), plan), group, "encoding the state")
        _raise_first([g[0] for g in gathered], "encoding the state", error)
        job = _SaveJob(destination, names, records, flat, metadata, step, group, rank, world)
        job.plans = [g[1] for g in gathered]
        if all(ok for ok, _ in job.plans):
            try:  # the same answer on every rank, from the same input: all ranks raise together
                job.owner = assign_writers([d for _, d in job.plans])
            except ValueError as err:  # replicated keys that differ between ranks
                raise _save_failure(err, "planning the writes", destination) from err
        if stage is not None:
            # 2. async: copy to host buffers what this rank will write (with our writer, its share of the
            #    replicated tensors; everything when DCP's writer decides)
            try:
                owner = job.owner
                mine = {k: t for k, t in flat.items() if owner is None or owner[k] == rank}
                staged, job.stage_event = stage(mine)
                job.flat = {k: staged.get(k, t) for k, t in flat.items()}  # the others are never read
                error = None
            except Exception as err:
                error = err
            _raise_first(_dist.all_gather(_describe_error(error), group, "staging"), "staging the state", error)
        return job

    def _write_and_commit(self, job: _SaveJob) -> Path:
        """Steps after encoding: staging directory, DCP write, checksums, manifest, publish (collective)."""
        destination, rank = job.destination, job.rank

        # 2. rank 0 locks the destination (a second job saving there fails at once), prepares the staging
        #    directory and tells everyone where it is; the lock is held until the publish
        staging, error, lock = None, None, None
        if rank == 0:
            try:
                destination.parent.mkdir(parents=True, exist_ok=True)
                lock = DestinationLock(destination).acquire()
                if (destination.exists() or destination.is_symlink()) and not _is_replaceable(destination):
                    raise CheckpointError(
                        "exists and is not a torchrl_dcp checkpoint; refusing to replace it (choose another path)",
                        path=destination,
                    )
                for stale in stale_entries(destination):
                    remove_tree(stale)
                staging = staging_path(destination)
                staging.mkdir()
            except Exception as err:
                error = _save_failure(err, "preparing the staging directory", destination)
        try:
            return self._write_staged(job, staging, error)
        finally:
            if lock is not None:
                lock.release()
                sweep_stale_locks(destination.parent)  # left by saves killed before they released theirs

    def _write_staged(self, job: _SaveJob, staging: Path | None, error: BaseException | None) -> Path:
        """Steps 3-5 of :meth:`_write_and_commit`, while rank 0 holds the destination lock."""
        destination, records, flat, group, rank = job.destination, job.records, job.flat, job.group, job.rank
        try:
            status = _dist.broadcast_from_0(
                (None if staging is None else str(staging), _describe_error(error)), group, "announcing the staging directory"
            )
        except BaseException:
            if staging is not None:
                remove_tree(staging)
            raise
        _raise_first([status[1]], "preparing the staging directory", error)
        staging = Path(status[0])

        try:
            # 3. every rank writes its share at once: packed torch.save-compatible blobs, several threads per
            #    rank, CRC32 computed while writing (storage/writer.py); DCP's own writer for DTensors & co.
            plans = job.plans
            fast = job.owner is not None
            error, files, entries = None, {}, []
            if fast:
                try:
                    out = write_share(flat, job.owner, staging, rank)
                    files, entries = out.files, out.entries
                except Exception as err:  # reported collectively below
                    error = _save_failure(err, f"rank {rank} writing its data file", staging)
            else:
                writer = make_writer(staging)
                try:
                    with _quiet_single_process():
                        dcp.save(
                            flat, storage_writer=writer, planner=SavePlanner(), process_group=group, no_dist=group is None
                        )
                except CheckpointException as err:
                    raise CollectiveError(f"DCP save failed: {_summarize(err)}", path=destination) from None

                # 4. checksums of the files this rank wrote
                try:
                    files = {
                        p.name: describe_file(p)
                        for p in staging.iterdir()
                        if p.name.startswith(f"__{rank}_") or (rank == 0 and p.name == DCP_METADATA)
                    }
                except Exception as err:
                    error = _save_failure(err, f"rank {rank} checksumming its data files", staging)
            per_rank = {n: r.pop("ranks_local") for n, r in records.items() if "ranks_local" in r}
            gathered = _dist.gather_to_0(
                (files, per_rank, _describe_error(error), entries), group, "collecting file records"
            )

            # 5. rank 0 writes the manifest last and publishes
            own_error, error = error, None
            if rank == 0:
                try:
                    with gc_paused():  # thousands of small objects: metadata and manifest
                        assert gathered is not None
                        _raise_first([g[2] for g in gathered], "writing data files", None)
                        all_files: dict[str, Any] = {}
                        for f, _, _, _ in gathered:
                            all_files.update(f)
                        if fast:  # DCP's metadata, as dcp.save would have written it
                            tensors = {k: (_DTYPES[dt], shape) for _, d in plans for k, dt, shape, _ in d}
                            dcp_entries = [e for g in gathered for e in g[3]]
                            all_files[DCP_METADATA] = write_metadata(staging, build_metadata(tensors, dcp_entries, staging))
                        for name, rec in records.items():
                            if rec["placement"] == "per_rank":
                                rec["ranks"] = {str(r): {"state": g[1][name]} for r, g in enumerate(gathered)}
                        manifest = new_manifest(
                            world_size=job.world_size, components=records, files=all_files, metadata=job.metadata, step=job.step
                        )
                        write_file_durably(staging / MANIFEST, dumps(manifest))
                        publish(staging, destination)
                except BaseException as err:
                    error = _save_failure(err, "committing the checkpoint", destination)
            statuses = _dist.all_gather(_describe_error(error), group, "confirming the commit")
            _raise_first(statuses, "committing the checkpoint", error or own_error)
        except BaseException:
            if rank == 0:
                remove_tree(staging)
            raise
        logger.info("saved checkpoint %s (step %s, %d components)", destination, job.step, len(job.names))
        return destination

    def _encode(
        self, names: list[str], options: Mapping[str, CheckpointOptions], rank: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        records: dict[str, Any] = {}
        flat: dict[str, torch.Tensor] = {}
        shared: dict[tuple[Any, ...], tuple[str, str]] = {}  # replicated tensors other components may reference
        for name in sorted(names, key=lambda n: self._components[n].placement != "replicated"):
            reg = self._components[name]
            adapter = self._adapter(name)
            ctx = self._ctx(name, options.get(name))
            skeleton, tensors = encode(adapter.state(reg.value, ctx), where=name, shared=shared)
            if reg.placement == "replicated":
                for key, tensor in tensors.items():
                    ident = tensor_identity(tensor)
                    if ident is not None:
                        shared.setdefault(ident, (name, key))
            prefix = key_prefix(reg.placement, name, rank)
            for key, tensor in tensors.items():
                if reg.placement == "per_rank" and _is_dtensor(tensor):
                    raise EncodingError(f"component {name!r} holds a DTensor at {key!r}: use placement='sharded'")
                flat[f"{prefix}/{key}"] = tensor
            record: dict[str, Any] = {
                "adapter": adapter.adapter_id,
                "adapter_version": adapter.version,
                "placement": reg.placement,
                "num_tensors": len(tensors),
                "nbytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            }
            if reg.placement == "per_rank":
                record["ranks_local"] = skeleton
            else:
                record["state"] = skeleton
            records[name] = record
        return {name: records[name] for name in names}, flat

    # ------------------------------------------------------------------ load
    def load(
        self,
        path: str | os.PathLike,
        *,
        components: Collection[str] | None = None,
        strict: Strictness | None = None,
        map_location: Any = None,
        component_options: Mapping[str, CheckpointOptions] | None = None,
        world_size_change: WorldSizeChange = "error",
        verify: bool = True,
    ) -> LoadResult:
        """Restore components from the checkpoint at ``path`` (collective).

        Args:
            components: names to restore (default: every registered component).
            strict: override of the checkpoint's default strictness.
            map_location: device (or ``{saved: target}`` mapping, or callable) for tensors.
            component_options: per-component :class:`CheckpointOptions` overrides.
            world_size_change: what to do with per-rank components saved by another
                number of ranks: ``"error"`` (default) raises :class:`WorldSizeMismatchError`
                naming both sizes; ``"reshard"`` lets each adapter redistribute them (replay
                buffers split their transitions over the new ranks, RNG streams are re-seeded
                deterministically, collectors start fresh trajectories; see docs/components/resharding.md).
                Components whose adapter cannot reshard still raise. Replicated components
                load at any world size.
            verify: check the CRC32 of every file this rank reads: while reading it (one pass) when its
                tensors land in fresh buffers, before reading it when an adapter reads into live objects
                in place (replay-buffer storages); a damaged file is refused before anything is restored.

        Returns:
            A :class:`LoadResult`. Tensors are read into fresh buffers and copied into
            the live objects only after every read succeeded.
        """
        with gc_paused():
            return self._load(path, components, strict, map_location, component_options, world_size_change, verify)

    def _load(
        self,
        path: str | os.PathLike,
        components: Collection[str] | None,
        strict: Strictness | None,
        map_location: Any,
        component_options: Mapping[str, CheckpointOptions] | None,
        world_size_change: WorldSizeChange,
        verify: bool,
    ) -> LoadResult:
        self._async.wait_pending()  # never interleave with a background save's collectives
        strict = self.strict if strict is None else strict
        _check_strict(strict)
        if world_size_change not in ("error", "reshard"):
            raise ValueError(f"world_size_change must be 'error' or 'reshard', got {world_size_change!r}")
        source = Path(path).expanduser().absolute()
        requested = self._select(components, None)
        options = dict(component_options or {})
        group = _dist.checkpoint_group(self.timeout)
        rank, world = _dist.rank(), _dist.world_size()

        result = LoadResult(path=source)
        plan: dict[str, tuple[Adapter, AdapterContext, dict[int, tuple[Any, str]], bool]] = {}
        flat: dict[str, torch.Tensor] = {}
        error: BaseException | None = None
        try:
            src = open_source(source)
            manifest = src.manifest()
            result.manifest = manifest
            result.comparison = _compare_versions(manifest["versions"])
            if result.version_skew:
                logger.warning("checkpoint %s was saved with other library versions: %s", source, _skew_text(result))
            saved = manifest["components"]
            result.missing = {n for n in requested if n not in saved}
            result.unrequested = set(saved) - set(requested)
            saved_world = manifest["world_size"]
            for name in requested:
                if name not in saved:
                    continue
                rec = saved[name]
                reg = self._components[name]
                try:
                    adapter = self._adapter(name)
                except TypeError as err:
                    result.incompatible[name] = str(err)
                    continue
                if rec["adapter"] == adapter.adapter_id and rec["adapter_version"] != adapter.version:
                    try:  # upgrade an older payload through registered migrations (docs/migrations.md)
                        rec = migrate_component(name, rec, adapter.version, source)
                    except CheckpointError as err:
                        result.incompatible[name] = err.message
                        continue
                if rec["adapter"] != adapter.adapter_id or rec["adapter_version"] != adapter.version:
                    result.incompatible[name] = (
                        f"saved with adapter {rec['adapter']!r} v{rec['adapter_version']}, "
                        f"the registered object uses {adapter.adapter_id!r} v{adapter.version}"
                    )
                    continue
                if rec["placement"] != reg.placement:
                    result.incompatible[name] = f"saved as {rec['placement']!r}, registered as {reg.placement!r}"
                    continue
                reshard = rec["placement"] == "per_rank" and saved_world != world
                if reshard and (world_size_change == "error" or not adapter.can_reshard):
                    why = (
                        "pass world_size_change='reshard' to redistribute it"
                        if adapter.can_reshard
                        else f"its adapter {adapter.adapter_id!r} cannot be resharded"
                    )
                    raise WorldSizeMismatchError(
                        f"component {name!r} is per_rank and was saved by {saved_world} ranks, this job has "
                        f"{world}: {why}; or load only replicated components (components=...), or resume with "
                        f"{saved_world} ranks",
                        path=source,
                    )
                ctx = self._ctx(name, options.get(name), map_location=map_location, saved_world_size=saved_world)
                try:
                    sources = self._plan_sources(name, rec, adapter, ctx, reshard, rank, saved_world)
                    for src_rank, (skeleton, prefix) in sources.items():
                        flat.update(self._destinations(name, adapter, ctx, skeleton, prefix, in_place=not reshard))
                except CheckpointFormatError:
                    raise
                except Exception as err:
                    result.incompatible[name] = f"cannot allocate its tensors: {err}"
                    continue
                for skeleton, _ in sources.values():
                    for ref_name, spec in xrefs(skeleton):
                        ref = saved.get(ref_name)
                        if ref is None or ref["placement"] != "replicated":
                            raise CheckpointFormatError(
                                f"component {name!r} refers to tensors of {ref_name!r}, which is not a replicated "
                                "component of this checkpoint",
                                path=source,
                            )
                        ref_key = f"{key_prefix('replicated', ref_name, rank)}/{spec.key}"
                        if ref_key not in flat:
                            flat[ref_key] = torch.empty(spec.shape, dtype=spec.dtype, device=ctx.device_for(spec.device))
                plan[name] = (adapter, ctx, sources, reshard)
            _report_issues(result, strict, source)
            metadata = src.dcp_metadata()
            needed = _files_for(metadata, flat) if metadata is not None else set()
            # files whose tensors all land in fresh buffers are checksummed while being read (one pass, no
            # live object changes before the whole file checked out); files holding tensors that an adapter
            # reads into live objects in place (Adapter.destinations) are checksummed first
            live = tuple(
                f"{prefix}/"
                for adapter, _, sources, reshard in plan.values()
                if not reshard and type(adapter).destinations is not Adapter.destinations
                for _, prefix in sources.values()
            )
            inline = set()
            if verify and metadata is not None:
                inline = needed - _files_for(metadata, {k: t for k, t in flat.items() if k.startswith(live)})
            src.check(needed - inline if verify else False)
        except BaseException as err:
            error = err
        _raise_first(_dist.all_gather(_describe_error(error), group), "validating the checkpoint", error)

        # every rank reads its tensors (collective, even with nothing to read)
        try:
            with _quiet_single_process():
                dcp.load(
                flat,
                storage_reader=src.storage_reader(verify=inline),
                planner=SafeLoadPlanner(),
                process_group=group,
                no_dist=group is None,
                )
        except CheckpointException as err:
            for failure in (getattr(err, "failures", None) or {}).values():  # a file failed its checksum: say so
                exc = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(exc, CheckpointIntegrityError):
                    raise CheckpointIntegrityError(exc.message, path=exc.path, result=result) from None
            raise CollectiveError(f"DCP load failed: {_summarize(err)}", path=source, result=result) from None

        # restore, RNG-like adapters last so nothing consumes random numbers after them
        order = sorted(plan, key=lambda n: getattr(plan[n][0], "restore_last", False))
        for name in order:
            adapter, ctx, sources, reshard = plan[name]
            try:
                states = {}
                for src_rank, (skeleton, prefix) in sources.items():
                    tensors = {spec.key: flat[f"{prefix}/{spec.key}"] for spec in tensor_specs(skeleton)}
                    for ref_name, spec in xrefs(skeleton):
                        tensors[xref_key(ref_name, spec.key)] = flat[f"{key_prefix('replicated', ref_name, rank)}/{spec.key}"]
                    states[src_rank] = decode(skeleton, tensors)
                obj = self._components[name].value
                if reshard:
                    value = adapter.reshard(obj, states, ctx)
                else:
                    value = adapter.restore(obj, states[ctx.source_rank], ctx)
            except Exception as err:
                result.incompatible[name] = f"{type(err).__name__}: {err}"
                if strict == "error":
                    raise IncompatibleComponentError(
                        f"component {name!r} could not be restored: {err}", path=source, result=result
                    ) from err
                if strict == "warn":
                    warnings.warn(f"{source}: component {name!r} could not be restored: {err}", stacklevel=2)
                continue
            result.loaded.add(name)
            if value is not None:
                result.values[name] = value
        return result

    def _plan_sources(
        self, name: str, rec: dict[str, Any], adapter: Adapter, ctx: AdapterContext, reshard: bool, rank: int, saved_world: int
    ) -> dict[int, tuple[Any, str]]:
        """Which saved states this rank reads: ``{source_rank: (skeleton, key prefix)}``."""
        placement = rec["placement"]
        if placement != "per_rank":
            ctx.source_rank = rank
            return {rank: (rec["state"], key_prefix(placement, name, rank))}
        if not reshard:
            ctx.source_rank = rank
            return {rank: (rec["ranks"][str(rank)]["state"], key_prefix("per_rank", name, rank))}
        skeletons = {r: rec["ranks"][str(r)]["state"] for r in range(saved_world)}
        wanted = adapter.reshard_sources({r: _planning_view(sk) for r, sk in skeletons.items()}, ctx)
        bad = [r for r in wanted if r not in skeletons]
        if bad:
            raise IncompatibleComponentError(f"component {name!r}: adapter asked for saved ranks {bad} that do not exist")
        ctx.source_rank = wanted[0] if wanted else None
        return {r: (skeletons[r], key_prefix("per_rank", name, r)) for r in wanted}

    def _destinations(
        self, name: str, adapter: Adapter, ctx: AdapterContext, skeleton: Any, prefix: str, in_place: bool = True
    ) -> dict[str, torch.Tensor]:
        specs = list(tensor_specs(skeleton))
        given = (adapter.destinations(self._components[name].value, _planning_view(skeleton), ctx) if in_place else None) or {}
        live: dict[str, Any] | None = None
        out: dict[str, torch.Tensor] = {}
        for spec in specs:
            dest = given.get(spec.key)
            if dest is None and _is_dtensor_spec(skeleton, spec):
                if live is None:
                    live = encode(adapter.state(self._components[name].value, ctx), where=name)[1]
                if spec.key not in live or not _is_dtensor(live[spec.key]):
                    raise IncompatibleComponentError(f"no live DTensor for sharded tensor {spec.key!r}")
                dest = torch.empty_like(live[spec.key])
            if dest is None:
                dest = torch.empty(spec.shape, dtype=spec.dtype, device=ctx.device_for(spec.device))
            out[f"{prefix}/{spec.key}"] = dest
        return out


# ---------------------------------------------------------------------- helpers
_TRAINER_MARKER = "trainer_state"  # what torchrl's Trainer registers when it binds a checkpoint


def _trainer_placement(name: str) -> Placement | None:
    """Placements for what a torchrl ``Trainer`` registers by name, where the type alone does not tell.

    The Trainer's hooks (``trainer_module.<hook>``) and logger hold each rank's own
    counters and logs: per rank. Buffers and collectors are per rank by type.
    """
    if name.startswith("trainer_module.") or name == "logger":
        return "per_rank"
    return None


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; a world of one is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _check_strict(strict: str) -> None:
    if strict not in ("error", "warn", "ignore"):
        raise ValueError(f"strict must be 'error', 'warn' or 'ignore', got {strict!r}")


def _check_json(value: Any, where: str) -> None:
    import json

    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise EncodingError(f"{where} must be JSON-safe: {err}") from None


def _is_dtensor(value: Any) -> bool:
    from torchrl_dcp.codec import _is_dtensor as check

    return check(value)


_DTENSOR_KEYS: list[Any] = [None, frozenset()]  # (skeleton, its DTensor keys): one walk per skeleton, not per tensor


def _is_dtensor_spec(skeleton: Any, spec: TensorSpec) -> bool:
    if _DTENSOR_KEYS[0] is not skeleton:
        keys, stack = set(), [skeleton]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if node.get("t") == "dtensor":
                    keys.add(node.get("key"))
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        _DTENSOR_KEYS[:] = [skeleton, frozenset(keys)]
    return spec.key in _DTENSOR_KEYS[1]


def _planning_view(skeleton: Any) -> Any:
    """The saved state with every tensor replaced by its TensorSpec (what adapters plan from)."""
    placeholders: dict[str, Any] = {spec.key: spec for spec in tensor_specs(skeleton)}
    placeholders.update({xref_key(ref, spec.key): spec for ref, spec in xrefs(skeleton)})
    return decode(skeleton, placeholders)


def _is_replaceable(destination: Path) -> bool:
    if not destination.is_dir() or destination.is_symlink():
        return False
    if not any(destination.iterdir()):
        return True
    try:
        read_manifest(destination)
        return True
    except CheckpointError:
        return False


def _save_failure(err: BaseException, phase: str, path: Path | None) -> BaseException:
    """A save step's failure as a :class:`CheckpointError` saying what to do (a full disk says so)."""
    if isinstance(err, CheckpointError) or not isinstance(err, Exception):
        return err
    hint = "nothing was committed; the previous checkpoint at this path, if any, is intact"
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = "the file system is full (or over quota): free space or save elsewhere; " + hint
    wrapped = CheckpointError(f"{phase} failed: {type(err).__name__}: {err}; {hint}", path=path)
    wrapped.__cause__ = err
    return wrapped


def _describe_error(error: BaseException | None) -> tuple[str, str, str | None] | None:
    if error is None:
        return None
    path = getattr(error, "path", None)
    message = getattr(error, "message", None) or str(error)
    return (type(error).__name__, message, path)


def _raise_first(statuses: list[Any], phase: str, own: BaseException | None) -> None:
    """Raise on every rank if any rank failed; a rank re-raises its own error, others a summary."""
    failed = [(r, s) for r, s in enumerate(statuses) if s is not None]
    if not failed:
        return
    if own is not None:
        if isinstance(own, CheckpointError):
            raise own
        raise CheckpointError(f"{phase} failed: {type(own).__name__}: {own}") from own
    r, (kind, message, path) = failed[0]
    raise CollectiveError(f"rank {r} failed while {phase}: {kind}: {message}", path=path)


def _summarize(err: CheckpointException) -> str:
    failures = getattr(err, "failures", {}) or {}
    parts = []
    for r, exc in sorted(failures.items()):
        exc = exc[0] if isinstance(exc, tuple) else exc
        text = str(exc).strip().splitlines()
        parts.append(f"rank {r}: {type(exc).__name__}{': ' + text[-1] if text else ''}")
    return "; ".join(parts) or str(err)


def _files_for(metadata: Any, flat: Mapping[str, torch.Tensor]) -> set[str]:
    keys = set(flat)
    return {info.relative_path for index, info in metadata.storage_data.items() if index.fqn in keys}


def _report_issues(result: LoadResult, strict: str, source: Path) -> None:
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
        warnings.warn(f"{source}: {text}", stacklevel=3)


def _compare_versions(saved: Mapping[str, Any]) -> dict[str, Any]:
    runtime = library_versions()
    versions = {
        lib: {"checkpoint": saved.get(lib), "runtime": now, "matches": saved.get(lib) == now}
        for lib, now in runtime.items()
        if isinstance(saved.get(lib), str)
    }
    return {"versions": versions, "version_skew": any(not v["matches"] for v in versions.values())}


def _skew_text(result: LoadResult) -> str:
    return ", ".join(
        f"{lib} {v['checkpoint']} -> {v['runtime']}" for lib, v in result.comparison["versions"].items() if not v["matches"]
    )

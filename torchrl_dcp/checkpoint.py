"""``DistributedCheckpoint``: register components, save them from every rank, load them back.

Example (one process; under ``torchrun`` every rank runs the same lines):
    >>> import tempfile, torch
    >>> import torchrl_dcp as tdcp
    >>> policy = torch.nn.Linear(3, 2)
    >>> ckpt = tdcp.DistributedCheckpoint(policy=policy)
    >>> _ = ckpt.register("rng", tdcp.RNGState())          # per_rank by default (returns ckpt)
    >>> _ = ckpt.register("stats", {"episodes": 3}, placement="per_rank")
    >>> path = ckpt.save(tempfile.mkdtemp() + "/step-100", step=100)
    >>> result = ckpt.load(path)
    >>> sorted(result.loaded)
    ['policy', 'rng', 'stats']
"""

from __future__ import annotations

import copy
import datetime
import os
import warnings
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn

from torchrl_dcp import _dist, load_engine, save_engine
from torchrl_dcp._gc import gc_paused
from torchrl_dcp._log import get_logger
from torchrl_dcp.adapters import Adapter, AdapterContext, CheckpointOptions, resolve_adapter
from torchrl_dcp.adapters.collector import collection_paused
from torchrl_dcp.adapters.modules import warn_networks_left_out
from torchrl_dcp.adapters.trainer import trainer_placement
from torchrl_dcp.arguments import (
    check_component_options,
    check_strict,
    check_timeout,
)
from torchrl_dcp.async_save import AsyncSaver, SaveHandle
from torchrl_dcp.collective import refused_on_every_rank, run_agreed
from torchrl_dcp.errors import TorchrlDcpWarning
from torchrl_dcp.format.layout import COMPONENT_NAME, is_component_name
from torchrl_dcp.load_engine import LoadResult, Strictness
from torchrl_dcp.load_plan import Registered
from torchrl_dcp.placement import Placement, check_placement
from torchrl_dcp.replicas import ReplicaCheck
from torchrl_dcp.replicas import check_mode as check_replica_mode
from torchrl_dcp.save_prepare import prepare_save
from torchrl_dcp.settings import check_environment
from torchrl_dcp.storage.urls import resolve_path
from torchrl_dcp.torchrl_format import is_torchrl_checkpoint
from torchrl_dcp.trainer_binding import (
    TRAINER_MARKER,
    bind_trainer,
    note_trainer_load,
    sync_trainer,
)

__all__ = ["DistributedCheckpoint", "LoadResult"]

logger = get_logger(__name__)

WorldSizeChange = Literal["error", "reshard"]


@dataclass
class _Registration:
    value: Any
    placement: Placement
    adapter: Adapter | None
    options: CheckpointOptions
    resolved: Adapter | None = None
    replica_check: ReplicaCheck | None = None  # None: the checkpoint's default
    optional: bool = False  # registered by the library itself: a checkpoint without it loads, with a warning


class DistributedCheckpoint:
    """Saves and restores named components from every rank of a job through DCP.

    Args:
        strict: default reaction to missing or incompatible requested components:
            ``"error"`` raises :class:`CheckpointError`, ``"warn"`` logs a warning,
            ``"ignore"`` only records them in the :class:`LoadResult`.
        save_components: default selection for :meth:`save` (e.g. leave the replay
            buffer out of frequent saves); ``None`` saves everything.
        timeout: timeout of the checkpoint's own gloo process group.
        replica_check: how saves check that replicated components are the same on every
            rank before anything is written (``"sample"``: JSON values whole and sampled bytes
            of each tensor; ``"full"``: every byte; ``"off"``); see :mod:`torchrl_dcp.replicas`.
        storage_options: fsspec options (endpoint, credentials, ...) for checkpoint paths that are
            URLs (``s3://bucket/run/step-100``); see docs/objectstores.md. A :class:`~torchrl_dcp.StorePath`
            passed as a path carries its own.
        process_group: save and load among this group's ranks only (a learner-only subgroup):
            ranks, world size, placements, replica checks and resharding are relative to the
            group, and ranks outside it never take part (they need not even call).
        no_dist: this process alone, inside a job or outside one: no collective at all (rank 0
            evaluating an archive while the other ranks train). Saves and loads as a world of one.
        **components: components registered with their adapter's default placement
            (``replicated`` for modules, optimizers and state dicts).

    Every public method that touches a checkpoint is collective: all ranks call it.
    """

    def __init__(
        self,
        *,
        strict: Strictness = "error",
        save_components: Collection[str] | None = None,
        timeout: datetime.timedelta | float | None = None,
        replica_check: ReplicaCheck = "sample",
        storage_options: Mapping[str, Any] | None = None,
        process_group: Any = None,
        no_dist: bool = False,
        **components: Any,
    ) -> None:
        check_strict(strict)
        self.strict = strict
        self.replica_check = check_replica_mode(replica_check)
        if isinstance(save_components, str):  # one name, as save(components="policy") takes it (not its letters)
            save_components = [save_components]
        self.save_components = None if save_components is None else frozenset(save_components)
        self.timeout = check_timeout(timeout)
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(
                f"storage_options must be a mapping of fsspec options, got {type(storage_options).__name__}"
            )
        self.storage_options = dict(storage_options or {})
        if not isinstance(no_dist, bool):
            raise TypeError(f"no_dist must be True or False, got {no_dist!r}")
        if no_dist and process_group is not None:
            raise ValueError("no_dist=True takes no process_group: this process saves and loads alone")
        self.process_group = _dist.check_process_group(process_group)
        self.no_dist = no_dist
        self._components: dict[str, _Registration] = {}
        self._local_adapters: dict[type, Adapter] = {}
        self._async = AsyncSaver()
        for name, value in components.items():
            _warn_if_option_typo(name, value)
            self.register(name, value)

    # ------------------------------------------------------------------ scope and lifetime
    def _group(self) -> Any:
        """The gloo group of this checkpoint's collectives (``None``: this process alone)."""
        if self.no_dist:
            return None
        return _dist.checkpoint_group(self.timeout, self.process_group)

    def _control_group(self) -> Any:
        """A second gloo group, over the same ranks, for a training loop's per-step decisions (never used by a save)."""
        if self.no_dist:
            return None
        return _dist.checkpoint_group(self.timeout, self.process_group, purpose="control")

    @property
    def rank(self) -> int:
        """This process's rank among the checkpoint's ranks (its ``process_group``'s; 0 with ``no_dist``); not a
        collective (the checkpoint's own group, created at the first save or load, orders ranks alike)."""
        if self.no_dist:
            return 0
        return _dist.group_rank(self.process_group) if self.process_group is not None else _dist.rank()

    @property
    def world_size(self) -> int:
        """How many ranks save and load together (the ``process_group``'s size; 1 with ``no_dist``)."""
        if self.no_dist:
            return 1
        return _dist.group_size(self.process_group) if self.process_group is not None else _dist.world_size()

    def _solo(self) -> DistributedCheckpoint:
        """The same registrations as a world of one (``no_dist``): what a node-local tier saves and loads per rank.

        It shares the components (later registrations included) but not the async saver, so its saves never
        wait for (or interleave with) the job's async save in flight.
        """
        solo = copy.copy(self)
        solo.no_dist, solo.process_group, solo._async = True, None, AsyncSaver()
        solo._solo_of = self
        return solo

    def wait(self) -> Path | None:
        """Block until the async save in flight (if any) is committed; return its path (``None``: none was).

        Raises its failure as a :class:`CheckpointError` (on every rank), like the handle's ``wait()``.
        """
        return self._async.wait_pending()

    def _settle_async(self) -> None:
        """Before a collective call: the background save settled alike on every rank
        (:meth:`~torchrl_dcp.async_save.AsyncSaver.settle_pending`), after the other checkpoints' background saves
        (:meth:`~torchrl_dcp.async_save.AsyncSaver.wait_for_others`)."""
        group = self._group()
        self._async.wait_for_others(group)
        if self._async.pending is None:
            return
        self._async.settle_pending(
            lambda flag: _dist.any_rank([flag], group, "agreeing whether the background save failed")[0]
        )

    def close(self) -> None:
        """Flush the async save in flight (:meth:`wait`) and stop the background writer; idempotent.

        Example:
            >>> import tempfile, torch, torchrl_dcp as tdcp
            >>> with tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2)) as ckpt:
            ...     _ = ckpt.async_save(tempfile.mkdtemp() + "/c", step=1)
            >>> # the save is committed here
        """
        try:
            self.wait()
        finally:
            self._async.shutdown()

    def __enter__(self) -> DistributedCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # leave the original error in front; a failed background save is logged, not raised over it
            try:
                self.close()
            except Exception as err:  # noqa: BLE001
                logger.error("async save failed while leaving the checkpoint after an error: %s", err)

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
        replica_check: ReplicaCheck | None = None,
    ) -> DistributedCheckpoint:
        """Register ``component`` under ``name``; returns ``self``.

        Args:
            placement: ``"replicated"``, ``"per_rank"`` or ``"sharded"``; default: the adapter's
                (``replicated`` for modules, optimizers, state dicts and plain values; ``per_rank``
                for RNG streams, replay buffers and collectors). See docs/api.md, "Choosing a placement".
            adapter: explicit adapter (otherwise chosen by type at save/load time).
            options: arguments forwarded to the component's state methods.
            replica_check: for a replicated component, how saves check that every rank holds the
                same state (``"sample"``, ``"full"``, ``"off"``; default: the checkpoint's).
        """
        if not is_component_name(name):
            raise ValueError(f"component name {name!r} must match {COMPONENT_NAME.pattern} (no '/' and no '..')")
        if name in self._components:
            raise KeyError(f"component {name!r} is already registered")
        if adapter is not None and not isinstance(adapter, Adapter):
            raise TypeError("adapter must be a torchrl_dcp.Adapter instance")
        resolved = adapter or self._adapter_for_value(component)
        if placement is None:
            placement = trainer_placement(name, component) or (
                resolved.default_placement if resolved is not None else "replicated"
            )
        self._components[name] = _Registration(
            component,
            check_placement(placement),
            adapter,
            options or CheckpointOptions(),
            resolved,
            None if replica_check is None else check_replica_mode(replica_check),
        )
        if name == TRAINER_MARKER:  # a torchrl Trainer is binding this checkpoint
            bind_trainer(self, getattr(component, "trainer", None))
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
        group = self._group()
        return AdapterContext(
            name=name,
            rank=_dist.group_rank(group),
            world_size=_dist.group_size(group),
            options=reg.options.merged(options),
            **kw,
        )

    def _select(
        self, components: Collection[str] | None, default: Collection[str] | None, *, some_ranks: bool = False
    ) -> list[str]:
        """The registered components ``components`` (else ``default``, else all) names. ``some_ranks`` (a save):
        a name this rank did not register is left out here (a per-rank component of other ranks: saved as absent),
        and the save's agreement refuses one no rank registered."""
        chosen = components if components is not None else default
        if chosen is None:
            return list(self._components)
        if isinstance(chosen, str):
            chosen = [chosen]
        unknown = sorted(set(chosen) - set(self._components))
        if unknown and not some_ranks:
            each = (
                "; a load's components= names what this rank registered (each its own)" if self.world_size > 1 else ""
            )
            raise KeyError(f"not registered: {unknown}; registered components are {sorted(self._components)}{each}")
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
        incremental_from: str | os.PathLike | None = None,
        commit_sequence: int | None = None,
    ) -> Path:
        """Save the selected components to the directory ``path`` (collective).

        Every rank writes its own bytes at the same time into a staging directory
        next to ``path``; rank 0 then writes ``manifest.json`` and moves the
        directory into place atomically (replacing a checkpoint already there).

        Args:
            step: training step recorded in the manifest (default: ``metadata["step"]``).
            metadata: JSON-safe user metadata stored in the manifest (rank 0's; other ranks' is ignored).
            components: names to save (default: ``save_components`` or all).
            component_options: per-component :class:`CheckpointOptions` overrides.
            incremental_from: a committed checkpoint directory of this job: chunk files
                whose rows are proven unchanged since it are hard-linked from it instead
                of written again (:mod:`torchrl_dcp.incremental`). The new checkpoint
                stands alone: deleting the base later does not affect it.
            commit_sequence: this commit's place in a series (manifest ``sequence``), which
                :class:`CheckpointRotation` sets so that its order never depends on clocks.

        Returns:
            The absolute checkpoint path.
        """
        self._settle_async()
        with collection_paused(self.components), gc_paused():
            job = prepare_save(self, path, step, metadata, components, component_options, incremental_from)
            job.sequence = commit_sequence
            return save_engine.run(job)

    def async_save(
        self,
        path: str | os.PathLike,
        *,
        step: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        components: Collection[str] | None = None,
        component_options: Mapping[str, CheckpointOptions] | None = None,
        stage_memmap: bool = False,
        incremental_from: str | os.PathLike | None = None,
        commit_sequence: int | None = None,
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
            incremental_from: as for :meth:`save`; chunks kept from the base are not staged.
            commit_sequence: as for :meth:`save`.

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
        return self._async_save(
            path, step, metadata, components, component_options, stage_memmap, incremental_from, commit_sequence
        )

    def _async_save(
        self,
        path: str | os.PathLike,
        step: int | None,
        metadata: Mapping[str, Any] | None,
        components: Collection[str] | None,
        component_options: Mapping[str, CheckpointOptions] | None,
        stage_memmap: bool,
        incremental_from: str | os.PathLike | None,
        commit_sequence: int | None,
        then: Any = None,
    ) -> SaveHandle:
        """:meth:`async_save`; ``then(committed_path) -> path`` runs in the background thread after the commit
        (a rotation's conversion and pruning: its collectives follow the save's, in the same thread on every rank)."""
        self._settle_async()
        with collection_paused(self.components) as paused:  # (until the state is staged)
            with gc_paused():
                job = prepare_save(
                    self, path, step, metadata, components, component_options, incremental_from,
                    stage=lambda f: self._async.stage(f, stage_memmap=stage_memmap),
                )  # fmt: skip
            job.sequence = commit_sequence
            event, job.stage_event = job.stage_event, None
            if paused and event is not None:  # (a device's copies to host still running: done before collection)
                event.synchronize()
                event = None

            def run() -> Path:
                committed = save_engine.run(job)
                return committed if then is None else then(committed)

            self._async.group = self._group()
            return self._async.submit(job.destination, job.step, run, event)

    def _refuse_save(self, err: BaseException) -> NoReturn:
        """Raise ``err``, an argument this rank refused before its save (a rotation's step), after taking part in the
        save's first exchange as a rank that failed: the other ranks, in their save, raise naming this rank."""
        group = self._group()
        refused_on_every_rank(group, err, lambda fail: save_engine.plan(group, fail))

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
        self._settle_async()  # never interleave with a background save's collectives
        request = self._load_request(
            path,
            components=components,
            strict=strict,
            map_location=map_location,
            component_options=component_options,
            world_size_change=world_size_change,
            verify=verify,
        )
        self._async.wait_for_path(request.path)  # (another checkpoint's save in flight to it: what it commits)
        warn_networks_left_out({n: self.components[n] for n in request.requested}, "loading")
        with collection_paused(self.components, "load"), gc_paused(), _dist.reading():  # (a failure: nothing saved)
            if is_torchrl_checkpoint(request.path):  # (a URL never is: torchrl writes local paths)
                from torchrl_dcp.torchrl_format.importer import import_load

                result = import_load(request)  # torchrl.checkpoint's own format, read-only (docs/api.md)
            else:
                result = load_engine.load(request)
        note_trainer_load(self, result)
        return result

    def _load_request(
        self,
        path: str | os.PathLike,
        *,
        components: Collection[str] | None = None,
        strict: Strictness | None = None,
        map_location: Any = None,
        component_options: Mapping[str, CheckpointOptions] | None = None,
        world_size_change: WorldSizeChange = "error",
        verify: bool = True,
    ) -> load_engine.LoadRequest:
        """What :meth:`load` asks of the load engine, its arguments checked (the local tier's resume runs the
        engine's phases itself on the same request)."""
        strict = self.strict if strict is None else strict
        group = self._group()
        try:  # the arguments, checked at the call: refused on one rank, on every rank (or the others would wait)
            check_strict(strict)
            check_environment()
            if world_size_change not in ("error", "reshard"):
                raise ValueError(f"world_size_change must be 'error' or 'reshard', got {world_size_change!r}")
            sync_trainer(self)
            requested = self._select(components, None)
            # (options for another rank's per-rank component: left out here; refused where the checkpoint has none)
            elsewhere = set(component_options or ()) - set(self._components) if _dist.group_size(group) > 1 else ()
            options = check_component_options(component_options, requested, "loaded", elsewhere=elsewhere)
        except Exception as err:
            refused_on_every_rank(
                group, err, lambda fail: run_agreed(group, "validating the checkpoint", fail, alike=lambda d: d)
            )
        return load_engine.LoadRequest(
            path=resolve_path(path, self.storage_options),
            requested=requested,
            registered={name: self._registered(name, options.get(name), map_location) for name in requested},
            strict=strict,
            reshard=world_size_change == "reshard",
            verify=verify,
            group=group,
            rank=_dist.group_rank(group),
            world_size=_dist.group_size(group),
            chosen=components is not None,
            options_elsewhere=sorted(elsewhere),
        )

    def _registered(self, name: str, options: CheckpointOptions | None, map_location: Any) -> Registered:
        reg = self._components[name]
        try:
            adapter, error = self._adapter(name), ""
        except TypeError as err:
            adapter, error = None, str(err)

        def make_ctx(**kw: Any) -> AdapterContext:
            return self._ctx(name, options, map_location=map_location, **kw)

        return Registered(reg.value, adapter, reg.placement, make_ctx, error, reg.optional)


# ---------------------------------------------------------------------- helpers


_OPTIONS = ("strict", "save_components", "timeout", "replica_check", "storage_options", "process_group", "no_dist")


def _warn_if_option_typo(name: str, value: Any) -> None:
    """A component whose name is a near-miss of an option and whose value looks like one (``stric="warn"``) is
    registered as asked, with a warning: the option was otherwise lost without a word."""
    import difflib

    close = difflib.get_close_matches(name, _OPTIONS, n=1, cutoff=0.8)
    option_like = (str, bool, int, float, Mapping, list, tuple, set, frozenset, datetime.timedelta)
    if close and (value is None or isinstance(value, option_like)):
        warnings.warn(
            f"component {name!r} ({type(value).__name__} {value!r:.40}) looks like the option {close[0]!r} "
            f"misspelt: it is registered as a component; pass {close[0]}=... if that was meant",
            TorchrlDcpWarning,
            stacklevel=3,
        )

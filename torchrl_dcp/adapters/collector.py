"""Collectors: ``Collector`` exactly, ``MultiSyncCollector`` / ``MultiAsyncCollector`` as far as reachable.

For a single-process ``Collector`` the state is ``collector.state_dict()`` (policy
weights, env transform state such as ``VecNormV2`` statistics, frame and iteration
counters, the trajectory-id pool) **plus** what ``state_dict()`` leaves out and
an exact continuation needs: the in-flight *carrier* (current observation, step
counters, episode rewards, last policy outputs, trajectory ids) and what the env's
own ``state_dict()`` leaves out, saved as :mod:`~torchrl_dcp.adapters.env` saves an
env registered alone (every ``torch.Generator`` / NumPy ``Generator`` the
environment owns, e.g. ``PendulumEnv.rng``; custom transform states; cached parent
envs). Restoring writes the carrier back in place after the
trajectory-id pool, so the next batch is the one an uninterrupted run collects.

Multi-process collectors keep carriers, environments and their RNGs inside worker
processes: only ``state_dict()`` is reachable (per-worker weights, transforms,
counters). Their next batch after a restore is therefore not the uninterrupted
one; see docs/components/collectors.md.

Example:
    >>> import torchrl_dcp as tdcp
    >>> from torchrl_dcp.adapters.collector import CollectorAdapter
    >>> CollectorAdapter.default_placement
    'per_rank'
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torchrl.collectors import BaseCollector, Collector

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.env import (  # (also imported from here by older code: one implementation, in env.py)
    composed_custom_state,
    env_extras,
    env_generators,
    generator_state,
    restore_env_extras,
    restore_env_generators,
    set_generator_state,
    simulator_envs,
    transformed_serial_envs,
    warn_unreachable,
    warn_worker_state,
    worker_envs,
)
from torchrl_dcp.adapters.env_transforms import (
    check_transform_attributes,
    resharded_attributes,
    statistics_taken_whole,
    warn_unverified_transforms,
)
from torchrl_dcp.adapters.rng import same_rank_source
from torchrl_dcp.adapters.state_kinds import integral_dtype
from torchrl_dcp.adapters.tensordict import drop_unsaved, saved_keys, tensordict_from_state, tensordict_state
from torchrl_dcp.errors import (
    CheckpointFormatError,
    EncodingError,
    IncompatibleComponentError,
    InexactResumeWarning,
)
from torchrl_dcp.format.codec import TensorSpec

__all__ = [
    "CollectorAdapter",
    "MultiCollectorAdapter",
    "composed_custom_state",
    "env_generators",
    "generator_state",
    "load_collector_state",
    "resume_async_workers",
    "set_generator_state",
    "simulator_envs",
    "transformed_serial_envs",
    "warn_worker_state",
    "worker_envs",
]


class CollectorAdapter(Adapter):
    """A single-process ``torchrl.collectors.Collector``, restored so the next batch is identical."""

    adapter_id = "torchrl_dcp.collector"
    version = 1
    default_placement = "per_rank"

    def state(self, collector: Collector, ctx: AdapterContext) -> Any:
        if _shut_down(collector):
            raise EncodingError(
                f"component {ctx.name!r}: the collector was shut down (collector.shutdown(), which Trainer.train() "
                "calls when it ends), its env is gone: save before the shutdown (a Trainer's scheduled and final "
                "saves happen inside train())"
            )
        warn_unreachable(ctx.name, collector.env, "saving")
        warn_unverified_transforms(ctx.name, collector.env, "saving")
        return self._state(collector)

    def validate(self, collector: Collector, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """The saved carrier (what the next step starts from) holds every entry the live env's specs declare
        (observations, done flags, state) that the live carrier holds: an env built otherwise (another transform, even one without state, such
        as a second ``StepCounter``) would get a carrier without its entries and fail at its next step. Refused
        while planning. So is a collector that was shut down (nothing to restore into: its env is gone)."""
        if _shut_down(collector):
            raise IncompatibleComponentError(
                f"component {ctx.name!r}: the collector was shut down (collector.shutdown(), which Trainer.train() "
                "calls when it ends), its env is gone: load into a collector built anew (nothing was restored)"
            )
        carrier = getattr(collector, "_carrier", None)
        if carrier is None:
            return
        needed = _env_keys(collector.env)
        if needed is not None:  # (what torchrl's carrier holds of them: never non-tensor entries, for one)
            try:
                needed &= set(carrier.keys(include_nested=True, leaves_only=True))
            except Exception:
                needed = None
        for state in saved.values():
            if not isinstance(state, dict) or state.get("carrier") is None or needed is None:
                continue
            try:
                keys = saved_keys(state["carrier"])
            except Exception:  # (a malformed carrier: the restore says what it is)
                continue
            lacking = sorted(map(str, needed - keys))
            if lacking:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: the collector's env declares entries the checkpoint's carrier lacks "
                    f"({lacking[:4]}): build the env (its transforms) as it was saved"
                )

    def check_saved(self, saved: Any) -> None:
        """The counters torchrl's ``state_dict`` holds, as every collector keeps them: ``frames`` an int ``>= 0``,
        ``iter`` an int ``>= -1`` (before the first batch), the trajectory-id pool's next id one integer; and the
        transform attributes the adapter saves (:func:`~torchrl_dcp.adapters.env_transforms.check_transform_attributes`)."""
        if not isinstance(saved, Mapping):
            raise ValueError(f"its state is a {type(saved).__name__}, not a mapping")
        check_collector_counters(saved.get("state_dict"))
        check_transform_attributes(saved.get("transform_attributes") or {})

    def check_values(self, saved: Any, read: Any) -> None:
        """The trajectory-id pool's next id is past every id in flight (the carrier's ``("collector", "traj_ids")``):
        ids are handed out in increasing order from 0, so a smaller one would be handed out again."""
        check_next_traj_id(saved.get("state_dict"), read, _carrier_traj_ids(saved.get("carrier")))

    def snapshot(self, collector: Collector, ctx: AdapterContext) -> Any:
        return copy.deepcopy(self._state(collector))  # what a failed load rolls back to (no warning: not a save)

    def rollback(self, collector: Collector, snapshot: Any, ctx: AdapterContext) -> None:
        self._restore(collector, snapshot, ctx)

    def _state(self, collector: Collector) -> Any:
        carrier = getattr(collector, "_carrier", None)
        return {
            "state_dict": collector.state_dict(),
            "carrier": None if carrier is None else tensordict_state(carrier),
            # env_rngs, transforms, sub_envs, transform_attributes, parents, base_envs (the plain env's own too)
            **env_extras(collector.env, covered=False),
            "traj_assembly": _assembly_state(collector),
        }

    def restore(self, collector: Collector, state: Any, ctx: AdapterContext) -> Any:
        warn_unreachable(ctx.name, collector.env, "loading")
        warn_unverified_transforms(ctx.name, collector.env, "loading")
        return self._restore(collector, state, ctx)

    def _restore(self, collector: Collector, state: Any, ctx: AdapterContext) -> Any:
        load_collector_state(collector, state["state_dict"])
        restore_env_extras(collector.env, state, ctx.name)  # what the env's state_dict leaves out (adapters/env.py)
        if state["carrier"] is not None:
            saved = tensordict_from_state(state["carrier"], ctx)
            carrier = collector._carrier
            if carrier.batch_size != saved.batch_size:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: the collector runs {tuple(carrier.batch_size)} envs, the checkpoint "
                    f"holds {tuple(saved.batch_size)}"
                )
            _replace_expanded(carrier, saved)
            drop_unsaved(carrier, saved)  # entries the saved carrier lacks (an env built otherwise; a rollback's)
            carrier.update(saved, inplace=True)  # existing entries in place (others may hold them), new ones set
        pool = state["state_dict"].get("traj_pool")
        if pool is not None:  # load_state_dict allocated a new trajectory id: undo it, the carrier is restored
            collector._traj_pool.load_state_dict(pool)
        if "traj_assembly" in state:  # (absent from checkpoints saved before: what the collector holds is kept)
            _restore_assembly(collector, state["traj_assembly"], ctx)
        restore_env_generators(collector.env, state["env_rngs"], ctx.name)
        return None

    def load_torchrl_state_dict(self, collector: Collector, state_dict: Any, ctx: AdapterContext) -> list[str]:
        """``state_dict()`` as this adapter loads it (a collector without policy state too); the step in flight, the
        env's generators and what its transforms keep outside ``state_dict()`` are not in torchrl's checkpoint."""
        load_collector_state(collector, state_dict)
        return _NOT_IN_STATE_DICT

    can_reshard = True

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        """Saved rank ``rank % saved_world_size``; refused while a saved collector holds complete trajectories it
        had not yielded (``trajs_per_batch``): collected transitions, which a new world would drop (or, taken by
        several ranks, repeat). The in-flight episodes' steps are not taken over (the collector is reset)."""
        for rank, state in saved.items():
            assembly = state.get("traj_assembly") if isinstance(state, Mapping) else None
            complete = assembly.get("complete") if isinstance(assembly, Mapping) else None
            if complete:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: saved rank {rank}'s collector holds {len(complete)} complete "
                    "trajectories it had not yielded (trajs_per_batch): another number of ranks would drop them; "
                    "load with the saved number of ranks, or save right after a batch"
                )
        return same_rank_source(ctx)

    def reshard(self, collector: Collector, states: dict[int, Any], ctx: AdapterContext) -> Any:
        """After a world-size change: weights, env transforms (e.g. normalisation statistics, also of sub-envs and
        ``Compose``'d ones such as ``TrajCounter``) and counters of saved rank ``rank % saved_world_size``; the
        in-flight episode and the env's own generator are not taken over: the collector is reset, so it starts a
        fresh trajectory, under the restored counters, with its own seed."""
        (state,) = states.values()
        load_collector_state(collector, state["state_dict"])
        restore_env_extras(collector.env, _statistics_only(state), ctx.name)  # sub-envs' and Compose'd transforms'
        collector.reset()  # the fresh trajectory starts under the restored counters (a TrajCounter's next count)
        return None


#: what a collector's checkpoint holds beyond its ``state_dict()`` (a torchrl.checkpoint import leaves it as it is)
_NOT_IN_STATE_DICT = [
    "the step in flight (the carrier the next rollout starts from)",
    "the env's generators",
    "transform state outside state_dict() (Python attributes, Compose'd and sub-envs' transforms)",
]


def _shut_down(collector: Any) -> bool:
    """Whether ``collector.shutdown()`` ran (torchrl deletes its env)."""
    return "env" not in vars(collector) and not hasattr(collector, "env")


@contextlib.contextmanager
def collection_paused(components: Mapping[str, Any], action: str = "save") -> Iterator[list[str]]:
    """Stop, at its next batch boundary, the background thread of each single-process ``Collector`` among
    ``components`` that collects on its own (``collector.start()``, what ``Trainer(async_collection=True)`` runs),
    for the duration of a save or a load (``action``), then start it again.

    The save then reads the collector, its env and the replay buffer the thread writes while nothing writes them
    (read while the thread wrote, a checkpoint was torn: a buffer's cursor past its rows, refused by its own load);
    a load restores them while nothing writes them (restored under the thread, they were torn, or its thread died).
    torchrl's ``Collector`` has no ``pause()``; its thread ends after the batch it is collecting when asked
    (``_stop``), and ``start()`` goes on from the collector's counters. Each such save warns: the checkpoint is whole,
    but how far background collection ran ahead of training is timing, which a resume does not repeat. Yields the
    names of the collectors paused.

    Example:
        >>> with collection_paused({}) as paused:  # (no collector running free: nothing to pause)
        ...     paused
        []
    """
    stopped: list[tuple[str, Collector]] = []
    try:
        for name, obj in components.items():
            thread = getattr(obj, "_thread", None) if isinstance(obj, Collector) else None
            if thread is not None and thread.is_alive():
                obj._stop = True  # (checked by its thread after each batch: torchrl's own async_shutdown)
                thread.join()
                stopped.append((name, obj))
        if stopped:
            warnings.warn(
                f"components {[n for n, _ in stopped]}: collecting in a background thread (collector.start(), "
                f"Trainer(async_collection=True)); paused at a batch boundary for this {action}, so the state "
                f"{'saved' if action == 'save' else 'restored'} is whole, but how far collection runs ahead of "
                "training is timing: a resumed run does not repeat the run that never stopped",
                InexactResumeWarning,
                stacklevel=4,
            )
        yield [n for n, _ in stopped]
    finally:
        for _, obj in stopped:
            obj.start()


def _statistics_only(state: Mapping[str, Any]) -> dict[str, Any]:
    """What a world-size change takes over of a saved env's extras: transform states (statistics, counters) of
    sub-envs, ``Compose``'d transforms and cached parents, and transform settings (a frozen ``VecNorm``); not the
    transform attributes of the saved rank's in-flight episode (a ``RandomTruncationTransform``'s horizons), nor a
    ``SerialEnv``'s shared buffers (its entries): the episode starts afresh."""
    attributes = resharded_attributes(state.get("transform_attributes") or {})
    return {**state, "transform_attributes": attributes, "serial_buffers": {}}


def _assembly_state(collector: Collector) -> dict[str, Any] | None:
    """The steps a collector with ``trajs_per_batch`` holds between batches: the chunks of in-flight episodes
    (``{trajectory id: [chunks]}``) and the complete trajectories not yet yielded (torchrl keeps both in
    ``_traj_assembly``, which its iterator's generator fills; ``None`` before the first batch)."""
    assembly = getattr(collector, "_traj_assembly", None)
    if assembly is None:
        return None
    partial, complete = assembly
    return {
        "partial": [[int(tid), [tensordict_state(c) for c in chunks]] for tid, chunks in partial.items()],
        "complete": [tensordict_state(t) for t in complete],
    }


class _PrimedIterator:
    """``collector.iterator`` until the collector's next new iterator after a restore. The restored steps are the
    collector's ``_traj_assembly`` meanwhile (what a save, torchrl's ``reset()`` or an iterator that was running
    sees); a new iterator's generator replaces it with empty containers of its own, then calls
    ``self.iterator()``: this moves the held steps into those (unless the running iterator took them on meanwhile:
    torchrl's own new iterator then starts empty), then steps aside for the collector's own ``iterator``."""

    def __init__(self, collector: Collector, held: tuple[dict[int, list[Any]], list[Any]]) -> None:
        self.collector, self.held = collector, held
        self.restored = _held_signature(held)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        vars(self.collector).pop("iterator", None)
        assembly = getattr(self.collector, "_traj_assembly", None)
        if assembly is not None and assembly is not self.held and _held_signature(self.held) == self.restored:
            assembly[0].update(self.held[0])
            assembly[1].extend(self.held[1])
        return self.collector.iterator(*args, **kwargs)


def _held_signature(held: tuple[dict[int, list[Any]], list[Any]]) -> tuple[Any, ...]:
    """What identifies the held steps (the chunk objects, by identity): unchanged until an iterator takes them on."""
    partial, complete = held
    return (tuple((tid, tuple(map(id, chunks))) for tid, chunks in partial.items()), tuple(map(id, complete)))


def _restore_assembly(collector: Collector, saved: Any, ctx: AdapterContext) -> None:
    """Put back the held steps (:func:`_assembly_state`): into the assembly of a running iterator, or, before the
    collector's first batch, into the one its generator is about to create."""
    partial: dict[int, list[Any]] = {}
    complete: list[Any] = []
    if saved is not None:
        if not isinstance(saved, dict) or not isinstance(saved.get("partial"), list):
            raise CheckpointFormatError(f"component {ctx.name!r}: malformed trajectory assembly")
        for item in saved["partial"]:
            if not (isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], list)):
                raise CheckpointFormatError(f"component {ctx.name!r}: malformed trajectory assembly")
            partial[item[0]] = [tensordict_from_state(c, ctx) for c in item[1]]
        complete = [tensordict_from_state(t, ctx) for t in saved.get("complete") or []]
    if (partial or complete) and getattr(collector, "trajs_per_batch", None) is None:
        raise IncompatibleComponentError(
            f"component {ctx.name!r}: the checkpoint holds steps of trajectories the saved collector assembled "
            "(trajs_per_batch), this collector assembles none: build it with the same trajs_per_batch"
        )
    assembly = getattr(collector, "_traj_assembly", None)
    if assembly is not None:  # the containers of the iterator it ran (or of a restore before its first batch)
        assembly[0].clear()
        assembly[0].update(partial)
        assembly[1].clear()
        assembly[1].extend(complete)
    elif partial or complete:
        assembly = collector._traj_assembly = (partial, complete)
    if partial or complete:  # a new iterator (a loop started again after the load) takes them on too
        collector.iterator = _PrimedIterator(collector, assembly)  # type: ignore[method-assign]
    else:
        vars(collector).pop("iterator", None)  # (a restore's hand-over left from an earlier load: nothing to hand)


def _replace_expanded(carrier: Any, saved: Any) -> None:
    """Entries of ``carrier`` that cannot take the saved values in place are replaced by them instead: expanded views
    (a stride 0 along a dimension of size > 1, e.g. what ``ExpandAs`` writes) and entries of another dtype (a
    float64 policy makes Pendulum's ``th`` float64 after the first step, where a new collector's reset holds float32:
    written in place, the saved values were cast)."""
    for key in saved.keys(include_nested=True, leaves_only=True):
        try:
            live, value = carrier.get(key, None), saved.get(key)
        except RuntimeError:  # (an entry of a lazy stack of other shapes per env: no one tensor, none expanded)
            continue
        if isinstance(live, torch.Tensor) and (
            any(st == 0 and n > 1 for st, n in zip(live.stride(), live.shape))
            or (isinstance(value, torch.Tensor) and value.dtype != live.dtype)
        ):
            carrier.set(key, value.clone())


WORKER_TRAJ_IDS = "_tdcp_worker_traj_ids"  # added to the multi-collector state dict (older checkpoints lack it)


def _env_keys(env: Any) -> set[Any] | None:
    """The leaf keys an env's specs declare for what a step carries over (observations, done flags, state);
    ``None`` when its specs cannot be read."""
    try:
        keys: set[Any] = set()
        for spec in (env.full_observation_spec, env.full_done_spec, env.full_state_spec):
            keys.update(spec.keys(include_nested=True, leaves_only=True))
        return keys
    except Exception:
        return None


def check_collector_counters(state_dict: Any) -> None:
    """``frames`` (an int ``>= 0``) and ``iter`` (an int ``>= -1``) of a collector's saved ``state_dict()``, and its
    trajectory-id pool's next id: one integer (a tensor of no dimension). Raises ``ValueError``."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"its collector state_dict is a {type(state_dict).__name__}, not a mapping")
    for key, least in _COUNTERS:
        value = state_dict.get(key, least)
        if isinstance(value, TensorSpec):  # (a worker's, shared with the parent: one integer, checked once read)
            if value.shape != () or not integral_dtype(value.dtype):
                raise ValueError(f"its collector's {key} is a {value.dtype} tensor of shape {list(value.shape)}")
        elif type(value) is not int or value < least:
            raise ValueError(f"its collector's {key} is {value!r}, not an integer >= {least}")
    pool = state_dict.get("traj_pool")
    if pool is not None:
        next_id = pool.get("traj_id") if isinstance(pool, Mapping) else None
        if not (isinstance(next_id, TensorSpec) and next_id.shape == () and integral_dtype(next_id.dtype)):
            raise ValueError(f"its trajectory-id pool's next id is {next_id!r}, not one integer")


_COUNTERS = (("frames", 0), ("iter", -1))


def check_next_traj_id(state_dict: Any, read: Any, in_flight: Any = None) -> None:
    """Counters held as tensors (a worker's) are at least their least value; the pool's next trajectory id is
    ``>= 0`` and past every id in ``in_flight`` (a spec of the ids the carrier holds), which are ``>= 0``: torchrl
    hands ids out in increasing order from 0. Raises ``ValueError``."""
    for key, least in _COUNTERS if isinstance(state_dict, Mapping) else ():
        value = state_dict.get(key)
        if isinstance(value, TensorSpec) and int(read(value)) < least:
            raise ValueError(f"its collector's {key} is {int(read(value))}, not an integer >= {least}")
    pool = state_dict.get("traj_pool") if isinstance(state_dict, Mapping) else None
    spec = pool.get("traj_id") if isinstance(pool, Mapping) else None
    if not isinstance(spec, TensorSpec):
        return
    next_id = int(read(spec))
    if next_id < 0:
        raise ValueError(f"its trajectory-id pool's next id is {next_id}")
    if isinstance(in_flight, TensorSpec) and integral_dtype(in_flight.dtype) and math.prod(in_flight.shape):
        ids = read(in_flight)
        if int(ids.min()) < 0 or int(ids.max()) >= next_id:
            raise ValueError(
                f"its carrier holds trajectory ids {int(ids.min())}..{int(ids.max())}, its pool's next id is "
                f"{next_id}: ids would be handed out twice"
            )


def _carrier_traj_ids(carrier: Any) -> Any:
    """The spec of ``("collector", "traj_ids")`` in a saved carrier state (``None``: none there)."""
    try:
        return carrier["entries"]["collector"]["td"]["entries"]["traj_ids"]["tensor"]
    except (KeyError, TypeError):
        return None


def load_collector_state(collector: Any, state_dict: Mapping[str, Any]) -> None:
    """``collector.load_state_dict(state_dict)``, also for a collector without a policy holding state.

    torchrl 0.14's ``Collector.state_dict()`` leaves ``policy_state_dict`` out when the policy has no state
    (``Collector(env, None)``, a ``RandomPolicy``), but its strict ``load_state_dict`` then demands one ("Underlying
    policy does not have state_dict"), so such a collector saved but never loaded. When neither side has policy
    state, the load runs non-strict: it then skips only the policy (the environment's state, counters and
    trajectory ids load as saved; the adapter restores the carrier and generators itself).
    """
    with statistics_taken_whole(collector.env):  # (sub-envs started, specs computed: live keys as saved)
        if "policy_state_dict" not in state_dict and not hasattr(collector, "_policy_w_state_dict"):
            # non-strict skips the env's keys too: compared here, as the strict load compares them (an env built
            # with other transforms dropped the saved statistics without a word)
            saved, live = state_dict.get("env_state_dict"), collector.state_dict().get("env_state_dict")
            saved, live = _key_paths(saved), _key_paths(live)  # (a SerialEnv's: each sub-env's keys, under worker<i>)
            if saved is not None and live is not None and saved != live:
                differ = sorted(saved ^ live)
                raise IncompatibleComponentError(
                    f"the collector's env holds other transform state than the checkpoint's (keys {differ[:4]} are "
                    "in one only): build the env with the transforms it was saved with"
                )
            collector.load_state_dict(state_dict, strict=False)
        else:
            collector.load_state_dict(state_dict)


def _key_paths(state: Any, prefix: str = "") -> set[str] | None:
    """The keys of a (nested) state dict, nested ones as dotted paths, down to a module's extra state (its content is
    the module's: a ``VecNorm``'s statistics, built lazily); ``None`` for no state dict."""
    if not isinstance(state, Mapping):
        return None
    out: set[str] = set()
    for key, value in state.items():
        inner = None if str(key).endswith("_extra_state") else _key_paths(value, f"{prefix}{key}.")
        out.update(inner if inner else {f"{prefix}{key}"})
    return out


class MultiCollectorAdapter(Adapter):
    """``MultiSyncCollector`` / ``MultiAsyncCollector``: ``state_dict()`` plus the workers' trajectory ids.

    ``load_state_dict`` makes every worker allocate a new trajectory id for its in-flight
    episode, which shifted the ids of all later trajectories by one per worker env. The
    workers' in-flight ids are read at save through torchrl's public
    ``get_distant_attr("_carrier")`` and written back at load (``map_fn("_carrier.set", ...)``)
    before the shared trajectory-id pool is restored again. Env state, carriers' other
    entries and worker RNG streams stay in the workers (see docs/components/collectors.md).
    """

    adapter_id = "torchrl_dcp.multi_collector"
    version = 1
    default_placement = "per_rank"

    def state(self, collector: BaseCollector, ctx: AdapterContext) -> Any:
        _warn_multi_worker_state(ctx.name, collector, "saving")
        return self._state(collector)

    def snapshot(self, collector: BaseCollector, ctx: AdapterContext) -> Any:
        return copy.deepcopy(self._state(collector))  # what a failed load rolls back to (no warning: not a save)

    @staticmethod
    def _state(collector: BaseCollector) -> Any:
        try:
            state = dict(collector.state_dict())
            ids = _worker_traj_ids(collector)
        finally:
            resume_async_workers(collector)
        if ids is not None:
            state[WORKER_TRAJ_IDS] = ids
        return state

    def check_saved(self, saved: Any) -> None:
        """The counters of the collector and of each worker (:func:`check_collector_counters`)."""
        check_collector_counters(saved)
        for key, worker in saved.items():
            if isinstance(key, str) and key.startswith("worker") and key[6:].isdigit():
                check_collector_counters(worker)

    def check_values(self, saved: Any, read: Any) -> None:
        check_next_traj_id(saved, read)
        for key, worker in saved.items():
            if isinstance(key, str) and key.startswith("worker") and key[6:].isdigit():
                check_next_traj_id(worker, read)

    def load_torchrl_state_dict(self, collector: BaseCollector, state_dict: Any, ctx: AdapterContext) -> list[str]:
        """Each worker's ``state_dict()`` (its error raised here); the workers' in-flight trajectory ids are not in
        torchrl's checkpoint."""
        try:
            load_worker_states(collector, state_dict)
        finally:
            resume_async_workers(collector)
        return ["the workers' in-flight trajectory ids"]

    def restore(self, collector: BaseCollector, state: Any, ctx: AdapterContext) -> Any:
        _warn_multi_worker_state(ctx.name, collector, "loading")
        state = dict(state)
        ids = state.pop(WORKER_TRAJ_IDS, None)
        try:
            load_worker_states(collector, state)
            if ids is not None and len(ids) == getattr(collector, "num_workers", -1):
                key = ("collector", "traj_ids")
                collector.map_fn("_carrier.set_", list_of_args=[(key, t.clone()) for t in ids])
        finally:
            resume_async_workers(collector)
        pool = state.get("traj_pool")
        if pool is not None:  # each worker's load_state_dict allocated an id: undo it
            collector._traj_pool.load_state_dict(pool)
        return None


def load_worker_states(collector: Any, state_dict: Mapping[str, Any]) -> None:
    """``collector.load_state_dict(state_dict)`` for a multi-process collector, with each worker's error raised here.

    torchrl 0.14's ``load_state_dict`` sends each worker its state as a control message the worker does not
    survive failing (its pipe closes: an ``EOFError`` here, and nothing left to roll back); its workers also load
    strictly, so workers whose policy holds no state (``policy=None``: a ``RandomPolicy``) never loaded what they
    saved. The states go through ``map_fn`` instead (a worker's error comes back as the exception), non-strict
    exactly where neither the saved nor the live workers hold policy state (as :func:`load_collector_state`), then
    the collector's own counters as ``load_state_dict`` sets them.
    """
    n = collector.num_workers
    workers = [state_dict[f"worker{i}"] for i in range(n)]
    strict = True
    if not any("policy_state_dict" in w for w in workers):
        live = collector.state_dict()
        lives = [live.get(f"worker{i}") or {} for i in range(n)]
        if not any("policy_state_dict" in w for w in lives):
            for i, (saved, now) in enumerate(zip(workers, lives)):
                env_saved, env_live = saved.get("env_state_dict"), now.get("env_state_dict")
                if env_saved is not None and env_live is not None and set(env_saved) != set(env_live):
                    differ = sorted(set(env_saved) ^ set(env_live))
                    raise IncompatibleComponentError(
                        f"the collector's worker {i} env holds other transform state than the checkpoint's (keys "
                        f"{differ[:4]} are in one only): build the envs with the transforms they were saved with"
                    )
            strict = False
    pool = state_dict.get("traj_pool")
    if pool is not None:
        collector._traj_pool.load_state_dict(pool)
    collector.map_fn("load_state_dict", list_of_args=[(w,) for w in workers], list_of_kwargs=[{"strict": strict}] * n)
    collector._frames = state_dict["frames"]
    collector._iter = state_dict["iter"]
    version = state_dict.get("policy_version")
    if version is not None and getattr(collector, "policy_version_tracker", None) is not None:
        collector.policy_version_tracker.version = version


def resume_async_workers(collector: BaseCollector) -> None:
    """Tell a running ``MultiAsyncCollector``'s workers to go on collecting after control messages.

    A worker of torchrl 0.14 (``collectors/_runner.py``) that handles a control message (``state_dict``,
    ``load_state_dict``, ``get_distant_attr``) forgets the ``continue`` it was running on and, if the queue was full
    when it finished a batch, that batch: it then waits for a ``continue`` the main process never sends (it sends one
    per batch it takes), and the next batch hangs (torchrl's own ``state_dict()`` between two batches hangs it the
    same way). One ``continue`` per worker puts every worker back to work; a worker that did not need it is one
    batch ahead, as asynchronous collection allows.
    """
    from torchrl.collectors import MultiAsyncCollector

    if not isinstance(collector, MultiAsyncCollector) or not getattr(collector, "running", False):
        return
    should_random = getattr(collector, "_should_use_random_frames", None)
    msg = "continue_random" if callable(should_random) and should_random() else "continue"
    for idx, pipe in enumerate(collector.pipes):
        pipe.send((idx, msg))


def _warn_multi_worker_state(name: str, collector: BaseCollector, action: str) -> None:
    warnings.warn(
        f"component {name!r} ({action}): {type(collector).__name__} keeps its workers' environments, in-flight "
        "episodes (carriers) and generators in worker processes, out of reach of torchrl's API: weights, transform "
        "statistics held in module buffers, the collectors' counters and trajectory ids are restored (state a "
        "transform keeps elsewhere, such as a TrajCounter's count, is not), the next batches are not an "
        "uninterrupted run's. "
        "Use a Collector (over a SerialEnv) per rank where exactness matters; see docs/components/collectors.md",
        InexactResumeWarning,
        stacklevel=4,
    )


def _worker_traj_ids(collector: BaseCollector) -> list[torch.Tensor] | None:
    """Each worker's in-flight trajectory ids (``None`` where torchrl does not expose them)."""
    get = getattr(collector, "get_distant_attr", None)
    if not callable(get) or not callable(getattr(collector, "map_fn", None)):
        return None
    try:
        carriers = get("_carrier")
    except (AttributeError, RuntimeError, KeyError):  # a collector without worker carriers: nothing to keep
        return None
    out = []
    for carrier in carriers:
        ids = carrier.get(("collector", "traj_ids"), None) if carrier is not None else None
        if ids is None:
            return None
        out.append(ids.clone())
    return out

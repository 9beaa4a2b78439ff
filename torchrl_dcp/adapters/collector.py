"""Collectors: ``Collector`` exactly, ``MultiSyncCollector`` / ``MultiAsyncCollector`` as far as reachable.

For a single-process ``Collector`` the state is ``collector.state_dict()`` (policy
weights, env transform state such as ``VecNormV2`` statistics, frame and iteration
counters, the trajectory-id pool) **plus** what ``state_dict()`` leaves out and
an exact continuation needs: the in-flight *carrier* (current observation, step
counters, episode rewards, last policy outputs, trajectory ids) and the state of
every ``torch.Generator`` / NumPy ``Generator`` the environment owns (e.g.
``PendulumEnv.rng``). Restoring writes the carrier back in place after the
trajectory-id pool, so the next batch is the one an uninterrupted run collects.

Multi-process collectors keep carriers, environments and their RNGs inside worker
processes: only ``state_dict()`` is reachable (per-worker weights, transforms,
counters). Their next batch after a restore is therefore not the uninterrupted
one; see docs/components.md.

Example:
    >>> import torchrl_dcp as tdcp
    >>> from torchrl_dcp.adapters.collector import CollectorAdapter
    >>> CollectorAdapter.default_placement
    'per_rank'
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torchrl.collectors import BaseCollector, Collector

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.env_transforms import (
    env_transforms,
    restore_transform_attributes,
    transform_attributes,
    warn_unverified_transforms,
)
from torchrl_dcp.adapters.rng import same_rank_source
from torchrl_dcp.adapters.tensordict import drop_unsaved, tensordict_from_state, tensordict_state
from torchrl_dcp.errors import (
    CheckpointFormatError,
    EncodingError,
    IncompatibleComponentError,
    InexactResumeWarning,
)


def env_generators(env: Any) -> dict[str, Any]:
    """Every ``torch.Generator`` and NumPy generator reachable from an env (through wrappers and transforms)."""
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, depth: int) -> None:
        if id(obj) in seen or depth > 6:
            return
        seen.add(id(obj))
        attrs = dict(getattr(obj, "__dict__", {}))
        attrs.update(getattr(obj, "_modules", None) or {})
        for name, value in attrs.items():
            if isinstance(value, (torch.Generator, np.random.Generator, np.random.RandomState)):
                found[f"{path}{name}"] = value
            elif isinstance(value, torch.nn.Module) and name != "policy":
                walk(value, f"{path}{name}.", depth + 1)  # wrapped envs, transforms (envs are modules)
            elif isinstance(value, (list, tuple)) and name in ("envs", "_envs"):
                for i, child in enumerate(value):
                    walk(child, f"{path}{name}.{i}.", depth + 1)

    walk(env, "", 0)
    return found


def generator_state(gen: Any) -> Any:
    if isinstance(gen, torch.Generator):
        return {"kind": "torch", "state": gen.get_state()}
    if isinstance(gen, np.random.Generator):
        return {"kind": "numpy", "state": gen.bit_generator.state}
    return {"kind": "numpy_legacy", "state": _legacy_state(gen)}


def _legacy_state(gen: np.random.RandomState) -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = gen.get_state(legacy=True)
    return {
        "kind": kind,
        "keys": torch.from_numpy(keys.astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "gauss": float(gauss),
    }


def set_generator_state(gen: Any, saved: dict[str, Any]) -> None:
    if saved["kind"] == "torch":
        gen.set_state(saved["state"].cpu())
    elif saved["kind"] == "numpy":
        gen.bit_generator.state = saved["state"]
    else:
        s = saved["state"]
        gen.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))


def worker_envs(env: Any) -> list[str]:
    """Batched envs in ``env`` (through wrappers) whose sub-envs run in worker processes (``ParallelEnv``)."""
    return _unreachable(env)[0]


def simulator_envs(env: Any) -> list[str]:
    """Envs in ``env`` (through wrappers and ``SerialEnv``) that wrap an external simulator (torchrl's
    ``_EnvWrapper``: ``GymEnv``, ``DMControlEnv``, ``BraxEnv``, ...), whose state lives outside the TensorDict."""
    return _unreachable(env)[1]


def _unreachable(env: Any) -> tuple[list[str], list[str]]:
    from torchrl.envs import ParallelEnv
    from torchrl.envs.common import _EnvWrapper

    workers: list[str] = []
    simulators: list[str] = []
    seen: set[int] = set()
    stack = [(env, "env")]
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, ParallelEnv):
            workers.append(f"{path} ({type(obj).__name__} of {obj.num_workers} workers)")
            continue
        if isinstance(obj, _EnvWrapper):
            simulators.append(f"{path} ({type(obj).__name__})")
            continue
        for attr in ("base_env", "env", "_env"):
            child = obj.__dict__.get(attr) or (getattr(obj, "_modules", None) or {}).get(attr)
            if child is not None:
                stack.append((child, f"{path}.{attr}"))
        for i, child in enumerate(obj.__dict__.get("_envs") or ()):  # SerialEnv's sub-envs
            stack.append((child, f"{path}._envs.{i}"))
    return workers, simulators


def warn_worker_state(name: str, where: list[str], action: str) -> None:
    """Say what will differ after a restore when env state lives in worker processes."""
    warnings.warn(
        f"component {name!r} ({action}): {', '.join(where)} keeps its sub-envs, their generators and the workers' "
        "RNG streams in worker processes, out of reach of torchrl's API: they are not checkpointed, so after a "
        "restore the next batches equal an uninterrupted run's only until a sub-env resets (then its initial state "
        "differs). Use SerialEnv (exact) or accept the difference; see docs/components/collectors.md",
        InexactResumeWarning,
        stacklevel=3,
    )


def warn_simulator_state(name: str, where: list[str], action: str) -> None:
    """Say what will differ after a restore when env state lives in an external simulator."""
    warnings.warn(
        f"component {name!r} ({action}): {', '.join(where)} wraps an external simulator whose own state (physics, "
        "its random generator) is not checkpointed: after a restore the episodes in flight do not continue as they "
        "would have, and new episodes start from other initial states. The collector's counters, carrier and "
        "transforms are restored; see docs/components/collectors.md",
        InexactResumeWarning,
        stacklevel=3,
    )


def _warn_unreachable(name: str, env: Any, action: str) -> None:
    workers, simulators = _unreachable(env)
    if workers:
        warn_worker_state(name, workers, action)
    if simulators:
        warn_simulator_state(name, simulators, action)


class CollectorAdapter(Adapter):
    """A single-process ``torchrl.collectors.Collector``, restored so the next batch is identical."""

    adapter_id = "torchrl_dcp.collector"
    version = 1
    default_placement = "per_rank"

    def state(self, collector: Collector, ctx: AdapterContext) -> Any:
        if "env" not in vars(collector) and not hasattr(collector, "env"):
            raise EncodingError(
                f"component {ctx.name!r}: the collector was shut down (collector.shutdown(), which Trainer.train() "
                "calls when it ends), its env is gone: save before the shutdown (a Trainer's scheduled and final "
                "saves happen inside train())"
            )
        _warn_unreachable(ctx.name, collector.env, "saving")
        warn_unverified_transforms(ctx.name, collector.env, "saving")
        return self._state(collector)

    def snapshot(self, collector: Collector, ctx: AdapterContext) -> Any:
        return copy.deepcopy(self._state(collector))  # what a failed load rolls back to (no warning: not a save)

    def rollback(self, collector: Collector, snapshot: Any, ctx: AdapterContext) -> None:
        self._restore(collector, snapshot, ctx)

    def _state(self, collector: Collector) -> Any:
        carrier = getattr(collector, "_carrier", None)
        return {
            "state_dict": collector.state_dict(),
            "carrier": None if carrier is None else tensordict_state(carrier),
            "env_rngs": {name: generator_state(g) for name, g in env_generators(collector.env).items()},
            "transforms": {path: dict(t.state_dict()) for path, t in composed_custom_state(collector.env).items()},
            "sub_envs": {path: dict(e.state_dict()) for path, e in transformed_serial_envs(collector.env).items()},
            **({"transform_attributes": attrs} if (attrs := transform_attributes(collector.env)) else {}),
            **({"parents": parents} if (parents := _parent_states(collector.env)) else {}),
            "traj_assembly": _assembly_state(collector),
        }

    def restore(self, collector: Collector, state: Any, ctx: AdapterContext) -> Any:
        _warn_unreachable(ctx.name, collector.env, "loading")
        warn_unverified_transforms(ctx.name, collector.env, "loading")
        return self._restore(collector, state, ctx)

    def _restore(self, collector: Collector, state: Any, ctx: AdapterContext) -> Any:
        load_collector_state(collector, state["state_dict"])
        for path, saved in (state.get("sub_envs") or {}).items():  # (absent from checkpoints saved before)
            serial = transformed_serial_envs(collector.env).get(path)
            if serial is None:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: the checkpoint holds the sub-envs' state of a SerialEnv at {path}, which "
                    "this collector's env does not have: build the env as it was saved"
                )
            serial.load_state_dict(saved)
        live = composed_custom_state(collector.env)
        for path, saved in (state.get("transforms") or {}).items():  # (absent from checkpoints saved before)
            if path not in live:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: the checkpoint holds the state of transform {path}, which this "
                    "collector's env does not have at that place: build the env with the transforms it was saved with"
                )
            live[path].load_state_dict(saved)
        restore_transform_attributes(collector.env, state.get("transform_attributes") or {}, ctx.name)
        _restore_parents(collector.env, state.get("parents") or {}, ctx.name)  # (after the transforms they clone)
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
        gens = env_generators(collector.env)
        for name, saved_gen in state["env_rngs"].items():
            if name not in gens:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: the env has no generator {name!r} to restore"
                )
            set_generator_state(gens[name], saved_gen)
        return None

    can_reshard = True

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return same_rank_source(ctx)

    def reshard(self, collector: Collector, states: dict[int, Any], ctx: AdapterContext) -> Any:
        """After a world-size change: weights, env transforms (e.g. normalisation statistics) and
        counters of saved rank ``rank % saved_world_size``; the in-flight episode and the env's own
        generator are not taken over, so the collector starts fresh trajectories with its own seed."""
        (state,) = states.values()
        load_collector_state(collector, state["state_dict"])
        return None


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
    """``collector.iterator`` until the collector's first batch after a restore. The restored steps are the
    collector's ``_traj_assembly`` meanwhile (what a save or torchrl's ``reset()`` then sees); torchrl's
    generator replaces it with empty containers of its own, then calls ``self.iterator()``: this moves the held
    steps into those, then steps aside for the collector's own ``iterator``."""

    def __init__(self, collector: Collector, held: tuple[dict[int, list[Any]], list[Any]]) -> None:
        self.collector, self.held = collector, held

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        vars(self.collector).pop("iterator", None)
        assembly = getattr(self.collector, "_traj_assembly", None)
        if assembly is not None and assembly is not self.held:
            assembly[0].update(self.held[0])
            assembly[1].extend(self.held[1])
        return self.collector.iterator(*args, **kwargs)


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
        collector._traj_assembly = (partial, complete)
        collector.iterator = _PrimedIterator(collector, collector._traj_assembly)  # type: ignore[method-assign]


def _replace_expanded(carrier: Any, saved: Any) -> None:
    """Entries of ``carrier`` that are expanded views (a stride 0 along a dimension of size > 1, e.g. what
    ``ExpandAs`` writes) cannot be written in place: they are replaced by the saved values instead."""
    for key in saved.keys(include_nested=True, leaves_only=True):
        live = carrier.get(key, None)
        if isinstance(live, torch.Tensor) and any(st == 0 and n > 1 for st, n in zip(live.stride(), live.shape)):
            carrier.set(key, saved.get(key).clone())


WORKER_TRAJ_IDS = "_tdcp_worker_traj_ids"  # added to the multi-collector state dict (older checkpoints lack it)


def transformed_serial_envs(env: Any) -> dict[str, Any]:
    """``{path: SerialEnv}`` of a ``SerialEnv`` under the collector's ``TransformedEnv`` (however deep).

    ``Collector.state_dict()`` saves a ``TransformedEnv``'s own transforms only (``env.transform.state_dict()``),
    never what its base env holds, so the transforms inside a ``SerialEnv``'s sub-envs (their ``VecNormV2``
    statistics) were lost (torchrl 0.14); the adapter saves the ``SerialEnv``'s ``state_dict()`` (every sub-env's)
    itself. A ``ParallelEnv``'s sub-envs live in worker processes (see :func:`warn_worker_state`).

    Example:
        >>> from torchrl.envs import PendulumEnv, SerialEnv, TransformedEnv, StepCounter
        >>> list(transformed_serial_envs(TransformedEnv(SerialEnv(2, PendulumEnv), StepCounter())))
        ['base_env']
    """
    from torchrl.envs import SerialEnv, TransformedEnv

    path = ""
    while isinstance(env, TransformedEnv):  # (a batched env forwards unknown attributes such as base_env to workers)
        env, path = env.base_env, f"{path}.base_env" if path else "base_env"
    return {path: env} if path and isinstance(env, SerialEnv) else {}


def composed_custom_state(env: Any) -> dict[str, Any]:
    """``{path: transform}`` of the transforms inside a ``Compose`` that define their own ``state_dict`` (also in the
    sub-envs of a ``SerialEnv``: ``base_env._envs.0.transform.1``).

    ``Compose.state_dict()`` is ``nn.Module``'s: it gathers its children's parameters and buffers, never their own
    ``state_dict`` overrides, so e.g. ``TrajCounter``'s trajectory count (a shared counter, not a buffer) was lost
    and trajectory ids restarted after a restore (torchrl 0.14). The adapter saves those states itself.

    Example:
        >>> from torchrl.envs import Compose, PendulumEnv, StepCounter, TrajCounter, TransformedEnv
        >>> sorted(composed_custom_state(TransformedEnv(PendulumEnv(), Compose(StepCounter(), TrajCounter()))))
        ['transform.1']
    """
    from torchrl.envs import SerialEnv, TransformedEnv

    out: dict[str, Any] = {}
    stack: list[tuple[Any, str]] = [(env, "")]
    while stack:
        obj, path = stack.pop()
        if isinstance(obj, TransformedEnv):
            stack.append((obj.transform, f"{path}transform"))
            stack.append((obj.base_env, f"{path}base_env."))
        elif isinstance(obj, SerialEnv):  # its sub-envs' transforms (``SerialEnv.state_dict`` is theirs: the same loss)
            stack.extend((e, f"{path}_envs.{i}.") for i, e in enumerate(obj.__dict__.get("_envs") or ()))
        children = getattr(obj, "transforms", None) if type(obj).__name__ == "Compose" else None
        for i, child in enumerate(children or ()):
            where = f"{path}.{i}"
            if type(child).state_dict is not torch.nn.Module.state_dict:
                out[where] = child
            stack.append((child, where))
    return out


def _transform_states(env: Any) -> dict[str, Any]:
    """What the adapter saves of an env's transforms: ``state_dict``, custom states, attributes (the transforms
    of ``env`` itself; its base env is saved where it is the collector's)."""
    return {
        "state_dict": dict(env.transform.state_dict()),
        "transforms": {
            p: dict(t.state_dict()) for p, t in composed_custom_state(env).items() if p.startswith("transform")
        },
        "transform_attributes": {p: v for p, v in transform_attributes(env).items() if p.startswith("transform")},
    }


def _parent_states(env: Any) -> dict[str, Any]:
    """``{transform path: state}`` of the parent envs torchrl built and cached for the transforms of ``env``
    (``Transform.parent``: the base env with *clones* of the transforms before that one).

    ``FrameSkipTransform`` steps through its parent: the clones there (a ``VecNormV2``'s statistics) update on their
    own, apart from the env's transforms, so a restore that skipped them continued from other statistics (and one
    into a live collector left the clones at the rolled-back-from state)."""
    from torchrl.envs import TransformedEnv

    return {
        path: _transform_states(parent)
        for path, transform in env_transforms(env)
        if isinstance(parent := transform.__dict__.get("_parent"), TransformedEnv)
    }


def _restore_parents(env: Any, saved: Mapping[str, Any], name: str) -> None:
    """Put the saved parents' transform states back (building each parent as torchrl does); a live parent the save
    had not built yet is dropped, so that it is built again on use from the restored transforms, as it was."""
    live = dict(env_transforms(env))
    unknown = sorted(set(saved) - set(live))
    if unknown:
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds the parent env of transforms at {unknown[:3]}, which this "
            "collector's env does not have: build the env with the transforms it was saved with"
        )
    for path, transform in live.items():
        if path not in saved:
            if transform.__dict__.get("_parent") is not None:
                transform.__dict__["_parent"] = None  # torchrl's own reset_parent, without touching the container
            continue
        parent, state = transform.parent, saved[path]
        parent.transform.load_state_dict(state["state_dict"])
        custom = composed_custom_state(parent)
        for at, transform_state in state["transforms"].items():
            if at not in custom:
                raise IncompatibleComponentError(
                    f"component {name!r}: the checkpoint holds the state of {at} in the parent env of {path}, which "
                    "this collector's env does not have: build the env with the transforms it was saved with"
                )
            custom[at].load_state_dict(transform_state)
        restore_transform_attributes(parent, state["transform_attributes"], name)


def load_collector_state(collector: Any, state_dict: Mapping[str, Any]) -> None:
    """``collector.load_state_dict(state_dict)``, also for a collector without a policy holding state.

    torchrl 0.14's ``Collector.state_dict()`` leaves ``policy_state_dict`` out when the policy has no state
    (``Collector(env, None)``, a ``RandomPolicy``), but its strict ``load_state_dict`` then demands one ("Underlying
    policy does not have state_dict"), so such a collector saved but never loaded. When neither side has policy
    state, the load runs non-strict: it then skips only the policy (the environment's state, counters and
    trajectory ids load as saved; the adapter restores the carrier and generators itself).
    """
    if "policy_state_dict" not in state_dict and not hasattr(collector, "_policy_w_state_dict"):
        collector.load_state_dict(state_dict, strict=False)
    else:
        collector.load_state_dict(state_dict)


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
        try:
            state = dict(collector.state_dict())
            ids = _worker_traj_ids(collector)
        finally:
            resume_async_workers(collector)
        if ids is not None:
            state[WORKER_TRAJ_IDS] = ids
        return state

    def restore(self, collector: BaseCollector, state: Any, ctx: AdapterContext) -> Any:
        _warn_multi_worker_state(ctx.name, collector, "loading")
        state = dict(state)
        ids = state.pop(WORKER_TRAJ_IDS, None)
        try:
            collector.load_state_dict(state)
            if ids is not None and len(ids) == getattr(collector, "num_workers", -1):
                key = ("collector", "traj_ids")
                collector.map_fn("_carrier.set_", list_of_args=[(key, t.clone()) for t in ids])
        finally:
            resume_async_workers(collector)
        pool = state.get("traj_pool")
        if pool is not None:  # each worker's load_state_dict allocated an id: undo it
            collector._traj_pool.load_state_dict(pool)
        return None


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
        "statistics, counters and trajectory ids are restored, the next batches are not an uninterrupted run's. "
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

"""Environments: a torchrl ``EnvBase`` saved with what its ``state_dict()`` leaves out, exactly.

An env is an ``nn.Module``, but its ``state_dict()`` holds few of the things that decide what it does next: the
transforms' buffers (``VecNormV2`` statistics) when it is a ``TransformedEnv``, its sub-envs' when it is a
``SerialEnv``, nothing else. This module finds and saves the rest (one implementation, used by the env adapter and
by the collector adapter for its env):

- every ``torch.Generator`` / NumPy generator the env owns, through wrappers, transforms and a ``SerialEnv``'s
  sub-envs (:func:`env_generators`; e.g. ``PendulumEnv.rng``, which draws each reset's initial state);
- the state of transforms inside a ``Compose`` that define their own ``state_dict`` (``TrajCounter``), which
  ``Compose.state_dict()`` drops (:func:`composed_custom_state`);
- the sub-envs' state of a ``SerialEnv`` under a ``TransformedEnv`` (:func:`transformed_serial_envs`);
- transform attributes kept outside ``state_dict`` (:func:`~torchrl_dcp.adapters.env_transforms.transform_attributes`)
  and the transform states of the parent envs torchrl caches (:func:`parent_states`).

State that lives out of reach (a ``ParallelEnv``'s workers, an external simulator) is warned about with an
:class:`~torchrl_dcp.errors.InexactResumeWarning` at save and at load (:func:`warn_unreachable`).

Example:
    >>> import torchrl_dcp as tdcp
    >>> from torchrl.envs import PendulumEnv
    >>> from torchrl_dcp.adapters import resolve_adapter
    >>> adapter = resolve_adapter(PendulumEnv())
    >>> adapter.adapter_id, adapter.default_placement
    ('torchrl_dcp.env', 'per_rank')
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.env_attributes import plain_attributes, warn_plain_attributes
from torchrl_dcp.adapters.env_generators import (
    env_generators,
    generator_state,
    restore_env_generators,
    set_generator_state,
)
from torchrl_dcp.adapters.env_lazy import lazy_places, lazy_plan, materialize_lazy, set_aside
from torchrl_dcp.adapters.env_transforms import (
    check_transform_attributes,
    env_transforms,
    resharded_attributes,
    restore_transform_attributes,
    statistics_taken_whole,
    transform_attributes,
    warn_unverified_transforms,
)
from torchrl_dcp.adapters.rng import same_rank_source
from torchrl_dcp.errors import (
    CheckpointError,
    CheckpointIntegrityError,
    EncodingError,
    IncompatibleComponentError,
    InexactResumeWarning,
)

__all__ = [
    "EnvAdapter",
    "base_env_states",
    "composed_custom_state",
    "env_extras",
    "env_generators",
    "env_state",
    "generator_state",
    "parent_states",
    "restore_base_envs",
    "restore_env_extras",
    "restore_env_generators",
    "restore_parents",
    "set_generator_state",
    "simulator_envs",
    "transformed_serial_envs",
    "warn_unreachable",
    "worker_envs",
]


# ---------------------------------------------------------------------- state out of reach
def worker_envs(env: Any) -> list[str]:
    """Batched envs in ``env`` (through wrappers) whose sub-envs run in worker processes (``ParallelEnv``)."""
    return _unreachable(env)[0]


def simulator_envs(env: Any) -> list[str]:
    """Envs in ``env`` (through wrappers and ``SerialEnv``) that wrap an external simulator (torchrl's
    ``_EnvWrapper``: ``GymEnv``, ``DMControlEnv``, ``BraxEnv``, ...), whose state lives outside the TensorDict."""
    return _unreachable(env)[1]


def _unreachable(env: Any) -> tuple[list[str], list[str], list[str]]:
    from torchrl.envs import EnvBase, ParallelEnv, TransformedEnv
    from torchrl.envs.batched_envs import BatchedEnvBase
    from torchrl.envs.common import _EnvWrapper

    workers: list[str] = []
    simulators: list[str] = []
    attributes: list[str] = []  # leaf envs' plain attributes (env_attributes.plain_attributes)
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
        if isinstance(obj, EnvBase) and not isinstance(obj, (TransformedEnv, BatchedEnvBase)):
            plain = plain_attributes(obj)
            if plain:
                attributes.append(f"{path} ({type(obj).__name__}: {', '.join(plain[:8])})")
        for attr in ("base_env", "env", "_env"):
            child = obj.__dict__.get(attr) or (getattr(obj, "_modules", None) or {}).get(attr)
            if child is not None:
                stack.append((child, f"{path}.{attr}"))
        for i, child in enumerate(obj.__dict__.get("_envs") or ()):  # SerialEnv's sub-envs
            stack.append((child, f"{path}._envs.{i}"))
    return workers, simulators, attributes


def warn_worker_state(name: str, where: list[str], action: str) -> None:
    """Say what will differ after a restore when env state lives in worker processes."""
    warnings.warn(
        f"component {name!r} ({action}): {', '.join(where)} keeps its sub-envs, their generators and the workers' "
        "RNG streams in worker processes, out of reach of torchrl's API: they are not checkpointed, so after a "
        "restore the next steps equal an uninterrupted run's only until a sub-env resets (then its initial state "
        "differs). Use SerialEnv (exact) or accept the difference; see docs/components/collectors.md",
        InexactResumeWarning,
        stacklevel=3,
    )


def warn_simulator_state(name: str, where: list[str], action: str) -> None:
    """Say what will differ after a restore when env state lives in an external simulator."""
    warnings.warn(
        f"component {name!r} ({action}): {', '.join(where)} wraps an external simulator whose own state (physics, "
        "its random generator) is not checkpointed: after a restore the episodes in flight do not continue as they "
        "would have, and new episodes start from other initial states. The counters, in-flight data and "
        "transforms are restored; see docs/components/collectors.md",
        InexactResumeWarning,
        stacklevel=3,
    )


def warn_unreachable(name: str, env: Any, action: str) -> None:
    """An :class:`~torchrl_dcp.errors.InexactResumeWarning` for each kind of state of ``env`` out of reach."""
    workers, simulators, attributes = _unreachable(env)
    if workers:
        warn_worker_state(name, workers, action)
    if simulators:
        warn_simulator_state(name, simulators, action)
    if attributes:
        warn_plain_attributes(name, attributes, action)


# ---------------------------------------------------------------------- transforms
def transformed_serial_envs(env: Any) -> dict[str, Any]:
    """``{path: SerialEnv}`` of a ``SerialEnv`` under the env's ``TransformedEnv`` (however deep).

    A ``TransformedEnv``'s ``state_dict()`` (and so ``Collector.state_dict()``) holds its own transforms only, never
    what its base env holds, so the transforms inside a ``SerialEnv``'s sub-envs (their ``VecNormV2`` statistics)
    were lost (torchrl 0.14); the adapters save the ``SerialEnv``'s ``state_dict()`` (every sub-env's) themselves. A
    ``ParallelEnv``'s sub-envs live in worker processes (see :func:`warn_worker_state`).

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


def base_env_states(env: Any, covered: bool = True) -> dict[str, dict[str, Any]]:
    """``{path: buffers}`` of the base envs whose own state nothing else saves: the ``state_dict()`` (parameters left
    out) of each env under a ``TransformedEnv`` (whose ``state_dict()`` holds its transforms only), however deep,
    also in a ``SerialEnv``'s sub-envs; with ``covered=False`` also of ``env`` itself (a collector's ``state_dict()``
    holds nothing of a plain env). E.g. torchrl's ``CountingEnv`` counts its steps in a buffer, which a resumed run
    restarted from 0. Parameters (a model-based env's world model) are the model's: register that module as a
    component (docs/components/collectors.md). Restored by :func:`restore_base_envs`.

    Example:
        >>> import torch
        >>> from torchrl.envs import StepCounter, TransformedEnv
        >>> from torchrl.testing.mocking_classes import CountingEnv
        >>> env = TransformedEnv(CountingEnv(), StepCounter())
        >>> _ = env.base_env.count.fill_(3)
        >>> base_env_states(env)["base_env"]["count"].tolist()
        [3]
    """
    found: dict[str, dict[str, Any]] = {}
    seen: set[int] = set()

    def walk(env: Any, path: str, covered: bool) -> None:
        from torchrl.envs import ParallelEnv, SerialEnv, TransformedEnv

        if id(env) in seen or not isinstance(env, torch.nn.Module):
            return
        seen.add(id(env))
        if isinstance(env, TransformedEnv):  # (a batched env forwards unknown attributes such as base_env to workers)
            walk(env.base_env, f"{path}base_env.", False)
        elif isinstance(env, SerialEnv):  # its state_dict() holds each sub-env's (started by env_state_dict first)
            for i, sub in enumerate(vars(env).get("_envs") or ()):
                walk(sub, f"{path}_envs.{i}.", True)
        elif not isinstance(env, ParallelEnv) and not covered:  # (a ParallelEnv's sub-envs: warn_unreachable)
            state = _own_buffers(env)
            if state:
                found[path.rstrip(".")] = state

    walk(env, "", covered)
    return found


def _own_buffers(env: Any) -> dict[str, Any]:
    params = {name for name, _ in env.named_parameters()}
    return {k: v for k, v in env.state_dict().items() if k not in params}


def _base_env_at(env: Any, path: str) -> Any:
    obj = env
    for part in path.split(".") if path else ():
        obj = obj[int(part)] if isinstance(obj, (list, tuple)) else (getattr(obj, part, None) or vars(obj).get(part))
        if obj is None:
            return None
    return obj


def restore_base_envs(env: Any, saved: Mapping[str, Any], name: str) -> None:
    """Put back what :func:`base_env_states` saved (in place, by ``load_state_dict``), after checking that every
    saved base env is there with the same buffers (keys, shapes, dtypes)."""
    checked = []
    for path, state in saved.items():
        base = _base_env_at(env, path)
        live = _own_buffers(base) if isinstance(base, torch.nn.Module) else None
        where = f"the base env at {path or 'the top'}"
        if live is None:
            raise IncompatibleComponentError(
                f"component {name!r}: the checkpoint holds the state of {where}, which this env does not have: "
                "build the env as it was saved"
            )
        if not isinstance(state, Mapping) or set(state) != set(live):
            keys = sorted(set(state) ^ set(live)) if isinstance(state, Mapping) else []
            raise IncompatibleComponentError(
                f"component {name!r}: {where} ({type(base).__name__}) holds other buffers than the checkpoint's "
                f"(keys {keys[:4]} are in one only): build the env as it was saved"
            )
        for key, value in state.items():
            have = live[key]
            if isinstance(have, torch.Tensor) and (
                not isinstance(value, torch.Tensor) or value.shape != have.shape or value.dtype != have.dtype
            ):
                got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise IncompatibleComponentError(
                    f"component {name!r}: {where}'s {key!r} is {got} in the checkpoint, {have.dtype} "
                    f"{tuple(have.shape)} in this env: build the env as it was saved"
                )
        checked.append((base, state))
    for base, state in checked:
        base.load_state_dict(state, strict=False)


def composed_custom_state(env: Any) -> dict[str, Any]:
    """``{path: transform}`` of the transforms inside a ``Compose`` that define their own ``state_dict`` (also in the
    sub-envs of a ``SerialEnv``: ``base_env._envs.0.transform.1``).

    ``Compose.state_dict()`` is ``nn.Module``'s: it gathers its children's parameters and buffers, never their own
    ``state_dict`` overrides, so e.g. ``TrajCounter``'s trajectory count (a shared counter, not a buffer) was lost
    and trajectory ids restarted after a restore (torchrl 0.14). The adapters save those states themselves.

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
    """What the adapters save of an env's transforms: ``state_dict``, custom states, attributes (the transforms
    of ``env`` itself; its base env is saved where it is the component's)."""
    return {
        "state_dict": dict(env.transform.state_dict()),
        "transforms": {
            p: dict(t.state_dict()) for p, t in composed_custom_state(env).items() if p.startswith("transform")
        },
        "transform_attributes": {p: v for p, v in transform_attributes(env).items() if p.startswith("transform")},
    }


def parent_states(env: Any) -> dict[str, Any]:
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


def restore_parents(env: Any, saved: Mapping[str, Any], name: str) -> None:
    """Put the saved parents' transform states back (building each parent as torchrl does); a live parent the save
    had not built yet is dropped, so that it is built again on use from the restored transforms, as it was."""
    live = dict(env_transforms(env))
    unknown = sorted(set(saved) - set(live))
    if unknown:
        raise IncompatibleComponentError(
            f"component {name!r}: the checkpoint holds the parent env of transforms at {unknown[:3]}, which this "
            "env does not have: build the env with the transforms it was saved with"
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
                    "this env does not have: build the env with the transforms it was saved with"
                )
            _load_custom_state(custom[at], transform_state, name, f"transform {at} of the parent env of {path}")
        restore_transform_attributes(parent, state["transform_attributes"], name)


def _load_custom_state(transform: Any, saved: Any, name: str, where: str) -> None:
    """Load a transform's saved custom state (every copy a save holds: the env's, and the cached parent envs', which
    share the counter), a ``TrajCounter``'s count checked first (ids are handed out from 0 up)."""
    if type(transform).__name__ == "TrajCounter" and isinstance(saved, Mapping) and "traj_count" in saved:
        count = saved["traj_count"]
        if not (type(count) is int and count >= 0):
            raise CheckpointIntegrityError(
                f"component {name!r}: {where} (TrajCounter) holds count {count!r}, not a count: damaged or forged"
            )
    transform.load_state_dict(saved)


def serial_buffers(env: Any) -> dict[str, dict[tuple[str, ...], torch.Tensor]]:
    """``{path: {key: tensor}}`` of each ``SerialEnv``'s shared buffers (``shared_tensordict_parent``: the last
    step's and reset's entries of every sub-env), however deep under ``TransformedEnv`` wrappers and sub-envs.

    When some sub-envs reset and others go on (episodes ending at different steps), the ones going on are given
    their entries from these buffers: a fresh env holds its own first reset there, so what the transforms outside
    it saw (a ``VecNormV2``'s statistics) differed after a load. Restored by :func:`restore_serial_buffers`.

    Example:
        >>> from torchrl.envs import PendulumEnv, SerialEnv
        >>> env = SerialEnv(2, PendulumEnv)
        >>> _ = env.reset()
        >>> ("next", "th") in serial_buffers(env)[""]
        True
    """
    from torchrl.envs import SerialEnv, TransformedEnv

    found: dict[str, dict[tuple[str, ...], torch.Tensor]] = {}

    def walk(env: Any, path: str, depth: int) -> None:
        if depth > 64:
            return
        if isinstance(env, TransformedEnv):
            walk(env.base_env, f"{path}base_env.", depth + 1)
        elif isinstance(env, SerialEnv):
            parent = vars(env).get("shared_tensordict_parent")
            if parent is not None:
                found[path.rstrip(".")] = {
                    key if isinstance(key, tuple) else (key,): value
                    for key in parent.keys(True, True)
                    if isinstance(value := parent.get(key), torch.Tensor)
                }
            for i, sub in enumerate(vars(env).get("_envs") or ()):
                walk(sub, f"{path}_envs.{i}.", depth + 1)

    walk(env, "", 0)
    return found


def restore_serial_buffers(env: Any, saved: Mapping[str, Any], name: str) -> None:
    """Write what :func:`serial_buffers` saved into each ``SerialEnv``'s shared buffers (in place), after checking
    that every one is there with the same entries (keys, shapes, dtypes)."""
    from torchrl.envs import SerialEnv

    checked = []
    for path, buffers in saved.items():
        serial = _base_env_at(env, path)
        where = f"the SerialEnv at {path or 'the top'}"
        if not isinstance(serial, SerialEnv):
            raise IncompatibleComponentError(
                f"component {name!r}: the checkpoint holds the shared buffers of {where}, which this env does not "
                "have: build the env as it was saved"
            )
        if serial.is_closed and getattr(serial, "_owns_workers", True):
            serial.start()  # (its buffers exist once started)
        live = serial_buffers(serial).get("", {})
        if not isinstance(buffers, Mapping) or set(buffers) != set(live):
            keys = sorted(map(str, set(buffers) ^ set(live))) if isinstance(buffers, Mapping) else []
            raise IncompatibleComponentError(
                f"component {name!r}: {where} holds other entries than the checkpoint's (keys {keys[:4]} are in "
                "one only): build the env as it was saved (the same sub-envs and specs)"
            )
        for key, value in buffers.items():
            have = live[key]
            if not isinstance(value, torch.Tensor) or value.shape != have.shape or value.dtype != have.dtype:
                got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise IncompatibleComponentError(
                    f"component {name!r}: {where}'s entry {key} is {got} in the checkpoint, {have.dtype} "
                    f"{tuple(have.shape)} in this env: build the env as it was saved"
                )
        checked.append((vars(serial)["shared_tensordict_parent"], buffers))
    for parent, buffers in checked:
        for key, value in buffers.items():
            parent.set_(key, value)


# ---------------------------------------------------------------------- what state_dict() leaves out
def env_extras(env: Any, covered: bool = True) -> dict[str, Any]:
    """What an exact continuation of ``env`` needs beside its ``state_dict()``: ``env_rngs``, ``transforms``,
    ``sub_envs``, and ``transform_attributes`` / ``parents`` / ``base_envs`` / ``serial_buffers`` where there are any
    (:func:`restore_env_extras`). ``covered=False``: what is saved beside it holds nothing of ``env``'s own buffers
    (a collector's ``state_dict()`` of a plain env): :func:`base_env_states` saves them."""
    return {
        "env_rngs": {path: generator_state(g) for path, g in env_generators(env).items()},
        "transforms": {path: dict(t.state_dict()) for path, t in composed_custom_state(env).items()},
        "sub_envs": {path: dict(e.state_dict()) for path, e in transformed_serial_envs(env).items()},
        **({"transform_attributes": attrs} if (attrs := transform_attributes(env)) else {}),
        **({"parents": parents} if (parents := parent_states(env)) else {}),
        **({"base_envs": bases} if (bases := base_env_states(env, covered)) else {}),
        **({"serial_buffers": buffers} if (buffers := serial_buffers(env)) else {}),
    }


def restore_env_extras(env: Any, state: Mapping[str, Any], name: str) -> None:
    """Put back what :func:`env_extras` saved, the generators excepted (:func:`restore_env_generators`), after the
    env's ``load_state_dict``: sub-envs, custom transform states, transform attributes, then the cached parents
    (which clone the transforms). Keys absent (from checkpoints saved before they were) are skipped."""
    for path, saved in (state.get("sub_envs") or {}).items():
        serial = transformed_serial_envs(env).get(path)
        if serial is None:
            raise IncompatibleComponentError(
                f"component {name!r}: the checkpoint holds the sub-envs' state of a SerialEnv at {path}, which "
                "this env does not have: build the env as it was saved"
            )
        serial.load_state_dict(saved)
    live = composed_custom_state(env)
    for path, saved in (state.get("transforms") or {}).items():
        if path not in live:
            raise IncompatibleComponentError(
                f"component {name!r}: the checkpoint holds the state of transform {path}, which this env does not "
                "have at that place: build the env with the transforms it was saved with"
            )
        _load_custom_state(live[path], saved, name, f"transform {path}")
    restore_base_envs(env, state.get("base_envs") or {}, name)
    restore_transform_attributes(env, state.get("transform_attributes") or {}, name)
    restore_parents(env, state.get("parents") or {}, name)  # (after the transforms they clone)
    restore_serial_buffers(env, state.get("serial_buffers") or {}, name)


# ---------------------------------------------------------------------- the adapter
class EnvAdapter(Adapter):
    """A torchrl ``EnvBase`` (``TransformedEnv``, ``SerialEnv``, ``ParallelEnv``, ...) registered on its own.

    Saved as the collector adapter saves its env: ``env.state_dict()`` (transform buffers, a batched env's sub-envs')
    plus :func:`env_extras`. Per rank by default (each rank steps its own env, seeded apart). What the env holds out
    of reach (``ParallelEnv`` workers, simulators) and transforms not verified exact are warned about
    (:class:`~torchrl_dcp.errors.InexactResumeWarning`) at save and at load. The in-flight TensorDict (what
    ``rollout``/``step`` take and return) is the caller's: register it too to resume mid-episode.

    Example:
        >>> from torchrl.envs import PendulumEnv
        >>> sorted(EnvAdapter().state(PendulumEnv(), AdapterContext("env")))
        ['env_rngs', 'state_dict', 'sub_envs', 'transforms']
    """

    adapter_id = "torchrl_dcp.env"
    version = 1
    default_placement = "per_rank"

    def state(self, env: Any, ctx: AdapterContext) -> Any:
        warn_unreachable(ctx.name, env, "saving")
        warn_unverified_transforms(ctx.name, env, "saving")
        try:
            return self._state(env, ctx.name)
        except EncodingError as err:
            try:  # (the uninitialised tensors the state holds, if those made it fail)
                lazy = [slot.where for slot, _ in lazy_places(env, ctx.name, env_state)]
            except CheckpointError:
                lazy = []
            if not lazy:
                raise err
            raise EncodingError(
                f"component {ctx.name!r}: the env holds tensors not initialised yet ({', '.join(lazy[:4])}: e.g. "
                "ObservationNorm's loc/scale before init_stats, CatFrames' buffers before its first step), so its "
                "state cannot be taken: initialise them before saving (init_stats, or a reset and a step). Loading "
                "into such an env works: the load gives them the saved shapes"
            ) from err

    def check_saved(self, saved: Any) -> None:
        """The transform attributes the adapter saves, as every save writes them
        (:func:`~torchrl_dcp.adapters.env_transforms.check_transform_attributes`)."""
        if not isinstance(saved, Mapping):
            raise ValueError(f"its state is a {type(saved).__name__}, not a mapping")
        check_transform_attributes(saved.get("transform_attributes") or {})

    def validate(self, env: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """Every uninitialised tensor of the env (an ``ObservationNorm`` before ``init_stats``) has one saved tensor
        to take its shape from (:func:`materialize_lazy`), refused otherwise before anything changes."""
        for state in saved.values():
            if isinstance(state, Mapping):
                lazy_plan(env, state, ctx.name, env_state)

    def snapshot(self, env: Any, ctx: AdapterContext) -> Any:
        """What a failed load rolls back to (no warning: not a save): the state, taken with the uninitialised tensors
        the state holds set aside, and those tensors (a load materialises them: a rollback makes them uninitialised
        again)."""
        lazy = [slot for slot, _ in lazy_places(env, ctx.name, env_state)]
        with set_aside(lazy):
            state = copy.deepcopy(self._state(env, ctx.name))
        return {"state": state, "lazy": lazy}

    def rollback(self, env: Any, snapshot: Any, ctx: AdapterContext) -> None:
        for slot in snapshot["lazy"]:
            slot.unmaterialize()
        with set_aside(snapshot["lazy"]):  # (the snapshot holds no value for them)
            self._restore(env, snapshot["state"], ctx.name)

    def restore(self, env: Any, state: Any, ctx: AdapterContext) -> Any:
        warn_unreachable(ctx.name, env, "loading")
        warn_unverified_transforms(ctx.name, env, "loading")
        self._restore(env, state, ctx.name)
        return None

    @staticmethod
    def _state(env: Any, name: str) -> dict[str, Any]:
        return env_state(env, name)

    @staticmethod
    def _restore(env: Any, state: Any, name: str) -> None:
        materialize_lazy(env, state, name, env_state)  # (first: torch's load_state_dict skips uninitialised tensors)
        load_env_state_dict(env, state["state_dict"], name)
        restore_env_extras(env, state, name)
        restore_env_generators(env, state["env_rngs"], name)

    def load_torchrl_state_dict(self, env: Any, state_dict: Any, ctx: AdapterContext) -> list[str]:
        """``state_dict()`` as this adapter loads it; the env's generators and what its transforms keep outside
        ``state_dict()`` are not in torchrl's checkpoint."""
        load_env_state_dict(env, state_dict, ctx.name)
        return [
            "the env's generators",
            "transform state outside state_dict() (Python attributes, Compose'd and sub-envs' transforms)",
        ]

    can_reshard = True

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return same_rank_source(ctx)

    def reshard(self, env: Any, states: dict[int, Any], ctx: AdapterContext) -> Any:
        """After a world-size change: the ``state_dict()`` and the transform states (statistics, counters: sub-envs',
        ``Compose``'d transforms', cached parents') of saved rank ``rank % saved_world_size``, as a collector's env;
        the generators and the in-flight episode's transform attributes are not taken over, so the env goes on with
        its own seed."""
        (state,) = states.values()
        materialize_lazy(env, state, ctx.name, env_state)
        load_env_state_dict(env, state["state_dict"], ctx.name)
        attributes = resharded_attributes(state.get("transform_attributes") or {})  # (settings: a frozen VecNorm)
        restore_env_extras(env, {**state, "transform_attributes": attributes, "serial_buffers": {}}, ctx.name)
        return None


def env_state(env: Any, name: str) -> dict[str, Any]:
    """What :class:`EnvAdapter` saves of ``env``: ``state_dict`` (:func:`env_state_dict`) and :func:`env_extras`."""
    # state_dict first: it starts a batched env's sub-envs, whose generators and transforms the extras hold
    return {"state_dict": env_state_dict(env, name), **env_extras(env)}


def env_state_dict(env: Any, name: str) -> dict[str, Any]:
    """``env.state_dict()`` (no arguments: a batched env's takes none), or an error naming the component."""
    try:
        return dict(env.state_dict())
    except CheckpointError:
        raise
    except Exception as err:
        raise EncodingError(
            f"component {name!r}: {type(env).__name__}.state_dict() failed ({type(err).__name__}: {err}), so the "
            "env cannot be saved: register the parts whose state matters (its transforms, a generator) as "
            "components of their own, or pass adapter= an Adapter for this env kind"
        ) from err


def load_env_state_dict(env: Any, state_dict: Mapping[str, Any], name: str) -> None:
    """``env.load_state_dict(state_dict)``, or an :class:`IncompatibleComponentError` naming the component."""
    try:
        with statistics_taken_whole(env):
            env.load_state_dict(state_dict)
    except CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError, TypeError) as err:
        raise IncompatibleComponentError(
            f"component {name!r}: the saved state does not fit this {type(env).__name__} ({type(err).__name__}: "
            f"{err}): build the env as it was saved (the same transforms, the same number of sub-envs)"
        ) from err

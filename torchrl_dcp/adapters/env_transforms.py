"""Which env transforms a collector restores exactly, what else they hold, and the warning for the others.

Every transform of a collector's env is found (nested ``TransformedEnv`` and ``Compose``, and the sub-envs of a
``SerialEnv``: :func:`env_transforms`). Three tables, checked by ``tests/test_conformance_transforms.py`` (each
entry there is generated from ``torchrl.envs.transforms`` and audited with :mod:`torchrl_dcp.audit`):

- :data:`EXACT_TRANSFORMS`: torchrl transforms whose state the collector adapter restores exactly (their
  ``state_dict``, with what :data:`TRANSFORM_ATTRIBUTES` adds);
- :data:`INEXACT_TRANSFORMS`: transforms that cannot continue exactly, and why;
- :data:`TRANSFORM_ATTRIBUTES`: attributes a transform keeps outside its ``state_dict``, saved by the collector
  adapter (``RandomTruncationTransform``'s per-env horizons, drawn at reset; a ``VecNorm``'s ``frozen`` flag).

A collector whose env holds a transform of another class (one not verified here, a user's own, a subclass) gets an
:class:`~torchrl_dcp.errors.InexactResumeWarning` at save and at load naming it; declare a class of your own exact
with :func:`register_exact_transform` once you have checked it.

Example:
    >>> from torchrl.envs import Compose, PendulumEnv, StepCounter, Timer, TransformedEnv
    >>> env = TransformedEnv(PendulumEnv(), Compose(StepCounter(), Timer()))
    >>> unverified_transforms(env)
    ['transform.1 (Timer: measures wall-clock time, which no restore can continue)']
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from torchrl_dcp.errors import CheckpointIntegrityError, IncompatibleComponentError, InexactResumeWarning

__all__ = [
    "EXACT_TRANSFORMS",
    "INEXACT_TRANSFORMS",
    "STATELESS_TRANSFORMS",
    "TRANSFORM_ATTRIBUTES",
    "check_transform_attributes",
    "env_transforms",
    "register_exact_transform",
    "resharded_attributes",
    "restore_transform_attributes",
    "transform_attributes",
    "statistics_taken_whole",
    "unverified_transforms",
    "warn_unverified_transforms",
]

#: torchrl transforms a collector resumes exactly (by class name, classes of ``torchrl.envs.transforms`` only)
EXACT_TRANSFORMS: frozenset[str] = frozenset(
    {
        "ActionDiscretizer", "ActionScaling", "BinarizeReward", "CatFrames", "CatTensors", "ClipTransform",
        "Compose", "ConditionalSkip", "DTypeCastTransform", "DeviceCastTransform", "DoubleToFloat",
        "ExcludeTransform", "ExpandAs", "FiniteTensorDictCheck", "FlattenObservation", "FrameSkipTransform", "InitTracker",
        "LineariseRewards", "NoopResetEnv", "ObservationNorm", "PermuteTransform", "RandomTruncationTransform",
        "RemoveEmptySpecs", "RenameTransform", "RewardClipping", "RewardScaling", "RewardSum", "SelectTransform",
        "SignTransform", "SqueezeTransform", "StepCounter", "TargetReturn", "TensorDictPrimer",
        "TerminateTransform", "TimeMaxPool", "TrajCounter", "UnaryTransform", "UnsqueezeTransform", "VecNorm",
        "VecNormV2", "gSDENoise",
    }
)  # fmt: skip

#: torchrl transforms that hold no state at all (a function of their input): a replay buffer's transforms other than
#: these (and MultiStepTransform, saved with the buffer) are warned about
STATELESS_TRANSFORMS: frozenset[str] = frozenset(
    {
        "ActionScaling", "BinarizeReward", "CatTensors", "ClipTransform", "DTypeCastTransform", "DeviceCastTransform",
        "DoubleToFloat", "ExcludeTransform", "ExpandAs", "FiniteTensorDictCheck", "FlattenObservation",
        "PermuteTransform", "RenameTransform", "RewardClipping", "RewardScaling", "SelectTransform", "SignTransform",
        "SqueezeTransform", "UnaryTransform", "UnsqueezeTransform",
    }
)  # fmt: skip

#: torchrl transforms that cannot continue exactly after a restore, and why
INEXACT_TRANSFORMS: dict[str, str] = {
    "Timer": "measures wall-clock time, which no restore can continue",
}

#: Attributes transforms keep outside their ``state_dict``, by class name: saved and restored by the collector
#: adapter. ``RandomTruncationTransform`` draws each env's horizon at reset (``_horizons``, ``_first_episode``); a
#: ``VecNorm``'s ``freeze()`` keeps its statistics fixed (``frozen``).
TRANSFORM_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "RandomTruncationTransform": ("_horizons", "_first_episode", "_initialized"),
    "VecNorm": ("frozen",),
    "VecNormV2": ("frozen",),
}
#: attributes of :data:`TRANSFORM_ATTRIBUTES` that are flags (a bool, nothing else)
_FLAGS = frozenset({"_initialized", "frozen"})
#: attributes of :data:`TRANSFORM_ATTRIBUTES` a world-size change carries over: the transform's settings (a
#: ``VecNorm`` frozen after its warm-up, as its statistics are), not the saved rank's in-flight episode (a
#: ``RandomTruncationTransform``'s horizons: the episode starts afresh)
_RESHARDED = frozenset({"frozen"})


def resharded_attributes(saved: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What a world-size change restores of saved :func:`transform_attributes`: the settings among them.

    Example:
        >>> resharded_attributes({"transform.1": {"frozen": True}, "transform.2": {"_horizons": None}})
        {'transform.1': {'frozen': True}}
    """
    out: dict[str, dict[str, Any]] = {}
    for path, values in saved.items():
        kept = {k: v for k, v in values.items() if k in _RESHARDED} if isinstance(values, Mapping) else {}
        if kept:
            out[path] = kept
    return out


_USER_EXACT: set[type] = set()


def register_exact_transform(transform_type: type) -> None:
    """Declare ``transform_type`` (a transform class of your own) exact: its state is in its ``state_dict``.

    Collectors holding it are then saved without an :class:`~torchrl_dcp.errors.InexactResumeWarning`. Check it
    first, e.g. with :func:`torchrl_dcp.state_snapshot` of the collector at a save and after a restore.

    Example:
        >>> from torchrl.envs import Transform
        >>> class Stateless(Transform):
        ...     pass
        >>> register_exact_transform(Stateless)
    """
    if not isinstance(transform_type, type):
        raise TypeError(f"register_exact_transform takes a class, got {transform_type!r}")
    _USER_EXACT.add(transform_type)


def env_transforms(env: Any) -> Iterator[tuple[str, Any]]:
    """``(path, transform)`` of every transform of ``env``: nested ``TransformedEnv`` and ``Compose``, and the
    sub-envs of a ``SerialEnv`` (a ``ParallelEnv``'s live in worker processes, out of reach).

    Paths are those of :func:`~torchrl_dcp.adapters.env.composed_custom_state` (``transform.1``,
    ``base_env.transform``, ``base_env._envs.0.transform``).
    """
    from torchrl.envs import SerialEnv, TransformedEnv

    stack: list[tuple[Any, str]] = [(env, "")]
    seen: set[int] = set()
    while stack:
        obj, path = stack.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, TransformedEnv):
            stack.append((obj.transform, f"{path}transform"))
            stack.append((obj.base_env, f"{path}base_env."))
        elif isinstance(obj, SerialEnv):
            stack.extend((e, f"{path}_envs.{i}.") for i, e in enumerate(obj.__dict__.get("_envs") or ()))
        elif _is_transform(obj):
            yield path, obj
            if type(obj).__name__ == "Compose":
                stack.extend((t, f"{path}.{i}") for i, t in enumerate(obj.transforms))


def _is_transform(obj: Any) -> bool:
    from torchrl.envs.transforms import Transform

    return isinstance(obj, Transform)


def _verdict(transform: Any) -> str | None:
    """``None`` when ``transform`` is exact, otherwise why it is not known to be."""
    klass = type(transform)
    if klass in _USER_EXACT:
        return None
    name, module = klass.__name__, klass.__module__ or ""
    if module.startswith("torchrl."):
        if name in INEXACT_TRANSFORMS:
            return INEXACT_TRANSFORMS[name]
        if name in EXACT_TRANSFORMS:
            return None
        return "a torchrl transform not verified exact by torchrl_dcp"
    return "not verified exact: declare it with tdcp.adapters.register_exact_transform once checked"


def unverified_transforms(env: Any) -> list[str]:
    """``"path (Class: why)"`` of each transform of ``env`` not known to resume exactly."""
    out = []
    for path, transform in env_transforms(env):
        why = _verdict(transform)
        if why is not None:
            out.append(f"{path} ({type(transform).__name__}: {why})")
    return out


def warn_unverified_transforms(name: str, env: Any, action: str) -> None:
    """An :class:`~torchrl_dcp.errors.InexactResumeWarning` naming every transform :func:`unverified_transforms`
    lists (none: no warning)."""
    found = unverified_transforms(env)
    if found:
        warnings.warn(
            f"component {name!r} ({action}): the env's transform(s) {'; '.join(found)} may hold state the "
            "checkpoint does not restore, so the batches after a restore may differ from an uninterrupted run's; "
            "see docs/components/conformance.md",
            InexactResumeWarning,
            stacklevel=3,
        )


def transform_attributes(env: Any) -> dict[str, dict[str, Any]]:
    """``{path: {attribute: value}}`` of what :data:`TRANSFORM_ATTRIBUTES` lists for the transforms of ``env``."""
    out: dict[str, dict[str, Any]] = {}
    for path, transform in env_transforms(env):
        attrs = TRANSFORM_ATTRIBUTES.get(type(transform).__name__, ())
        if attrs:
            out[path] = {a: getattr(transform, a, None) for a in attrs}
    return out


def check_transform_attributes(saved: Any) -> None:
    """What :func:`transform_attributes` writes, checked on a saved state (tensors as
    :class:`~torchrl_dcp.format.codec.TensorSpec`): a ``RandomTruncationTransform`` is either not initialised
    (``_initialized`` False, no horizons) or holds int64 horizons and a bool first-episode mask of one shape.
    Raises ``ValueError``."""
    from torchrl_dcp.format.codec import TensorSpec

    if not isinstance(saved, Mapping):
        raise ValueError("its transform attributes are not a mapping")
    for path, values in saved.items():
        flags = {k: v for k, v in values.items() if k in _FLAGS} if isinstance(values, Mapping) else {}
        if any(type(v) is not bool for v in flags.values()):
            raise ValueError(f"its transform at {path} holds flags {flags!r}, not bools")
        if not isinstance(values, Mapping) or set(values) != {"_horizons", "_first_episode", "_initialized"}:
            continue  # (another transform's, or one the restore refuses naming it)
        horizons, first, initialized = values["_horizons"], values["_first_episode"], values["_initialized"]
        if initialized is False and horizons is None and first is None:
            continue
        shapes = [v.shape if isinstance(v, TensorSpec) else None for v in (horizons, first)]
        dtypes = [v.dtype if isinstance(v, TensorSpec) else None for v in (horizons, first)]
        if (
            initialized is not True
            or shapes[0] is None
            or shapes[0] != shapes[1]
            or dtypes != [torch.int64, torch.bool]
        ):
            raise ValueError(
                f"its transform at {path} (RandomTruncationTransform) holds _initialized {initialized!r}, horizons "
                f"{_described(horizons)} and first-episode flags {_described(first)}"
            )


def _described(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"{value.dtype} {list(shape)}" if shape is not None and hasattr(value, "dtype") else repr(value)


def restore_transform_attributes(env: Any, saved: Mapping[str, Mapping[str, Any]], name: str) -> None:
    """Put back what :func:`transform_attributes` saved (tensors copied, so the checkpoint's are not shared), after
    checking every value against the live transform's (a tensor attribute keeps its shape: the env's batch; a
    horizon lies in ``1..max_horizon``)."""
    live = dict(env_transforms(env))
    changes = []
    for path, values in saved.items():
        transform = live.get(path)
        allowed = TRANSFORM_ATTRIBUTES.get(type(transform).__name__, ()) if transform is not None else ()
        if not allowed:
            raise IncompatibleComponentError(
                f"component {name!r}: the checkpoint holds the state of a transform at {path}, which this "
                "collector's env does not have: build the env with the transforms it was saved with"
            )
        for attr, value in values.items():
            if attr in allowed:
                _check_attribute(transform, attr, value, f"component {name!r}: transform {path}'s {attr}")
                changes.append((transform, attr, value))
    for transform, attr, value in changes:
        _set_attribute(transform, attr, value)


def _check_attribute(transform: Any, attr: str, value: Any, where: str) -> None:
    """A saved tensor attribute has the live one's shape and dtype (when the live transform holds one), and
    horizons lie in ``1..max_horizon``; a flag is a bool."""
    live = transform.__dict__.get(attr)
    if isinstance(live, torch.Tensor) and isinstance(value, torch.Tensor):
        if (live.shape, live.dtype) != (value.shape, value.dtype):
            raise IncompatibleComponentError(
                f"{where} is {value.dtype} {list(value.shape)} in the checkpoint, {live.dtype} {list(live.shape)} "
                "in this env: build the env (its number of envs) as it was saved"
            )
    elif isinstance(live, torch.Tensor) != isinstance(value, torch.Tensor) and live is not None and value is not None:
        raise IncompatibleComponentError(f"{where} is a {type(value).__name__} in the checkpoint, a tensor here")
    if attr == "_horizons" and isinstance(value, torch.Tensor) and value.numel():
        top = getattr(transform, "max_horizon", None)
        if int(value.min()) < 1 or (isinstance(top, int) and int(value.max()) > top):
            raise CheckpointIntegrityError(
                f"{where} holds {int(value.min())}..{int(value.max())}, outside 1..{top}: damaged or forged"
            )
    if attr in _FLAGS and type(value) is not bool:
        raise CheckpointIntegrityError(f"{where} is {value!r}, not a bool: damaged or forged")


def _set_attribute(transform: Any, attr: str, value: Any) -> None:
    """A tensor attribute of the live transform's shape, dtype and device is overwritten in place: torchrl's cached
    parent envs (``FrameSkipTransform`` steps through a copy of the transforms before it) share that tensor, and a
    new one would leave their copy at the old values. Otherwise the attribute is replaced (tensors copied, so the
    checkpoint's are not shared)."""
    live = transform.__dict__.get(attr)
    if (
        isinstance(value, torch.Tensor)
        and isinstance(live, torch.Tensor)
        and (live.shape, live.dtype, live.device) == (value.shape, value.dtype, value.device)
    ):
        live.copy_(value)
    else:
        setattr(transform, attr, value.clone() if isinstance(value, torch.Tensor) else value)


@contextmanager
def statistics_taken_whole(env: Any) -> Iterator[None]:
    """While the block runs, every ``VecNorm`` of ``env`` (sub-envs of a ``SerialEnv`` included, started first as its
    ``load_state_dict`` starts them, their specs computed as their first use does: ``ActionDiscretizer`` registers
    its buffers then) takes the statistics a load gives it with their very keys.

    ``VecNorm`` builds its statistics lazily (those of ``reward`` at the first step, after the observation's at
    reset), and its ``set_extra_state`` fills only the keys it holds already: a fresh env, reset but not stepped,
    silently dropped the saved reward statistics. Here the keys the saved statistics hold and the live ones lack are
    added (then filled), and those they lack are removed (the env builds them again when it steps, as the saved one
    would have), in the live table itself (in shared memory where it is shared).
    """
    from torchrl.envs import SerialEnv, TransformedEnv
    from torchrl.envs.transforms import VecNorm

    def start(obj: Any) -> None:
        if isinstance(obj, SerialEnv) and obj.is_closed and getattr(obj, "_owns_workers", True):
            obj.start()
        for child in (obj.__dict__.get("_envs") or ()) if isinstance(obj, SerialEnv) else ():
            start(child)
        if isinstance(obj, TransformedEnv):
            try:  # its transforms' specs, as its first use computes them: some register buffers then
                obj.input_spec  # noqa: B018  (ActionDiscretizer's intervals)
            except Exception:  # (the load says what does not fit)
                pass
            start(obj.base_env)

    start(env)
    patched = [t for _, t in env_transforms(env) if isinstance(t, VecNorm)]
    for transform in patched:
        transform.set_extra_state = _whole_setter(transform)
    try:
        yield
    finally:
        for transform in patched:
            transform.__dict__.pop("set_extra_state", None)


def _whole_setter(transform: Any) -> Any:
    own = type(transform).set_extra_state

    def set_extra_state(state: Any) -> None:
        from tensordict import TensorDict

        live = transform._td
        if state is not None:
            _check_statistics_keys(transform, state)
        if state is not None and live is not None:
            saved = TensorDict(state).unflatten_keys(transform.SEP)
            keys = set(saved.keys(True, True))
            held = set(live.keys(True, True))
            for key in held - keys:
                live.del_(key)
            for key in keys - held:
                value = saved.get(key).clone()
                live.set(key, value.share_memory_() if live.is_shared() else value)
        own(transform, state)

    return set_extra_state


_STATISTICS = ("_sum", "_ssq", "_count")


def _check_statistics_keys(transform: Any, state: Mapping[str, Any]) -> None:
    """Refuse statistics a ``VecNorm`` does not keep: each of its ``in_keys`` has a sum, a sum of squares and a
    count (``<key>_sum``, ...). A load into a ``VecNorm`` of other ``in_keys`` took the saved ones as they were,
    and the next step failed inside torchrl ("Cannot modify locked TensorDict")."""
    allowed = set()
    for key in transform.in_keys:
        path = key if isinstance(key, tuple) else (key,)
        allowed.update(transform.SEP.join((*path[:-1], path[-1] + suffix)) for suffix in _STATISTICS)
    foreign = sorted(k for k in state if k not in allowed)
    if foreign:
        kept = sorted({k.rsplit("_", 1)[0] for k in state if isinstance(k, str)})
        raise IncompatibleComponentError(
            f"a VecNorm normalizing {list(transform.in_keys)} is given statistics of {kept} ({foreign[:4]}): the "
            "checkpoint's env normalized other keys; build the env (its VecNorm's in_keys) as it was saved"
        )

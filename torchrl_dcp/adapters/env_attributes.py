"""Env state kept in plain attributes, which no ``state_dict`` holds, and the warning that says so.

An env's state is saved from its buffers, generators and transforms (:mod:`torchrl_dcp.adapters.env`). A leaf env
(not a ``TransformedEnv``, batched env or simulator wrapper) that keeps numbers, arrays, tensors or containers as
plain attributes (``self.episode += 1`` in ``_step``, as torchrl's ``ContinuousActionVecMockEnv`` counts) loads
with what the freshly built env holds there: :func:`plain_attributes` finds them (the attributes every ``EnvBase``
has left out), and a collector or env holding one gets an :class:`~torchrl_dcp.errors.InexactResumeWarning` at save
and at load naming them. Classes whose plain attributes are configuration only (set when built, never changed) are
exact: torchrl's own in :data:`EXACT_ENVS`, a user's declared with :func:`register_exact_env`.

Example:
    >>> from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv, CountingEnv
    >>> plain_attributes(ContinuousActionVecMockEnv()), plain_attributes(CountingEnv())
    (['counter', 'seed'], [])
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np
import torch

from torchrl_dcp.errors import InexactResumeWarning

__all__ = ["EXACT_ENVS", "plain_attributes", "register_exact_env", "warn_plain_attributes"]

#: torchrl envs whose plain attributes are configuration only (their state is in buffers, ``CountingEnv.count``, or
#: in the tensordict, ``TicTacToeEnv``'s board): checked by ``tests/test_env_attributes.py``
EXACT_ENVS: frozenset[str] = frozenset({"CountingEnv", "TicTacToeEnv"})

#: attributes torchrl itself sets on envs it drives (a collector's in-place flag, an autoreset mode): configuration
_SET_BY_TORCHRL: frozenset[str] = frozenset({"_inplace_update", "_torchrl_native_autoreset"})

_USER_EXACT: set[type] = set()
_PLAIN = (bool, int, float, complex, np.ndarray, np.generic, torch.Tensor, list, dict, set, tuple)


def register_exact_env(env_type: type) -> None:
    """Declare ``env_type`` (an env class of your own) exact: its plain attributes are configuration, set when it
    is built and never changed, and its state is in its buffers, generators and transforms.

    Collectors and envs holding one are then saved without an :class:`~torchrl_dcp.errors.InexactResumeWarning`.
    Check it first, e.g. with :func:`torchrl_dcp.state_snapshot` of the env at a save and after a restore.

    Example:
        >>> from torchrl.envs import EnvBase
        >>> class Configured(EnvBase):
        ...     pass
        >>> register_exact_env(Configured)
    """
    if not isinstance(env_type, type):
        raise TypeError(f"register_exact_env takes a class, got {env_type!r}")
    _USER_EXACT.add(env_type)


def plain_attributes(env: Any) -> list[str]:
    """The attributes of the leaf env ``env`` holding plain values (numbers, arrays, tensors, containers) that no
    ``EnvBase`` has, sorted; ``[]`` for a class declared exact (:data:`EXACT_ENVS`, :func:`register_exact_env`)."""
    cls = type(env)
    if any(issubclass(cls, t) for t in _USER_EXACT) or _exact_torchrl_env(cls):
        return []
    common = _env_base_attributes() | _exact_ancestor_attributes(cls)
    return sorted(k for k, v in vars(env).items() if k not in common and isinstance(v, _PLAIN))


def _exact_torchrl_env(cls: type) -> bool:
    return cls.__name__ in EXACT_ENVS and cls.__module__.startswith("torchrl.")


@functools.cache
def _exact_ancestor_attributes(cls: type) -> frozenset[str]:
    """What the nearest exact torchrl env ``cls`` derives from holds (its configuration: a subclass of ``CountingEnv``
    is told only of the attributes it adds), from one built with its defaults; none when it has no such ancestor."""
    for base in cls.__mro__[1:]:
        if _exact_torchrl_env(base):
            try:
                return frozenset(vars(base()))
            except Exception:  # noqa: BLE001 - not buildable without arguments: its subclasses are told of everything
                return frozenset()
    return frozenset()


@functools.cache
def _env_base_attributes() -> frozenset[str]:
    """What every ``EnvBase`` holds (its own bookkeeping and ``nn.Module``'s), from a bare one."""
    from torchrl.envs import EnvBase

    class _Bare(EnvBase):
        def _step(self, tensordict: Any) -> Any:
            return tensordict

        def _reset(self, tensordict: Any = None, **kwargs: Any) -> Any:
            return tensordict

        def _set_seed(self, seed: int | None) -> None:
            return None

    return frozenset(vars(_Bare())) | _SET_BY_TORCHRL


def warn_plain_attributes(name: str, where: list[str], action: str) -> None:
    """Say what a restore leaves as the fresh env holds it: ``where`` lists ``path (Class: attributes)``."""
    warnings.warn(
        f"component {name!r} ({action}): {', '.join(where)} keeps them as plain attributes, which no state_dict "
        "holds: after a restore they are what the freshly built env holds, not what the saved one held. Keep what "
        "changes in buffers (self.register_buffer) or in the tensordict; if they are configuration only, declare "
        "the class exact with tdcp.adapters.register_exact_env(cls); see docs/components/collectors.md",
        InexactResumeWarning,
        stacklevel=3,
    )

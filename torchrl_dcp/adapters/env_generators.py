"""The generators an env draws from: every ``torch.Generator``, NumPy generator (new and legacy) and
``random.Random`` reachable from it (through wrappers, transforms and a ``SerialEnv``'s sub-envs), their states as
codec-safe values, and putting them back.

Example:
    >>> from torchrl.envs import PendulumEnv
    >>> env = PendulumEnv()
    >>> saved = {path: generator_state(g) for path, g in env_generators(env).items()}
    >>> list(saved), saved["rng"]["kind"]
    (['rng'], 'torch')
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torchrl_dcp.errors import IncompatibleComponentError, InexactResumeWarning

__all__ = ["env_generators", "generator_state", "restore_env_generators", "set_generator_state"]


def env_generators(env: Any) -> dict[str, Any]:
    """Every ``torch.Generator``, NumPy generator and ``random.Random`` reachable from an env (through wrappers and
    transforms).

    Example:
        >>> from torchrl.envs import PendulumEnv
        >>> list(env_generators(PendulumEnv()))
        ['rng']
    """
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def walk(obj: Any, path: str, depth: int) -> None:  # (no depth bound: envs nest as deep as users wrap them)
        if id(obj) in seen:
            return
        seen.add(id(obj))
        attrs = dict(getattr(obj, "__dict__", {}))
        attrs.update(getattr(obj, "_modules", None) or {})
        for name, value in attrs.items():
            if isinstance(value, (torch.Generator, np.random.Generator, np.random.RandomState)) or (
                isinstance(value, random.Random) and not isinstance(value, random.SystemRandom)  # (no state)
            ):
                found[f"{path}{name}"] = value
            elif isinstance(value, torch.nn.Module) and name != "policy":
                walk(value, f"{path}{name}.", depth + 1)  # wrapped envs, transforms (envs are modules)
            elif isinstance(value, (list, tuple)) and name in ("envs", "_envs"):
                for i, child in enumerate(value):
                    walk(child, f"{path}{name}.{i}.", depth + 1)

    walk(env, "", 0)
    return found


def generator_state(gen: Any) -> Any:
    """The state of a torch, NumPy, legacy NumPy or Python generator, as codec-safe values
    (:func:`set_generator_state`)."""
    if isinstance(gen, torch.Generator):
        return {"kind": "torch", "state": gen.get_state()}
    if isinstance(gen, np.random.Generator):
        return {"kind": "numpy", "state": gen.bit_generator.state}
    if isinstance(gen, random.Random):
        version, internal, gauss = gen.getstate()
        return {"kind": "python", "state": {"version": version, "words": torch.tensor(internal), "gauss": gauss}}
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
    """Put back what :func:`generator_state` returned."""
    if saved["kind"] == "torch":
        gen.set_state(saved["state"].cpu())
    elif saved["kind"] == "numpy":
        gen.bit_generator.state = saved["state"]
    elif saved["kind"] == "python":
        s = saved["state"]
        if not isinstance(gen, random.Random) or not isinstance(s.get("words"), torch.Tensor):
            raise ValueError(f"a Python generator's state for a {type(gen).__name__}")
        gen.setstate((s["version"], tuple(s["words"].tolist()), s["gauss"]))
    else:
        s = saved["state"]
        gen.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))


def restore_env_generators(env: Any, saved: Mapping[str, Any], name: str) -> None:
    """Put back the generators :func:`env_extras` saved (``saved``: its ``env_rngs``)."""
    gens = env_generators(env)
    for path, saved_gen in saved.items():
        if path not in gens:
            raise IncompatibleComponentError(f"component {name!r}: the env has no generator {path!r} to restore")
        set_generator_state(gens[path], saved_gen)
    unsaved = sorted(set(gens) - set(saved))
    if unsaved:  # (no save of this env leaves one out: a damaged checkpoint, or an env built with more)
        warnings.warn(
            InexactResumeWarning(
                f"component {name!r}: the checkpoint holds no state for the env's generator(s) {unsaved[:3]}, which "
                "keep their current state: the env will not draw what the saved one would (build the env as it was "
                "saved)"
            ),
            stacklevel=2,
        )

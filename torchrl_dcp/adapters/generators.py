"""Python's and NumPy's generator objects as components: ``random.Random``, ``numpy.random.Generator``,
``numpy.random.RandomState``.

RL code keeps generators of its own beside the process-wide streams (exploration noise,
environment seeds, ``rng = np.random.default_rng(seed)`` in a sampler); registered, each
resumes its stream exactly. Like ``torch.Generator``, they are ``per_rank`` by default (each
rank its own stream). After a change of world size, new rank ``r`` takes saved rank
``r % saved`` and re-seeds from it and its own rank (:func:`~torchrl_dcp.adapters.rng.derived_seed_of`):
deterministic, different on every rank, not a continuation of a saved stream.

Example:
    >>> import random, tempfile, torchrl_dcp as tdcp
    >>> rng = random.Random(0)
    >>> path = tdcp.DistributedCheckpoint(noise=rng).save(tempfile.mkdtemp() + "/c")
    >>> expected = rng.random()
    >>> fresh = random.Random(123)
    >>> _ = tdcp.DistributedCheckpoint(noise=fresh).load(path)
    >>> fresh.random() == expected
    True
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch

from torchrl_dcp._log import user_stacklevel
from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.rng import derived_seed_of, same_rank_source
from torchrl_dcp.errors import IncompatibleComponentError, InexactResumeWarning


class _PerRankGenerator(Adapter):
    default_placement = "per_rank"
    shares_tensors = False
    can_reshard = True

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return same_rank_source(ctx)

    def reshard(self, obj: Any, states: dict[int, Any], ctx: AdapterContext) -> Any:
        (state,) = states.values()
        self.reseed(obj, derived_seed_of(state, ctx.rank, ctx.world_size))
        return None

    def reseed(self, obj: Any, seed: int) -> None:
        raise NotImplementedError


class PythonRandomAdapter(_PerRankGenerator):
    """A ``random.Random`` (Mersenne Twister state, and the cached Gaussian)."""

    adapter_id = "torchrl_dcp.python_random"
    version = 1

    def state(self, obj: random.Random, ctx: AdapterContext) -> Any:
        try:
            version, internal, gauss = obj.getstate()
        except NotImplementedError:
            raise TypeError(
                f"{type(obj).__name__} has no state to save (it draws from the operating system): register a "
                "random.Random instead"
            ) from None
        own = sorted(k for k in vars(obj) if k != "gauss_next") if type(obj) is not random.Random else []
        if own:  # (a subclass's attributes: only the Mersenne Twister state is a random.Random's)
            _inexact(
                ctx,
                f"its {type(obj).__name__} holds attributes of its own ({', '.join(own[:4])}) that are not saved, "
                "only the generator's state; register that state as a component of its own, or give the class "
                "an adapter (tdcp.register_adapter)",
            )
        return {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}

    def restore(self, obj: random.Random, state: Any, ctx: AdapterContext) -> Any:
        internal = state["state"]
        if not isinstance(internal, torch.Tensor) or internal.dtype != torch.int64 or internal.dim() != 1:
            raise IncompatibleComponentError(f"component {ctx.name!r}: not the state of a random.Random")
        obj.setstate((state["version"], tuple(internal.tolist()), state["gauss"]))
        return None

    def reseed(self, obj: random.Random, seed: int) -> None:
        obj.seed(seed)


class NumpyGeneratorAdapter(_PerRankGenerator):
    """A ``numpy.random.Generator``: its bit generator's state (any kind: PCG64, MT19937, Philox, SFC64, ...)."""

    adapter_id = "torchrl_dcp.numpy_generator"
    version = 1

    def state(self, obj: np.random.Generator, ctx: AdapterContext) -> Any:
        seeds = getattr(obj.bit_generator, "seed_seq", None)
        spawned = getattr(seeds, "n_children_spawned", 0)
        if spawned:  # (numpy lets no one set it on a live generator: a load cannot give it back)
            _inexact(
                ctx,
                f"its numpy Generator has spawned {spawned} child generator(s) (Generator.spawn); that count is "
                "not restored, so spawn() after a load hands out the same children again; keep spawned "
                "generators as components of their own, or seed children from a counter you save",
            )
        return obj.bit_generator.state

    def validate(self, obj: np.random.Generator, saved: dict[int, Any], ctx: AdapterContext) -> None:
        live = type(obj.bit_generator).__name__
        for state in saved.values():
            kind = state.get("bit_generator") if isinstance(state, dict) else None
            if kind != live and ctx.saved_world_size == ctx.world_size:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r} was saved from a numpy {kind} generator, the registered one uses "
                    f"{live}: build it as numpy.random.Generator(numpy.random.{kind}())"
                )

    def restore(self, obj: np.random.Generator, state: Any, ctx: AdapterContext) -> Any:
        try:
            obj.bit_generator.state = state
        except (TypeError, ValueError, KeyError) as err:
            raise IncompatibleComponentError(f"component {ctx.name!r}: {err}") from None
        return None

    def reseed(self, obj: np.random.Generator, seed: int) -> None:
        obj.bit_generator.state = type(obj.bit_generator)(seed).state


class NumpyRandomStateAdapter(_PerRankGenerator):
    """A legacy ``numpy.random.RandomState`` (MT19937 state and the cached Gaussian)."""

    adapter_id = "torchrl_dcp.numpy_random_state"
    version = 1

    def state(self, obj: np.random.RandomState, ctx: AdapterContext) -> Any:
        return obj.get_state(legacy=False)

    def restore(self, obj: np.random.RandomState, state: Any, ctx: AdapterContext) -> Any:
        try:
            obj.set_state(state)
        except (TypeError, ValueError, KeyError) as err:
            raise IncompatibleComponentError(f"component {ctx.name!r}: {err}") from None
        return None

    def reseed(self, obj: np.random.RandomState, seed: int) -> None:
        obj.seed(seed % (1 << 32))


def _inexact(ctx: AdapterContext, what: str) -> None:
    """An :class:`~torchrl_dcp.errors.InexactResumeWarning` at save: ``what`` a load of the component will not give
    back."""
    warnings.warn(f"component {ctx.name!r}: {what}", InexactResumeWarning, stacklevel=user_stacklevel())

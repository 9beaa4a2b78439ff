"""The adapter protocol: :class:`Adapter`, what it is told (:class:`AdapterContext`) and its options.

An adapter turns one kind of object into nested *state* (tensors plus values the
codec can store: dicts, lists, numbers, strings, dtypes, ...) and back. It never
touches files: the checkpoint encodes the state, routes it to DCP and decodes it.
Which adapter serves which type is decided by :mod:`torchrl_dcp.adapters.registry`.

Example:
    >>> from torchrl_dcp.adapters.base import Adapter, AdapterContext
    >>> class Counter:
    ...     def __init__(self): self.n = 0
    >>> class CounterAdapter(Adapter):
    ...     adapter_id = "example.counter"
    ...     def state(self, obj, ctx): return {"n": obj.n}
    ...     def restore(self, obj, state, ctx): obj.n = state["n"]
    >>> CounterAdapter().state(Counter(), AdapterContext("counter"))
    {'n': 0}
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from torchrl_dcp.errors import IncompatibleComponentError
from torchrl_dcp.format.codec import repeated_tensors
from torchrl_dcp.placement import Placement

if TYPE_CHECKING:
    from torchrl_dcp.format.codec import TensorSpec

__all__ = ["Adapter", "AdapterContext", "CheckpointOptions"]


@dataclass(frozen=True)
class CheckpointOptions:
    """Arguments forwarded to a component's ``state_dict`` / ``load_state_dict``.

    As in ``torchrl.checkpoint``: options given to ``save``/``load`` are merged over
    those given at registration (keyword arguments shallow-merged, positional ones
    replaced).

    Example:
        >>> from torchrl_dcp import CheckpointOptions
        >>> CheckpointOptions(load_kwargs={"strict": False}).load_kwargs["strict"]
        False
    """

    save_args: tuple[Any, ...] | None = None
    save_kwargs: Mapping[str, Any] | None = None
    load_args: tuple[Any, ...] | None = None
    load_kwargs: Mapping[str, Any] | None = None

    def merged(self, override: CheckpointOptions | None) -> CheckpointOptions:
        if override is None:
            return self
        return CheckpointOptions(
            save_args=self.save_args if override.save_args is None else override.save_args,
            save_kwargs={**(self.save_kwargs or {}), **(override.save_kwargs or {})},
            load_args=self.load_args if override.load_args is None else override.load_args,
            load_kwargs={**(self.load_kwargs or {}), **(override.load_kwargs or {})},
        )


@dataclass
class AdapterContext:
    """What an adapter may know about the operation in progress."""

    name: str
    rank: int = 0
    world_size: int = 1
    options: CheckpointOptions = field(default_factory=CheckpointOptions)
    map_location: Any = None
    saved_world_size: int | None = None
    source_rank: int | None = None
    plan: dict[str, Any] = field(default_factory=dict)  # carried from reshard_sources() to reshard()

    def device_for(self, saved_device: str) -> torch.device:
        """The device a tensor saved on ``saved_device`` is restored to, after ``map_location`` (a device, a
        ``{saved device: device}`` mapping, or a callable given the saved device's name, e.g. ``"cuda:1"``). The meta
        device holds no data: a load there would restore nothing, so it is refused."""
        loc = self.map_location
        if loc is None:
            device = torch.device(saved_device)
        elif isinstance(loc, Mapping):
            device = torch.device(loc.get(saved_device, loc.get(torch.device(saved_device), saved_device)))
        elif callable(loc):
            device = torch.device(loc(saved_device))
        else:
            device = torch.device(loc)
        if device.type == "cuda" and not torch.cuda.is_available():
            device = torch.device("cpu")
        if device.type == "meta":
            raise IncompatibleComponentError(
                f"component {self.name!r}: map_location={loc!r} puts tensors saved on {saved_device!r} on the meta "
                "device, which holds no data (the load would restore nothing): map them to a real device"
            )
        return device


class Adapter(abc.ABC):
    """Turns one kind of object into nested state and back.

    Subclasses set ``adapter_id`` (stable, stored in the manifest), ``version`` (of
    the payload layout; bump it and register a migration when it changes) and may
    set ``default_placement``.
    """

    adapter_id: str = ""
    version: int = 1
    default_placement: Placement = "replicated"
    #: ``False``: no state of this adapter holds one tensor twice (or another component's tensor). A save of such a
    #: state is refused, and so is a saved state that does (an ``alias`` or ``xref``: a forgery), by ``load`` and
    #: ``verify`` alike: e.g. an optimizer whose ``exp_avg_sq`` would be its ``exp_avg``.
    shares_tensors: bool = True
    #: ``True``: what :meth:`restore` returns is the component's value, ``None`` included, and goes to
    #: ``LoadResult.values`` as it is (a JSON ``None`` is a value); otherwise only a return other than ``None`` does.
    returns_values: bool = False
    #: ``True``: :meth:`destinations` may change the object before anything is read (a lazily built storage
    #: allocated from the saved shapes), so a load refused before it restores anything rolls it back; the others
    #: are left untouched then (nothing changed them: their :meth:`rollback` is not called).
    allocates_when_planned: bool = False

    def refused_repeats(self, skeleton: Any) -> list[str]:
        """The keys of the repeated tensors (``alias``, ``xref``) a state of this adapter may not hold: every one
        unless :attr:`shares_tensors`. What a save refuses to write and a load refuses to read."""
        return [] if self.shares_tensors else repeated_tensors(skeleton)

    @abc.abstractmethod
    def state(self, obj: Any, ctx: AdapterContext) -> Any:
        """Return the object's state: tensors plus codec-safe values."""

    @abc.abstractmethod
    def restore(self, obj: Any, state: Any, ctx: AdapterContext) -> Any:
        """Restore ``state`` into ``obj``; the return value goes to ``LoadResult.values``."""

    def destinations(self, obj: Any, saved: Any, ctx: AdapterContext) -> dict[str, torch.Tensor] | None:
        """Optionally return tensors DCP should read into in place, by tensor key.

        ``saved`` is the saved state with every tensor replaced by its
        :class:`~torchrl_dcp.format.codec.TensorSpec` (key, shape, dtype, device), so an adapter
        can allocate lazily built storage from the checkpoint before DCP reads. The
        default (``None``) lets the checkpoint allocate fresh tensors on the mapped
        device; keys left out are allocated too.
        """
        return None

    def row_changes(self, obj: Any, ctx: AdapterContext) -> dict[tuple[str, ...], Any] | None:
        """Optionally, what an incremental save may trust about which rows changed (called once per save).

        Returns ``{path in the state: tracking.Snapshot}`` for tensors whose written rows
        are tracked (:mod:`torchrl_dcp.tracking`), taken just before :meth:`state`. The
        default (``None``): unknown, so chunks are compared by checksum.
        """
        return None

    def check_saved(self, saved: Any) -> None:
        """Raise ``ValueError`` (saying what is wrong) if ``saved`` is a state no save of this adapter writes.

        Object-independent, so ``load`` (while planning) and ``verify`` both run it on every
        saved state (tensors as :class:`~torchrl_dcp.format.codec.TensorSpec`, JSON values
        real): JSON values that contradict the tensors they describe, impossible counts, a
        value no ``state_dict`` produces. The default accepts everything.
        """
        return None

    def check_values(self, saved: Any, read: Callable[[TensorSpec], torch.Tensor]) -> None:
        """Raise ``ValueError`` (saying what is wrong) if the values of ``saved``'s tensors make it a state no save of
        this adapter writes (an index past the end of a storage), where :meth:`check_saved` sees only their specs.

        ``saved`` as for :meth:`check_saved`; ``read(spec)`` returns one tensor's saved value. A load calls it on
        every state it restores once the tensors bound for fresh buffers are read, before anything is restored
        (one it reads in place later is read for the check alone: ask for small tensors); ``verify`` reads the
        tensors asked for. The default checks nothing.
        """
        return None

    def validate(self, obj: Any, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """Raise (e.g. :class:`~torchrl_dcp.errors.IncompatibleComponentError`) if ``saved`` cannot be restored into ``obj``.

        Called while the load is planned, before anything changes, with every saved
        state this rank will read (``{saved_rank: state}``, tensors as
        :class:`~torchrl_dcp.format.codec.TensorSpec`); ``ctx.saved_world_size`` tells whether
        the load reshards. The default accepts everything.
        """
        return None

    def snapshot(self, obj: Any, ctx: AdapterContext) -> Any:
        """What :meth:`rollback` needs to put ``obj`` back as it is now (taken before a load changes anything).

        The default is a deep copy of :meth:`state` (tensors cloned). Adapters whose
        objects are large and read in place (replay-buffer storages) keep less.
        """
        return copy.deepcopy(self.state(obj, ctx))

    def rollback(self, obj: Any, snapshot: Any, ctx: AdapterContext) -> None:
        """Undo a load of ``obj`` (it failed, here or on another rank): restore :meth:`snapshot`'s value."""
        self.restore(obj, snapshot, ctx)

    def load_torchrl_state_dict(self, obj: Any, state_dict: Any, ctx: AdapterContext) -> list[str]:
        """Restore ``obj`` from the ``state_dict()`` a ``torchrl.checkpoint`` saved of it (an import); returns what
        this adapter saves beyond ``state_dict()`` and the import leaves as it is (an
        :class:`~torchrl_dcp.errors.InexactResumeWarning` names it; empty: exact). The default calls
        ``obj.load_state_dict`` with the component's ``load_args`` / ``load_kwargs``."""
        opts = ctx.options
        obj.load_state_dict(state_dict, *(opts.load_args or ()), **(opts.load_kwargs or {}))
        return []

    #: whether :meth:`state` is the object's own ``state_dict()`` (what ``torchrl.checkpoint`` saves of it): an import
    #: of a torchrl checkpoint then runs :meth:`check_saved`, :meth:`validate` and :meth:`check_values` on what it
    #: reads, as our loads do (a subclass whose :meth:`state` differs sets it ``False``: ``tests/test_conventions.py``)
    state_is_state_dict: bool = False

    def from_torchrl_state_dict(self, state_dict: Any) -> Any:
        """The state this adapter saves, from the ``state_dict()`` a ``torchrl.checkpoint`` saved of its object (where
        :attr:`state_is_state_dict`: the checks of an import run on it). The default: that state dict itself."""
        return state_dict

    #: whether :meth:`reshard_sources` / :meth:`reshard` are implemented (per_rank state only)
    can_reshard: bool = False
    #: whether a reshard shares the saved states' contents out among the new ranks, each taking a part (a replay
    #: buffer's transitions), rather than each taking a copy of one (a generator): every new rank must then
    #: register the component, or the parts meant for the ranks without it would be lost (such a load is refused)
    reshard_shares_out: bool = False

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        """Saved ranks whose state this rank needs after a world-size change.

        ``saved`` maps every saved rank to its state with :class:`TensorSpec` leaves
        (JSON values are real), so the choice can depend on e.g. buffer lengths.
        ``ctx.rank`` / ``ctx.world_size`` are the new ones, ``ctx.saved_world_size`` the old.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot reshard")

    def reshard(self, obj: Any, states: dict[int, Any], ctx: AdapterContext) -> Any:
        """Restore from the saved states of the ranks :meth:`reshard_sources` chose."""
        raise NotImplementedError(f"{type(self).__name__} cannot reshard")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.adapter_id!r}, version={self.version})"

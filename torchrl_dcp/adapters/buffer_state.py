"""Replay-buffer state helpers shared by the adapter (:mod:`.replay_buffer`) and resharding (:mod:`.buffer_reshard`).

- :func:`initialized_buffer`: the buffer, its lazy parts (storage, sampler, writer) built;
- :func:`flatten`: the leaves of a saved storage tree by key path;
- :func:`allocate`: a lazy storage initialised from saved leaves, before rows are read into it;
- :func:`buffer_settings` / :func:`restore_buffer_settings`: transforms, batch size and the
  buffer's own generator.

Example:
    >>> import torch
    >>> from torchrl.data import LazyTensorStorage
    >>> leaves = flatten({"obs": torch.zeros(4, 3), "next": {"reward": torch.zeros(4, 1)}})
    >>> sorted(leaves)
    [('next', 'reward'), ('obs',)]
    >>> storage = LazyTensorStorage(10)
    >>> allocate(storage, leaves, is_tensordict=True, ndim=1)
    >>> storage._storage["obs"].shape
    torch.Size([10, 3])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, is_tensor_collection
from torchrl.data.replay_buffers import ReplayBuffer
from torchrl.data.replay_buffers.storages import TensorStorage

from torchrl_dcp.adapters.rng import derived_seed
from torchrl_dcp.errors import IncompatibleComponentError
from torchrl_dcp.format.tensor_nodes import dense_layout

__all__ = [
    "allocate",
    "buffer_settings",
    "check_no_other_entries",
    "flatten",
    "initialized_buffer",
    "restore_buffer_settings",
]


def initialized_buffer(rb: ReplayBuffer) -> ReplayBuffer:
    """``rb``, after building its lazily initialised parts (torchrl's delayed ``_init``) if it has not yet."""
    if not getattr(rb, "_initialized", True):
        rb._init()
    return rb


def flatten(tree: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Leaves of a nested mapping by key path (``()`` for a bare leaf)."""
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, (*prefix, key)))
    return out


def allocate(storage: TensorStorage, leaves: Mapping[tuple[str, ...], Any], is_tensordict: bool, ndim: int) -> None:
    """Initialise a lazy storage from saved leaves of shape ``[rows, *batch, *item]`` (``batch``: ``ndim - 1`` dims).

    torchrl's ``_init`` takes one row: a TensorDict with batch size ``batch`` whose
    leaves have shape ``[*batch, *item]`` (``leaf.shape[1:]``); with ``ndim > 1`` it
    sizes the storage to ``ceil(max_size / prod(batch))`` rows, as an ``extend`` would.
    """
    items = {k: _saved_row(v) for k, v in leaves.items()}
    batch = tuple(next(iter(leaves.values())).shape[1:ndim]) if leaves else ()
    try:
        storage._init(TensorDict(items, batch) if is_tensordict else items[()])
    except RuntimeError as err:
        scratch = getattr(storage, "scratch_dir", None)
        if scratch is not None and "already exists" in str(err):  # a memmap storage's files from an earlier run
            raise RuntimeError(
                f"{err} The memmap storage's scratch_dir {str(scratch)!r} holds the files of an earlier buffer (the "
                "job that crashed?); torchrl never overwrites them. Give the new buffer an empty scratch_dir, or "
                "remove the old files once nothing uses them, then load again"
            ) from None
        raise


def _saved_row(leaf: Any) -> torch.Tensor:
    """A row of zeros shaped as ``leaf``'s rows, laid out as its saved rows were (a channels-last frame: torchrl's
    ``_init`` allocates the storage like the row it is given, as it did from the first batch of the saving run)."""
    shape = tuple(leaf.shape[1:])
    stride = getattr(leaf, "stride", None)  # (a TensorSpec's saved layout; a tensor's is a method: row-major here)
    if isinstance(stride, tuple) and dense_layout(shape, stride[1:]):
        return torch.empty_strided(shape, stride[1:], dtype=leaf.dtype).zero_()
    return torch.zeros(shape, dtype=leaf.dtype)


def live_leaf(
    storage: TensorStorage, key: tuple[str, ...], tail: tuple[int, ...], dtype: Any, *, allocate: bool = True
) -> Any:
    """The storage's tensor at ``key`` (``()``: the storage itself), an entry it lacks allocated first.

    A ``TensorStorage`` over rows the user allocated may lack entries the buffer writes itself (a
    ``TensorDictReplayBuffer`` adds ``index``): torchrl adds them at the first write, so a load does too (zeros of
    saved shape past the rows: ``tail``). Pass ``allocate=False`` when no saved row backs ``tail`` (a state of
    zero rows): a size read off disk is never allocated unless the checkpoint's bytes back it; ``None`` then. Anything
    else found is returned as is, for the caller to check.
    """
    live = storage._storage
    if not key:
        return live
    leaf = live.get(key, None) if is_tensor_collection(live) else None
    if leaf is None and is_tensor_collection(live) and allocate:
        leaf = torch.zeros((int(live.shape[0]), *tail), dtype=dtype, device=live.device)
        live.set(key, leaf)
    return leaf


def buffer_settings(rb: ReplayBuffer) -> dict[str, Any]:
    """Transforms, batch size and the buffer's own generator, as :func:`restore_buffer_settings` takes them."""
    rng = getattr(rb, "_rng", None)
    transform = getattr(rb, "_transform", None)
    return {
        "transform": transform.state_dict() if isinstance(transform, torch.nn.Module) else None,
        "batch_size": rb._batch_size,
        "generator": None if rng is None else {"state": rng.get_state(), "device": str(rng.device)},
    }


def restore_buffer_settings(
    rb: ReplayBuffer, saved: Mapping[str, Any], reseed_for: tuple[int, int] | None = None
) -> None:
    """Transforms, batch size and the buffer's own generator (re-seeded for ``(rank, world)`` when resharding)."""
    transform = getattr(rb, "_transform", None)
    if saved["transform"] is not None and isinstance(transform, torch.nn.Module):
        transform.load_state_dict(saved["transform"])
    rb._batch_size = saved["batch_size"]
    generator = saved["generator"]
    if generator is None:
        return
    if getattr(rb, "_rng", None) is None:
        rb.set_rng(torch.Generator(device=generator["device"]))
    if reseed_for is None:
        rb._rng.set_state(generator["state"].cpu())
    else:
        rb._rng.manual_seed(derived_seed(generator["state"], *reseed_for))


def check_no_other_entries(storage: TensorStorage, saved: Mapping[tuple[str, ...], Any], name: str) -> None:
    """An initialised storage holds no entry the checkpoint lacks: its rows would keep values no save wrote (a
    sample would carry them). Entries the checkpoint has and the storage lacks are added by the load."""
    live = storage._storage
    if not is_tensor_collection(live):
        return
    keys = {k if isinstance(k, tuple) else (k,) for k in live.keys(include_nested=True, leaves_only=True)}
    other = sorted(".".join(k) for k in keys - set(saved))
    if other:
        raise IncompatibleComponentError(
            f"component {name!r}: the buffer's storage holds entries the checkpoint does not ({other[:5]}): load "
            "into a freshly built buffer, or one whose storage holds the saved entries"
        )

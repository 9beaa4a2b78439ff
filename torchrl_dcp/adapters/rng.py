"""Process-wide random number generators as a checkpoint component.

:class:`RNGState` captures Python's ``random``, NumPy's global generator, torch's CPU
generator and every initialised CUDA device's generator. It is ``per_rank`` by
default: each rank resumes its own streams. Its adapter is restored after every
other component read into fresh buffers (``restore_last``), whatever the registration
order, and set again after the components read in place, so loading other objects
cannot consume random numbers after the streams were restored.

Example:
    >>> import torch
    >>> from torchrl_dcp import RNGState
    >>> rng = RNGState()
    >>> saved = rng.state_dict()
    >>> a = torch.rand(2)
    >>> rng.load_state_dict(saved)
    >>> torch.equal(a, torch.rand(2))
    True
"""

from __future__ import annotations

import hashlib
import math
import random
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from torchrl_dcp.adapters.base import Adapter, AdapterContext
from torchrl_dcp.adapters.state_dict import StateDictAdapter
from torchrl_dcp.errors import IncompatibleComponentError, InexactResumeWarning
from torchrl_dcp.format.record import byte_view


class RNGState:
    """The process's global RNG streams (Python, NumPy, torch CPU, CUDA)."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
            "numpy": {
                "kind": np_kind,
                "keys": torch.from_numpy(np_keys.astype(np.int64)),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "gauss": float(np_gauss),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the streams from :meth:`state_dict`'s layout, or ``torchrl.checkpoint.GlobalRNGState``'s (a torchrl
        checkpoint's RNG loads into an ``RNGState``: what a bound torchrl ``Trainer`` registers)."""
        if "torch_cpu" in state:
            state = rng_state_from_torchrl(state)
        py = state["python"]
        random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        npst = state["numpy"]
        np.random.set_state(
            (npst["kind"], npst["keys"].cpu().numpy().astype(np.uint32), npst["pos"], npst["has_gauss"], npst["gauss"])
        )
        torch.set_rng_state(state["torch"].cpu())
        if "cuda" in state:
            if torch.cuda.is_available():
                cuda_states = [s.cpu() for s in state["cuda"]]
                n = min(len(cuda_states), torch.cuda.device_count())
                for i in range(n):
                    torch.cuda.set_rng_state(cuda_states[i], i)
            else:
                warnings.warn(
                    "the checkpoint holds CUDA RNG state but CUDA is not available: not restored (CUDA random "
                    "draws after the restore will not continue the saved streams)",
                    InexactResumeWarning,
                    stacklevel=2,
                )


def _spec_shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(shape)


def derived_seed(saved_state: torch.Tensor, rank: int, world_size: int) -> int:
    """A seed derived deterministically from a saved generator state and a (new) rank.

    Used when the number of ranks changes: rank ``r`` of ``world_size`` continues
    from the saved streams of rank ``r % saved_world_size``, re-seeded with this
    value so that two new ranks reading the same saved stream do not draw the same
    numbers.

    Example:
        >>> import torch
        >>> s = torch.Generator().get_state()
        >>> derived_seed(s, 0, 4) != derived_seed(s, 1, 4)
        True
    """
    digest = hashlib.sha256(saved_state.detach().cpu().contiguous().numpy().tobytes())
    digest.update(f"torchrl_dcp.reshard:{rank}/{world_size}".encode())
    return int.from_bytes(digest.digest()[:8], "little") & ((1 << 63) - 1)


def derived_seed_of(state: Any, rank: int, world_size: int) -> int:
    """:func:`derived_seed` of any saved state (nested dicts, lists, tensors, arrays and scalars), through a
    canonical byte string of it.

    Example:
        >>> derived_seed_of({"key": 7, "pos": [1, 2]}, 0, 2) != derived_seed_of({"key": 7, "pos": [1, 2]}, 1, 2)
        True
    """
    digest = hashlib.sha256()
    _feed(digest, state)
    return derived_seed(torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8), rank, world_size)


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, dict):
        digest.update(b"{")
        for k in sorted(value, key=str):
            _feed(digest, str(k))
            _feed(digest, value[k])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for v in value:
            _feed(digest, v)
        digest.update(b"]")
    elif isinstance(value, torch.Tensor):
        digest.update(str(value.dtype).encode() + byte_view(value.detach().cpu().contiguous()).numpy().tobytes())
    elif isinstance(value, np.ndarray):
        digest.update(value.dtype.str.encode() + np.ascontiguousarray(value).tobytes())
    else:
        digest.update(f"{type(value).__name__}:{value!r};".encode())


def same_rank_source(ctx: AdapterContext) -> list[int]:
    """After a world-size change, new rank ``r`` takes the state of saved rank ``r % saved``."""
    return [ctx.rank % (ctx.saved_world_size or 1)]


def torchrl_rng_layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """An :class:`RNGState` state in ``torchrl.checkpoint.GlobalRNGState.state_dict()``'s layout
    (:func:`rng_state_from_torchrl` is the inverse).

    Example:
        >>> sorted(torchrl_rng_layout(RNGState().state_dict()))
        ['numpy', 'python', 'torch_cpu']
    """
    py, npst = state["python"], state["numpy"]
    out: dict[str, Any] = {
        "python": (int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]),
        "torch_cpu": state["torch"].cpu(),
        "numpy": (
            npst["kind"],
            npst["keys"].cpu().long(),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["gauss"]),
        ),
    }
    if "cuda" in state:
        out["torch_cuda"] = [s.cpu() for s in state["cuda"]]
    return out


def rng_state_from_torchrl(state: Mapping[str, Any]) -> dict[str, Any]:
    """``torchrl.checkpoint.GlobalRNGState``'s state in :meth:`RNGState.state_dict`'s layout.

    Example:
        >>> s = RNGState().state_dict()
        >>> back = rng_state_from_torchrl(torchrl_rng_layout(s))
        >>> torch.equal(back["torch"], s["torch"]) and back["python"]["gauss"] == s["python"]["gauss"]
        True
    """
    try:
        version, internal, gauss = state["python"]
        kind, keys, pos, has_gauss, np_gauss = state["numpy"]
        out: dict[str, Any] = {
            "python": {"version": version, "state": torch.as_tensor(list(internal), dtype=torch.int64), "gauss": gauss},
            "numpy": {
                "kind": kind,
                "keys": torch.as_tensor(keys).to(torch.int64),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(np_gauss),
            },
            "torch": state["torch_cpu"],
        }
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"not torchrl's GlobalRNGState layout ({type(err).__name__}: {err})") from None
    if "torch_cuda" in state:
        out["cuda"] = list(state["torch_cuda"])
    return out


class RNGStateAdapter(Adapter):
    """Global RNG streams, per rank; after a world-size change, deterministically re-seeded."""

    adapter_id = "torchrl_dcp.rng"
    state_is_state_dict = True
    version = 1
    shares_tensors = False
    default_placement = "per_rank"
    restore_last = True
    can_reshard = True

    def state(self, obj: RNGState, ctx: AdapterContext) -> Any:
        return obj.state_dict()

    def from_torchrl_state_dict(self, state_dict: Any) -> Any:
        """``GlobalRNGState``'s layout (what a torchrl checkpoint holds) in ours, as :meth:`RNGState.load_state_dict`
        reads it."""
        return (
            rng_state_from_torchrl(state_dict)
            if isinstance(state_dict, dict) and "torch_cpu" in state_dict
            else state_dict
        )

    def check_saved(self, saved: Any) -> None:
        """What ``random.getstate()`` and ``np.random.get_state()`` return, and nothing else."""
        py, npst = saved["python"], saved["numpy"]
        check_stream_layout(
            (py["version"], _spec_shape(py["state"]), py.get("gauss")),
            (npst["kind"], _spec_shape(npst["keys"]), npst["pos"], npst["has_gauss"], npst.get("gauss")),
        )

    def check_values(self, saved: Any, read: Any) -> None:
        """Each saved stream is one its generator takes and can have reached: set on a scratch generator of its kind
        (a short or malformed torch state, a Python position past its words, refused there: ``verify`` refused none
        of them, every load did), words of 32 bits (wider ones were cut silently), not all zero (a Mersenne twister
        of zeros draws 0.0 for ever: no seeding leaves it), pending Gaussians finite."""
        check_stream_values(saved, read)

    def restore(self, obj: RNGState, state: Any, ctx: AdapterContext) -> Any:
        obj.load_state_dict(state)
        return None

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return same_rank_source(ctx)

    def reshard(self, obj: RNGState, states: dict[int, Any], ctx: AdapterContext) -> Any:
        (state,) = states.values()
        reseed_global_streams(state["torch"], ctx)
        return None


def check_stream_layout(python: tuple[Any, Any, Any], numpy: tuple[Any, Any, Any, Any, Any]) -> None:
    """``python`` ``(version, shape of its words, gauss)`` and ``numpy`` ``(kind, shape of its keys, pos, has_gauss,
    gauss)`` are what ``random.getstate()`` and ``np.random.get_state()`` return (raises ``ValueError``)."""
    version, words, gauss = python
    kind, keys, pos, has_gauss, np_gauss = numpy
    if version not in (2, 3) or words != (625,):
        raise ValueError(f"Python RNG state of version {version!r}, {words} words")
    if kind != "MT19937" or keys != (624,) or type(pos) is not int or not 0 <= pos <= 624:
        raise ValueError(f"NumPy RNG state of kind {kind!r} at position {pos!r}")
    if has_gauss not in (0, 1) or type(has_gauss) not in (int, bool):
        raise ValueError(f"NumPy RNG has_gauss {has_gauss!r}")
    if gauss is not None and type(gauss) is not float or type(np_gauss) is not float:  # (Python's: None when none)
        raise ValueError(f"RNG gauss values {gauss!r}, {np_gauss!r} (floats, or None for Python's)")


def check_stream_values(saved: Any, read: Any) -> None:
    """What :meth:`RNGStateAdapter.check_values` checks (raises ``ValueError``)."""
    py, npst = saved["python"], saved["numpy"]
    words = read(py["state"]) if not isinstance(py["state"], torch.Tensor) else py["state"]
    _mt_words("Python", words[:-1] if words.numel() == 625 else words)
    try:
        random.Random().setstate((py["version"], tuple(int(v) for v in words.tolist()), py["gauss"]))
    except (ValueError, TypeError, OverflowError) as err:
        raise ValueError(f"its Python RNG state is refused by random.setstate ({err})") from None
    if py["gauss"] is not None and not math.isfinite(py["gauss"]):
        raise ValueError(f"its Python RNG holds a pending Gaussian of {py['gauss']}")
    keys = read(npst["keys"]) if not isinstance(npst["keys"], torch.Tensor) else npst["keys"]
    _mt_words("NumPy", keys)
    if npst["has_gauss"] and not math.isfinite(npst["gauss"]):
        raise ValueError(f"its NumPy RNG holds a pending Gaussian of {npst['gauss']}")
    cpu = saved.get("torch")
    cpu = read(cpu) if cpu is not None and not isinstance(cpu, torch.Tensor) else cpu
    if cpu is not None:
        try:
            torch.Generator().set_state(cpu.cpu())
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"its torch RNG state is refused by torch ({str(err).splitlines()[0][:160]})") from None


def _mt_words(which: str, words: torch.Tensor) -> None:
    """A Mersenne twister's words: 32-bit, not all zero."""
    if words.numel() and (int(words.min()) < 0 or int(words.max()) >= 1 << 32):
        raise ValueError(f"its {which} RNG state holds words outside 32 bits ({int(words.min())}..{int(words.max())})")
    if words.numel() and not bool(words.any()):
        raise ValueError(f"its {which} RNG state is all zeros: no seeding leaves a Mersenne twister there")


class TorchrlGlobalRNGAdapter(StateDictAdapter):
    """torchrl's ``torchrl.checkpoint.GlobalRNGState``: its ``state_dict``, per rank (each rank's own streams),
    restored last; after a world-size change, deterministically re-seeded like :class:`RNGState`."""

    default_placement = "per_rank"
    restore_last = True
    can_reshard = True

    def check_saved(self, saved: Any) -> None:
        """What :meth:`RNGStateAdapter.check_saved` checks, on ``GlobalRNGState.state_dict()``'s layout."""
        try:
            version, words, gauss = saved["python"]
            kind, keys, pos, has_gauss, np_gauss = saved["numpy"]
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"its RNG state is not what GlobalRNGState.state_dict() holds ({err})") from None
        shape = _spec_shape(words) if hasattr(words, "shape") else (len(words),)
        check_stream_layout((version, shape, gauss), (kind, _spec_shape(keys), pos, has_gauss, np_gauss))

    def check_values(self, saved: Any, read: Any) -> None:
        """What :meth:`RNGStateAdapter.check_values` checks, on ``GlobalRNGState.state_dict()``'s layout: Python's
        ``random.getstate()`` tuple, NumPy's ``get_state()`` tuple (its keys a tensor) and ``torch_cpu``."""
        try:
            version, words, gauss = saved["python"]
            kind, keys, pos, has_gauss, np_gauss = saved["numpy"]
            if not isinstance(words, torch.Tensor):
                if not all(type(w) is int for w in words):
                    raise ValueError("Python RNG words that are not integers")
                words = torch.tensor(words, dtype=torch.int64)
        except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as err:
            raise ValueError(f"its RNG state is not what GlobalRNGState.state_dict() holds ({err})") from None
        streams = {
            "python": {"version": version, "state": words, "gauss": gauss},
            "numpy": {"kind": kind, "keys": keys, "pos": pos, "has_gauss": has_gauss, "gauss": np_gauss},
            "torch": saved.get("torch_cpu"),
        }
        check_stream_values(streams, read)

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return same_rank_source(ctx)

    def reshard(self, obj: Any, states: dict[int, Any], ctx: AdapterContext) -> Any:
        (state,) = states.values()
        reseed_global_streams(state["torch_cpu"], ctx)
        return None


def reseed_global_streams(saved_torch_state: Any, ctx: AdapterContext) -> None:
    """After a world-size change: seed Python, NumPy, torch (and CUDA) from the saved torch stream, this rank and
    the world size (:func:`derived_seed`: the same on every resume of the same job, different between ranks)."""
    seed = derived_seed(saved_torch_state, ctx.rank, ctx.world_size)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


class GeneratorAdapter(Adapter):
    """A ``torch.Generator`` (e.g. a replay buffer's own ``generator=``)."""

    adapter_id = "torchrl_dcp.generator"
    version = 1
    shares_tensors = False
    default_placement = "per_rank"
    can_reshard = True

    def reshard_sources(self, saved: dict[int, Any], ctx: AdapterContext) -> list[int]:
        return same_rank_source(ctx)

    def reshard(self, obj: torch.Generator, states: dict[int, Any], ctx: AdapterContext) -> Any:
        (state,) = states.values()
        obj.manual_seed(derived_seed(state["state"], ctx.rank, ctx.world_size))
        return None

    def state(self, obj: torch.Generator, ctx: AdapterContext) -> Any:
        return {"state": obj.get_state(), "device": str(obj.device)}

    def check_saved(self, saved: Any) -> None:
        try:
            torch.device(saved["device"])
        except (RuntimeError, TypeError):
            raise ValueError(f"generator device {saved['device']!r} is not a device") from None

    def validate(self, obj: torch.Generator, saved: dict[int, Any], ctx: AdapterContext) -> None:
        """A generator saved on another kind of device than ``obj``'s is refused while planning (its state would not
        fit); another index of the same kind (a rank's GPU) is accepted."""
        for state in saved.values():
            if torch.device(state["device"]).type != obj.device.type:
                raise IncompatibleComponentError(
                    f"component {ctx.name!r}: the generator was saved on {state['device']}, this one is on "
                    f"{obj.device}: register a generator of that device"
                )

    def restore(self, obj: torch.Generator, state: Any, ctx: AdapterContext) -> Any:
        obj.set_state(state["state"].cpu())
        return None

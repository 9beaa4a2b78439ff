"""Where a component's state lives across ranks.

- ``"replicated"``: identical on every rank (policy, optimizer). Written once; DCP
  spreads the writes over the ranks. Key prefix ``replicated/<component>/``.
- ``"per_rank"``: every rank has its own (RNG, collector, replay-buffer shard). Each
  rank writes and restores its own copy under ``rank/<r>/<component>/``.
- ``"sharded"``: DTensor / FSDP state, sharded by DCP itself under ``sharded/<component>/``.

Example:
    >>> from torchrl_dcp.placement import check_placement, key_prefix
    >>> key_prefix(check_placement("per_rank"), "rng", rank=1)
    'rank/1/rng'
"""

from __future__ import annotations

from typing import Literal, get_args

Placement = Literal["replicated", "per_rank", "sharded"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)


def check_placement(placement: str) -> Placement:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    return placement  # type: ignore[return-value]


def key_prefix(placement: Placement, component: str, rank: int) -> str:
    """The DCP key prefix of a component's tensors (documented in docs/format.md)."""
    if placement == "per_rank":
        return f"rank/{rank}/{component}"
    return f"{placement}/{component}"


#: the state a rank saves for a ``per_rank`` component other ranks registered and it did not (a logger, an evaluation
#: hook on rank 0 alone): every rank's manifest shard holds each per-rank component, and a load on a rank whose
#: saved state is this one leaves its object as it is (said)
_ABSENT_KEY = "_tdcp_absent_on_this_rank"
ABSENT_STATE = {_ABSENT_KEY: True}


def is_absent(state: object) -> bool:
    """Whether a decoded per-rank state is :data:`ABSENT_STATE` (the rank registered no such component): a plain
    ``dict`` whose one value is ``True`` itself (not a value equal to it: ``1``, NumPy's ``True_``, an ``OrderedDict``
    are a component's own state, which a save may hold).

    Example:
        >>> is_absent({"_tdcp_absent_on_this_rank": True}), is_absent({"_tdcp_absent_on_this_rank": 1})
        (True, False)
    """
    return type(state) is dict and len(state) == 1 and state.get(_ABSENT_KEY, False) is True


#: how :data:`ABSENT_STATE` is saved in a manifest (the codec's encoding of that dict; reserved: a save refuses a
#: component's own state that encodes to it)
ABSENT_SKELETON = {"t": "dict", "items": [[_ABSENT_KEY, True]]}


def is_absent_skeleton(skeleton: object) -> bool:
    """Whether a saved state is :data:`ABSENT_SKELETON` itself (``true``, not a ``1`` equal to it: what
    :func:`is_absent` takes for absent once decoded). No torch needed (``inspect`` and ``diff`` read it).

    Example:
        >>> is_absent_skeleton(ABSENT_SKELETON), is_absent_skeleton({"t": "dict", "items": [[_ABSENT_KEY, 1]]})
        (True, False)
    """
    if skeleton != ABSENT_SKELETON:
        return False
    ((_, value),) = skeleton["items"]  # type: ignore[index]
    return value is True

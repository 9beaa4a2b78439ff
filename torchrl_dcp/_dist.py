"""Process-group helpers: rank, world size and the dedicated checkpoint group.

Checkpoint collectives run on their own gloo group (created once per default
group, collectively, at the first save or load) so they never interleave with the
training's NCCL/gloo collectives. Without an initialised process group the world
is one rank and every collective is a no-op.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

_GROUPS: dict[int, Any] = {}


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def checkpoint_group(timeout: datetime.timedelta | None = None) -> Any:
    """The gloo group used for checkpoint collectives (collective on first call)."""
    if not initialized():
        return None
    world = dist.group.WORLD
    key = id(world)
    group = _GROUPS.get(key)
    if group is None:
        group = dist.new_group(backend="gloo", timeout=timeout) if timeout else dist.new_group(backend="gloo")
        _GROUPS.clear()
        _GROUPS[key] = group
    return group


def all_gather(obj: Any, group: Any) -> list[Any]:
    """Every rank's ``obj`` (live, trusted values between our own ranks; never checkpoint content)."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_to_0(obj: Any, group: Any) -> list[Any] | None:
    if group is None:
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def broadcast_from_0(obj: Any, group: Any) -> Any:
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]

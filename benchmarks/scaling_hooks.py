"""Timing wrappers for ``benchmarks/scaling.py``: the library's save/load steps and collectives, timed from outside.

Nothing in ``torchrl_dcp`` is changed: :func:`install` replaces module attributes the
library looks up at call time (``_dist.all_gather``, ``save_engine.write_manifest``, ...)
with wrappers that append ``(name, seconds)`` events to :data:`EVENTS`, and DCP's own
collectives (``_DistWrapper.gather_object`` & co., used inside ``dcp.load``) likewise.
With :data:`PROBE` set, the collectives also record the pickled size of what this rank
sends (``bytes:<name>``): that costs a pickle, so it is only on for an untimed warm-up.

Example:
    >>> from benchmarks import scaling_hooks as hooks
    >>> hooks.install()
    >>> hooks.reset(); hooks.EVENTS
    []
"""

from __future__ import annotations

import functools
import pickle
import time
from collections import defaultdict
from typing import Any

EVENTS: list[tuple[str, float]] = []
PROBE = False
_INSTALLED = False


def reset() -> None:
    EVENTS.clear()


def totals() -> dict[str, float]:
    """Seconds (and probed bytes) per event name, summed over repeated events of one save or load."""
    out: dict[str, float] = defaultdict(float)
    for name, value in EVENTS:
        out[name] += value
    return dict(out)


def exchanges(totals_: dict[str, float]) -> dict[str, int]:
    """How many times each collective ran (``count:`` events), barriers apart from exchanges."""
    counts = {n[6:]: int(v) for n, v in totals_.items() if n.startswith("count:")}
    return {
        "exchanges": sum(v for n, v in counts.items() if n.split(":")[0] in COLLECTIVES),
        "barriers": sum(v for n, v in counts.items() if n.startswith("barrier")),
        "dcp_collectives": sum(v for n, v in counts.items() if n.startswith("dcp_")),
        "by_phase": counts,
    }


COLLECTIVES = ("all_gather", "gather_to_0", "broadcast", "agree")


def _wrap(owner: Any, attr: str, name: str, *, phase_arg: int | None = None, payload_arg: int | None = None) -> None:
    """Replace ``owner.attr`` by a timed wrapper; ``phase_arg``: the positional index of a phase name to append.

    Each call also counts itself (``count:<name>``); an attribute the library no longer has is left alone."""
    fn = getattr(owner, attr, None)
    if fn is None:
        return

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        label = name
        if phase_arg is not None:
            phase = kwargs.get("phase", kwargs.get("step", args[phase_arg] if len(args) > phase_arg else "?"))
            label = f"{name}:{phase}"
        if PROBE and payload_arg is not None and len(args) > payload_arg:
            try:
                EVENTS.append((f"bytes:{label}", float(len(pickle.dumps(args[payload_arg])))))
            except Exception:  # noqa: BLE001 - a probe never breaks the save
                pass
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((label, time.perf_counter() - t))
            EVENTS.append((f"count:{label}", 1.0))

    setattr(owner, attr, timed)


def install() -> None:
    """Wrap the save/load steps, rank 0's commit work and every collective (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    from torch.distributed.checkpoint.utils import _DistWrapper

    from torchrl_dcp import _dist, load_engine, save_engine
    from torchrl_dcp.storage import objectstore_save

    # collectives: the monitored barrier before each, then the exchange itself (its time includes the barrier)
    _wrap(_dist, "sync", "barrier", phase_arg=1)
    _wrap(_dist, "all_gather", "all_gather", phase_arg=2, payload_arg=0)
    _wrap(_dist, "gather_to_0", "gather_to_0", phase_arg=2, payload_arg=0)
    _wrap(_dist, "broadcast_from_0", "broadcast", phase_arg=2, payload_arg=0)
    _wrap(_dist, "agree", "agree", phase_arg=3, payload_arg=0)
    # DCP's collectives inside dcp.load (plan exchange, read confirmation)
    _wrap(_DistWrapper, "gather_object", "dcp_gather", payload_arg=1)
    _wrap(_DistWrapper, "scatter_object", "dcp_scatter", payload_arg=1)
    _wrap(_DistWrapper, "all_gather_object", "dcp_all_gather", payload_arg=1)
    # save steps (every rank) and rank 0's commit work
    for attr in ("encode", "plan_local", "plan_writes", "prepare", "write", "commit"):
        _wrap(save_engine, attr, f"save.{attr}")
    for attr in ("manifest_bytes", "metadata_bytes", "root_manifest"):
        _wrap(save_engine, attr, f"rank0.{attr}")
    _wrap(save_engine, "write_rank_part", "save.shard")  # every rank: its manifest shard and .metadata part
    # object-store saves
    _wrap(objectstore_save, "begin", "rank0.store_begin")
    _wrap(objectstore_save, "finish", "rank0.store_finish")
    _wrap(objectstore_save, "write_share", "save.store_write")
    # load phases
    for attr in ("prepare", "read", "restore"):
        _wrap(load_engine, attr, f"load.{attr}")


def count_s3_requests() -> dict[str, int]:
    """Count s3fs's S3 API calls in this process by operation (``put_object``, ``upload_part``, ...)."""
    import s3fs.core

    counts: dict[str, int] = defaultdict(int)
    original = s3fs.core.S3FileSystem._call_s3

    async def counted(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        counts[getattr(method, "__name__", str(method))] += 1
        return await original(self, method, *args, **kwargs)

    s3fs.core.S3FileSystem._call_s3 = counted  # type: ignore[method-assign]
    return counts

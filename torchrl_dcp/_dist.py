"""Process-group helpers: rank, world size and the dedicated checkpoint group.

Checkpoint collectives run on their own gloo group (created once per default
group and timeout, collectively, at the first save or load) so they never
interleave with the training's NCCL/gloo collectives. Without an initialised
process group the world is one rank and every collective is a no-op.

A collective where a rank may be stuck somewhere else (the first exchange of a save
or load: a rank still training; the commit gather: a rank stuck writing) is preceded
by a *monitored* barrier with the group's timeout: a rank that is stuck (or gone)
turns into a :class:`CollectiveError` on every rank after at most the timeout,
naming the silent ranks, instead of a hang or an anonymous gloo timeout. Rank 0
learns the silent ranks from the barrier and publishes them in the job's store, so
the other ranks' errors name them too. The exchanges in between pass
``monitored=False``: every rank is inside the same checkpoint call there, a dead
rank still raises at once, and a barrier would double their rounds. ``TDCP_MONITOR_ALL=1``
puts the barrier back before every exchange (to name a rank stuck inside a save or load).

Example:
    >>> from torchrl_dcp import _dist
    >>> _dist.all_gather("x", _dist.checkpoint_group())  # one process: a world of one
    ['x']
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import datetime
import gc
import hashlib
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from torchrl_dcp.errors import CollectiveError
from torchrl_dcp.settings import setting

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default for gloo groups

_GROUPS: dict[tuple[int, float | None, int | None, str], Any] = {}
_TIMEOUTS: dict[int, datetime.timedelta] = {}
_NAMES: dict[int, str] = {}  # from what the group is (timeout, members, purpose): the same on every member
_SEQ: dict[int, int] = {}
_CALLS: dict[int, int] = {}  # collectives run on each group, in the same order on every member (absent-rank keys)
_CREATED: dict[str, int] = {}  # groups created per name (timeout, members, purpose): the next one's number
_SILENT = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def forget_groups() -> None:
    """Drop the cached checkpoint groups (their collectives are never used again)."""
    _GROUPS.clear()
    _TIMEOUTS.clear()
    _NAMES.clear()
    _SEQ.clear()
    _CALLS.clear()
    _CREATED.clear()


def _release_at_exit() -> None:
    """Free the checkpoint groups while Python is intact, references from exception tracebacks included.

    A gloo group still alive when the interpreter tears down (e.g. after the job called
    ``destroy_process_group``) is destroyed too late: its C++ destructor aborted the process
    ("terminate called without an active exception", exit -6) in about 1 of 5 runs of a 2-rank job. Failed
    collectives leave it referenced from traceback/frame cycles, which only the cyclic collector frees.
    """
    forget_groups()
    gc.collect()


atexit.register(_release_at_exit)


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def group_rank(group: Any) -> int:
    """This process's rank within ``group`` (a checkpoint group; ``None``: a world of one, rank 0)."""
    return dist.get_rank(group) if group is not None else 0


def group_size(group: Any) -> int:
    """The number of ranks of ``group`` (``None``: 1)."""
    return dist.get_world_size(group) if group is not None else 1


def check_process_group(process_group: Any) -> Any:
    """``process_group`` if it is one this process belongs to (``None``: the whole job), else a clear error."""
    if process_group is None:
        return None
    if not initialized():
        raise ValueError("process_group= needs torch.distributed initialised (init_process_group) first")
    if type(process_group) is int and process_group == dist.GroupMember.NON_GROUP_MEMBER:  # (new_group's, elsewhere)
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the process_group given (new_group returned its placeholder "
            "for the ranks it leaves out): only its ranks build the checkpoint (the others need not)"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup, got {type(process_group).__name__}")
    if dist.get_rank(process_group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the process_group given: only its ranks build the "
            "checkpoint (the others need not)"
        )
    return process_group


def checkpoint_group(
    timeout: datetime.timedelta | None = None, process_group: Any = None, purpose: str = "checkpoint"
) -> Any:
    """The gloo group used for checkpoint collectives; ``None`` without an initialised process group.

    Collective on the first call per timeout: over the whole job (every rank calls it), or, with
    ``process_group``, over that group's ranks only (the others need not call it: a learner-only
    subgroup checkpoints while the other ranks run their own work). ``purpose="control"`` is a
    second group for the decisions a training loop takes while an async save's background
    thread runs its collectives on the first (two threads never share a group).
    """
    if not initialized():
        return None
    world = id(dist.group.WORLD)
    seconds = None if timeout is None else timeout.total_seconds()
    if any(key[0] != world for key in _GROUPS):  # the default group was re-initialised
        forget_groups()
    scope = None if process_group is None or process_group is dist.group.WORLD else id(process_group)
    group = _GROUPS.get((world, seconds, scope, purpose))
    if group is None:
        kwargs: dict[str, Any] = {"backend": "gloo"}
        if timeout:
            kwargs["timeout"] = timeout
        members = "world"
        if scope is not None:
            ranks = dist.get_process_group_ranks(process_group)
            kwargs.update(ranks=ranks, use_local_synchronization=True)
            members = ",".join(map(str, sorted(ranks)))  # the same on every member (an id() is not)
        # numbered: two user groups of the same ranks, or a group made again after a failed collective broke the
        # last one, get names of their own (every member creates its groups in the same order: calls are collective)
        base = f"{seconds}-{members}-{purpose}"
        name = f"{base}-{_CREATED.get(base, 0)}"
        wait = (timeout or DEFAULT_TIMEOUT).total_seconds()
        try:
            group = _within(
                wait + _GROUP_GRACE,
                lambda: _members_only_group(kwargs, name) if scope is not None else dist.new_group(**kwargs),
            )
        except (RuntimeError, TimeoutError) as err:  # its rendezvous (DistError; gloo's connectFullMesh: RuntimeError)
            why = "it did not end" if isinstance(err, TimeoutError) else str(err).splitlines()[0][:200]
            raise CollectiveError(
                f"the ranks ({members}) did not all reach their first checkpoint call within {wait:.0f} s (creating "
                f"the checkpoint process group failed: {type(err).__name__}: {why}): a "
                "rank is stuck or dead, called no checkpoint operation, or failed before it (its own error says "
                "which); every rank must call save, load and resume alike"
            ) from err
        _CREATED[base] = _CREATED.get(base, 0) + 1
        _GROUPS[(world, seconds, scope, purpose)] = group
        _TIMEOUTS[id(group)] = timeout or DEFAULT_TIMEOUT
        _NAMES[id(group)] = name  # store keys of silent-rank reports: one per group
    return group


def _discard(group: Any) -> None:
    """Stop using ``group`` after one of its collectives failed: a gloo timeout or a lost peer closes its
    connections for good, so the next checkpoint call creates a new group (on every member: each raised)."""
    for key, cached in list(_GROUPS.items()):
        if cached is group:
            del _GROUPS[key]


def ranks_named(group: Any, ranks: str) -> str:
    """``ranks`` (group ranks, "1, 2") with their global ranks, when ``group`` is a subgroup."""
    try:
        if dist.get_world_size(group) == dist.get_world_size():
            return ranks
        return ", ".join(f"{r} (global rank {dist.get_global_rank(group, int(r))})" for r in ranks.split(","))
    except (ValueError, RuntimeError):
        return ranks


#: seconds a group's creation may run past its timeout before it is given up (gloo's rendezvous blocks past its own
#: timeout when a peer dies while it connects)
_GROUP_GRACE = 10.0


def _within(seconds: float, create: Any) -> Any:
    """``create()``, given up with a ``TimeoutError`` after ``seconds`` (the creation goes on in a daemon thread:
    a job whose peer died has no use for it)."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["value"] = create()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = err

    thread = threading.Thread(target=run, name="tdcp-group-creation", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"still running after {seconds:.0f} s")
    if "error" in done:
        raise done["error"]
    return done["value"]


def _members_only_group(kwargs: dict[str, Any], name: str) -> Any:
    """``dist.new_group(**kwargs)`` called by a group's members only, without moving the job's group counter.

    torch 2.14 counts group creations in ``_world.group_count`` on every rank that calls ``new_group`` and salts
    the names of later groups with it: created by some ranks only, the counters part, and the next group any code
    creates on every rank gets other names on other ranks (a deadlock until the store times out). So the counter
    is set, for this creation, to a salt of its own (from ``name``: the same on every member, never a count the
    job reaches) and put back after.
    """
    world = getattr(c10d, "_world", None)
    count = getattr(world, "group_count", None)
    if not isinstance(count, int):  # another torch: nothing to keep in step
        return dist.new_group(**kwargs)
    salt = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "little")
    world.group_count = (1 << 62) + salt
    try:
        return dist.new_group(**kwargs)
    finally:
        world.group_count = count


def group_timeout(group: Any) -> datetime.timedelta:
    return _TIMEOUTS.get(id(group), DEFAULT_TIMEOUT)


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no store (custom init); errors just name fewer ranks
        return None


def sync(group: Any, phase: str) -> None:
    """Monitored barrier: every rank arrives within the timeout, or every rank raises naming the silent ones."""
    if group is None:
        return
    seq = _SEQ.get(id(group), 0) + 1
    _SEQ[id(group)] = seq
    timeout = group_timeout(group)
    me = dist.get_rank(group)
    start = time.monotonic()
    try:
        dist.monitored_barrier(group, timeout=timeout, wait_all_ranks=True)
        return
    except RuntimeError as err:
        text = str(err)
    elapsed = time.monotonic() - start
    _discard(group)
    key = f"torchrl_dcp/silent/{_NAMES.get(id(group), 'g')}/{seq}"
    store = _store()
    silent = None
    found = _SILENT.search(text)
    if found:
        silent = found.group(1).strip()
        if store is not None:
            try:
                store.set(key, silent)
            except Exception:
                pass
    elif store is not None and me != 0:
        try:  # rank 0 publishes who it was waiting for when its own barrier times out
            store.wait([key], datetime.timedelta(seconds=min(10.0, timeout.total_seconds())))
            silent = store.get(key).decode()
        except Exception:
            silent = None
    seconds = f"{timeout.total_seconds():g} s"
    if silent is not None:
        who = f"rank{'s' if ',' in silent else ''} {ranks_named(group, silent)}"
        raise CollectiveError(
            f"{not_reached(who, phase, elapsed, timeout)} {outcome(phase)} Check that rank's log; raise "
            "DistributedCheckpoint(timeout=...) if it is only slow"
        ) from None
    if "Connection closed by peer" in text or "Connection reset" in text:
        raise CollectiveError(
            f"a rank died during the checkpoint collective ({phase}) (gloo: {_last_line(text)}). {outcome(phase)} "
            "Check the logs of the other ranks"
        ) from None
    if me == 0:
        raise CollectiveError(
            f"the checkpoint collective ({phase}) failed on the coordinator (rank 0) within {seconds}: a rank is "
            f"stuck, dead or unreachable. {outcome(phase)} (gloo: {_last_line(text)})"
        ) from None
    raise CollectiveError(
        f"rank 0 (the coordinator) did not answer within {seconds} at the checkpoint collective ({phase}): it is "
        f"stuck or dead, or waiting for another rank (its error names it). {outcome(phase)} (gloo: "
        f"{_last_line(text)})"
    ) from None


def not_reached(who: str, phase: str, elapsed: float, timeout: datetime.timedelta) -> str:
    """How ``who`` failed to reach a collective: silent for the whole timeout, or gone before it (its process exited
    or crashed: the connection broke after ``elapsed`` seconds).

    Example:
        >>> not_reached("rank 1", "planning", 1.4, datetime.timedelta(seconds=6))
        'rank 1 did not reach the checkpoint collective (planning): it left after 1.4 s, before the 6 s timeout (its process exited or crashed).'
    """
    limit = timeout.total_seconds()
    if elapsed < 0.9 * limit:
        return (
            f"{who} did not reach the checkpoint collective ({phase}): it left after {elapsed:.1f} s, before the "
            f"{limit:g} s timeout (its process exited or crashed)."
        )
    return f"{who} did not reach the checkpoint collective ({phase}) within {limit:g} s: stuck or dead."


_READING: contextvars.ContextVar[bool] = contextvars.ContextVar("torchrl_dcp_reading", default=False)


@contextlib.contextmanager
def reading() -> Iterator[None]:
    """Collectives inside run for a load or a resume: their failures say nothing was written (not "committed")."""
    token = _READING.set(True)
    try:
        yield
    finally:
        _READING.reset(token)


#: phases that run once the save is committed (its manifest published): a failure there leaves it committed, or
#: not, depending on how far the coordinator got
AFTER_COMMIT = frozenset({"confirming the commit", "rotating checkpoints"})


def outcome(phase: str) -> str:
    """What a collective failure in ``phase`` left: nothing committed, or, after the commit, a save that may be (a
    load's: nothing written)."""
    if _READING.get():
        return "Nothing was saved; the checkpoints being read are unchanged."
    if phase in AFTER_COMMIT:
        return (
            "The checkpoint may be committed (this phase runs after its commit): `latest()` or `verify` says; the "
            "checkpoints committed before it are intact."
        )
    return "Nothing was committed; the previous checkpoint is intact."


def _barrier_unless_inside(monitored: bool, group: Any, phase: str) -> None:
    """The monitored barrier of a collective, unless it runs inside a checkpoint call (``monitored=False``) and
    ``TDCP_MONITOR_ALL`` is not set."""
    if monitored or setting("TDCP_MONITOR_ALL"):
        sync(group, phase)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no details"


def _collective(fn: Any, phase: str, group: Any = None) -> Any:
    call = 0
    if group is not None:
        call = _CALLS[id(group)] = _CALLS.get(id(group), 0) + 1
    start = time.monotonic()
    try:
        return fn()
    except RuntimeError as err:
        if group is not None:
            _discard(group)
            text = str(err)
            dead = "Connection closed by peer" in text or "Connection reset" in text  # (said at once, as before)
            absent = [] if dead else _absent_ranks(group, call)
            if absent:
                who = f"rank{'s' if len(absent) > 1 else ''} {ranks_named(group, ', '.join(map(str, absent)))}"
                waited = not_reached(who, phase, time.monotonic() - start, group_timeout(group))
                raise CollectiveError(
                    f"{waited} {outcome(phase)} Check that rank's log; raise DistributedCheckpoint(timeout=...) if it "
                    f"is only slow (gloo: {_last_line(str(err))})"
                ) from None
        raise CollectiveError(
            f"checkpoint collective ({phase}) failed: a rank died, the connection broke or a rank did not answer "
            f"within the timeout (gloo: {_last_line(str(err))}). {outcome(phase)}"
        ) from None


def _absent_ranks(group: Any, call: int) -> list[int]:
    """After collective number ``call`` of ``group`` failed here: the members that never reached it (``[]`` when
    every member did, or when the job's store cannot say). Each member whose collective failed publishes its arrival
    in the store and waits a little for the others'; a rank stuck elsewhere (or dead) publishes nothing. Costs
    nothing until a collective fails (collectives taken at every step run without a monitored barrier)."""
    store = _store()
    if store is None:
        return []
    seen: tuple[int, list[int]] | None = None  # (count, the members not arrived) at the last change of the count
    try:
        me, size = dist.get_rank(group), dist.get_world_size(group)
        prefix = f"torchrl_dcp/arrived/{_NAMES.get(id(group), 'g')}/{call}/"
        store.set(f"{prefix}{me}", b"1")
        arrived = store.add(f"{prefix}count", 1)
        start = time.monotonic()
        deadline = start + min(10.0, group_timeout(group).total_seconds())
        while arrived < size and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add(f"{prefix}count", 0)
            if time.monotonic() - start >= 1.0 and (seen is None or seen[0] != arrived):
                seen = (arrived, [r for r in range(size) if not store.check([f"{prefix}{r}"])])
        if arrived >= size:
            return []
        return [r for r in range(size) if not store.check([f"{prefix}{r}"])]
    except Exception:  # noqa: BLE001 - the store went with the rank that hosted it (a job started without an agent,
        # whose rank 0 raised and exited after its own wait): who had come by then, else the plain error
        return seen[1] if seen is not None else []


_TAG = "torchrl_dcp"


def _sealed(obj: Any, kind: str, phase: str) -> tuple[str, str, str, Any]:
    """``obj`` as it travels: tagged with the kind of exchange it belongs to (and the phase, for messages)."""
    return (_TAG, kind, phase, obj)


def _opened(items: list[Any], kind: str, phase: str, group: Any, ranks: list[int] | None = None) -> list[Any]:
    """The objects of ``items`` (from ranks ``ranks``, default 0, 1, ...), each checked to belong to an exchange of
    ``kind``: a rank at another checkpoint exchange (one rank saving while another loads, one retrying what another
    gave up) sent something else, which would be read as garbage; every rank raises naming it instead."""
    out = []
    for i, item in enumerate(items):
        rank = i if ranks is None else ranks[i]
        if not (isinstance(item, tuple) and len(item) == 4 and item[0] == _TAG and item[1] == kind):
            other = item[2] if isinstance(item, tuple) and len(item) == 4 and item[0] == _TAG else "another exchange"
            raise CollectiveError(
                f"rank {ranks_named(group, str(rank))} was at another checkpoint exchange ({other}) than this rank "
                f"({phase}): every rank must "
                "call save, load, resume and the rotation's calls alike and in the same order; nothing was committed"
            )
        out.append(item[3])
    return out


def all_gather(
    obj: Any, group: Any, phase: str = "exchanging status", *, monitored: bool = True, kind: str = "all_gather"
) -> list[Any]:
    """Every rank's ``obj`` (live, trusted values between our own ranks; never checkpoint content), each checked to
    come from an exchange of the same ``kind`` (:func:`_opened`)."""
    if group is None:
        return [obj]
    _barrier_unless_inside(monitored, group, phase)
    out: list[Any] = [None] * dist.get_world_size(group)
    _collective(lambda: dist.all_gather_object(out, _sealed(obj, kind, phase), group=group), phase, group)
    return _opened(out, kind, phase, group)


def gather_to_0(
    obj: Any, group: Any, phase: str = "gathering to rank 0", *, monitored: bool = True, kind: str = "gather_to_0"
) -> list[Any] | None:
    if group is None:
        return [obj]
    _barrier_unless_inside(monitored, group, phase)
    out: list[Any] | None = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    _collective(lambda: dist.gather_object(_sealed(obj, kind, phase), out, group=group, group_dst=0), phase, group)
    return None if out is None else _opened(out, kind, phase, group)


def any_rank(flags: list[bool], group: Any, phase: str = "agreeing") -> list[bool]:
    """Element-wise OR of every rank's ``flags``: one small ``all_reduce``, without a monitored barrier.

    For decisions taken at every training step (is a save due, has any rank been preempted), where
    a barrier would double the cost; a rank that is gone still turns into a :class:`CollectiveError`.
    """
    if group is None:
        return list(flags)
    import torch

    values = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int64)
    _collective(lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group), phase, group)
    return [bool(v) for v in values.tolist()]


def scatter_from_0(
    objs: list[Any] | None,
    group: Any,
    phase: str = "scatter from rank 0",
    *,
    monitored: bool = True,
    kind: str = "scatter_from_0",
) -> Any:
    """Rank 0 hands ``objs[r]`` to each rank ``r`` (others pass ``None``): each rank receives its own part only."""
    if group is None:
        assert objs is not None
        return objs[0]
    _barrier_unless_inside(monitored, group, phase)
    box: list[Any] = [None]
    sent = [_sealed(o, kind, phase) for o in objs] if dist.get_rank(group) == 0 and objs is not None else None
    _collective(lambda: dist.scatter_object_list(box, sent, group=group, group_src=0), phase, group)
    return _opened(box, kind, phase, group, [0])[0]


def agree(flags: list[bool], digest: int, group: Any, phase: str, *, monitored: bool = True) -> tuple[list[bool], bool]:
    """Element-wise OR of every rank's ``flags``, and whether every rank's ``digest`` is the same.

    One monitored barrier (unless ``monitored=False``) and one ``all_reduce`` of ``len(flags) + 2`` integers: what every rank
    sends and receives does not grow with the world size (unlike an ``all_gather`` of what each
    rank holds). ``digest`` is any integer (a hash of what must be the same everywhere).

    Example (one process):
        >>> agree([False, True], 7, None, "agreeing")
        ([False, True], True)
    """
    if group is None:
        return list(flags), True
    import torch

    _barrier_unless_inside(monitored, group, phase)
    folded = digest & ((1 << 62) - 1)  # non-negative and negatable in int64: max(d) == -max(-d) iff all equal
    values = torch.tensor([1 if f else 0 for f in flags] + [folded, -folded], dtype=torch.int64)
    _collective(lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group), phase, group)
    out = values.tolist()
    return [bool(v) for v in out[: len(flags)]], out[-2] == -out[-1]


def broadcast_from_0(
    obj: Any, group: Any, phase: str = "broadcast from rank 0", *, monitored: bool = True, kind: str = "broadcast"
) -> Any:
    if group is None:
        return obj
    _barrier_unless_inside(monitored, group, phase)
    box = [_sealed(obj, kind, phase)]
    _collective(lambda: dist.broadcast_object_list(box, group=group, group_src=0), phase, group)
    return _opened(box, kind, phase, group, [0])[0]

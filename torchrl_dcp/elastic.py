"""``init_process_group`` that survives ``torchrun --max-restarts``: one store namespace per start of the workers.

Under ``torchrun`` the workers' ``env://`` rendezvous is a client of the agent's store, and the
agent keeps that store (``MASTER_PORT``) across restarts. torch 2.14's ``env://`` handler adds no
per-attempt prefix, so restarted workers can read the addresses their dead predecessors published
and gloo fails with ``connectFullMesh ... Connection refused`` (measured here: restarts of a 2-rank
``--standalone`` job and of a 2-node job failed that way). ``TORCHELASTIC_RESTART_COUNT`` cannot
name the attempt: an agent whose workers were healthy restarts them after another node's failure
without counting it, so two nodes can disagree.

:func:`init_process_group` counts instead how many workers with this ``RANK`` (in a world of this
``WORLD_SIZE``) have started, in the agent's store: every start of the job's workers starts each
rank once, so every rank of one start computes the same count, and the process group meets in the
namespace ``torchrl_dcp/start-<count>``, which no earlier start wrote. Outside ``torchrun``, or
without the agent's store, it is ``torch.distributed.init_process_group``.

Example:
    >>> import torchrl_dcp as tdcp
    >>> tdcp.init_process_group("gloo")  # doctest: +SKIP
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

_start: int | None = None  # this worker's start count, set by init_process_group under torchrun's agent store


def start_count() -> int | None:
    """How many times this rank has been started in this ``torchrun`` job, this start included.

    ``1`` on the first start, more after ``torchrun --max-restarts`` restarted the workers (whichever
    node failed: unlike ``TORCHELASTIC_RESTART_COUNT``, every rank of one start agrees). ``None`` when
    the process group was not made by :func:`init_process_group` under ``torchrun``'s agent store.

    Example:
        >>> import torchrl_dcp as tdcp
        >>> restarted = (tdcp.start_count() or 1) > 1
    """
    return _start


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``, restart-safe under ``torchrun``.

    With ``torchrun``'s agent store (``TORCHELASTIC_USE_AGENT_STORE=True``) and no ``store`` or
    ``init_method`` given, the process group meets in a namespace of the agent's store that only
    this start of the workers uses (see the module docstring). A worker that dies before it calls
    this leaves its rank's count behind for the rest of the job: every later start then fails to form the
    group (at the store's timeout, the group's ``timeout``, 30 minutes by default, or refused at once) instead of
    joining stale peers. Call it first thing in the worker, before anything that can fail.
    """
    env = os.environ
    if (
        kwargs.get("store") is not None
        or kwargs.get("init_method") is not None
        or env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
    ):
        dist.init_process_group(backend, **kwargs)
        return
    timeout = kwargs.get("timeout")  # the backend's own default when not given (NCCL's differs from gloo's)
    client = dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=timeout or datetime.timedelta(minutes=30),
    )
    rank, world = (
        int(kwargs.setdefault("rank", int(env["RANK"]))),
        int(kwargs.setdefault("world_size", int(env["WORLD_SIZE"]))),
    )
    global _start
    start = client.add(f"torchrl_dcp/starts/world-{world}/rank-{rank}", 1)
    dist.init_process_group(backend, store=dist.PrefixStore(f"torchrl_dcp/start-{start}", client), **kwargs)
    _start = start

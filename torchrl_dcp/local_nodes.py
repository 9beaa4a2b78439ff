"""Which node each rank runs on, where its local-tier replicas go, and which step the tier can restore.

A local tier's parts live on nodes: :class:`NodeLayout` names each rank's node (:func:`node_identity`,
gathered once per group) and the ranks on other nodes that hold its replicas; at a resume,
:func:`newest_complete` picks the newest step whose every rank's part some rank holds.

Example:
    >>> layout = NodeLayout(("a", "a", "b", "b"))
    >>> newest_complete([[(4, 0, "s", 3, 10.0, None)], [(4, 1, "s", 3, 10.0, None)], [], []], 2, (), layout)
    (4, 's', {0: [0], 1: [1]}, 3)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any


def node_identity() -> str:
    """What names this process's node: ``GROUP_RANK`` (the agent's rank, set by ``torchrun``), else the host name."""
    agent = os.environ.get("GROUP_RANK")
    return f"agent-{agent}" if agent is not None else f"host-{socket.gethostname()}"


@dataclass(frozen=True)
class NodeLayout:
    """Which node each rank of the group runs on, and where each rank's replicas go.

    Nodes are ordered by their lowest rank; rank ``i``-th of its node sends its replica ``k``
    (1-based) to the ``i``-th rank (modulo) of the ``k``-th next node, never to its own node.

    Example:
        >>> layout = NodeLayout(("a", "a", "b", "b"))
        >>> layout.targets(0, 1), layout.sources(2, 1), layout.leader(3)
        ([2], [0], False)
    """

    nodes: tuple[str, ...]

    def _order(self) -> tuple[list[str], dict[str, list[int]]]:
        members: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            members.setdefault(node, []).append(rank)
        return list(members), members

    def targets(self, rank: int, replicas: int) -> list[int]:
        order, members = self._order()
        n = order.index(self.nodes[rank])
        i = members[self.nodes[rank]].index(rank)
        out = []
        for k in range(1, min(replicas, len(order) - 1) + 1):
            ranks = members[order[(n + k) % len(order)]]
            out.append(ranks[i % len(ranks)])
        return out

    def sources(self, rank: int, replicas: int) -> list[int]:
        return [r for r in range(len(self.nodes)) if rank in self.targets(r, replicas)]

    def leader(self, rank: int) -> bool:
        """Whether ``rank`` is its node's first rank (the one that prunes the node's tier)."""
        return self.nodes.index(self.nodes[rank]) == rank

    def node_count(self) -> int:
        return len(set(self.nodes))


def newest_complete(
    held: list[list[tuple[Any, ...]]],
    world: int,
    refused: Collection[tuple[int, str, int, str]],
    layout: NodeLayout,
) -> tuple[int, str, dict[int, list[int]], int] | None:
    """The newest ``(step, save_id)`` whose every rank's part some rank holds, with the holders of each part and the
    shared-tier commit its records name (``local_records.HeldPart.shared_sequence``: parts whose records differ there
    are not one save's); ``held``: each rank's parts as :func:`~torchrl_dcp.local_records.plain` gives them;
    ``refused``: copies ``(step, save_id, part's rank, node)`` not to count (found damaged; ``layout`` names the
    holders' nodes). Parts of an abandoned future do not count (:func:`abandoned`: a
    node back with steps a later run, found on another node, rolled back past)."""
    runs = {tuple(part[5]) for parts in held for part in parts if part[5] is not None}
    found: dict[tuple[int, str, int], dict[int, list[int]]] = {}
    for holder, parts in enumerate(held):
        for step, owner, save_id, shared_sequence, saved_at, run in parts:
            own = None if run is None else tuple(run)
            if (step, save_id, owner, layout.nodes[holder]) in refused or abandoned(step, saved_at, runs, own):
                continue
            found.setdefault((step, save_id, shared_sequence), {}).setdefault(owner, []).append(holder)
    complete = [key for key, owners in found.items() if sorted(owners) == list(range(world))]
    if not complete:
        return None
    step, save_id, shared_sequence = max(complete)
    return step, save_id, found[(step, save_id, shared_sequence)], shared_sequence


def abandoned(
    step: int, saved_at: float | None, runs: Iterable[tuple[int, float]], own: tuple[int, float] | None = None
) -> bool:
    """Whether a part of ``step`` saved at ``saved_at`` by the run ``own`` is an abandoned future: another, later run
    (one of ``runs``, the runs that saved the parts found anywhere: ``(step resumed, when)``) resumed an older step
    after it was saved. Such a run rolled back past it (it could not reach the part, or chose an older step): the
    part's node may come back with it, but the job went on from elsewhere. Compares clocks: the nodes' (within
    seconds of each other, as NTP keeps them) against the time between a run's last save and the next run's resume;
    never a part's own run's (its ranks' clocks may differ by more than its first save took).

    Example:
        >>> abandoned(12, 100.0, [(8, 160.0)]), abandoned(10, 170.0, [(8, 160.0)]), abandoned(12, None, [(8, 160.0)])
        (True, False, False)
        >>> abandoned(12, 159.9, [(8, 160.0)], own=(8, 160.0))  # (its own run's rank 0 a little ahead)
        False
    """
    return saved_at is not None and any(
        (resumed, at) != own and at > saved_at and resumed < step for resumed, at in runs
    )

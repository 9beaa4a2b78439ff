"""Two "nodes" on this machine: separate ``torchrun --nnodes 2`` agents, c10d rendezvous, private TMPDIRs.

Ranks 0-1 run under one agent and ranks 2-3 under the other, each agent with its own
temporary directory and working directory; only the checkpoint directory is shared (as
on NFS or Lustre). A run killed mid-way and resumed must end bit for bit where an
uninterrupted run ends.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests_distributed.launch import torchrun_nodes

DEMO = "torchrl_dcp.examples.demo"


def finals(runs: list) -> dict[str, str]:
    out: dict[str, str] = {}
    for run in runs:
        out.update(re.findall(r"rank (\d+) final step \d+ (weights \S+ seen \S+)", run.stdout))
    return out


def _ok(runs: list) -> bool:
    return all(r.returncode == 0 for r in runs)


def _text(runs: list) -> str:
    return "\n".join(
        f"--- node {i} (exit {r.returncode})\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}" for i, r in enumerate(runs)
    )


@pytest.mark.slow
def test_two_nodes_killed_and_resumed_match_uninterrupted(tmp_path: Path) -> None:
    args = ("--steps", "30", "--save-every", "10")
    ref = torchrun_nodes(DEMO, *args, "--ckpt-dir", str(tmp_path / "ref"), root=tmp_path / "a")
    assert _ok(ref), _text(ref)
    assert sorted(finals(ref)) == ["0", "1", "2", "3"], _text(ref)
    killed = torchrun_nodes(
        DEMO, *args, "--kill-at-step", "15", "--ckpt-dir", str(tmp_path / "run"), root=tmp_path / "b"
    )
    assert not _ok(killed) and not finals(killed)
    resumed = torchrun_nodes(DEMO, *args, "--resume", "--ckpt-dir", str(tmp_path / "run"), root=tmp_path / "c")
    assert _ok(resumed), _text(resumed)
    assert any("resumed from" in r.stdout for r in resumed)
    assert finals(resumed) == finals(ref)
    # nothing of the checkpoint's machinery was left in a node's private TMPDIR
    for node_tmp in (tmp_path / x / f"node{i}" / "tmp" for x in "abc" for i in (0, 1)):
        assert not [p for p in node_tmp.rglob("*") if ".tdcp-" in p.name], list(node_tmp.rglob("*"))

"""An export replacing an older one: a process killed at any moment leaves one whole export at the path, and the next
export sweeps what the killed one left beside it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torchrl_dcp as tdcp

# Exports ``src`` over ``dst`` (overwrite=True), killing itself with SIGKILL right after its ``kill_after``-th rename
# (``os.rename`` or the ``renameat2`` the commit uses): the states a kill can leave.
KILLED_EXPORT = """
import os, signal, sys
import torchrl_dcp as tdcp
from torchrl_dcp.storage import commit

src, dst, fmt, kill_after = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
calls = [0]

def counted(real):
    def rename(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return rename

os.rename = counted(os.rename)
commit._renameat2 = counted(commit._renameat2)
tdcp.export_torchrl(src, dst, ["policy"], format=fmt, overwrite=True)
print("finished", calls[0])
"""

LOAD = """
import sys, torch
from torchrl.checkpoint import Checkpoint
policy = torch.nn.Linear(8, 4)
Checkpoint(policy=policy).load(sys.argv[1])
print(float(policy.weight.sum()))
"""


def _saved(tmp_path: Path, name: str, seed: int) -> tuple[Path, float]:
    torch.manual_seed(seed)
    policy = torch.nn.Linear(8, 4)
    return tdcp.DistributedCheckpoint(policy=policy).save(tmp_path / name), float(policy.weight.detach().sum())


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("fmt", ["directory", "archive"])
def test_an_export_killed_at_any_rename_leaves_the_old_or_the_new_export_and_the_next_one_sweeps(
    tmp_path: Path, fmt: str
) -> None:
    """The old export was renamed aside, then the new one renamed in: killed in between, the path held no export
    (the old one hidden as ``.<name>.replaced-<hex>``, never swept). The two are now exchanged in one step, and
    what a killed export leaves beside the path (its staging) is removed by the next export to it."""
    old_src, old_sum = _saved(tmp_path, "old", 0)
    new_src, new_sum = _saved(tmp_path, "new", 1)
    out = tmp_path / "exports" / "policy.torchrl"
    finished = False
    kill_after = 0
    while not finished:
        kill_after += 1
        tdcp.export_torchrl(old_src, out, ["policy"], format=fmt, overwrite=True)
        killed = _run(KILLED_EXPORT, str(new_src), str(out), fmt, str(kill_after))
        finished = killed.returncode == 0
        assert finished or killed.returncode == -9, killed.stderr[-2000:]
        loaded = _run(LOAD, str(out))
        assert loaded.returncode == 0, f"killed after rename {kill_after}: {loaded.stderr[-1500:]}"
        assert float(loaded.stdout.split()[-1]) in (old_sum, new_sum)
        if finished:
            assert float(loaded.stdout.split()[-1]) == new_sum
        tdcp.export_torchrl(new_src, out, ["policy"], format=fmt, overwrite=True)  # sweeps what the killed one left
        assert sorted(p.name for p in out.parent.iterdir()) == ["policy.torchrl"], kill_after
    assert kill_after >= 2  # (the replacement renamed at least once before it finished)


# Exports ``src`` to ``dst``, killing itself with SIGKILL once torchrl has made its temporary ``what`` (its staging
# directory, ``stage``, or its archive before the rename, ``archive``) beside our staging entry.
KILLED_IN_TORCHRL = """
import os, signal, sys, zipfile
from pathlib import Path
import torchrl_dcp as tdcp

src, dst, fmt, what = sys.argv[1:5]
real_mkdir, real_zip = Path.mkdir, zipfile.ZipFile.__init__

def mkdir(self, *args, **kwargs):
    real_mkdir(self, *args, **kwargs)
    if what == "stage" and ".stage-" in self.name:
        (self / "components").mkdir()
        os.kill(os.getpid(), signal.SIGKILL)

def zip_init(self, file, mode="r", *args, **kwargs):
    real_zip(self, file, mode, *args, **kwargs)
    if what == "archive" and mode == "w" and ".archive-" in str(file):
        os.kill(os.getpid(), signal.SIGKILL)

Path.mkdir, zipfile.ZipFile.__init__ = mkdir, zip_init
tdcp.export_torchrl(src, dst, ["policy"], format=fmt, overwrite=True)
"""


@pytest.mark.parametrize(("fmt", "what"), [("directory", "stage"), ("archive", "stage"), ("archive", "archive")])
def test_what_torchrl_made_beside_a_killed_exports_staging_is_swept_by_the_next_export(
    tmp_path: Path, fmt: str, what: str
) -> None:
    """torchrl's save makes ``.<target>.stage-<hex>`` (and ``.archive-<hex>``) beside its target, our staging entry:
    a killed export left ``..policy.torchrl.tdcp-staging-<hex>.stage-<hex>``, which no later export removed."""
    src, _ = _saved(tmp_path, "src", 0)
    out = tmp_path / "exports" / "policy.torchrl"
    tdcp.export_torchrl(src, out, ["policy"], format=fmt)
    killed = _run(KILLED_IN_TORCHRL, str(src), str(out), fmt, what)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert any(f".{what}-" in p.name for p in out.parent.iterdir())
    (out.parent / ".mine.stage-0").mkdir()  # a user's, named alike but of no export: kept
    tdcp.export_torchrl(src, out, ["policy"], format=fmt, overwrite=True)
    assert sorted(p.name for p in out.parent.iterdir()) == [".mine.stage-0", "policy.torchrl"]

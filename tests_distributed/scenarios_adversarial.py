"""The generated adversarial suite (``tests/test_adversarial.py``) on 2 real ranks: a forged 2-rank checkpoint is
refused on every rank with every live object unchanged, or loads on every rank exactly as its files say.

One launch runs every case: rank 0 forges a copy of the pristine checkpoint (the single-process suite's forger and
mutations, resealing every checksum), both ranks load it into fresh objects, and each rank reports what happened.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import torchrl_dcp as tdcp
import torchrl_dcp.chunking as chunking


def _suite() -> Any:
    """The single-process suite's module (its objects, kinds, mutations and forger)."""
    from tests import test_adversarial

    return test_adversarial


def _objects(seed: int) -> dict[str, Any]:
    """The suite's objects; rank 1's per-rank state differs from rank 0's (one more buffer row, its own stream)."""
    objs = _suite().make_objects(seed)
    if dist.get_rank() == 1:
        from tensordict import TensorDict

        objs["rb"].extend(TensorDict({"obs": torch.full((1, 3), 7.0), "r": torch.tensor([70])}, [1]))
        objs["gen"].manual_seed(seed + 1000)
    return objs


def save_pristine(root: str) -> None:
    """The pristine 2-rank checkpoint ``root/c`` and the same job saved again from other values, ``root/other``."""
    old = chunking.CHUNK_BYTES, chunking.MIN_CHUNKED_BYTES
    chunking.CHUNK_BYTES, chunking.MIN_CHUNKED_BYTES = 4096, 8192  # the big tensor is cut into chunk files
    try:
        tdcp.DistributedCheckpoint(**_objects(1)).save(Path(root) / "c", step=1)
        tdcp.DistributedCheckpoint(**_objects(2)).save(Path(root) / "other", step=2)
    finally:
        chunking.CHUNK_BYTES, chunking.MIN_CHUNKED_BYTES = old


def run_cases(root: str, cases: list[list[str]]) -> list[dict[str, Any]]:
    """Every ``[kind, mutation]`` case on the 2-rank checkpoint; per case what this rank saw."""
    adv = _suite()
    rank = dist.get_rank()
    base = Path(root)
    pristine = adv.Pristine(base / "c", base / "other", adv.forging.read_parts(base / "c"))
    out: list[dict[str, Any]] = []
    for i, (kind, name) in enumerate(cases):
        mutation = adv.MUTATIONS[name]
        forged = base / f"case-{i}"
        found: list[Any] = [None, None, False]
        if rank == 0:
            shutil.copytree(pristine.path, forged)
            forger = adv.Forger(forged, adv.KINDS[kind], pristine)
            names = mutation.names(forger)
            mutation.apply(forger)
            if forger.mirrored:  # records moved in the manifest's storage entries too: an error may name either
                names = (*names, "manifest")
            try:
                tdcp.verify(forged)
                found = [list(names), None, forger.unread]
            except Exception as err:  # noqa: BLE001 - judged by the test
                found = [list(names), f"{type(err).__name__}: {err}", forger.unread]
        dist.broadcast_object_list(found, src=0)
        names, verify_error, unread = found
        objs = _objects(5)
        before = adv.snapshot(objs)
        error = None
        with adv.deadline(adv.CASE_SECONDS):
            try:
                tdcp.DistributedCheckpoint(**objs).load(forged)
            except Exception as err:  # noqa: BLE001 - judged by the test
                error = err
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error is not None)
        result: dict[str, Any] = {
            "case": f"{kind}-{name}",
            "names": names,
            "verify_error": verify_error,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "checkpoint_error": isinstance(error, tdcp.CheckpointError),
            "changed": [],
            "problems": [],
            "must_refuse": mutation.must_refuse,
            "compatibility": mutation.compatibility,
            "tools_only": mutation.tools_only,
            "unread": unread,  # only .metadata forged: loads do not read it, they restore the saved state
        }
        if error is not None:
            after = adv.snapshot(objs)
            result["changed"] = [k for k in before if not adv.same(before[k], after[k])]
        elif not any(errors):  # loaded on every rank: the objects, saved again, hold exactly the forged files
            try:  # (the saved ones, when only .metadata was forged)
                adv.holds_exactly_the_files(objs, pristine.path if unread else forged, base / f"resaved-{i}")
            except adv.Untrusted as err:
                result["problems"].append(f"the load accepted files that do not decode: {err}")
            except AssertionError as err:
                result["problems"].append(str(err).split("\n")[0])
        out.append(result)
        dist.barrier()
    return out

"""A child process that saves to S3 and SIGKILLs itself at a chosen phase (run by test_objectstore_kill.py).

Usage: ``python tests/objectstore_child.py <url> <step> <phase>``; the local S3 server comes from
fsspec's configuration (``FSSPEC_S3_*`` in the environment). Phases: ``none``, ``before_data``
(marker written, no data), ``mid_data`` (some parts of the multipart upload sent),
``before_manifest`` (data and ``.metadata`` uploaded, no manifest); ``inc_mid_copy`` and
``inc_before_manifest``: the previous step saved, then an incremental save of :func:`incremental_state`
(few rows changed since; chunk files of ``TDCP_CHUNK_BYTES``) killed after some unchanged chunk
objects were copied server-side, or after every copy and upload but before its manifest; ``retire_incremental``
and ``retire_damaged``: ``<url>/A`` saved incrementally from ``<url>/base`` (its chunk objects carry the base's
identity), or saved and its manifest then damaged, then saved again and killed while retiring it (its manifest
deleted, its other objects not yet).
"""

from __future__ import annotations

import os
import signal
import sys

import torch

import torchrl_dcp as tdcp
from torchrl_dcp.storage import objectstore, objectstore_save
from torchrl_dcp.storage.urls import resolve_path


def state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3_000_000, generator=g), "b": torch.full((10,), float(step))}


def incremental_state(step: int) -> dict[str, torch.Tensor]:
    """The same large tensor at every step but its first rows (so most chunk objects are kept by copies)."""
    w = torch.randn(3_000_000, generator=torch.Generator().manual_seed(0))
    w[:1000] = float(step)
    return {"w": w, "b": torch.full((10,), float(step))}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _retire(url: str, kind: str) -> None:
    if kind == "incremental":
        tdcp.DistributedCheckpoint(state=incremental_state(0)).save(f"{url}/base")
        tdcp.DistributedCheckpoint(state=incremental_state(1)).save(f"{url}/A", incremental_from=f"{url}/base")
    else:
        path = tdcp.DistributedCheckpoint(state=state(1)).save(f"{url}/A")
        manifest = resolve_path(f"{path}/manifest.json")
        manifest.fs.pipe_file(manifest.key, manifest.fs.cat_file(manifest.key)[:-10])  # damaged: a save replaces it
    objectstore_save.delete_objects = lambda fs, keys: _die()  # type: ignore[assignment]
    tdcp.DistributedCheckpoint(state=state(2)).save(f"{url}/A")


def main(url: str, step: int, phase: str) -> None:
    if phase.startswith("retire_"):
        _retire(url, phase.removeprefix("retire_"))
        return
    make = incremental_state if phase.startswith("inc_") else state
    if phase.startswith("inc_"):  # the base first, by this process: only objects it wrote are copied
        tdcp.CheckpointRotation(url, keep_last=5).save(tdcp.DistributedCheckpoint(state=make(step - 1)), step=step - 1)
    phase = phase.removeprefix("inc_")
    if phase == "mid_copy":
        keep = objectstore_save.keep_object
        copied: list[object] = []

        def some_copies(kept, dst):  # type: ignore[no-untyped-def]
            if len(copied) == 3:
                _die()
            copied.append(dst)
            return keep(kept, dst)

        objectstore_save.keep_object = some_copies  # type: ignore[assignment]
    elif phase == "before_data":
        objectstore_save.write_data_file = lambda *a, **k: _die()  # type: ignore[assignment]
    elif phase == "mid_data":
        parts = objectstore._parts

        def some_parts(pieces, size):  # type: ignore[no-untyped-def]
            for i, part in enumerate(parts(pieces, size)):
                if i == 2:
                    import time

                    time.sleep(0.5)  # the first parts are on the wire
                    _die()
                yield part

        objectstore._parts = some_parts  # type: ignore[assignment]
    elif phase == "before_manifest":  # .metadata uploaded, killed before the manifest (the commit)
        assert objectstore_save.commit_manifest
        objectstore_save.commit_manifest = lambda destination, manifest: _die()  # type: ignore[assignment]
    tdcp.CheckpointRotation(url, keep_last=5).save(tdcp.DistributedCheckpoint(state=make(step)), step=step)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

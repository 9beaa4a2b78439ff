"""Save and load through a local S3 server (moto, its own process) against s3fs's own ``put``/``get`` of the same files.

The state is ``--mib`` MiB of float32 tensors (``--tensors`` of them). Each round:

- **save**: ``DistributedCheckpoint.save("s3://…")`` (records built from the tensors,
  multipart upload, CRC-32, ``.metadata`` and the manifest) vs ``fs.put`` of the
  files of the same checkpoint saved locally (bytes already on disk: the floor);
- **load**: ``DistributedCheckpoint.load`` (ranged reads into the tensors, checksums
  verified) vs ``fs.get`` of the same objects to local files.

Ratios are baseline seconds / ours (>= 1: ours is as fast); the median of ``--rounds``.
Never asserts a time.

Usage::

    python -m benchmarks.objectstore --mib 128 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import torchrl_dcp as tdcp


def _server() -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, endpoint
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start")


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(mib: int, tensors: int, rounds: int) -> dict[str, Any]:
    import s3fs

    proc, endpoint = _server()
    try:
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "use_listings_cache": False}
        fs = s3fs.S3FileSystem(**options)
        fs.mkdir("bench")
        n = mib * (1 << 20) // 4 // tensors
        state = {f"t{i}": torch.randn(n) for i in range(tensors)}
        target = {k: torch.empty_like(v) for k, v in state.items()}
        ckpt = tdcp.DistributedCheckpoint(state=state, storage_options=options)
        loader = tdcp.DistributedCheckpoint(state=target, storage_options=options)
        rows: dict[str, list[float]] = {"save": [], "put": [], "load": [], "get": []}
        with tempfile.TemporaryDirectory() as tmp:
            local = ckpt.save(Path(tmp) / "local")
            for r in range(rounds):
                url = f"s3://bench/{uuid.uuid4().hex[:8]}"
                rows["save"].append(_timed(lambda url=url: ckpt.save(f"{url}/ours")))
                rows["put"].append(
                    _timed(lambda url=url: fs.put(str(local) + "/", f"bench/{url[12:]}/theirs/", recursive=True))
                )
                rows["load"].append(_timed(lambda url=url: loader.load(f"{url}/ours")))
                dst = Path(tmp) / f"get{r}"
                rows["get"].append(
                    _timed(lambda url=url, dst=dst: fs.get(f"bench/{url[12:]}/theirs/", str(dst) + "/", recursive=True))
                )
        assert all(torch.equal(target[k], state[k]) for k in state)
    finally:
        proc.kill()
        proc.wait()
    med = {k: statistics.median(v) for k, v in rows.items()}
    size = mib * (1 << 20)
    return {
        "mib": mib,
        "tensors": tensors,
        "rounds": rounds,
        "seconds": {k: [round(x, 3) for x in v] for k, v in rows.items()},
        "MB/s": {k: round(size / v / 1e6, 1) for k, v in med.items()},
        "save_ratio_vs_put": round(med["put"] / med["save"], 2),
        "load_ratio_vs_get": round(med["get"] / med["load"], 2),
        "part_size": int(os.environ.get("TDCP_STORE_PART_SIZE", 16 << 20)),
        "concurrency": int(os.environ.get("TDCP_STORE_CONCURRENCY", 8)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(run(args.mib, args.tensors, args.rounds), indent=1))


if __name__ == "__main__":
    main()

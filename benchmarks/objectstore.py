"""Save and load through a local S3 server (moto, its own process) against s3fs's own ``put``/``get`` of the same files.

The state is ``--mib`` MiB of float32 tensors (``--tensors`` of them). Each round:

- **save**: ``DistributedCheckpoint.save("s3://…")`` (records built from the tensors,
  multipart upload, CRC-32, ``.metadata`` and the manifest) vs ``fs.put`` of the
  files of the same checkpoint saved locally (bytes already on disk: the floor);
- **load**: ``DistributedCheckpoint.load`` (planned ranged GETs into the tensors,
  checksums verified) vs ``fs.get`` of the same objects to local files, and vs
  ``fs.cat_ranges`` of exactly the byte ranges our load requested (recorded once);
- **requests**: S3 calls made by one save, load, ``put`` and ``get`` (by kind);
- with ``--incremental F``: a full save vs an incremental one after ``F`` of every
  tensor's rows changed (unchanged chunk objects copied server-side).

Ratios are baseline seconds / ours (>= 1: ours is as fast); the median of ``--rounds``.
The order of ours and the baseline alternates between rounds (the machine is shared).
``--chunk-mib`` sets the chunk-file size (``TDCP_CHUNK_BYTES``; tensors of twice that or
more are cut into chunk files). Never asserts a time.

Usage::

    python -m benchmarks.objectstore --mib 128 --rounds 5
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
from torchrl_dcp.storage.urls import resolve_path


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


class _Calls:
    """Counts s3fs's S3 calls by kind (``get_object``, ``head_object``, ...) while active."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __enter__(self) -> _Calls:
        import s3fs

        self._orig = orig = s3fs.S3FileSystem._call_s3
        counts = self.counts

        async def counting(fs: Any, method: str, *args: Any, **kwargs: Any) -> Any:
            counts[method] = counts.get(method, 0) + 1
            body = kwargs.get("Body")
            if body is not None:
                counts["bytes_uploaded"] = counts.get("bytes_uploaded", 0) + len(body)
            return await orig(fs, method, *args, **kwargs)

        s3fs.S3FileSystem._call_s3 = counting
        return self

    def __exit__(self, *exc: Any) -> None:
        import s3fs

        s3fs.S3FileSystem._call_s3 = self._orig


def _ranges_of(fs: Any, load: Any) -> list[tuple[str, int, int]]:
    """The ``(key, start, end)`` of every ranged read ``load()`` makes through ``fs.cat_file``."""
    seen: list[tuple[str, int, int]] = []
    orig = fs.cat_file

    def recording(path: str, start: int | None = None, end: int | None = None, **kw: Any) -> Any:
        data = orig(path, start=start, end=end, **kw)
        seen.append((path, start or 0, (start or 0) + len(data)))
        return data

    fs.cat_file = recording
    try:
        load()
    finally:
        fs.cat_file = orig  # the instance's own sync wrapper (fsspec mirrors async methods per instance)
    return seen


def _incremental(ckpt: Any, state: dict[str, torch.Tensor], fraction: float, rounds: int) -> dict[str, Any]:
    """Full vs incremental saves after changing ``fraction`` of each tensor's rows (kept objects copied server-side)."""
    rows: dict[str, list[float]] = {"full": [], "incremental": []}
    requests: dict[str, dict[str, int]] = {}
    kept = total = 0
    for r in range(rounds):
        url = f"s3://bench/inc-{uuid.uuid4().hex[:8]}"
        base = ckpt.save(f"{url}/base")
        for t in state.values():
            t[: max(1, int(len(t) * fraction))] += 1.0
        steps = {
            "incremental": lambda url=url, base=base: ckpt.save(f"{url}/inc", incremental_from=base),
            "full": lambda url=url: ckpt.save(f"{url}/full"),
        }
        for name in ("incremental", "full") if r % 2 == 0 else ("full", "incremental"):
            with _Calls() as calls:
                rows[name].append(_timed(steps[name]))
            requests.setdefault(name, calls.counts)
        files = tdcp.read_manifest(resolve_path(f"{url}/inc", ckpt.storage_options))["files"]
        kept, total = sum("origin" in f for f in files.values()), len(files)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "changed_fraction": fraction,
        "seconds": {k: [round(x, 3) for x in v] for k, v in rows.items()},
        "speedup": round(med["full"] / med["incremental"], 2),
        "objects_copied_of": [kept, total],
        "requests": requests,
    }


def _moved(spans: list[tuple[str, int, int]], prefix: str) -> list[tuple[str, int, int]]:
    """The same ranges in the objects of the checkpoint at ``prefix`` (``s3://bucket/key``)."""
    return [(prefix[5:] + "/" + k.rsplit("/", 1)[-1], a, b) for k, a, b in spans]


def run(mib: int, tensors: int, rounds: int, incremental: float | None = None) -> dict[str, Any]:
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
        rows: dict[str, list[float]] = {"save": [], "put": [], "load": [], "get": [], "ranges": []}
        requests: dict[str, dict[str, int]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            local = ckpt.save(Path(tmp) / "local")
            for r in range(rounds):
                url = f"s3://bench/{uuid.uuid4().hex[:8]}"
                ours, theirs = f"{url}/ours", f"bench/{url[12:]}/theirs/"
                steps = {
                    "save": lambda ours=ours: ckpt.save(ours),
                    "put": lambda theirs=theirs: fs.put(str(local) + "/", theirs, recursive=True),
                }
                for name in ("save", "put") if r % 2 == 0 else ("put", "save"):
                    with _Calls() as calls:
                        rows[name].append(_timed(steps[name]))
                    requests.setdefault(name, calls.counts)
                if r == 0:
                    with _Calls() as calls:
                        spans = _ranges_of(fs, lambda ours=ours: loader.load(ours))
                    requests["load"] = calls.counts
                dst = Path(tmp) / f"get{r}"
                steps = {
                    "load": lambda ours=ours: loader.load(ours),
                    "get": lambda dst=dst, theirs=theirs: fs.get(theirs, str(dst) + "/", recursive=True),
                    "ranges": lambda ours=ours, spans=spans: fs.cat_ranges(*map(list, zip(*_moved(spans, ours)))),
                }
                for name in ("load", "get", "ranges") if r % 2 == 0 else ("ranges", "get", "load"):
                    with _Calls() as calls:
                        rows[name].append(_timed(steps[name]))
                    requests.setdefault(name, calls.counts)
        assert all(torch.equal(target[k], state[k]) for k in state)
        inc = None if incremental is None else _incremental(ckpt, state, incremental, rounds)
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
        "load_ratio_vs_same_ranges": round(med["ranges"] / med["load"], 2),
        "load_ranges": len(spans),
        "requests": requests,
        "part_size": int(os.environ.get("TDCP_STORE_PART_SIZE", 16 << 20)),
        "concurrency": int(os.environ.get("TDCP_STORE_CONCURRENCY", 8)),
        "chunk_bytes": _chunk_bytes(),
        **({} if inc is None else {"incremental": inc}),
    }


def _chunk_bytes() -> int:
    import torchrl_dcp.chunking as chunking

    return chunking.CHUNK_BYTES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=None, help="chunk-file size (TDCP_CHUNK_BYTES)")
    parser.add_argument(
        "--incremental", type=float, default=None, help="also time incremental saves after changing this fraction"
    )
    args = parser.parse_args()
    if args.chunk_mib is not None:
        import torchrl_dcp.chunking as chunking

        chunking.CHUNK_BYTES = args.chunk_mib << 20
        chunking.MIN_CHUNKED_BYTES = 2 * chunking.CHUNK_BYTES
    print(json.dumps(run(args.mib, args.tensors, args.rounds, args.incremental), indent=1))


if __name__ == "__main__":
    main()

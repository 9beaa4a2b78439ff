"""A local S3 server for tests and benchmarks: moto's standalone server on 127.0.0.1, a free port, no network.

``s3_server()`` starts it (in a thread of this process) with a bucket, sets dummy AWS
credentials, and returns a :class:`LocalS3` with the endpoint, the ``storage_options``
that point s3fs at it and the environment (fsspec's ``FSSPEC_S3_*`` configuration) that
points child processes at it.

Example:
    >>> s3 = s3_server()  # doctest: +SKIP
    >>> tdcp.DistributedCheckpoint(storage_options=s3.storage_options, m=model).save(s3.url("run/step-1"))  # doctest: +SKIP
    >>> s3.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

BUCKET = "tdcp-test"
_DUMMY = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def have_s3() -> bool:
    """Whether s3fs and moto's server (Flask) can be imported."""
    try:
        import flask  # noqa: F401
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class LocalS3:
    endpoint: str
    server: Any
    bucket: str = BUCKET
    storage_options: dict[str, Any] = field(default_factory=dict)

    def url(self, key: str = "") -> str:
        """``s3://<bucket>/<key>``; without ``key``, a fresh prefix for one test."""
        return f"s3://{self.bucket}/{key or uuid.uuid4().hex[:12]}"

    @property
    def env(self) -> dict[str, str]:
        """Environment that points a child process's s3fs at this server through fsspec's configuration."""
        return {
            **_DUMMY,
            "FSSPEC_S3_ENDPOINT_URL": self.endpoint,
            "FSSPEC_S3_KEY": "testing",
            "FSSPEC_S3_SECRET": "testing",
        }

    def stop(self) -> None:
        self.server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_server() -> LocalS3:
    """Start moto's S3 server on 127.0.0.1 and create the test bucket."""
    import s3fs
    from moto.server import ThreadedMotoServer

    for k, v in _DUMMY.items():
        os.environ.setdefault(k, v)
    for _ in range(5):  # the free port may be taken between probing and binding (other test workers)
        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        endpoint = f"http://127.0.0.1:{port}"
        options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing", "use_listings_cache": False}
        bucket = f"{BUCKET}-{uuid.uuid4().hex[:8]}"  # ours alone, whichever server answers on this port
        try:
            s3fs.S3FileSystem(**options, skip_instance_cache=True).mkdir(bucket)
        except (FileExistsError, OSError):
            server.stop()
            continue
        return LocalS3(endpoint, server, bucket, options)
    raise RuntimeError("could not start moto's S3 server on a free local port")


@pytest.fixture(scope="session")
def s3() -> Iterator[LocalS3]:
    """moto's S3 server on 127.0.0.1 (a free port) for the session; skipped without s3fs/moto[server]."""
    if not have_s3():
        pytest.skip("s3fs and moto[server] are not installed (pip install -e '.[test,s3,test-s3]')")
    server = s3_server()
    yield server
    server.stop()

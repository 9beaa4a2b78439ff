from __future__ import annotations


def pytest_sessionstart(session) -> None:  # type: ignore[no-untyped-def]
    # torchrl hides a failed load of its compiled extension until a prioritized buffer is built
    import torchrl._torchrl  # noqa: F401


from tests_distributed.s3server import s3  # noqa: E402, F401 - the session's local S3 server fixture

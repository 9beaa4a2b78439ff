from __future__ import annotations


def pytest_sessionstart(session) -> None:  # type: ignore[no-untyped-def]
    # torchrl hides a failed load of its compiled extension until a prioritized buffer is built
    import torchrl._torchrl  # noqa: F401

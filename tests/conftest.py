from __future__ import annotations

import os

from hypothesis import settings

# Property tests draw the same examples on every run (CI must not fail by chance); set
# TDCP_FUZZ_EXPLORE=1 to draw new ones and keep failures in .hypothesis/ to replay them.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore")
settings.load_profile("explore" if os.environ.get("TDCP_FUZZ_EXPLORE") else "deterministic")


def pytest_sessionstart(session) -> None:  # type: ignore[no-untyped-def]
    # torchrl hides a failed load of its compiled extension until a prioritized buffer is built
    import torchrl._torchrl  # noqa: F401


# ---------------------------------------------------------------------- object stores
from tests_distributed.s3server import s3  # noqa: E402, F401 - the session's local S3 server fixture

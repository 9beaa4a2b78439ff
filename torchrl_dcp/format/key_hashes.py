"""Bounded cost of building a decoded container: keys that share one hash are counted and refused past a few.

A dict or set of n keys of one hash takes n**2 / 2 comparisons to build (ints ``k + i * (2**61 - 1)`` all share
one): a forged manifest of 40,000 such keys took 26 s. Strings are safe (their hashes are randomized per process).

Example:
    >>> counts: dict[int, int] = {}
    >>> for key in range(300):
    ...     count_hash(counts, key, 300)
    >>> check_hashes([HASH_MODULUS * i + 1 for i in range(1, 10)])
    Traceback (most recent call last):
    ...
    torchrl_dcp.errors.CheckpointFormatError: malformed state skeleton: a container of 9 keys holds more than 8 distinct int keys of one hash (such as 2305843009213693952): no saved state has those, and building it would take quadratic time; the manifest is damaged or forged (refused)
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torchrl_dcp.errors import CheckpointFormatError

__all__ = ["HASHES_CHECKED_FROM", "HASH_MODULUS", "MAX_EQUAL_HASHES", "check_hashes", "colliding", "count_hash"]

#: containers of more keys than this have the hashes of their non-str keys counted (smaller ones cost at most
#: ~HASHES_CHECKED_FROM / 2 key comparisons per key, whatever their hashes)
HASHES_CHECKED_FROM = 256
#: keys of one container that may share one hash: more is refused (ints ``k + i * (2**61 - 1)`` all share one, and
#: a dict or set of n such keys takes n**2 / 2 comparisons to build: 40,000 took 26 s)
MAX_EQUAL_HASHES = 8
HASH_MODULUS = (1 << 61) - 1  # ints of smaller magnitude are their own hash (but -1, whose hash is -2's)


def count_hash(counts: dict[int, int], key: Any, size: int) -> None:
    """Count ``key``'s hash (a key of a mapping of ``size`` keys), refusing a hash met too often."""
    h = hash(key)
    n = counts[h] = counts.get(h, 0) + 1
    if n > MAX_EQUAL_HASHES:
        raise colliding(size, key)


def check_hashes(items: list[Any]) -> None:
    """Refuse a set or frozenset whose items share one hash more than :data:`MAX_EQUAL_HASHES` times."""
    counts = Counter(map(hash, items))  # (str items too: counting them costs less than leaving them out)
    h, n = counts.most_common(1)[0]
    if n > MAX_EQUAL_HASHES:
        raise colliding(len(items), next(x for x in items if hash(x) == h))


def colliding(size: int, key: Any) -> CheckpointFormatError:
    return CheckpointFormatError(
        f"malformed state skeleton: a container of {size} keys holds more than {MAX_EQUAL_HASHES} distinct "
        f"{type(key).__name__} keys of one hash (such as {repr(key)[:40]}): no saved state has those, and building "
        "it would take quadratic time; the manifest is damaged or forged (refused)"
    )

"""JSON read from files and peers: every way the bytes can fail to decode is a ``ValueError``.

``json.loads`` raises ``RecursionError`` (not a ``ValueError``) on text nested deeper than the interpreter's
recursion limit, a few kilobytes of ``[`` (a damaged or forged commit record, marker or manifest), and callers that
catch ``ValueError`` let it out raw. Every JSON the library reads from a checkpoint, a store or another rank is
decoded here (the manifest decoder, :func:`torchrl_dcp.format.manifest.decode_json`, adds its cost bounds on top).

Example:
    >>> loads_json(b'{"step": 3}')
    {'step': 3}
    >>> try:
    ...     loads_json(b"[" * 100_000)
    ... except ValueError as err:
    ...     print(err)
    nested too deeply to decode
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads_json"]


def loads_json(data: bytes | bytearray | str, **kwargs: Any) -> Any:
    """``json.loads(data, **kwargs)``, raising ``ValueError`` for anything that does not decode (``UnicodeDecodeError``
    is one already; text nested too deeply becomes one)."""
    try:
        return json.loads(data, **kwargs)
    except RecursionError:
        raise ValueError("nested too deeply to decode") from None

"""The one error family of torchrl_dcp.

Every refusal (a foreign or damaged checkpoint, an unencodable value, an
incompatible component, a world-size change) raises a :class:`CheckpointError`
or one of its subclasses, so ``except tdcp.CheckpointError`` catches them all.

Example:
    >>> from torchrl_dcp import CheckpointError
    >>> try:
    ...     raise CheckpointError("no manifest.json", path="/tmp/x")
    ... except CheckpointError as err:
    ...     print(err)
    /tmp/x: no manifest.json
"""

from __future__ import annotations

from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, read or restored.

    Args:
        message: what was expected and what was found, and what to do next.
        path: the checkpoint, file or member concerned (prefixed to the message).
        result: the partial :class:`~torchrl_dcp.LoadResult` when a load failed.
    """

    def __init__(self, message: str, *, path: Any = None, result: Any = None) -> None:
        self.path = None if path is None else str(path)
        self.result = result
        self.message = message
        super().__init__(f"{self.path}: {message}" if self.path else message)

    def __reduce__(self):  # keep the keyword arguments when sent between ranks
        return (_rebuild, (type(self), self.message, self.path))


def _rebuild(cls: type, message: str, path: str | None) -> CheckpointError:
    return cls(message, path=path)


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """Nothing committed exists at the given path."""


class CheckpointFormatError(CheckpointError):
    """The path is not a torchrl_dcp checkpoint, or its manifest is malformed."""


class CheckpointVersionError(CheckpointFormatError):
    """The checkpoint was written by a newer format than this library reads."""


class CheckpointIntegrityError(CheckpointError):
    """A data file is missing, has the wrong size, or fails its checksum."""


class UnsafeCheckpointError(CheckpointIntegrityError):
    """A file asked to run code on load (pickle globals outside the allow-list)."""


class EncodingError(CheckpointError, TypeError):
    """A value cannot be stored without pickle; raised at save time."""


class IncompatibleComponentError(CheckpointError):
    """A saved component cannot be restored into the registered object."""


class WorldSizeMismatchError(CheckpointError):
    """Per-rank state was saved with another number of ranks."""


class CollectiveError(CheckpointError):
    """Another rank failed during a collective save or load."""

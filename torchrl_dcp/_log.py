"""The package's loggers: one per module under ``torchrl_dcp``, INFO and below from rank 0 only.

A job on N ranks would otherwise print every progress line N times. Records below WARNING logged on another rank are
dropped unless ``TDCP_LOG_ALL_RANKS=1``; warnings and errors are always kept. The rank is the process group's when
one is initialised, else ``RANK`` (as ``torchrun`` sets it). The package logger has a ``NullHandler``, so nothing
is printed unless the application configures logging (``logging.basicConfig(level=logging.INFO)``).

Example:
    >>> logger = get_logger("torchrl_dcp.example")
    >>> logger.name
    'torchrl_dcp.example'
"""

from __future__ import annotations

import logging
import os
import sys

from torchrl_dcp.settings import setting

__all__ = ["get_logger", "user_stacklevel"]

logging.getLogger("torchrl_dcp").addHandler(logging.NullHandler())


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")  # (never imports torch: the command-line tools stay torch-free)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _RankZeroInfo(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or setting("TDCP_LOG_ALL_RANKS"):
            return True
        return _rank() == 0


_FILTER = _RankZeroInfo()


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (a child of ``torchrl_dcp``), with the rank filter."""
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the function calling this name the first frame outside
    torchrl_dcp: the user's call, however many of the library's own calls lie between (``tdcp.resume`` and
    ``rotation.resume`` reach one warning through different depths).

    Example:
        >>> user_stacklevel() >= 1
        True
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level

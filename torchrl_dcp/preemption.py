"""Preemption signals: handlers that only set a flag, for the next ``maybe_save`` to act on.

Schedulers (Slurm, Kubernetes, spot instances) send ``SIGTERM`` and allow a grace period;
``torchrun`` forwards it to its workers (and kills them after its ``--shutdown-timeout``,
30 s by default). A :class:`PreemptionWatcher` installs a handler per signal that records it
and returns: the training step in progress finishes, and the rotation's next
``maybe_save`` agrees with every rank that one of them was signalled, saves and sets
``preempted``. A Python handler installed before is still called after ours (chained);
the default actions (``SIG_DFL``: terminate; Python's ``KeyboardInterrupt`` for ``SIGINT``)
are replaced, since they would end the process before the save.

Example:
    >>> import os, signal
    >>> watcher = PreemptionWatcher((signal.SIGUSR1,))
    >>> os.kill(os.getpid(), signal.SIGUSR1)
    >>> watcher.signalled
    'SIGUSR1'
    >>> watcher.restore()
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from typing import Any

from torchrl_dcp._log import get_logger

logger = get_logger(__name__)

_DEFAULTS = (signal.SIG_DFL, signal.SIG_IGN, None, signal.default_int_handler)


def check_signals(signals: Iterable[Any]) -> tuple[signal.Signals, ...]:
    """``signals`` as :class:`signal.Signals` (numbers and names such as ``"SIGTERM"`` accepted)."""
    if isinstance(signals, (str, int)):
        signals = (signals,)
    out = []
    for sig in signals:
        try:
            out.append(signal.Signals[sig] if isinstance(sig, str) else signal.Signals(sig))
        except (KeyError, ValueError):
            raise ValueError(f"preemption_signals: {sig!r} is not a signal of this platform") from None
        if out[-1] in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"preemption_signals: {out[-1].name} cannot be caught")
    return tuple(dict.fromkeys(out))


class PreemptionWatcher:
    """Installs a flag-setting handler for each of ``signals`` (from the main thread) until :meth:`restore`."""

    def __init__(self, signals: Iterable[Any]) -> None:
        self.signals = check_signals(signals)
        self.signalled: str | None = None  # the name of the first signal received
        self._previous: dict[signal.Signals, Any] = {}
        self._closed = False  # no longer watching (restore called, from any thread)
        self._restored = False  # the handlers found are back (from the main thread only)
        if self.signals and threading.current_thread() is not threading.main_thread():
            raise ValueError("preemption_signals can only be installed from the main thread: build the rotation there")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._closed:  # closed from another thread (handlers not put back yet), or chained to by a later handler
            sig = signal.Signals(signum)
            if signal.getsignal(sig) == self._handle:  # ours still installed: put back what was found (a handler
                found = _unwrapped(sig, self._previous.get(sig))  # runs on the main thread), then deliver it there
                signal.signal(sig, found if found is not None else signal.SIG_DFL)
                if found in (signal.SIG_DFL, None):
                    signal.raise_signal(signum)  # (the default action: SIGTERM ends the process, as before us)
                elif callable(found):  # (Python's default_int_handler too: a KeyboardInterrupt, as before us)
                    found(signum, frame)
                return
            self._chain(signum, frame)
            return
        name = signal.Signals(signum).name
        if self.signalled is None:
            self.signalled = name
            logger.warning("%s received: the next maybe_save saves, and the job can then exit", name)
        self._chain(signum, frame)

    def _chain(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signal.Signals(signum))
        if callable(previous) and previous not in _DEFAULTS:
            previous(signum, frame)

    def restore(self) -> None:
        """Put the handlers installed before back (idempotent; only from the main thread). Where another handler
        was installed since, it is left in place and this watcher only passes signals on; a watcher restoring
        this one's handler later puts back what was installed before this one (closed in any order, watchers
        leave the handlers they found). Called from another thread, it stops watching and the handlers are put back
        at the next of these signals (then delivered as before this watcher) or at a later call from the main
        thread."""
        self._closed = True
        if self._restored:
            return
        if threading.current_thread() is not threading.main_thread():  # (signal.signal would raise ValueError)
            logger.debug("preemption watcher closed outside the main thread: handlers put back at the next signal")
            return
        self._restored = True
        for sig, handler in self._previous.items():
            if signal.getsignal(sig) == self._handle:  # someone installed another since: leave theirs
                handler = _unwrapped(sig, handler)
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _unwrapped(sig: signal.Signals, handler: Any) -> Any:
    """``handler``, or for the handler of a closed watcher, what that watcher found installed (recursively)."""
    while isinstance(owner := getattr(handler, "__self__", None), PreemptionWatcher) and owner._closed:
        handler = owner._previous.get(sig)
    return handler

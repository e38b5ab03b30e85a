"""Ctrl-C (SIGINT) and SIGTERM during training: finish nothing half-way.

The first signal is noted and the update in flight completes (with its checkpoint); the trainer
then stops and says how to resume. A second signal stops at once — every file is written
atomically, so the last complete checkpoint is still whole.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    signum: int | None = None

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None


@contextmanager
def deferred_signals():
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield request
        return

    def note(signum, frame):
        if request.signum is not None:  # the second one: stop now
            raise KeyboardInterrupt
        request.signum = signum

    previous = {s: signal.signal(s, note) for s in HANDLED}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class SignalReceived(Exception):
    """Ctrl-C or SIGTERM while `raised_signals` is active."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def raised_signals():
    """Ctrl-C and SIGTERM raise SignalReceived at once (the first one): for waits that hold
    nothing half-written, such as the resume check waiting on its child processes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SignalReceived(signum)

    previous = {s: signal.signal(s, stop) for s in HANDLED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

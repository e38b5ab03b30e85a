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
def _handling(handler):
    """`handler` for Ctrl-C and SIGTERM inside the block, the previous handlers restored after."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {s: signal.signal(s, handler) for s in HANDLED}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


@contextmanager
def deferred_signals():
    request = StopRequest()

    def note(signum, frame):
        if request.signum is not None:  # the second one: stop now
            raise KeyboardInterrupt
        request.signum = signum

    with _handling(note):
        yield request


class SignalReceived(Exception):
    """Ctrl-C or SIGTERM while `raised_signals` is active."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def raised_signals():
    """Ctrl-C and SIGTERM raise SignalReceived at once (the first one): for waits that hold
    nothing half-written, such as the resume check waiting on its child processes."""

    def stop(signum, frame):
        raise SignalReceived(signum)

    with _handling(stop):
        yield

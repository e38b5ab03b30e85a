"""Ctrl-C (SIGINT) and SIGTERM during training: finish nothing half-way.

The first signal is noted and the update in flight completes (with its checkpoint); the trainer
then stops and says how to resume. A second signal stops at once — every file is written
atomically, so the last complete checkpoint is still whole. Outside an update either signal stops
at once, in one line (interrupting_signals).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from contextlib import contextmanager

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM raised where nothing is half-way (loading, a probe, the report) or a second
    one during an update: handled as Ctrl-C is, and named by its signal."""

    def __init__(self, signum: int):
        super().__init__(signum)  # the args rebuild it (pickled to a joblib launcher's parent)
        self.signum = signum

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


def signal_of(interrupt: KeyboardInterrupt) -> signal.Signals:
    """The signal behind a KeyboardInterrupt: SIGINT unless an Interrupted says otherwise."""
    return signal.Signals(getattr(interrupt, "signum", signal.SIGINT))


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


# The signal whose Interrupted interrupting_signals raised, while its block runs: Python swallows an
# exception raised inside a __del__ ("Exception ignored in ..."), and a signal that lands in one during
# loading would be lost; the next update's start raises it again.
_raised: list[int] = []


@contextmanager
def deferred_signals():
    if _raised:  # an earlier Interrupted was swallowed: stop now, before the update starts
        raise Interrupted(_raised.pop())
    request = StopRequest()

    def note(signum, frame):
        if request.signum is not None:  # the second one: stop now
            raise Interrupted(signum)
        request.signum = signum

    with _handling(note):
        yield request


@contextmanager
def interrupting_signals():
    """SIGTERM raises as Ctrl-C does (Python's default ends the process without a word), so that a
    run stopped while it loads or checks ends in the same one line; blocks inside (an update's
    deferred_signals) set their own handlers."""

    def stop(signum, frame):
        _raised[:] = [signum]
        raise Interrupted(signum)

    _raised.clear()
    with _handling(stop):
        try:
            yield
        finally:
            _raised.clear()  # none left for another command in this process (a sweep's next job, a test)


class SignalReceived(Exception):
    """Ctrl-C or SIGTERM while `raised_signals` is active."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


@contextmanager
def raised_signals():
    """Ctrl-C and SIGTERM raise SignalReceived at once (the first one): for waits that hold
    nothing half-written, such as the resume check waiting on its child processes."""

    def stop(signum, frame):
        raise SignalReceived(signum)

    with _handling(stop):
        yield


# Looked up in the parent: a child between fork and exec should call, not load (dlopen takes locks).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(parent: int) -> None:
    """subprocess's preexec_fn (bound to the parent's pid): the child is killed when the process `parent` that
    started it dies, however (SIGKILL, a closed terminal's SIGHUP), rather than run on unattended. Linux's
    PR_SET_PDEATHSIG; elsewhere nothing. A parent dead already by then: the child ends at once."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

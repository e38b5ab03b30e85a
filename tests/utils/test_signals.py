"""Signals outside an update: an Interrupted names its signal, survives a joblib worker's pickling,
and a SIGTERM under HYDRA_FULL_ERROR=1 still ends as SIGTERM does (143), traceback shown."""

from __future__ import annotations

import os
import pickle
import signal
import sys

import pytest

from miniverl.utils.errors import ctrl_c_stop
from miniverl.utils.signals import Interrupted, SignalReceived, deferred_signals, interrupting_signals, signal_of


def test_an_interrupt_names_its_signal_and_survives_pickling():
    for error in (Interrupted(signal.SIGTERM), SignalReceived(signal.SIGTERM)):
        again = pickle.loads(pickle.dumps(error))  # a joblib launcher's worker sends it to its parent
        assert (str(again), again.signum) == ("SIGTERM", signal.SIGTERM)
    assert signal_of(Interrupted(signal.SIGTERM)) == signal.SIGTERM
    assert signal_of(KeyboardInterrupt()) == signal.SIGINT  # Python's own Ctrl-C


def test_a_sigterm_under_hydra_full_error_ends_with_its_own_status(monkeypatch, capsys):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(SystemExit) as ended:
        try:
            raise Interrupted(signal.SIGTERM)
        except KeyboardInterrupt:
            raise ctrl_c_stop("stopped by SIGTERM", signal.SIGTERM) from None
    assert ended.value.code == 128 + signal.SIGTERM and "Interrupted: SIGTERM" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C: Python's KeyboardInterrupt goes on, as before
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ctrl_c_stop("stopped by SIGINT") from None


class _SignalledInAFinalizer:
    """SIGTERM arriving while a __del__ runs (the audit's: a `regex` Group's, while the models loaded)."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_python_swallows_in_a_finalizer_still_stops_the_run_before_its_first_update(monkeypatch):
    """Python only prints "Exception ignored in ..." for an exception raised inside a __del__: the
    handler's Interrupted was lost and the run trained to the end."""
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: swallowed.append(unraisable.exc_type))
    with pytest.raises(Interrupted) as stopped:
        with interrupting_signals():
            _SignalledInAFinalizer()  # its Interrupted is raised in __del__, and swallowed
            assert swallowed == [Interrupted]
            with deferred_signals():
                pytest.fail("an update started after the SIGTERM")
    assert stopped.value.signum == signal.SIGTERM
    with interrupting_signals(), deferred_signals():  # nothing left over for the next command in this process
        pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_with_die_with_parent_dies_when_its_parent_is_killed():
    """A lose-work audit: the resume check's runs outlived a command killed with SIGKILL (or a closed
    terminal's SIGHUP), and the command run again found one of them writing into its new check's folders."""
    import subprocess
    import time

    parent = (
        "import functools, os, subprocess, sys, time; from miniverl.utils.signals import die_with_parent; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True, "
        "preexec_fn=functools.partial(die_with_parent, os.getpid())); print(child.pid, flush=True); time.sleep(60)"
    )
    started = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child = int(started.stdout.readline())
    os.kill(started.pid, signal.SIGKILL)
    started.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)  # still there (or a zombie until init reaps it)
            with open(f"/proc/{child}/stat") as stat:
                if stat.read().split(")")[-1].split()[0] == "Z":
                    break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its parent")

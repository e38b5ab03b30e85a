"""Signals outside an update: an Interrupted names its signal, survives a joblib worker's pickling,
and a SIGTERM under HYDRA_FULL_ERROR=1 still ends as SIGTERM does (143), traceback shown."""

from __future__ import annotations

import pickle
import signal

import pytest

from miniverl.utils.errors import ctrl_c_stop
from miniverl.utils.signals import Interrupted, SignalReceived, signal_of


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

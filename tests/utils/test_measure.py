"""The report's clocks start at the interpreter's start, not at the creation of its process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_the_clock_does_not_count_what_the_shell_ran_before_execing_python():
    # bash execs its last command in its own process: the process was created before the sleep.
    probe = (
        "import time, psutil, miniverl.utils.measure as m; "
        "print(m.seconds_since_start(), time.time() - psutil.Process().create_time())"
    )
    result = subprocess.run(
        ["bash", "-c", f'sleep 2; exec "{sys.executable}" -c "{probe}"'],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    since_start, since_process_creation = map(float, result.stdout.split())
    assert since_process_creation > 2.0
    assert since_start < since_process_creation - 1.5

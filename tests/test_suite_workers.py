"""The suite's workers share the cores (tests/conftest.py, docs/testing.md): on two or more
workers each runs torch, and the commands it starts, on cores // workers threads, unless the user
set a thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import USER_THREADS, usable_cores

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))


@pytest.mark.skipif(WORKERS < 2, reason="one process (-n 0 or one core): torch keeps its own thread count")
@pytest.mark.skipif(USER_THREADS is not None, reason="OMP_NUM_THREADS set by the user: the suite keeps it")
def test_each_worker_runs_torch_and_its_commands_on_its_share_of_the_cores():
    share = max(1, usable_cores() // WORKERS)
    assert torch.get_num_threads() == share
    child = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True, text=True
    )
    assert child.stdout.strip() == str(share), child.stderr[-500:]

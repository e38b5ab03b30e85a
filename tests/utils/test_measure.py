"""The report's clocks start at the interpreter's start, not at the creation of its process; the digest of
the code that drove a run covers the whole package."""

from __future__ import annotations

import shutil
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


def test_the_code_digest_changes_with_any_module_of_the_package_not_only_utils(tmp_path):
    # A copy of the package: a change to the controller must change the report's workload_driver_sha256.
    shutil.copytree(ROOT / "miniverl", tmp_path / "miniverl", ignore=shutil.ignore_patterns("__pycache__"))
    probe = "import miniverl.utils.measure as m; print(m.workload_driver_sha256())"

    def digest() -> str:
        run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path)
        return run.stdout.strip()

    before = digest()
    with open(tmp_path / "miniverl" / "trainer" / "opd_trainer.py", "a") as controller:
        controller.write("# an edit\n")
    assert digest() != before

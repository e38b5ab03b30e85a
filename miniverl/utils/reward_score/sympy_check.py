"""sympy for the PRM800K grader, in a process of its own (_sympy_worker.py).

verl evaluates model answers with sympy's parser (Python's eval) and simplifies them: in a forked
process with a 10 s limit for its numina rule (prime_math), in the trainer itself without one for
geometry3k (mathruler). Here every such evaluation runs in one long-lived helper process, started
on first use, under a 4 GiB address-space limit; an answer later than `SYMPY_TIMEOUT_S` kills it
and counts as "not equal" (verl's numina rule: the same; its geometry3k rule would wait forever),
and the next request starts a new one.
"""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import sys
import threading
from pathlib import Path

SYMPY_TIMEOUT_S = 10.0  # verl's prime_math: @timeout_limit(seconds=10) on are_equal_under_sympy
STARTUP_TIMEOUT_S = 120.0  # python + `import sympy`, on a busy machine
WORKER = Path(__file__).with_name("_sympy_worker.py")


class SympyProcess:
    """The helper process: `ask` sends one request and returns its answer, or None when the
    process did not answer in time or died (it is then stopped, and restarted on the next ask)."""

    def __init__(self, timeout_s: float = SYMPY_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.started = 0  # how many processes were started (a test reads it)

    def _start(self) -> bool:
        self._process = subprocess.Popen(
            [sys.executable, "-I", str(WORKER)],  # -I: no script folder or user site on sys.path
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            encoding="utf-8",
        )
        self.started += 1
        return self._read(STARTUP_TIMEOUT_S) is not None

    def _read(self, timeout_s: float) -> dict | None:
        out = self._process.stdout
        ready, _, _ = select.select([out], [], [], timeout_s)
        line = out.readline() if ready else ""
        if not line:
            self.stop()
            return None
        return json.loads(line)

    def ask(self, request: dict) -> dict | None:
        with self._lock:
            if (self._process is None or self._process.poll() is not None) and not self._start():
                return None
            try:
                self._process.stdin.write(json.dumps(request) + "\n")
                self._process.stdin.flush()
            except OSError:  # it died since the last answer
                self.stop()
                return None
            return self._read(self.timeout_s)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
        if process is not None:
            process.wait()
            for stream in (process.stdin, process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass


SYMPY = SympyProcess()
atexit.register(SYMPY.stop)


def sympy_equal(a: str, b: str) -> bool:
    """simplify((a) - (b)) == 0 with `^` as power and implicit multiplication; False when sympy
    fails, or takes longer than SYMPY_TIMEOUT_S."""
    answer = SYMPY.ask({"op": "equal", "a": a, "b": b})
    return bool(answer and answer.get("value"))


class SympyValue:
    """An element of an object sympy parsed in the helper process, as the grader reads it: its
    str(), its truth value (a TypeError where sympy has none), == 0 when it is false."""

    def __init__(self, text: str, truth: bool | None):
        self.text, self.truth = text, truth

    def __str__(self) -> str:
        return self.text

    def __bool__(self) -> bool:
        if self.truth is None:
            raise TypeError(f"{self.text} has no truth value")
        return self.truth

    def __eq__(self, other) -> bool:  # sympy: an element is false only when it is zero
        return self.truth is False and other in (0, False)

    __hash__ = None


def sympy_items(text: str) -> list[SympyValue] | None:
    """The elements of sympy's `parse_expr(text)` (a Matrix's, row by row); None when it does not
    parse, has no length, or takes too long."""
    answer = SYMPY.ask({"op": "items", "text": text})
    if not answer or "items" not in answer or answer["len"] != len(answer["items"]):
        return None
    return [SympyValue(text, truth) for text, truth in answer["items"]]

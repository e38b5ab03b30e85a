"""User-facing errors: one line that says what is wrong, where, and how to fix it."""

import errno
import os
import signal
import sys
import traceback

# Write errors the user can fix (a full disk, a read-only folder, no permission): one line, not a bug.
WRITE_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)


class MiniverlError(Exception):
    """A mistake in the user's input or environment. `main` prints it as one line (no traceback
    unless HYDRA_FULL_ERROR=1) and exits non-zero."""


class RunStopped(MiniverlError):
    """The run stopped cleanly on a signal; exits with 128 + the signal number, as shells expect."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def ctrl_c_stop(message: str, signum: int = signal.SIGINT) -> RunStopped:
    """A Ctrl-C (the KeyboardInterrupt being handled; SIGTERM with `signum`) as a one-line stop:
    `raise ctrl_c_stop(...) from None` inside `except KeyboardInterrupt:`. With HYDRA_FULL_ERROR=1
    the KeyboardInterrupt goes on, traceback and all."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        if signum == signal.SIGINT:
            raise  # called inside the except block: the KeyboardInterrupt itself goes on
        traceback.print_exc()  # an uncaught KeyboardInterrupt would end the process as SIGINT does (130)
        sys.exit(128 + signum)
    return RunStopped(message, signum)


def exit_code_of(error: MiniverlError, prefix: str = "miniverl") -> int:
    """Print a user mistake as one line on stderr (re-raise it with HYDRA_FULL_ERROR=1, to see the
    traceback) and return the exit status every command uses for it."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        raise error
    print(f"{prefix}: error: {error}", file=sys.stderr)
    return getattr(error, "exit_code", 2)  # a RunStopped carries its own


def unwritable(error: OSError, fix: str) -> MiniverlError:
    """A write error the user can fix (`WRITE_ERRNOS`) as one line saying where and `fix`; any other
    error is raised again as it is, a bug to show in full."""
    if error.errno not in WRITE_ERRNOS:
        raise error
    return MiniverlError(f"cannot write {error.filename or 'the output'}: {error.strerror}; {fix}")

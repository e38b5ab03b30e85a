"""User-facing errors: one line that says what is wrong, where, and how to fix it."""


class MiniverlError(Exception):
    """A mistake in the user's input or environment. `main` prints it as one line (no traceback
    unless HYDRA_FULL_ERROR=1) and exits non-zero."""


class RunStopped(MiniverlError):
    """The run stopped cleanly on a signal; exits with 128 + the signal number, as shells expect."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum

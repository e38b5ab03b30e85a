"""User-facing errors: one line that says what is wrong, where, and how to fix it."""


class MiniverlError(Exception):
    """A mistake in the user's input or environment. `main` prints it as one line (no traceback
    unless HYDRA_FULL_ERROR=1) and exits non-zero."""

"""The one error the `expr` commands raise on purpose: a line on stderr and an exit code."""

from __future__ import annotations


class CLIError(Exception):
    """A user-facing failure: printed as one red `error: ...` line, then exit `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

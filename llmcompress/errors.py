"""Typed user-facing errors. The CLI turns each into one line and exit code 2."""

from __future__ import annotations

import errno


class UserError(Exception):
    """Bad input: the message names the problem, `hint` says what to do about it."""

    exit_code = 2

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message}. {self.hint}" if self.hint else self.message


class UnsupportedArchitecture(UserError):
    pass


class ModelNotFound(UserError):
    pass


class DataError(UserError):
    pass


class OutputExists(UserError):
    pass


class DiskFull(UserError, OSError):
    """The disk filled during a write (exit 2, not a raw OSError). Still an OSError with errno ENOSPC, so
    code that handles a full disk in its own words (e.g. the distill feature cache) keeps doing so."""

    def __init__(self, message: str, hint: str = "") -> None:
        UserError.__init__(self, message, hint)
        self.errno = errno.ENOSPC

    def __str__(self) -> str:
        return self.one_line()

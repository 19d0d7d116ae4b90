"""One error type for everything a user can cause.

Every error the package raises about input (a model spec, a task, data, a task-vector file,
an argument, a server's answer, a benchmark step) derives from `UserError`; the CLI turns it
into one line on stderr and exit status 1, never a traceback. Module-specific subclasses
(`VectorError`, `TaskError`, ...) stay, so callers can still catch one kind. `UserError` is a
`ValueError` because most of them are bad values, and so existing `except ValueError` still
catches them.
"""

from __future__ import annotations


class UserError(ValueError):
    """Something the user can fix; its message is shown as is, on one line."""


class ArgumentError(UserError):
    """An option value that cannot work (checked before any model is loaded)."""

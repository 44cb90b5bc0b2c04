"""One error root. Subclasses of AutotuneError are mistakes a user can fix; the CLI prints them as
one line and exits with status 2. Anything else is a bug and keeps its traceback."""

from __future__ import annotations


class AutotuneError(Exception):
    """A problem the user can fix. The message says what is wrong and what to do."""

    exit_code = 2


class BadInput(AutotuneError):
    """A flag or argument has a value autotune cannot use."""


class ModelNotFound(AutotuneError):
    """The model reference resolves to nothing usable (offline, misspelt, no config.json)."""


class BudgetError(AutotuneError):
    """The memory budget cannot be honoured on this device."""


class DeviceError(AutotuneError):
    """The requested device does not exist or cannot run the requested configuration."""


class DatabaseError(AutotuneError):
    """The results database cannot be opened, is not ours, or is newer than this autotune."""


class StudyNotFound(AutotuneError):
    """No study of that name (or no finished probe in it) in the database."""


class DatasetError(AutotuneError):
    """The training data set cannot be loaded or has no usable text."""


class Conflict(AutotuneError):
    """The request clashes with what is stored: a study of that name queued or running with other
    settings, an idempotency key used for another request, a token name taken."""

"""One error root. Subclasses of AutotuneError are mistakes a user can fix; the CLI prints them as
one line and exits with status 2. Anything else is a bug and keeps its traceback. And the exit
statuses every command ends with."""

from __future__ import annotations

import json

# How a command ends, as its exit status says it (README, "Exit statuses"; scripts and the service's
# queue worker read them): 2 is a user's mistake throughout.
EXIT_NOTHING_FITS = 1  # search: every candidate measured or ruled out, and none fits the budget
EXIT_USER_ERROR = 2  # an AutotuneError: one line on stderr, nothing written
EXIT_UNMEASURED = 3  # search: some candidates could not be measured (crashed, timed out, failed)
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
EXIT_BROKEN_PIPE = 141  # stdout's reader went away (128 + SIGPIPE), any command
EXIT_TERMINATED = 143  # SIGTERM (128 + SIGTERM)

QUOTED_MAX = 40  # characters of a value a message quotes (a pasted megabyte stays a short line)


def quoted(value: object) -> str:
    """A value as a refusal quotes it, cut short: a string in quotes, anything else as JSON writes it
    (as the value was given, to a JSON door or in a config), else as Python prints it."""
    if isinstance(value, str):
        text = repr(value)
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = str(value)
    return text if len(text) <= QUOTED_MAX else text[: QUOTED_MAX - 3] + "..."


class AutotuneError(Exception):
    """A problem the user can fix. The message says what is wrong and what to do."""

    exit_code = EXIT_USER_ERROR


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

"""Deadlines by the wall clock: a command's `--timeout` and every wait on another process are held
to one, whatever that process is doing (computing, stopped, wedged in a kernel, blocked on a pipe).
Torch-free."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


class DeadlineReached(Exception):
    """The command's deadline came while a probe was in flight: the probe was stopped, and what it
    would have measured is unknown (not a timeout of the config: nothing is recorded for it)."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """A moment on the monotonic clock (None: no deadline)."""

    at: float | None = None

    @classmethod
    def after(cls, seconds: float | None) -> Deadline:
        """The deadline `seconds` from now (None: none)."""
        return cls(None if seconds is None else time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left (infinite without a deadline, 0 once past)."""
        return math.inf if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def allows(self, seconds: float) -> bool:
        """Whether something that takes `seconds` can end before the deadline."""
        return self.remaining() >= seconds

    def bound(self, seconds: float) -> float:
        """`seconds`, or what is left of the deadline if that is less."""
        return min(seconds, self.remaining())


NO_DEADLINE = Deadline()

"""The live line of `autotune search` on a terminal: the probe in flight (its config, the phase
it reached, seconds so far) and the candidates settled with an estimate of the time left,
redrawn every half second and replaced by the probe's result line when it ends.

Only on a terminal: in a log or a pipe, and with `--json`, the output is the result lines alone.
Rendering only; the search reports through `Progress` (search/common.py) and `Event`.

`trace_progress` is the same for the traces `autotune plan` and `autotune estimate` wait on, on
stderr. On a terminal, one line redrawn in place ("traced 3 of 16 (42 s)"), kept when the last
trace arrives, cleared if the work ends before. In a log or a pipe, where a redrawn line would
be noise, a whole line at most every PIPE_EVERY_SECONDS ("traced 3 of 16 (42 s)", or "tracing
... (20 s)" before the first count), so that a command piped into a file is not silent for
minutes; work done within that time prints nothing. Nothing goes to stdout (a `--json` document
stays whole there), and a quiet progress (`--json`) prints nothing at all:

    with trace_progress(quiet=as_json) as progress:
        result = plan_for(..., on_progress=progress)       # progress(done, total) as traces arrive
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from autotune.vocabulary.units import format_duration

REDRAW_SECONDS = 0.5
_PHASES = {
    "starting": "starting",
    "start-up": "starting a probe process",
    "build": "building the model",
    "warm-up": "warm-up steps",
    "compile": "compiling (torch.compile)",
    "timing": "timing steps",
}


class LiveLine:
    """One line at the bottom of the terminal for the probe in flight. Use as a context manager;
    `progress` and `print` may be called from the search's thread."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()
        self._current = None  # the latest Progress, while a probe runs
        self._probe_seconds: list[float] = []
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="autotune-live", daemon=True)
        self._shown = False

    def __enter__(self) -> LiveLine:
        self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._ticker.join(timeout=2)
        with self._lock:
            self._clear()

    def progress(self, progress) -> None:
        """The probe in flight reached a phase: draw it now (within the redraw period after)."""
        with self._lock:
            self._current = progress
            self._draw()

    def print(self, line: str) -> None:
        """A result line: it replaces the live line, which is drawn again below it if a probe runs."""
        with self._lock:
            if self._current is not None:
                self._probe_seconds.append(time.monotonic() - self._current.started)
            self._current = None
            self._clear()
            self.stream.write(line + "\n")
            self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(REDRAW_SECONDS):
            with self._lock:
                if self._current is not None:
                    self._draw()

    def _clear(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False

    def _draw(self) -> None:
        p = self._current
        if p is None:
            return
        elapsed = time.monotonic() - p.started
        what = "confirming" if p.confirming else f"[{p.resolved + 1}/{p.total}]"
        left = ""
        if self._probe_seconds and not p.confirming:
            # Settled candidates include skips, which cost nothing: an estimate, said as one.
            mean = sum(self._probe_seconds) / len(self._probe_seconds)
            remaining = mean * max(0, p.total - p.resolved - 1)
            left = f"  ~{format_duration(remaining)} left at most" if remaining >= 1 else ""
        text = f"{what} {p.config.label()}  {_PHASES.get(p.phase, p.phase)}, {elapsed:.0f} s{left}"
        self.stream.write("\r\033[K" + text)
        self.stream.flush()
        self._shown = True


# -- the traces of `plan` and `estimate` -----------------------------------------------------------

PIPE_EVERY_SECONDS = 10.0  # a line at most this often in a log or a pipe
TTY_REDRAW_SECONDS = 1.0  # the terminal line's clock


class TraceProgress:
    """`progress(done, total)` as traces arrive; `tick()` on a clock (trace_progress's thread) keeps
    the elapsed time moving while none does. Thread-safe."""

    def __init__(
        self,
        stream: TextIO,
        *,
        tty: bool,
        what: str = "tracing",
        every: float = PIPE_EVERY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.tty, self.what, self.every, self.clock = stream, tty, what, every, clock
        self.started = clock()
        self.done: int | None = None
        self.total: int | None = None
        self._printed_at: float | None = None  # when the last pipe line went out
        self._drawn = False  # a terminal line is showing
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            self.done, self.total = done, total
            if self.tty:
                self._draw()
                if done >= total:
                    self._finish_line()
            elif done >= total:
                if self._printed_at is not None:  # a long run ends with its last count; a quick one stays quiet
                    self._print()
            else:
                self._print_if_due()

    def tick(self) -> None:
        with self._lock:
            if self.tty:
                if self.total is None or (self.done or 0) < self.total:
                    self._draw()
            elif self.total is None or (self.done or 0) < self.total:
                self._print_if_due()

    def close(self) -> None:
        """Clear a terminal line still showing (work without counts, or that failed): what the command
        prints next takes its place. A pipe needs nothing more."""
        with self._lock:
            if self._drawn:
                self.stream.write("\r\033[K")
                self.stream.flush()
                self._drawn = False

    def text(self) -> str:
        elapsed = f"({self.clock() - self.started:.0f} s)"
        if self.total is None:
            return f"{self.what} {elapsed}"
        return f"traced {self.done} of {self.total} {elapsed}"

    def _print_if_due(self) -> None:
        now = self.clock()
        if now - (self._printed_at if self._printed_at is not None else self.started) >= self.every:
            self._print()

    def _print(self) -> None:
        self._printed_at = self.clock()
        self.stream.write(self.text() + "\n")
        self.stream.flush()

    def _draw(self) -> None:
        self.stream.write("\r\033[K" + self.text())
        self.stream.flush()
        self._drawn = True

    def _finish_line(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
        self._drawn = False


def _quiet(done: int, total: int) -> None:
    return None


# A program that runs a `--json` command and shows its progress (the service, for GET /v1/plans/ID
# and the plan page) sets PROGRESS_ENV in the command's environment: each count then goes to stderr
# as one line, PROGRESS_PREFIX + "traced N of M", which `read_progress` reads back. stdout stays the
# document alone.
PROGRESS_ENV = "AUTOTUNE_PROGRESS_LINES"
PROGRESS_PREFIX = "autotune: progress: "
_PROGRESS_LINE = re.compile(re.escape(PROGRESS_PREFIX) + r"traced (\d+) of (\d+)$")


def read_progress(line: str) -> tuple[int, int] | None:
    """(done, total) of a progress line written for PROGRESS_ENV; None for any other line."""
    match = _PROGRESS_LINE.match(line.rstrip("\r\n"))
    return (int(match[1]), int(match[2])) if match else None


def _progress_lines(stream: TextIO) -> Callable[[int, int], None]:
    lock = threading.Lock()

    def report(done: int, total: int) -> None:
        with lock:
            stream.write(f"{PROGRESS_PREFIX}traced {done} of {total}\n")
            stream.flush()

    return report


@contextlib.contextmanager
def trace_progress(
    *, quiet: bool = False, what: str = "tracing", stream: TextIO | None = None, every: float = PIPE_EVERY_SECONDS
) -> Iterator[Callable[[int, int], None]]:
    """A progress callback `(done, total)` for the traces of the `with` block (plan_for's and
    make_plan's `on_progress`); with none passed on (one trace: `autotune estimate`), the clock alone
    says the work goes on. `what` names the work before any count arrives. Quiet: a callback that
    prints nothing (but the lines PROGRESS_ENV asks for)."""
    if quiet:
        asked = os.environ.get(PROGRESS_ENV) == "1"
        yield _progress_lines(stream if stream is not None else sys.stderr) if asked else _quiet
        return
    stream = stream if stream is not None else sys.stderr
    tty = bool(getattr(stream, "isatty", lambda: False)())
    progress = TraceProgress(stream, tty=tty, what=what, every=every)
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(TTY_REDRAW_SECONDS if tty else min(1.0, every)):
            progress.tick()

    ticker = threading.Thread(target=run, name="autotune-trace-progress", daemon=True)
    ticker.start()
    try:
        yield progress
    finally:
        stop.set()
        ticker.join(timeout=2)
        progress.close()

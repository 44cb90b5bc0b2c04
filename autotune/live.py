"""The live line of `autotune search` on a terminal: the probe in flight (its config, the phase
it reached, seconds so far) and the candidates settled with an estimate of the time left,
redrawn every half second and replaced by the probe's result line when it ends.

Only on a terminal: in a log or a pipe, and with `--json`, the output is the result lines alone.
Rendering only; the search reports through `Progress` (search/common.py) and `Event`.
"""

from __future__ import annotations

import threading
import time
from typing import TextIO

from autotune.units import format_duration

REDRAW_SECONDS = 0.5
_PHASES = {"starting": "starting", "start-up": "starting a probe process", "build": "building the model",
           "warm-up": "warm-up steps", "compile": "compiling (torch.compile)", "timing": "timing steps"}


class LiveLine:
    """One line at the bottom of the terminal for the probe in flight. Use as a context manager;
    `progress` and `print` may be called from the search's thread."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()
        self._current = None        # the latest Progress, while a probe runs
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

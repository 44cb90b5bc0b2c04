"""Running the real command line in a subprocess, and the contract for mistakes a user can fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def autotune_command(*args: str) -> list[str]:
    """The argv of `python -m autotune ARGS` with this interpreter (for Popen)."""
    return [sys.executable, "-m", "autotune", *args]


def autotune(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m autotune ARGS` with this interpreter, output captured as text; `env` adds to
    (or overrides) this process's environment."""
    return subprocess.run(autotune_command(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def with_flags(args: list[str], change: dict[str, str]) -> list[str]:
    """`args` with each flag in `change` set to its value (replaced where present, else appended)."""
    args = list(args)
    for flag, value in change.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def assert_usage_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    """Exit status 2 and one line on stderr that contains `needle`; no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def wait_for(predicate, seconds: float = 180.0, what: str = "condition"):
    """Poll `predicate` until it returns something true (returned), or fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")

"""Running the real command line, in this process (`invoke`) or in a subprocess (`autotune`), and
the contract for mistakes a user can fix: one line, exit status 2, nothing written (`refused`,
`Unchanged`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from click.testing import CliRunner

from autotune.cli.app import main


def autotune_command(*args: str) -> list[str]:
    """The argv of `python -m autotune ARGS` with this interpreter (for Popen)."""
    return [sys.executable, "-m", "autotune", *args]


def autotune(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m autotune ARGS` with this interpreter, output captured as text; `env` adds to
    (or overrides) this process's environment."""
    return subprocess.run(
        autotune_command(*args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


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


@dataclass
class Outcome:
    """What a command did: as subprocess.CompletedProcess has it, so that a check reads either."""

    returncode: int
    stdout: str
    stderr: str


def invoke(*args: str, env: dict[str, str] | None = None) -> Outcome:
    """`autotune ARGS` through `main()`, as the console script runs it, in this process."""
    with CliRunner().isolation(env=env) as (out, err, _), mock.patch.object(sys, "argv", ["autotune", *args]):
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
    return Outcome(code, out.getvalue().decode(), err.getvalue().decode())


def snapshot(*roots: Path) -> dict[str, bytes | None]:
    """Every file under `roots` with its bytes (directories as None): what "unchanged" compares.
    SQLite's -wal/-shm files of a database nobody has open are gone once it is closed, so they
    show here only if a command left them behind."""
    found: dict[str, bytes | None] = {}
    for root in roots:
        if not root.exists():
            found[str(root)] = b"<absent>"
            continue
        for path in sorted(root.rglob("*")):
            found[str(path)] = None if path.is_dir() else path.read_bytes()
    return found


class Unchanged:
    """`with Unchanged(folder): run a refused command`: the folder holds the same files, byte for byte."""

    def __init__(self, *roots: Path) -> None:
        self.roots = roots

    def __enter__(self) -> Unchanged:
        self.before = snapshot(*self.roots)
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            after = snapshot(*self.roots)
            added = sorted(set(after) - set(self.before))
            changed = sorted(k for k in set(after) & set(self.before) if after[k] != self.before[k])
            assert not added and not changed and set(after) == set(self.before), (
                f"database unchanged: no (added {added}, changed {changed}, removed {sorted(set(self.before) - set(after))})"
            )


def refused(proc, needle: str) -> None:
    assert_usage_error(proc, needle)
    assert proc.stderr.startswith("autotune: error: ") and proc.stdout == ""


HEAVY = ("torch", "transformers", "optuna", "alembic")
_PROBE_IMPORTS = """
import sys
from autotune.cli import main
sys.argv = ["autotune", *{argv!r}]
try:
    main()
except SystemExit:
    pass
print(sorted({{m.split(".")[0] for m in sys.modules}} & {heavy!r}), file=sys.stderr)
"""


def heavy_modules_loaded(*argv: str) -> list[str]:
    """Which of HEAVY (and sqlalchemy) `autotune ARGV` imports, run in a fresh interpreter."""
    code = _PROBE_IMPORTS.format(argv=list(argv), heavy=set(HEAVY) | {"sqlalchemy"})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stderr.strip().splitlines()[-1].replace("'", '"'))

"""Running a child: a command from the repository root in a process group of its own, its stderr into
the log as it comes, killed with everything it started when the deadline arrives or its own timeout
runs out (Outcome says which, and reads its stdout as the JSON a section wants). The orchestrator's one
way to touch torch or the card.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from benchmarks.gpu_evidence.common import KILL_GRACE_SECONDS, REPO, Failed, Pending, last_line
from benchmarks.run import Deadline


@dataclass
class Outcome:
    """A finished child: its exit status (None when it had to be killed), stdout, wall time, and
    whether the deadline (`cut`) or its own timeout (`timed_out`) ended it."""

    argv: list[str]
    returncode: int | None
    stdout: str
    seconds: float
    cut: bool = False
    timed_out: bool = False

    def json(self, accept: Sequence[int] = (0,), what: str = "") -> dict:
        """Its stdout as one JSON object; Pending when the deadline cut it, Failed otherwise."""
        what = what or Path(self.argv[2] if len(self.argv) > 2 else self.argv[0]).name
        if self.cut:
            raise Pending(f"{what} was stopped at the deadline; the same command goes on")
        if self.timed_out or self.returncode not in accept:
            status = "timed out" if self.timed_out else f"exit status {self.returncode}"
            raise Failed(f"{what}: {status}: {last_line(self.stdout) or 'see the log'}")
        try:
            data = json.loads(self.stdout)
        except json.JSONDecodeError:
            raise Failed(f"{what}: no JSON on stdout: {last_line(self.stdout)!r}") from None
        if not isinstance(data, dict):
            raise Failed(f"{what}: stdout is not a JSON object")
        return data


def kill_group(process: subprocess.Popen) -> None:
    """End `process` and everything it started (its process group): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            if sig == signal.SIGTERM:
                # The leader is gone; a child that ignored SIGTERM must not outlive it.
                os.killpg(process.pid, signal.SIGKILL)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(
    argv: Sequence[str],
    *,
    log: IO[str],
    scratch: Path,
    deadline: Deadline,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> Outcome:
    """Run `argv` from the repository root in a process group of its own (not a session of its own:
    the GPU machine ends leftover processes of a command, except those in a new session), stderr
    straight into `log` as it comes, stdout into a file then the log. Killed, with its group, at
    the deadline or after `timeout` seconds; its group is ended afterwards anyway, so nothing it
    started is left running."""
    argv = [str(a) for a in argv]
    log.write(f"\n$ {shlex.join(argv)}\n")
    log.flush()
    scratch.mkdir(parents=True, exist_ok=True)
    out_path = scratch / f"stdout-{os.getpid()}-{time.monotonic_ns()}.txt"
    started = time.monotonic()
    left = deadline.left()
    limits = [t for t in (timeout, left) if t is not None]
    limit = min(limits) if limits else None
    cut = timed_out = False
    with open(out_path, "w+") as out:
        process = subprocess.Popen(
            argv,
            cwd=REPO,
            env=dict(env) if env is not None else None,
            stdout=out,
            stderr=log,
            stdin=subprocess.DEVNULL,
            process_group=0,
        )
        try:
            process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            cut = left is not None and (timeout is None or left <= timeout)
            timed_out = not cut
        finally:
            kill_group(process)
        out.seek(0)
        stdout = out.read()
    out_path.unlink(missing_ok=True)
    seconds = time.monotonic() - started
    returncode = None if cut or timed_out else process.returncode
    if stdout:
        log.write(f"--- stdout ---\n{stdout}{'' if stdout.endswith(chr(10)) else chr(10)}")
    ending = "stopped at the deadline" if cut else "timed out" if timed_out else f"exit status {returncode}"
    log.write(f"--- {ending}, {seconds:.1f} s ---\n")
    log.flush()
    return Outcome(argv, returncode, stdout, seconds, cut, timed_out)

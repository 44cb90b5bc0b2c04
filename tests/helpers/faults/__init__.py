"""Make a probe misbehave on purpose: see sitecustomize.py beside this file."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

FAULTS = (
    "hang",
    "kill",
    "error",
    "nan",
    "patch-module",
    "leak",
    "poison",
    "oom-on-rank-1",
    "gate",
    "abort-once",
    "slow",
    "stuck-start",
    "paced",
)
FAULT_ENV = "AUTOTUNE_INJECT_FAULT"
GATE_ENV = "AUTOTUNE_INJECT_FAULT_GATE"  # the file a `gate` fault waits for (`abort-once`: makes)
HERE = str(Path(__file__).resolve().parent)
STACKS_ENV = "AUTOTUNE_TEST_STACKS"  # (sitecustomize.py: where each process's stacks go on SIGUSR2)


def fault_env(fault: str, base: dict[str, str] | None = None, *, on_probe: int = 0) -> dict[str, str]:
    """An environment in which every autotune process's probe step misbehaves as `fault` says (in
    every probe, or only in the `on_probe`-th probe each child runs)."""
    assert fault in FAULTS, fault
    env = dict(os.environ if base is None else base)
    if env.get("PYTHONPATH", "").split(os.pathsep)[0] != HERE:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    env[FAULT_ENV] = fault
    env[FAULT_ENV + "_ON_PROBE"] = str(on_probe)
    return env


def inject_fault(monkeypatch, fault: str) -> None:
    """For this test, the probe children it spawns misbehave as `fault` says."""
    for key, value in fault_env(fault).items():
        if os.environ.get(key) != value:
            monkeypatch.setenv(key, value)


def dump_stacks(pids: list[int], directory: Path, wait: float = 2.0) -> str:
    """The stacks of every thread of `pids` (Python processes started with STACKS_ENV=`directory`
    in their environment: sitecustomize.py), each under its pid and command line: SIGUSR2, then
    what they wrote within `wait` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGUSR2)
    time.sleep(wait)
    parts = []
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            command = "(gone)"
        stacks = directory / f"stack-{pid}.txt"
        parts.append(f"--- {pid} {command}\n{stacks.read_text() if stacks.exists() else '(no stacks written)'}")
    return "\n".join(parts)

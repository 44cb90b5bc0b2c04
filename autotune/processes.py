"""Processes autotune starts die with it. A probe child left running by a killed search would keep
its GPU memory while the resumed search probes, and every later OOM and timing would be wrong.

Two guards, because neither covers every case alone:
- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG, SIGKILL)`): the kernel kills the child
  the moment its parent dies, kill -9 included, whatever the child is doing (a hung CUDA call too).
- A watchdog thread that polls the parent's pid: on other platforms, and for a parent that died
  in the instant before the signal was armed.
Torch-free and cheap: spawned children arm both before their heavy imports.

Linux sends the parent-death signal when the *thread* that started the child ends, not only the
process: start probe runners from a thread that outlives them (the main thread, as the CLI does).
"""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import socket
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: stop now (what a second Ctrl-C does). A KeyboardInterrupt, so that every
    `finally` and claim release on the way out runs as for Ctrl-C; the CLI exits 143 for it."""

WATCHDOG_SECONDS = 1.0


def owner_label() -> str:
    """'host:pid': this process, as the owner of a running study or training run (stored, so that
    a later command can tell whether it is still there)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_gone(owner: str | None) -> bool:
    """Whether the process an owner label names is gone, as far as this machine can tell: False
    for another host's process (its heartbeat tells), or a label of another form."""
    host, _, pid = (owner or "").rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process of that pid: alive
        return False
    return _zombie(int(pid))


def _zombie(pid: int) -> bool:
    """A process that exited but was not reaped yet (Linux): gone for our purposes."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill_me_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; elsewhere nothing).
    Survives exec, so it is also what a Popen preexec_fn calls."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the watchdog still holds
        pass


def watch_parent(parent_pid: int, interval: float = WATCHDOG_SECONDS) -> None:
    """Exit at once (no cleanup: the parent that wanted the results is gone) when the parent dies."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(1)

    if os.getppid() != parent_pid:  # died before we got here
        os._exit(1)
    threading.Thread(target=watch, name="autotune-parent-watchdog", daemon=True).start()


# OpenMP's threads wait for each other by spinning by default: on a host busier than its cores (other
# jobs, a test suite, a shared node) each thread's spin takes the slices another one needs, and a
# probe's steps ran 3x slower than with the threads sleeping while they wait (measured on 2 cores
# beside 4 busy processes: 40 tokens/s against 130; idle, no slower). Set for every process
# autotune runs torch in (probe and trace children, train, its ranks), unless the user set it.
OPENMP_ENVIRONMENT = {"OMP_WAIT_POLICY": "PASSIVE"}


def quiet_openmp() -> None:
    """OPENMP_ENVIRONMENT in this process's environment (and its children's), where not set: before
    torch is imported, which reads it once."""
    for name, value in OPENMP_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def run_as_child(parent_pid: int, target: str, *args: object, environment: dict[str, str | None] | None = None) -> None:
    """A spawn target: tie this process to `parent_pid`, then import and call `target`
    ('package.module:function') with `args`. The import comes after the guards, so a child killed
    with its parent during torch's import leaves nothing behind either. `environment` is set (None:
    unset) before the import, for settings read once at start-up (the CUDA allocator's)."""
    kill_me_with_parent()
    watch_parent(parent_pid)
    quiet_openmp()
    for name, value in (environment or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    module, _, function = target.partition(":")
    getattr(importlib.import_module(module), function)(*args)

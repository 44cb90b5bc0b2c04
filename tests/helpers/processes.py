"""The processes a test started, read from /proc: who is alive below whom, their command lines and
CPU time, and the check that a search left nothing running."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

GONE_WITHIN = 10.0  # seconds a test allows a search's processes to end after it did


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields after the command name: state, ppid, ...


def state(pid: int) -> str:
    """The process's state letter (R, S, T, Z, ...); X once it is gone."""
    fields = _stat(pid)
    return "X" if fields is None else fields[0]


def alive(pid: int) -> bool:
    return state(pid) not in ("Z", "X")  # a zombie holds no memory and runs nothing


def parent_of(pid: int) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def children() -> list[int]:
    """Processes whose parent is this one, zombies too (a child never reaped is left behind): each
    thread's `children` list (Linux), else a scan of /proc."""
    me = os.getpid()
    lists = list(Path(f"/proc/{me}/task").glob("*/children"))
    if lists:
        found: set[int] = set()
        for listing in lists:
            with contextlib.suppress(OSError):
                found.update(int(pid) for pid in listing.read_text().split())
        return sorted(found)
    return sorted(int(entry) for entry in os.listdir("/proc") if entry.isdigit() and parent_of(int(entry)) == me)


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if alive(p)}


def ancestors(pid: int) -> set[int]:
    """Every process above `pid`, up to (not including) init."""
    found = set()
    while pid > 1 and (parent := parent_of(pid)) is not None:
        found.add(parent)
        pid = parent
    return found - {0, 1}


def cmdline(pid: int) -> bytes:
    """The process's argv, NUL-separated as /proc holds it (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def name(pid: int) -> str:
    """The process's name (/proc/PID/comm): `autotune-trace` for a trace child forked from the fork
    server, whose command line is the server's."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def trace_children(owner: int) -> set[int]:
    """The estimator's trace children below `owner`: spawned (`-m autotune.estimate.trace`) or forked."""
    return {p for p in descendants(owner) if b"autotune.estimate.trace" in cmdline(p) or name(p) == "autotune-trace"}


def command_text(pid: int) -> str:
    """The process's argv joined with spaces."""
    return cmdline(pid).replace(b"\0", b" ").decode(errors="replace")


def signal_state(pid: int) -> str | None:
    """One line of where the process stands with signals: its state, parent, and the pending,
    blocked, ignored and caught masks (a stop that was sent and not taken shows there); None once
    it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
    return (
        f"{pid} ppid {fields['PPid']} {fields['State']} pending {fields['SigPnd']}/{fields['ShdPnd']} "
        f"blocked {fields['SigBlk']} ignored {fields['SigIgn']} caught {fields['SigCgt']}"
    )


def processes_named(text: str) -> set[int]:
    """Every live process on the machine whose command line contains `text`."""
    return {
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and text in command_text(int(entry)) and alive(int(entry))
    }


def probe_children(owner: int) -> list[int]:
    """The probe children of process `owner` (a search): spawned by it, or forked by its fork server
    (autotune.host.processes.fork_server_context); not the server, nor a forked trace child, nor a child's
    group guard (a fork of the child, with its command line)."""
    below = descendants(owner)
    servers = {p for p in below if parent_of(p) == owner and b"multiprocessing.forkserver" in cmdline(p)}
    return sorted(
        p
        for p in below
        if (parent_of(p) == owner and b"spawn_main" in cmdline(p))
        or (parent_of(p) in servers and name(p) != "autotune-trace")
    )


def cpu_seconds(pids: set[int]) -> float:
    """CPU time (user + system) the live processes `pids` have used."""
    ticks = 0
    for pid in pids:
        fields = _stat(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def assert_all_gone(pids: set[int], within: float = GONE_WITHIN) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    left = {p: cmdline(p).replace(b"\0", b" ")[:120] for p in pids if alive(p)}
    assert not left, f"left running {within:.0f} s after the search ended: {left}"


def environment(pid: int) -> dict[str, str]:
    """The process's environment as it started (/proc/PID/environ)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


def marked_pids(name: str, value: str) -> list[int]:
    """Live processes (other than this one) whose environment has `name=value`: a test cluster's
    marker, which its daemons pass to every process they start."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if not alive(int(entry.name)):
                continue  # a zombie: already dead, its parent reaps it
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_marked(name: str, value: str) -> None:
    """SIGTERM, then SIGKILL, every process marked `name=value` (marked_pids), until none is left:
    what a test cluster started, and nothing else on the machine."""
    for sig, timeout in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        pids = marked_pids(name, value)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            pids = marked_pids(name, value)
            time.sleep(0.1)
        if not pids:
            return

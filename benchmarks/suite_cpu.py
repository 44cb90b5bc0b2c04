"""Where the test suite's CPU goes: run a command (by default `make test`'s pytest) while reading
/proc every half second, and add up each process's CPU time by the kind of process it is (a probe
child, a trace child, a rank, torchrun's agent, a command of the CLI, a pytest worker...) and by the
test that started it (pytest puts PYTEST_CURRENT_TEST in the environment its subprocesses inherit).

    python -m benchmarks.suite_cpu [--out FILE.jsonl] [-- COMMAND ...]

On a 2-core machine the suite keeps both cores busy, so its time is its CPU: this says which
processes to start fewer of. A process that lives less than half a second may be missed (it costs
little); a process's CPU is its own, not its children's. Linux only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

DEFAULT_COMMAND = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
INTERVAL_SECONDS = 0.5
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

# (kind, what in the command line says it), the first that matches
KINDS: tuple[tuple[str, str], ...] = (
    ("pytest worker", r"import sys;exec\(eval\("),
    ("trace child", r"-m autotune\.estimate\.trace|^autotune-trace "),
    ("probe child", r"multiprocessing\.(spawn import spawn_main|forkserver import main)"),  # (a fork server's too)
    ("torchrun agent", r"torch\.distributed\.run"),  # (before rank: its arguments name the ranks' module)
    ("rank", r"-m autotune\.(probe|train)\.rank_main"),
    ("pytest", r"-m pytest"),
    ("benchmarks", r"-m benchmarks\."),
    ("ray", r"\bray\b|raylet|gcs_server"),
    ("slurm", r"slurm|munged"),
    ("postgres", r"postgres"),
    ("chromium", r"chrom"),
    ("compiler", r"\b(cc1plus|g\+\+|gcc|ld)\b"),
)


def kind_of(command_line: str) -> str:
    """The kind of process a command line is ('cli search' for `python -m autotune search ...`)."""
    for kind, pattern in KINDS:
        if re.search(pattern, command_line):
            return kind
    cli = re.search(r"-m autotune (\w+)|/autotune (\w+)", command_line)
    if cli:
        return f"cli {cli.group(1) or cli.group(2)}"
    return "other"


def _forked_name(pid: int) -> str:
    """'autotune-trace ' for a trace child forked from the fork server (its name, set once it runs)."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return "autotune-trace " if comm.read().strip() == "autotune-trace" else ""
    except OSError:
        return ""


@dataclass
class Process:
    pid: int
    command_line: str
    test: str
    cpu_seconds: float


def read_process(pid: int) -> tuple[int, float] | None:
    """(start time in ticks, CPU seconds) of a live process; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[19]), (int(fields[11]) + int(fields[12])) / TICKS


def _environment_value(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            for entry in environ.read().split(b"\0"):
                if entry.startswith(name.encode() + b"="):
                    return entry.split(b"=", 1)[1].decode(errors="replace")
    except OSError:
        pass
    return ""


class Sampler:
    """Reads every process's CPU time every INTERVAL_SECONDS until stopped, keyed by (pid, start)
    so that a reused pid is another process."""

    def __init__(self) -> None:
        self.processes: dict[tuple[int, int], Process] = {}
        self.before: set[tuple[int, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suite-cpu-sampler", daemon=True)

    def sample(self) -> None:
        me = os.getpid()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            pid = int(entry)
            read = read_process(pid)
            if read is None:
                continue
            start, cpu = read
            known = self.processes.get((pid, start))
            if (
                known is not None
                and "forkserver" in known.command_line
                and not known.command_line.startswith("autotune-")
            ):
                # A child forked from a fork server has the server's command line; a trace child
                # names itself (/proc/PID/comm) once it runs.
                known.command_line = _forked_name(pid) + known.command_line
            if known is None:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                        command_line = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    continue
                test = _environment_value(pid, "PYTEST_CURRENT_TEST")
                self.processes[(pid, start)] = Process(pid, command_line, test, cpu)
            else:
                known.cpu_seconds = cpu

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_SECONDS):
            self.sample()

    def __enter__(self) -> "Sampler":
        self.sample()
        self.before = set(self.processes)  # (running already: not the command's)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def by_kind(processes: list[Process]) -> list[tuple[str, int, float]]:
    """(kind, processes, CPU seconds), most CPU first."""
    seconds: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for process in processes:
        kind = kind_of(process.command_line)
        seconds[kind] += process.cpu_seconds
        count[kind] += 1
    return [(kind, count[kind], total) for kind, total in seconds.most_common()]


def by_module(processes: list[Process]) -> list[tuple[str, float]]:
    """(test module, CPU seconds of the processes its tests started), most first."""
    seconds: collections.Counter[str] = collections.Counter()
    for process in processes:
        if process.test:
            seconds[process.test.split("::")[0]] += process.cpu_seconds
    return seconds.most_common()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write every process seen, one JSON object a line")
    parser.add_argument("--top", type=int, default=25, help="rows of each table (default 25)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    args = parser.parse_args(argv)
    command = [part for part in args.command if part != "--"] or DEFAULT_COMMAND
    started = time.monotonic()
    try:
        with Sampler() as sampler:
            returncode = subprocess.call(command)
    except OSError as exc:
        print(f"suite_cpu: cannot run {command[0]!r} ({exc.strerror}); give the command after --", file=sys.stderr)
        return 2
    wall = time.monotonic() - started
    # (Processes already running before the command are not its own.)
    processes = [p for key, p in sampler.processes.items() if key not in sampler.before and p.cpu_seconds > 0]
    total = sum(p.cpu_seconds for p in processes)
    print(
        f"\n{' '.join(command)}: exit {returncode}, {wall:.0f} s wall, {total:.0f} s of CPU seen "
        f"({os.cpu_count()} cores)"
    )
    print(f"\n{'CPU s':>8} {'share':>6} {'count':>6} {'each':>6}  kind")
    for kind, count, seconds in by_kind(processes)[: args.top]:
        print(f"{seconds:8.1f} {seconds / total:6.1%} {count:6d} {seconds / count:6.2f}  {kind}")
    print(f"\n{'CPU s':>8}  test module (the processes its tests started)")
    for module, seconds in by_module(processes)[: args.top]:
        print(f"{seconds:8.1f}  {module}")
    if args.out:
        with open(args.out, "w") as out:
            for process in processes:
                out.write(json.dumps(process.__dict__) + "\n")
    return returncode


if __name__ == "__main__":
    sys.exit(main())

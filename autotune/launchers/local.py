"""`--launcher local` (the default, `--workers N`): worker processes on this machine, one GPU each
(its CUDA_VISIBLE_DEVICES entries) or the CPU. Each dies with the search (the parent-death signal),
and its probes with it."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections import deque
from dataclasses import dataclass, field

from autotune.launchers.base import Launcher, WorkerEnd, WorkerSpec
from autotune.host.processes import kill_me_with_parent


@dataclass
class WorkerProcess:
    """A worker process and what it printed. Its output is read by threads into memory (no files
    to leave behind when this process is killed): stdout is its JSON summary, stderr its progress,
    of which the last lines are kept."""

    device: str
    visible: str
    popen: subprocess.Popen
    stdout: list[str] = field(default_factory=list)
    stderr: deque[str] = field(default_factory=lambda: deque(maxlen=50))
    readers: list[threading.Thread] = field(default_factory=list)

    def read_output(self) -> None:
        assert self.popen.stdout is not None and self.popen.stderr is not None
        for stream, sink in ((self.popen.stdout, self.stdout.append), (self.popen.stderr, self.stderr.append)):
            thread = threading.Thread(target=lambda st=stream, add=sink: [add(line) for line in st], daemon=True)
            thread.start()
            self.readers.append(thread)

    def describe(self) -> str:
        return f"worker {self.popen.pid} ({self.device}{':' + self.visible if self.visible else ''})"

    def summary(self) -> dict | None:
        for thread in self.readers:
            thread.join(timeout=10)
        try:
            return json.loads("".join(self.stdout) or "null")
        except json.JSONDecodeError:
            return None

    def last_error(self) -> str:
        lines = [line.strip() for line in self.stderr if line.strip()]
        return lines[-1].removeprefix("autotune: error: ") if lines else f"exit status {self.popen.returncode}"

    def stop(self, grace: float) -> None:
        """SIGTERM (the worker gives its claim back and exits), then SIGKILL after `grace` seconds."""
        if self.popen.poll() is not None:
            return
        self.popen.terminate()
        try:
            self.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class LocalLauncher(Launcher):
    """Workers on this machine: `devices` is each one's (--device, CUDA_VISIBLE_DEVICES), as
    search.fleet.worker_devices gives them."""

    name = "local"

    def __init__(self, devices: list[tuple[str, str]]) -> None:
        self.devices = devices
        self.processes: list[WorkerProcess] = []

    def start(self, count: int, spec: WorkerSpec) -> None:
        for device, visible in self.devices[:count]:
            command = WorkerSpec(spec.study, spec.db_url, device, spec.ranks, spec.timeout).command()
            env = {**os.environ, **spec.environment(), "CUDA_VISIBLE_DEVICES": visible}
            # kill_me_with_parent: a worker (and through its own lifeline, its probe child) dies with
            # this process, kill -9 included.
            popen = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env=env,
                text=True,
                errors="replace",
                preexec_fn=kill_me_with_parent,
            )
            process = WorkerProcess(device, visible, popen)
            process.read_output()
            self.processes.append(process)

    def alive(self) -> int:
        return sum(p.popen.poll() is None for p in self.processes)

    def stop(self, grace: float) -> None:
        for process in self.processes:
            process.stop(grace=grace)

    def stop_silent(self, labels: set[str]) -> None:
        for process in self.processes:
            if process.popen.poll() is None and any(f":{process.popen.pid}:" in label for label in labels):
                process.stop(grace=0)

    def ends(self) -> list[WorkerEnd]:
        ends = []
        for process in self.processes:
            summary = process.summary()
            ok = process.popen.returncode in (0, 130) and summary is not None
            ends.append(WorkerEnd(process.describe(), summary if ok else None, None if ok else process.last_error()))
        return ends

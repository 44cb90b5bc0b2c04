"""The launcher seam: what starts a search's workers where the GPUs are, follows how many are alive
and stops them all. The database stays the one source of truth: a launcher only starts `autotune
worker --study S` processes (on this machine, as Ray tasks, as a Slurm job array), which pull their
probes from it (claims, heartbeats, retries: search/fleet.py), and stops them. Every launcher is
held to the same rule: when the search ends, is stopped (Ctrl-C, SIGTERM) or reaches its --timeout,
nothing it started is left queued or running."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every worker runs: `autotune worker --study STUDY` (a search's), or `autotune worker
    --queue` (the service's: `study` None), on `device` against the database at `db_url` (given in
    its environment, never on a command line `ps` shows)."""

    study: str | None
    db_url: str
    device: str  # cuda or cpu: each worker's device kind (vocabulary/devices.py worker_kind)
    ranks: int = 1  # GPUs (or CPU ranks) each worker's probes take
    timeout: float | None = None  # the search's --timeout, left when the workers start

    @property
    def label(self) -> str:
        """What the workers serve, for names (a Slurm job's, a Ray task's)."""
        return self.study if self.study is not None else "queue"

    def command(self, python: str = sys.executable) -> list[str]:
        serves = ["--study", self.study] if self.study is not None else ["--queue"]
        command = [python, "-m", "autotune", "worker", *serves, "--device", self.device, "--json"]
        if self.timeout is not None:
            command += ["--timeout", f"{max(self.timeout, 0.001):.3f}s"]
        return command

    def environment(self) -> dict[str, str]:
        return {"AUTOTUNE_DB": self.db_url, "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True, slots=True)
class WorkerEnd:
    """How one worker ended: its JSON summary, or the line that says why it failed."""

    name: str
    summary: dict | None
    failure: str | None = None


class Launcher(ABC):
    """Start `count` workers for a search; how many are alive; stop them all."""

    name: ClassVar[str]

    def check(self, count: int, spec: WorkerSpec) -> None:
        """Refuse, in one line (BadInput) and before anything is written, what cannot start."""

    @abstractmethod
    def start(self, count: int, spec: WorkerSpec) -> None: ...

    @abstractmethod
    def alive(self) -> int: ...

    @abstractmethod
    def stop(self, grace: float) -> None:
        """Ask every worker to stop (each gives its claim back), and end what is left after
        `grace` seconds. Returns when nothing it started runs or waits."""

    @abstractmethod
    def ends(self) -> list[WorkerEnd]: ...

    def stop_silent(self, labels: set[str]) -> None:
        """Stop the workers whose claims went stale (labels 'host:pid:device'), where this launcher
        can tell which they are; another worker takes their configurations over."""

"""What every part of the GPU evidence shares: where the repository is and the names of the files a run
writes, the exit statuses, the margins kept before the deadline, and how a section ends other than
measured (Skip, Pending, Failed, raised with the figures it got so far; Interrupted on SIGTERM), with
the one-line texts a section's status is made of. It starts no process and imports no torch: the
orchestrator and every child import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]  # (this file: benchmarks/gpu_evidence/common.py)
EVIDENCE_FILE = "gpu-evidence.json"
LOG_FILE = "gpu-evidence.log"
STATE_TAR = "gpu-evidence-state.tar.gz"
RESULT_MARK = "GPU_EVIDENCE_RESULT "
EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_PENDING = 0, 1, 2, 3
# A child told to stop (SIGTERM: autotune marks its study interrupted) gets this long before SIGKILL.
KILL_GRACE_SECONDS = 10.0
# What a command that ends itself (search --timeout, benchmarks.run --deadline) is told to leave
# free before our deadline: its own wrap-up, and our kill's grace.
WRAP_UP_SECONDS = 45.0
MiB, GiB = 2**20, 2**30


class SectionEnd(Exception):
    """How a section ends other than measured: the message is the status's reason; `figures` what
    it measured on the way (kept, and read back by the next attempt)."""

    prefix = ""

    def __init__(self, reason: str, figures: Mapping[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.figures = dict(figures or {})

    @property
    def status(self) -> str:
        return f"{self.prefix}: {one_line(str(self))}"


class Skip(SectionEnd):
    prefix = "skipped"


class Pending(SectionEnd):
    prefix = "pending"


class Failed(SectionEnd):
    prefix = "failed"


class Interrupted(BaseException):
    """SIGTERM: stop now, as if the deadline had come (a BaseException, as KeyboardInterrupt is, so
    that no section's error handling records it as the section's failure)."""


class UsageError(Exception):
    """A mistake in the command: one line, exit status 2, nothing written."""


def one_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def last_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return one_line(lines[-1] if lines else "", limit)


def is_done(status: str | None) -> bool:
    return bool(status) and (status == "measured" or str(status).startswith("skipped"))


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")

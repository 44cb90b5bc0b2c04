"""Run: one command of the evidence, with its directories (--out, --state), mode, deadline, log and
document, and the ways a section starts a child through it: a command, `autotune ...`, or a helper
(helpers.HELPERS by name, its figures read back from the last line of its stdout), all in the
environment the children share (autotune's files and the HF caches inside the state, no hub).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from benchmarks.gpu_evidence.children import Outcome, run_child
from benchmarks.gpu_evidence.common import LOG_FILE, REPO, RESULT_MARK, WRAP_UP_SECONDS, Failed, Pending
from benchmarks.gpu_evidence.document import save_document
from benchmarks.run import Deadline


@dataclass
class Run:
    """One invocation: its directories, mode, deadline, log, and the evidence document it writes."""

    out: Path
    state: Path
    mode: str  # "cuda" or "cpu"
    deadline: Deadline
    log: IO[str]
    doc: dict
    python: str = sys.executable

    @property
    def cuda(self) -> bool:
        return self.mode == "cuda"

    @property
    def sections(self) -> dict[str, dict]:
        return self.doc["sections"]

    def previous(self, name: str) -> dict:
        """What an earlier attempt of section `name` left (pending or failed ones included)."""
        return dict(self.sections.get(name) or {})

    def say(self, line: str) -> None:
        stamp = datetime.now(timezone.utc).strftime("%H:%M:%S")
        self.log.write(f"[{stamp}] {line}\n")
        self.log.flush()
        print(line, file=sys.stderr, flush=True)

    def env(self, overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """The children's environment: autotune's files and the HF caches inside the state, no hub,
        this repository importable; `overrides` set (None: unset) what a child needs besides."""
        env = dict(os.environ)
        home = self.state / "home"
        env.update(
            {
                "AUTOTUNE_HOME": str(home),
                "AUTOTUNE_DB": f"sqlite:///{home / 'autotune.db'}",
                "HF_HUB_OFFLINE": "1",
                "HF_DATASETS_CACHE": str(self.state / "cache" / "hf-datasets"),
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            }
        )
        if not self.cuda:
            # Two cores: one OpenMP thread per process, or children spin against each other.
            env.setdefault("OMP_NUM_THREADS", "1")
        for name, value in (overrides or {}).items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    def command(
        self, argv: Sequence[str], *, timeout: float | None = None, env: Mapping[str, str | None] | None = None
    ) -> Outcome:
        return run_child(
            argv, log=self.log, scratch=self.state / "tmp", deadline=self.deadline, timeout=timeout, env=self.env(env)
        )

    def autotune(self, *args: str, timeout: float | None = None) -> Outcome:
        return self.command([self.python, "-m", "autotune", *args], timeout=timeout)

    def helper(
        self, name: str, *, timeout: float = 300.0, env: Mapping[str, str | None] | None = None, **kwargs: Any
    ) -> dict:
        """Run helpers.HELPERS[name](**kwargs) in a fresh Python process; its figures."""
        code = "import sys; from benchmarks.gpu_evidence.helpers import helper_main; helper_main(sys.argv[1:])"
        outcome = self.command([self.python, "-c", code, name, json.dumps(kwargs)], timeout=timeout, env=env)
        if outcome.cut:
            raise Pending(f"{name} was stopped at the deadline")
        lines = [line for line in outcome.stdout.splitlines() if line.startswith(RESULT_MARK)]
        if outcome.timed_out or not lines:
            why = (
                f"timed out after {timeout:.0f} s"
                if outcome.timed_out
                else f"exit status {outcome.returncode}, no result"
            )
            raise Failed(f"{name}: {why} (see {LOG_FILE})")
        return json.loads(lines[-1][len(RESULT_MARK) :])

    def timeout_flag(self, flag: str, unit: str = "") -> list[str]:
        """`flag SECONDS` for a command that ends itself before our deadline (none without one)."""
        left = self.deadline.left()
        if left is None:
            return []
        return [flag, f"{max(30, int(left - WRAP_UP_SECONDS))}{unit}"]

    def db(self, name: str) -> str:
        return f"sqlite:///{self.state / name}"

    @property
    def tiny_model(self) -> Path:
        return self.state / "tiny-gpt2"

    def save(self) -> None:
        """The document into --out and --state (written whole, then renamed: a kill leaves the
        previous one), and, where they differ, the state packed into --out so that a fresh machine
        can be given it back (docs/gpu-evidence.md)."""
        save_document(self.doc, self.out, self.state)

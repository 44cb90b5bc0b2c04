"""The parent side of a probe: start a worker process, hand it a configuration, wait with a time
limit, and turn whatever happens (a result, a hang, a dead process) into a ProbeResult.

The parent never imports torch. A worker that ended a probe cleanly is kept for the next one when
`reuse_worker` is on (the default: it saves the interpreter start and the torch/transformers
imports, several seconds a probe); after an OOM or any fault the worker exits and the next probe
gets a fresh process.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, replace
from typing import Any

from autotune import errors
from autotune.config import ProbeConfig
from autotune.environment import Environment
from autotune.models import ModelSpec, resolve_model
from autotune.result import ProbeResult
from autotune.units import format_size

DEFAULT_TIMEOUT = 600.0       # seconds for one probe, start-up included
STARTUP_TIMEOUT = 300.0       # a worker that cannot import torch in this long is broken
DEFAULT_MARGIN_FRACTION = 0.05


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """How probes are run, as opposed to what they run (ProbeConfig)."""

    device: str = "auto"
    warmup_steps: int = 2
    measure_steps: int = 3
    timeout: float = DEFAULT_TIMEOUT
    margin: int | float = DEFAULT_MARGIN_FRACTION  # bytes, or a fraction of the budget when < 1
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.warmup_steps < 2:
            problems.append("--warmup-steps must be at least 2 (the peak needs the optimizer state, created by the first step)")
        if self.measure_steps < 1:
            problems.append("--measure-steps must be at least 1")
        if self.timeout <= 0:
            problems.append("--probe-timeout must be positive")
        if self.margin < 0:
            problems.append("--safety-margin must not be negative")
        if problems:
            raise errors.BadInput("; ".join(problems) + ".")

    def margin_bytes(self, budget_bytes: int) -> int:
        return int(self.margin * budget_bytes) if self.margin < 1 else int(self.margin)


def check_config(config: ProbeConfig, spec: ModelSpec) -> None:
    """Problems a user must fix before any process starts."""
    if spec.max_positions is not None and config.block_size > spec.max_positions:
        raise errors.BadInput(
            f"--block-size {config.block_size} is above {spec.reference}'s maximum of {spec.max_positions} positions; "
            f"use at most {spec.max_positions}."
        )
    if "vocab_size" not in spec.config:
        raise errors.ModelNotFound(f"--model {spec.reference}: its config has no vocab_size; is it a causal language model?")


class ProbeRunner:
    """Runs probes in worker processes. Use as a context manager so the worker is always stopped."""

    def __init__(self, settings: ProbeSettings | None = None, *, reuse_worker: bool = True) -> None:
        self.settings = settings or ProbeSettings()
        self.reuse_worker = reuse_worker
        self._ctx = mp.get_context("spawn")
        self._process: Any = None   # multiprocessing's SpawnProcess, while a worker is alive
        self._conn: Any = None      # our end of the pipe to it
        self.workers_started = 0

    # -- worker lifecycle ----------------------------------------------------------------------
    def _start_worker(self) -> float:
        from autotune.probe import worker

        started = time.perf_counter()
        parent_conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(target=worker.main, args=(child_conn,), name="autotune-probe", daemon=True)
        process.start()
        child_conn.close()  # so that the worker's death reads as EOF here
        self._process, self._conn = process, parent_conn
        self.workers_started += 1
        reply = self._receive(STARTUP_TIMEOUT)
        if reply is None or not reply.get("ready"):
            self.close()
            raise RuntimeError(f"the probe worker did not start (exit code {process.exitcode}); a script that calls "
                               f"run_probe or ProbeRunner must do so under `if __name__ == '__main__':`, since "
                               f"workers are spawned and import the main module again")
        return time.perf_counter() - started

    def _receive(self, timeout: float) -> dict | None:
        """The worker's next reply; None if it died; raises TimeoutError past `timeout`."""
        assert self._conn is not None
        try:
            ready = self._conn.poll(timeout)
            if ready:
                return self._conn.recv()
        except (EOFError, ConnectionResetError, BrokenPipeError):
            return None
        raise TimeoutError  # (outside the try: TimeoutError is an OSError)

    def close(self) -> None:
        """Stop the worker (politely, then by force)."""
        if self._conn is not None:
            try:
                self._conn.send(None)
            except (OSError, ValueError):
                pass
        if self._process is not None:
            self._process.join(timeout=5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def _kill(self) -> int | None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
        if self._process is not None:
            self._process.join(timeout=10)
        exitcode = self._process.exitcode if self._process is not None else None
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
        return exitcode

    def __enter__(self) -> "ProbeRunner":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------
    def _ensure_worker(self) -> float:
        """Start a worker if none is alive; the seconds that took (0 when one was reused)."""
        if self._process is not None and self._process.is_alive():
            return 0.0
        self._kill()
        return self._start_worker()

    def environment(self) -> Environment:
        """The device the probes will run on, as the worker sees it."""
        self._ensure_worker()
        assert self._conn is not None
        self._conn.send({"op": "environment", "device": self.settings.device})
        reply = self._receive(STARTUP_TIMEOUT)
        if reply is None:
            raise RuntimeError("the probe worker died while describing its device")
        if "user_error" in reply:
            raise getattr(errors, reply["user_error"], errors.AutotuneError)(reply["message"])
        return Environment.from_dict(reply["environment"])

    def run(self, config: ProbeConfig, budget_bytes: int, spec: ModelSpec | None = None) -> ProbeResult:
        """Probe `config` against `budget_bytes` in a worker; every outcome comes back as a status."""
        spec = spec or resolve_model(config.model)
        check_config(config, spec)
        margin = self.settings.margin_bytes(budget_bytes)
        if margin >= budget_bytes:
            raise errors.BadInput(f"--safety-margin {format_size(margin)} leaves nothing of the {format_size(budget_bytes)} budget; use a smaller margin.")
        started = time.perf_counter()
        startup = self._ensure_worker()
        request = {
            "op": "probe",
            "config": config.to_dict(),
            "model_config": spec.config,
            "model_path": spec.path,
            "trust_remote_code": self.settings.trust_remote_code,
            "budget_bytes": budget_bytes,
            "margin_bytes": margin,
            "device": self.settings.device,
            "warmup_steps": self.settings.warmup_steps,
            "measure_steps": self.settings.measure_steps,
        }
        assert self._conn is not None
        self._conn.send(request)
        remaining = max(1.0, self.settings.timeout - startup)
        try:
            reply = self._receive(remaining)
        except TimeoutError:
            self._kill()
            return self._failed(config, budget_bytes, margin, "timeout", f"no result within {self.settings.timeout:.0f} s; the worker was killed", started, startup)
        if reply is None:
            exitcode = self._kill()
            how = f"signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"
            return self._failed(config, budget_bytes, margin, "crashed", f"the worker died without a result ({how})", started, startup)
        if "user_error" in reply:
            raise getattr(errors, reply["user_error"], errors.AutotuneError)(reply["message"])
        result = ProbeResult.from_dict(reply["result"])
        result.startup_seconds = startup
        result.wall_seconds = time.perf_counter() - started
        if result.status not in ("ok", "skipped") or not self.reuse_worker:
            # The worker exits by itself after an unclean probe; make sure, and reap it.
            self.close()
        return result

    @staticmethod
    def _failed(config: ProbeConfig, budget: int, margin: int, status: str, why: str, started: float, startup: float) -> ProbeResult:
        return ProbeResult(status=status, budget_bytes=budget, margin_bytes=margin, error=why,
                           startup_seconds=startup, wall_seconds=time.perf_counter() - started)


def run_probe(config: ProbeConfig, budget: int, device: str | None = None, *, settings: ProbeSettings | None = None) -> ProbeResult:
    """Probe one configuration in a fresh worker process and return what it measured.
    `budget` is in bytes; `device` (auto, cpu, cuda, cuda:N) overrides `settings.device`."""
    settings = settings or ProbeSettings()
    if device is not None:
        settings = replace(settings, device=device)
    with ProbeRunner(settings, reuse_worker=False) as runner:
        return runner.run(config, budget)

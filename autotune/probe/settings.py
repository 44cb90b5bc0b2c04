"""ProbeSettings: how probes are run, as opposed to what they run (ProbeConfig). The one definition
of those settings: the request a child gets carries them whole, and the plan a study stores for
workers that join it (`to_plan` / `from_plan`) is derived from their fields, so a new setting
cannot be dropped on the way to a worker. Torch-free."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from autotune.vocabulary import defaults
from autotune.vocabulary import errors
from autotune.vocabulary.devices import device_kind
from autotune.results.budget import Budget


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """How probes are run."""

    device: str = "auto"
    warmup_steps: int = defaults.WARMUP_STEPS
    measure_steps: int = defaults.MEASURE_STEPS
    measure_seconds: float = defaults.MEASURE_SECONDS
    timeout: float = defaults.PROBE_TIMEOUT_SECONDS
    margin: int | float = defaults.SAFETY_MARGIN  # bytes, or a fraction of the budget when < 1
    trust_remote_code: bool = False
    max_compile_seconds: float | None = None  # skip a --compile config whose compilation takes longer
    # Where a run on several nodes meets (host:port of torchrun's static rendezvous, on this node):
    # the other nodes run `autotune node` with the same address.
    rendezvous: str | None = None

    # Not part of a study's plan: each worker probes on its own device (and meets its own nodes),
    # and the margin is the study's (stored in its row, in bytes). Every other field travels to
    # joining workers.
    WORKER_OWN: ClassVar[frozenset[str]] = frozenset({"device", "margin", "rendezvous"})
    # What a plan stored by an older autotune means by a setting it lacks: plans stored before
    # time-sized windows were step-counted (no minimum length).
    OLDER_PLANS: ClassVar[dict[str, Any]] = {"measure_seconds": 0.0}

    def __post_init__(self) -> None:
        problems = []
        # The form is checked here, before a child starts; whether the device exists, in the child.
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(self.device).strip().lower()):
            problems.append(f"--device {self.device!r} is not supported; use auto, cpu, cuda or cuda:N")
        if self.warmup_steps < 2:
            problems.append(
                "--warmup-steps must be at least 2 (the peak needs the optimizer state, created by the first step)"
            )
        if self.measure_steps < 1:
            problems.append("--measure-steps must be at least 1")
        if not 0 <= self.measure_seconds <= 3600:
            problems.append("--measure-seconds must be from 0 to 3600")
        if self.timeout <= 0:
            problems.append("--probe-timeout must be positive")
        if self.margin < 0:
            problems.append("--safety-margin must not be negative")
        if self.max_compile_seconds is not None and self.max_compile_seconds <= 0:
            problems.append("--max-compile-seconds must be positive")
        if self.rendezvous is not None and not re.fullmatch(r"[A-Za-z0-9._\-\[\]:]+:\d{1,5}", self.rendezvous.strip()):
            problems.append(
                f"--rendezvous {self.rendezvous!r} is not HOST:PORT (the first node's address and a free port)"
            )
        if problems:
            raise errors.BadInput("; ".join(problems) + ".")

    @property
    def device_kind(self) -> str:
        """'cpu', 'cuda' or 'auto', as the settings name it (the child says what auto became)."""
        return device_kind(self.device)

    def budget(self, budget_bytes: int) -> Budget:
        """`budget_bytes` with these settings' margin (checked)."""
        return Budget.of(budget_bytes, self.margin)

    def to_plan(self) -> dict[str, Any]:
        """The settings every worker of a study shares, as JSON-ready values."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.WORKER_OWN}

    @classmethod
    def from_plan(cls, plan: dict[str, Any] | None, *, device: str, margin: int | float) -> ProbeSettings:
        """A joining worker's settings: the study's plan, with its own device and the study's margin."""
        shared = {f.name for f in fields(cls)} - cls.WORKER_OWN
        stored = {name: value for name, value in (plan or {}).items() if name in shared and value is not None}
        return cls(device=device, margin=margin, **{**cls.OLDER_PLANS, **stored})

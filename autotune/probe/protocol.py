"""What the probe runner (parent) and the probe child say to each other over their pipe: typed
messages, pickled by multiprocessing. Torch-free, so both sides import it."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.host.environment import Environment
from autotune.vocabulary.errors import AutotuneError
from autotune.specs.models import ModelSpec
from autotune.probe.settings import ProbeSettings
from autotune.results.probe_result import ProbeResult


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """Probe one configuration of a model against a budget, run as the settings say."""

    config: ProbeConfig
    model: ModelSpec  # its config.json contents, and its directory for models with their own code
    budget: Budget
    settings: ProbeSettings
    # Wait, after saying 'timing', for the parent's Go: it pauses the search's other processes first.
    hold_before_timing: bool = False
    # Another window of a config already measured (the confirmation round): its memory is known, so
    # no CPU accountant (which slows steps by 40%), no later phases, and one warm-up step where the
    # process ran a probe before.
    timing_only: bool = False


@dataclass(frozen=True, slots=True)
class EnvironmentRequest:
    """Describe the device `device` as the child sees it."""

    device: str


@dataclass(frozen=True, slots=True)
class ModelCheckRequest:
    """Can the probe build this model, with each of these attention kernels, on this device?
    Answered by building it on the meta device (no memory): a mistake found here is refused before
    a study is written."""

    model: ModelSpec
    config: ProbeConfig  # the task and its head, as the probes will build them
    attentions: tuple[str, ...]
    device: str
    trust_remote_code: bool = False


@dataclass(frozen=True, slots=True)
class ModelCheckReply:
    """The model builds with at least one attention asked for; the kernels the model's class does
    not implement (deberta and sdpa), with the reason, are left to be skipped by their probes."""

    parameters: int
    unsupported: tuple[tuple[str, str], ...] = ()  # (attention, why)


@dataclass(frozen=True, slots=True)
class Ready:
    """The child imported torch and transformers and waits for requests."""

    startup_seconds: float


@dataclass(frozen=True, slots=True)
class EnvironmentReply:
    environment: Environment


@dataclass(frozen=True, slots=True)
class ResultReply:
    result: ProbeResult
    why_not_reused: str | None = None  # set: the child exits after this reply (probe/hygiene.py says why)

    @property
    def child_goes_on(self) -> bool:
        return self.why_not_reused is None


@dataclass(frozen=True, slots=True)
class UserErrorReply:
    """The request cannot be honoured for a reason the user can fix: the parent raises the same
    error (its class and message travel pickled; the child names the model as the user typed it)."""

    error: AutotuneError


Request = ProbeRequest | EnvironmentRequest | ModelCheckRequest


@dataclass(frozen=True, slots=True)
class Phase:
    """The probe in flight reached a phase ('build', 'warm-up', 'timing'): sent before its reply,
    for the live display."""

    name: str


@dataclass(frozen=True, slots=True)
class Go:
    """The parent's answer to a held 'timing' phase: the window may start."""


Reply = Ready | EnvironmentReply | ResultReply | ModelCheckReply | UserErrorReply | Phase

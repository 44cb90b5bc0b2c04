"""ProbeResult: what one probe measured, or why it measured nothing. Outcomes are data."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from autotune.results.budget import required_bytes
from autotune.vocabulary.status import ProbeStatus


@dataclass(slots=True)
class ProbeResult:
    status: ProbeStatus  # see autotune.vocabulary.status
    device: str = ""  # e.g. 'NVIDIA H100 80GB HBM3' or 'cpu (AMD EPYC ...)'
    device_total_bytes: int | None = None
    budget_bytes: int | None = None
    margin_bytes: int | None = None
    cap_bytes: int | None = None  # what the allocator (or the CPU accountant) was allowed
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    context_bytes: int | None = None  # CUDA context and other memory outside the allocator; 0 on CPU
    step_seconds: float | None = None  # per optimizer step (the median of the window), micro-steps included
    step_spread: float | None = None  # half the interquartile range of the step times, over the median
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    mfu: float | None = None  # model FLOP utilisation, where the device's peak is known
    first_loss: float | None = None
    last_loss: float | None = None
    warmup_steps: int | None = None
    measured_steps: int | None = None
    startup_seconds: float | None = None  # worker process start and imports; 0 when a warm worker was reused
    build_seconds: float | None = None  # model build and optimizer set-up
    compile_seconds: float | None = None  # torch.compile's one-off cost: the first compiled step less a timed one
    measured_seconds: float | None = None  # the timed window
    wall_seconds: float | None = None  # the whole probe as the caller saw it, process start included
    parameters: int | None = None  # parameters of the model built (the task's whole class)
    trainable_parameters: int | None = None  # of which train (fewer under LoRA: the adapters)
    step_times: list[float] | None = None  # each timed step's seconds, in order (autotune.results.timing)
    host_load: float | None = None  # the host's load average per core as the probe ended: what it was timed beside
    gpu_processes: int | None = None  # other processes on its GPU (NVML), where it can be told
    # Each phase's peaks, {"train": {"allocated": .., "reserved": ..}, "eval": .., "generate": ..}, for
    # the phases the config's run has (autotune.levers.evaluation); the peaks above are their maximum.
    phase_peaks: dict[str, dict[str, int]] | None = None
    failed_phase: str | None = None  # the phase that ran out of memory or failed (None: all ran, or train only)
    eval_batch_found: int | None = (
        None  # --eval-batch auto: the largest eval batch that fitted (the phases' peaks are its)
    )
    # On several ranks: each rank's peaks, [{"allocated": .., "reserved": ..}, ...] by rank; the
    # peaks above are the largest rank's (what must fit each card).
    rank_peaks: list[dict[str, int]] | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        # Stored rows and JSON hand back plain strings: make them members, refusing unknown ones.
        self.status = ProbeStatus(self.status)

    @property
    def fits(self) -> bool:
        return self.status == ProbeStatus.OK

    @property
    def required_bytes(self) -> int | None:
        """What this config needs of the card: peak reserved plus the context outside the allocator."""
        return required_bytes(self.peak_reserved_bytes, self.context_bytes)

    def to_dict(self) -> dict:
        data = asdict(self)
        # JSON has no NaN/inf; an unstable probe's loss becomes null.
        for key, value in data.items():
            if isinstance(value, float) and not math.isfinite(value):
                data[key] = None
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "ProbeResult":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

"""A study's plan: what the search that started a study stored so that workers joining it from
other processes or machines search the same way (strategy, probe settings, memory predictions).

Stored as JSON in the study's row (Store.set_study_plan); this module is its one definition, so
the writing and the reading side cannot disagree on a key or a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune import defaults
from autotune.search.predictions import Prediction


@dataclass(frozen=True, slots=True)
class ProbePlan:
    """How every worker runs its probes (ProbeSettings, less the device and margin, which are
    each worker's own and the study's)."""

    warmup_steps: int = defaults.WARMUP_STEPS
    measure_steps: int = defaults.MEASURE_STEPS
    timeout: float = defaults.PROBE_TIMEOUT_SECONDS
    trust_remote_code: bool = False
    # Plans stored before time-sized windows read as step-counted ones (0: no minimum length).
    measure_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class StudyPlan:
    strategy: str = defaults.STRATEGY
    fresh: bool = False
    predict_margin: float = defaults.PREDICT_MARGIN
    patience: int | None = None
    heartbeat_seconds: float = defaults.HEARTBEAT_SECONDS
    probe: ProbePlan = field(default_factory=ProbePlan)
    predictions: dict[str, Prediction] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy, "fresh": self.fresh, "predict_margin": self.predict_margin,
            "patience": self.patience, "heartbeat_seconds": self.heartbeat_seconds,
            "probe": {"warmup_steps": self.probe.warmup_steps, "measure_steps": self.probe.measure_steps,
                      "timeout": self.probe.timeout, "trust_remote_code": self.probe.trust_remote_code,
                      "measure_seconds": self.probe.measure_seconds},
            "predictions": {key: [p.peak_bytes, p.floor_bytes, p.required_bytes] for key, p in self.predictions.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StudyPlan:
        """The stored plan; keys a plan of an older autotune lacks take today's defaults."""
        data = data or {}
        probe = data.get("probe") or {}
        known = {k: data[k] for k in ("strategy", "fresh", "predict_margin", "patience", "heartbeat_seconds")
                 if data.get(k) is not None}
        return cls(
            **known,
            probe=ProbePlan(**{k: probe[k] for k in ProbePlan.__dataclass_fields__ if probe.get(k) is not None}),
            predictions={key: Prediction(*values) for key, values in (data.get("predictions") or {}).items()},
        )

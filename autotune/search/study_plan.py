"""A study's plan: what the search that started a study stored so that workers joining it from
other processes or machines search the same way (strategy, probe settings, memory predictions).

Stored as JSON in the study's row (Store.set_study_plan); this module is its one definition, so
the writing and the reading side cannot disagree on a key or a default. The probe settings are
ProbeSettings' own plan (`to_plan`/`from_plan`), derived from its fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autotune.vocabulary import defaults
from autotune.search.predictions import Prediction


@dataclass(frozen=True, slots=True)
class StudyPlan:
    strategy: str = defaults.STRATEGY
    fresh: bool = False
    predict_margin: float = defaults.PREDICT_MARGIN
    patience: int | None = None
    heartbeat_seconds: float = defaults.HEARTBEAT_SECONDS
    confirm: bool = True  # a fleet's workers run the confirmation round unless the search said --no-confirm
    probe: dict[str, Any] = field(default_factory=dict)  # ProbeSettings.to_plan(): how every worker probes
    predictions: dict[str, Prediction] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "fresh": self.fresh,
            "predict_margin": self.predict_margin,
            "patience": self.patience,
            "heartbeat_seconds": self.heartbeat_seconds,
            "confirm": self.confirm,
            "probe": dict(self.probe),
            "predictions": {
                key: [p.peak_bytes, p.floor_bytes, p.required_bytes] for key, p in self.predictions.items()
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> StudyPlan:
        """The stored plan; keys a plan of an older autotune lacks take today's defaults (the probe
        settings' in ProbeSettings.from_plan)."""
        data = data or {}
        known = {
            k: data[k]
            for k in ("strategy", "fresh", "predict_margin", "patience", "heartbeat_seconds", "confirm")
            if data.get(k) is not None
        }
        return cls(
            **known,
            probe=dict(data.get("probe") or {}),
            predictions={key: Prediction(*values) for key, values in (data.get("predictions") or {}).items()},
        )

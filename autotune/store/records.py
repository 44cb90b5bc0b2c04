"""What the store hands back: plain dataclasses, detached from any database session."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from autotune.levers.config import ProbeConfig
from autotune.results.probe_result import ProbeResult


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


@dataclass(frozen=True, slots=True)
class StudyRecord:
    """One study as stored."""

    id: int
    name: str
    model_reference: str
    model_fingerprint: str
    device_name: str
    device_total_bytes: int | None
    budget_bytes: int
    margin_bytes: int
    effective_batch: int
    space: dict[str, Any]
    env_fingerprint: str
    environment: dict[str, Any]
    status: str
    created_at: datetime
    updated_at: datetime
    plan: dict[str, Any] | None = None  # what a joining worker needs (see Store.set_study_plan)
    confirmation: dict[str, Any] | None = None  # how the winner was told apart (search/confirm.py)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "model_reference": self.model_reference,
            "model_fingerprint": self.model_fingerprint,
            "device_name": self.device_name,
            "device_total_bytes": self.device_total_bytes,
            "budget_bytes": self.budget_bytes,
            "margin_bytes": self.margin_bytes,
            "effective_batch": self.effective_batch,
            "space": self.space,
            "env_fingerprint": self.env_fingerprint,
            "environment": self.environment,
            "status": self.status,
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "plan": self.plan,
            "confirmation": self.confirmation,
        }


@dataclass(frozen=True, slots=True)
class StudySummary:
    """One line of `autotune studies`: a study and what its probes found."""

    name: str
    model_reference: str
    device_name: str
    budget_bytes: int
    margin_bytes: int
    status: str
    created_at: datetime
    updated_at: datetime
    probes_total: int
    probes_ok: int
    probes_oom: int
    probes_skipped: int
    best_tokens_per_s: float | None  # of its best config that fits (autotune.results.ranking), the leaderboard's first
    workers: int = 0  # distinct workers that recorded probes
    best_label: str | None = None  # that config

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model": self.model_reference,
            "device": self.device_name,
            "budget_bytes": self.budget_bytes,
            "margin_bytes": self.margin_bytes,
            "status": self.status,
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "probes": self.probes_total,
            "ok": self.probes_ok,
            "oom": self.probes_oom,
            "skipped": self.probes_skipped,
            "best_tokens_per_s": self.best_tokens_per_s,
            "best": self.best_label,
            "workers": self.workers,
        }


@dataclass(frozen=True, slots=True)
class ProbeRecord:
    """One stored probe: the config, what it measured, and where and when."""

    id: int
    study_id: int
    trial_number: int | None
    config: ProbeConfig
    config_key: str
    result: ProbeResult
    cacheable: bool
    predicted_peak_bytes: int | None
    worker: str | None
    started_at: datetime | None
    finished_at: datetime
    env_fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        """Flat: config fields, then result fields, then bookkeeping."""
        return {
            "id": self.id,
            "study_id": self.study_id,
            "trial_number": self.trial_number,
            "config_key": self.config_key,
            "label": self.config.label(),
            **self.config.to_dict(),
            **self.result.to_dict(),
            "cacheable": self.cacheable,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "worker": self.worker,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
            "env_fingerprint": self.env_fingerprint,
        }


@dataclass(frozen=True, slots=True)
class LeaderboardRow:
    """One ranked configuration that fits: the fastest first."""

    rank: int
    study: str
    probe_id: int
    trial_number: int | None
    config: ProbeConfig
    config_key: str
    status: str
    tokens_per_s: float | None
    step_seconds: float | None
    samples_per_s: float | None
    mfu: float | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    context_bytes: int | None
    budget_bytes: int
    margin_bytes: int
    worker: str | None = None
    step_spread: float | None = None  # the timed window's relative spread (autotune.results.timing)
    compile_seconds: float | None = None  # --compile: torch.compile's one-off cost, apart from the timing
    host_load: float | None = None  # the host's load average per core as the probe ended
    phase_peaks: dict[str, dict[str, int]] | None = None  # each phase's peaks, where the run evaluates (ProbeResult)
    eval_batch_found: int | None = None  # --eval-batch auto: the eval batch its probe found (ProbeResult)
    rank_peaks: list[dict[str, int]] | None = None  # on several ranks: each rank's peaks (ProbeResult)

    @property
    def label(self) -> str:
        return self.config.label()

    def to_dict(self) -> dict[str, Any]:
        """Flat and JSON-ready; `autotune best --format json` relies on these names."""
        return {
            "rank": self.rank,
            "label": self.label,
            **self.config.to_dict(),
            "status": self.status,
            "tokens_per_s": self.tokens_per_s,
            "step_seconds": self.step_seconds,
            "step_spread": self.step_spread,
            "samples_per_s": self.samples_per_s,
            "mfu": self.mfu,
            # (with the data's lengths: tokens_per_s counts real tokens; this share of those computed was padding)
            "padding_share": self.config.padding_share,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "context_bytes": self.context_bytes,
            "budget_bytes": self.budget_bytes,
            "margin_bytes": self.margin_bytes,
            "study": self.study,
            "probe_id": self.probe_id,
            "trial_number": self.trial_number,
            "config_key": self.config_key,
            "worker": self.worker,
            "compile_seconds": self.compile_seconds,
            "host_load": self.host_load,
            "phase_peaks": self.phase_peaks,
            "eval_batch_found": self.eval_batch_found,
            "rank_peaks": self.rank_peaks,
        }


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    """Which worker holds or settled one configuration of a study, as last read."""

    study_id: int
    config_key: str
    worker: str
    state: str  # running | done | crashed
    attempts: int  # probes started: 0 for a config settled without one (skipped, reused)
    claimed_at: datetime
    heartbeat_at: datetime
    stale: bool  # running, but its worker has not heartbeaten within the stale period

    def to_dict(self) -> dict[str, Any]:
        return {
            "study_id": self.study_id,
            "config_key": self.config_key,
            "worker": self.worker,
            "state": self.state,
            "attempts": self.attempts,
            "claimed_at": _iso(self.claimed_at),
            "heartbeat_at": _iso(self.heartbeat_at),
            "stale": self.stale,
        }


@dataclass(frozen=True, slots=True)
class RunRecord:
    """One full fine-tune."""

    id: int
    study_id: int | None
    probe_id: int | None
    config: dict[str, Any]
    status: str
    output_dir: str | None
    dataset: str | None
    steps: int | None
    tokens_per_s: float | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    final_loss: float | None
    summary: dict[str, Any] | None
    error: str | None
    started_at: datetime
    finished_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "study_id": self.study_id,
            "probe_id": self.probe_id,
            "config": self.config,
            "status": self.status,
            "output_dir": self.output_dir,
            "dataset": self.dataset,
            "steps": self.steps,
            "tokens_per_s": self.tokens_per_s,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "final_loss": self.final_loss,
            "summary": self.summary,
            "error": self.error,
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
        }


@dataclass(frozen=True, slots=True)
class UpgradeReport:
    """What `autotune db upgrade` did."""

    url: str
    before: str | None
    after: str | None

    @property
    def changed(self) -> bool:
        return self.before != self.after


@dataclass(frozen=True, slots=True)
class SearchRecord:
    """A search submitted to the service, as stored (its state as read: a running search whose
    worker is gone reads as interrupted)."""

    id: int
    name: str
    arguments: list[str]
    request_hash: str
    idempotency_key: str | None
    model: str
    budget_bytes: int
    device_kind: str
    gpus: int
    card: str | None
    candidates: int
    state: str
    reason: str | None
    cancel_requested: bool
    submitted_by: str | None
    worker: str | None
    attempts: int
    exit_status: int | None
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "reason": self.reason,
            "model": self.model,
            "budget_bytes": self.budget_bytes,
            "device": self.device_kind,
            "gpus": self.gpus,
            "card": self.card,
            "candidates": self.candidates,
            "arguments": list(self.arguments),
            "cancel_requested": self.cancel_requested,
            "submitted_by": self.submitted_by,
            "worker": self.worker,
            "attempts": self.attempts,
            "exit_status": self.exit_status,
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "started_at": _iso(self.started_at),
            "finished_at": _iso(self.finished_at),
        }


@dataclass(frozen=True, slots=True)
class TokenRecord:
    """A service token's name and dates (the token itself is never stored)."""

    name: str
    created_at: datetime
    revoked_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "created_at": _iso(self.created_at), "revoked_at": _iso(self.revoked_at)}

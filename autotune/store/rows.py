"""Between ORM rows and the records callers get: a probe row's columns, and each row type as its
plain dataclass, detached from any session."""

from __future__ import annotations

from dataclasses import fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from autotune.levers.config import ProbeConfig
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.status import CACHEABLE, RunStatus, StudyStatus
from autotune.store.liveness import effective_status
from autotune.store.records import ProbeRecord, RunRecord, StudyRecord
from autotune.store.schema import Probe, Run, Study, utcnow

CONFIG_FIELDS = tuple(f.name for f in fields(ProbeConfig))
# ProbeResult fields stored as columns. A field without a column is not stored (a test flags it:
# it needs a new revision), rather than breaking every write.
RESULT_FIELDS = tuple(f.name for f in fields(ProbeResult) if f.name in Probe.__table__.columns)


def study_record(study: Study) -> StudyRecord:
    return StudyRecord(
        id=study.id,
        name=study.name,
        model_reference=study.model_reference,
        model_fingerprint=study.model_fingerprint,
        device_name=study.device_name,
        device_total_bytes=study.device_total_bytes,
        budget_bytes=study.budget_bytes,
        margin_bytes=study.margin_bytes,
        effective_batch=study.effective_batch,
        space=dict(study.space),
        env_fingerprint=study.env_fingerprint,
        environment=dict(study.environment),
        status=effective_status(study.status, study.owner, study.heartbeat_at, interrupted=StudyStatus.INTERRUPTED),
        created_at=study.created_at,
        updated_at=study.updated_at,
        plan=dict(study.plan) if study.plan is not None else None,
        confirmation=dict(study.confirmation) if study.confirmation is not None else None,
    )


def probe_values(
    study_id: int,
    config: ProbeConfig,
    result: ProbeResult,
    *,
    env_fingerprint: str,
    trial_number: int | None,
    predicted_peak_bytes: int | None,
    worker: str | None,
    started_at: datetime | None,
    cacheable: bool | None,
) -> dict[str, Any]:
    """A probe row's columns. (A new Probe is made from them for each try of a write: an object
    added in a rolled-back transaction is not safe to add again.)"""
    finished_at = utcnow()
    if started_at is None and result.wall_seconds is not None:
        started_at = finished_at - timedelta(seconds=result.wall_seconds)
    measured = result.to_dict()  # non-finite floats (a diverged loss) become NULL
    return dict(
        study_id=study_id,
        trial_number=trial_number,
        config_key=config.key(),
        **{name: getattr(config, name) for name in CONFIG_FIELDS},
        **{name: measured[name] for name in RESULT_FIELDS},
        cacheable=(result.status in CACHEABLE) if cacheable is None else cacheable,
        predicted_peak_bytes=predicted_peak_bytes,
        worker=worker,
        started_at=started_at,
        finished_at=finished_at,
        env_fingerprint=env_fingerprint,
    )


def add_probe(session: Session, probe: Probe) -> int:
    session.add(probe)
    # The study's "last touched" time orders `autotune studies` and picks the default study.
    session.execute(update(Study).where(Study.id == probe.study_id).values(updated_at=probe.finished_at))
    session.flush()
    return probe.id


def probe_result(probe: Probe) -> ProbeResult:
    return ProbeResult(**{name: getattr(probe, name) for name in RESULT_FIELDS})


def probe_record(probe: Probe) -> ProbeRecord:
    return ProbeRecord(
        id=probe.id,
        study_id=probe.study_id,
        trial_number=probe.trial_number,
        config=ProbeConfig(**{name: getattr(probe, name) for name in CONFIG_FIELDS}),
        config_key=probe.config_key,
        result=probe_result(probe),
        cacheable=probe.cacheable,
        predicted_peak_bytes=probe.predicted_peak_bytes,
        worker=probe.worker,
        started_at=probe.started_at,
        finished_at=probe.finished_at,
        env_fingerprint=probe.env_fingerprint,
    )


def run_record(run: Run) -> RunRecord:
    return RunRecord(
        id=run.id,
        study_id=run.study_id,
        probe_id=run.probe_id,
        config=dict(run.config),
        status=effective_status(run.status, run.owner, run.heartbeat_at, interrupted=RunStatus.INTERRUPTED),
        output_dir=run.output_dir,
        dataset=run.dataset,
        steps=run.steps,
        tokens_per_s=run.tokens_per_s,
        peak_allocated_bytes=run.peak_allocated_bytes,
        peak_reserved_bytes=run.peak_reserved_bytes,
        final_loss=run.final_loss,
        summary=dict(run.summary) if run.summary is not None else None,
        error=run.error,
        started_at=run.started_at,
        finished_at=run.finished_at,
    )

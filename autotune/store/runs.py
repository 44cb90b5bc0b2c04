"""Runs: full fine-tunes (`autotune train`) stored beside the probe that chose their config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from sqlalchemy import select, update

from autotune.levers.config import ProbeConfig
from autotune.host.processes import owner_label
from autotune.vocabulary.status import RunStatus
from autotune.store.base import Database
from autotune.store.records import RunRecord
from autotune.store.rows import run_record
from autotune.store.schema import Run, utcnow


class Runs:
    """Full fine-tunes (`autotune train`) as they start, beat and end: `store.runs`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def start(
        self,
        *,
        config: ProbeConfig | Mapping[str, Any],
        study_id: int | None = None,
        probe_id: int | None = None,
        output_dir: str | os.PathLike[str] | None = None,
        dataset: str | None = None,
    ) -> int:
        """Record a full fine-tune as running; returns its id for finish_run/fail_run."""
        config_data = config.to_dict() if isinstance(config, ProbeConfig) else dict(config)
        run = Run(
            study_id=study_id,
            probe_id=probe_id,
            config=config_data,
            status=RunStatus.RUNNING,
            output_dir=os.fspath(output_dir) if output_dir is not None else None,
            dataset=dataset,
            started_at=utcnow(),
            owner=owner_label(),
            heartbeat_at=utcnow(),
        )
        with self.db.writing() as session:
            session.add(run)
            session.flush()
            return run.id

    def finish(
        self,
        run_id: int,
        *,
        steps: int | None = None,
        tokens_per_s: float | None = None,
        peak_allocated_bytes: int | None = None,
        peak_reserved_bytes: int | None = None,
        final_loss: float | None = None,
        summary: Mapping[str, Any] | None = None,
    ) -> None:
        """Mark a run finished, with what it measured."""
        self._end(
            run_id,
            status=RunStatus.FINISHED,
            steps=steps,
            tokens_per_s=tokens_per_s,
            peak_allocated_bytes=peak_allocated_bytes,
            peak_reserved_bytes=peak_reserved_bytes,
            final_loss=final_loss,
            summary=dict(summary) if summary is not None else None,
        )

    def fail(self, run_id: int, error: str, *, summary: Mapping[str, Any] | None = None) -> None:
        """Mark a run failed, keeping the error text (and whatever summary there is)."""
        self._end(run_id, status=RunStatus.FAILED, error=error, summary=dict(summary) if summary is not None else None)

    def interrupt(self, run_id: int, *, summary: Mapping[str, Any] | None = None) -> None:
        """Mark a run interrupted (Ctrl-C, SIGTERM): it did not finish, and --resume goes on from
        its latest checkpoint."""
        self._end(
            run_id,
            status=RunStatus.INTERRUPTED,
            error="interrupted",
            summary=dict(summary) if summary is not None else None,
        )

    def beat(self, run_id: int) -> None:
        """The run's process is alive (a running run whose process is gone reads as interrupted)."""
        with self.db.writing() as session:
            session.execute(update(Run).where(Run.id == run_id).values(heartbeat_at=utcnow()))

    def interrupt_abandoned(self, output_dir: str | os.PathLike[str]) -> list[int]:
        """Mark interrupted, for good, the runs into `output_dir` stored as running whose process is
        gone (a `train --resume` takes their directory over); their ids."""
        with self.db.writing() as session:
            rows = session.scalars(
                select(Run).where(Run.output_dir == os.fspath(output_dir), Run.status == RunStatus.RUNNING)
            ).all()
            gone = [run for run in rows if run_record(run).status == RunStatus.INTERRUPTED]
            for run in gone:
                run.status, run.error, run.finished_at = RunStatus.INTERRUPTED, "its process was gone", utcnow()
            return [run.id for run in gone]

    def _end(self, run_id: int, **values: Any) -> None:
        assert values["status"] in RunStatus.__members__.values()
        with self.db.writing() as session:
            run = session.get(Run, run_id)
            if run is None:
                raise LookupError(f"no run with id {run_id}")
            for key, value in values.items():
                setattr(run, key, value)
            run.finished_at = utcnow()

    def get(self, run_id: int) -> RunRecord:
        """One run by id (LookupError when there is none)."""
        with self.db.reading() as session:
            run = session.get(Run, run_id)
            if run is None:
                raise LookupError(f"no run with id {run_id}")
            return run_record(run)

    def all(self, study_name: str | None = None) -> list[RunRecord]:
        """Every run, or those of one study, oldest first."""
        with self.db.reading() as session:
            query = select(Run).order_by(Run.id)
            if study_name is not None:
                query = query.where(Run.study_id == self.db.find_study(session, study_name).id)
            return [run_record(run) for run in session.scalars(query)]

"""The results store: every study, probe and run, in SQLite or any SQLAlchemy database.

Callers get plain dataclasses (records.py), never ORM objects bound to a closed session. Each write
is one short transaction, so a process killed at any moment leaves only whole rows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Protocol

from sqlalchemy import Engine, case, func, select, update

from autotune.levers.config import ProbeConfig
from autotune.host.environment import Environment
from autotune.vocabulary.errors import BadInput, DatabaseError, StudyNotFound
from autotune.results.probe_result import ProbeResult
from autotune.results.budget import required_bytes
from autotune.results.ranking import Standing, ranked
from autotune.vocabulary.status import CACHEABLE, ProbeStatus, StudyStatus
import autotune.store.migrate as migrate
from autotune.store.claims import Claims
from autotune.host.processes import owner_label
from autotune.store.base import Database
from autotune.store.engine import display_url, make_engine, resolve_url, sqlite_path
from autotune.store.liveness import effective_status
from autotune.store.moved import move_study
from autotune.store.names import check_same_study, check_study_name
from autotune.store.records import LeaderboardRow, ProbeRecord, StudyRecord, StudySummary, UpgradeReport
from autotune.store.rows import CONFIG_FIELDS, add_probe, probe_record, probe_result, probe_values, study_record
from autotune.store.queue import SearchQueue
from autotune.store.workers import Workers
from autotune.store.runs import Runs
from autotune.store.tokens import Tokens
from autotune.store.schema import Probe, Study, utcnow
from autotune.vocabulary.units import INT64_MAX


class ModelLike(Protocol):
    """What a study needs of a model: autotune.specs.models.ModelSpec fits."""

    @property
    def reference(self) -> str: ...

    @property
    def recorded(self) -> str: ...  # the reference the study keeps (a local directory made absolute)

    @property
    def fingerprint(self) -> str: ...


def open_store(
    url: str | os.PathLike[str] | None = None, *, upgrade: bool | None = None, read_only: bool = False
) -> Store:
    """Open the results database: `url` (a SQLAlchemy URL or a file path), else `$AUTOTUNE_DB`, else
    `autotune.db` in the user data directory (`$AUTOTUNE_HOME` when set).

    A local SQLite database is created or upgraded to this code's schema; a server database is
    created when it has none of our tables, and otherwise must be upgraded explicitly
    (`autotune db upgrade`). `upgrade=True`/`False` forces either way. Raises DatabaseError for
    a file that is not a database, a database newer than this autotune, or one that cannot be reached.

    `read_only=True`, for commands that only read (studies, leaderboard, best, train --study):
    nothing is created, upgraded or written. A missing SQLite file, a database without our tables
    and one at an older revision are each refused with one line saying what to run.
    """
    resolved = resolve_url(url)
    if read_only:
        path = sqlite_path(resolved)
        if path is not None and not path.exists():
            raise DatabaseError(f"no results database at {path}; `autotune search` creates it (or check --db).")
    # Looked at through an engine that writes nothing on connect (a writing one switches an SQLite
    # file to WAL, which rewrites its header): the file may turn out to be another application's.
    engine = make_engine(resolved, read_only=True)
    try:
        migrate.ensure_current(engine, auto_upgrade=False if read_only else upgrade, read_only=read_only)
        if not read_only:
            engine.dispose()
            engine = make_engine(resolved)
    except BaseException:
        engine.dispose()
        raise
    return Store(engine, read_only=read_only)


def upgrade_database(url: str | os.PathLike[str] | None = None) -> UpgradeReport:
    """`autotune db upgrade`: bring the database to this code's schema (any backend)."""
    resolved = resolve_url(url)
    before, after = migrate.upgrade(resolved)
    return UpgradeReport(url=display_url(resolved), before=before, after=after)


class Store:
    """One results database: its studies and probes (here), and its parts, each over the same
    `Database` (base.py): `claims` (workers sharing a study, claims.py), `runs` (full fine-tunes,
    runs.py), `queue` (the service's submitted searches, queue.py), `workers` (the queue workers
    connected, workers.py) and `tokens` (its bearer tokens, tokens.py). Use `open_store()` to get one; close it (or use it as a context manager)
    to release its connections."""

    def __init__(self, engine: Engine, *, read_only: bool = False) -> None:
        self.db = Database(engine, read_only=read_only)
        self.claims = Claims(self.db)
        self.runs = Runs(self.db)
        self.queue = SearchQueue(self.db)
        self.tokens = Tokens(self.db)
        self.workers = Workers(self.db)

    @property
    def engine(self) -> Engine:
        return self.db.engine

    @property
    def url(self) -> str:
        """The database, for messages (password hidden)."""
        return self.db.url

    @property
    def read_only(self) -> bool:
        return self.db.read_only

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- studies ---------------------------------------------------------------------------------

    def get_or_create_study(
        self,
        name: str,
        *,
        model: ModelLike,
        environment: Environment,
        budget_bytes: int,
        margin_bytes: int,
        effective_batch: int,
        space: Mapping[str, Any],
    ) -> StudyRecord:
        """The study called `name`, created if new. Resuming an existing study (same model by
        fingerprint, budget, margin and effective batch) marks it running again and stores the
        given search space. A name taken by a study of another model or budget raises BadInput."""
        name = check_study_name(name)

        def work() -> StudyRecord:
            with self.db.writing() as session:
                study = session.scalars(select(Study).where(Study.name == name)).one_or_none()
                now = utcnow()
                if study is None:
                    study = Study(
                        name=name,
                        model_reference=model.recorded,
                        model_fingerprint=model.fingerprint,
                        device_name=environment.device_name,
                        device_total_bytes=environment.device_total_bytes,
                        budget_bytes=budget_bytes,
                        margin_bytes=margin_bytes,
                        effective_batch=effective_batch,
                        space=dict(space),
                        env_fingerprint=environment.fingerprint(),
                        environment=environment.to_dict(),
                        status=StudyStatus.RUNNING,
                        created_at=now,
                        updated_at=now,
                        owner=owner_label(),
                        heartbeat_at=now,
                    )
                    session.add(study)
                else:
                    check_same_study(
                        study, model.fingerprint, model.reference, budget_bytes, margin_bytes, effective_batch
                    )
                    if study.model_reference != model.recorded:
                        _check_not_running_elsewhere(study, model)
                        move_study(session, study, model.recorded)
                    study.space = dict(space)
                    study.status = StudyStatus.RUNNING
                    study.updated_at = now
                    study.owner, study.heartbeat_at = owner_label(), now
                session.flush()
                return study_record(study)

        return self.db.retry_on_conflict(work)

    def study(self, name: str | None = None) -> StudyRecord:
        """The study called `name` (the most recent one when None); StudyNotFound if there is none."""
        with self.db.reading() as session:
            return study_record(self.db.find_study(session, name))

    def latest_study_name(self) -> str | None:
        """The study probed most recently (resumed studies count), or None in an empty database."""
        with self.db.reading() as session:
            return session.scalars(
                select(Study.name).order_by(Study.updated_at.desc(), Study.id.desc()).limit(1)
            ).first()

    def set_study_status(self, study: int | str, status: str) -> None:
        """Mark a study (by id or name) running, finished or interrupted."""
        if status not in StudyStatus.__members__.values():
            raise ValueError(f"study status must be one of {', '.join(StudyStatus)}, not {status!r}")
        where = Study.id == study if isinstance(study, int) else Study.name == study
        with self.db.writing() as session:
            changed = session.execute(update(Study).where(where).values(status=status, updated_at=utcnow())).rowcount  # type: ignore[attr-defined]
        if not changed:
            raise StudyNotFound(self.db.not_found_message(str(study)))

    def beat_study(self, study_id: int) -> None:
        """The study's owner is alive: its heartbeat (a running study whose owner stops beating
        reads as interrupted, store/liveness.py)."""
        with self.db.writing() as session:
            session.execute(update(Study).where(Study.id == study_id).values(heartbeat_at=utcnow()))

    def set_study_plan(self, study_id: int, plan: Mapping[str, Any]) -> None:
        """Store what a worker needs to join the study (strategy, probe settings, predictions)."""
        with self.db.writing() as session:
            session.execute(update(Study).where(Study.id == study_id).values(plan=dict(plan)))

    def set_confirmation(self, study_id: int, confirmation: Mapping[str, Any]) -> None:
        """Store how the study's winner was told apart from its contenders (search/confirm.py)."""
        with self.db.writing() as session:
            session.execute(update(Study).where(Study.id == study_id).values(confirmation=dict(confirmation)))

    def update_timing(self, probe_id: int, result: ProbeResult) -> None:
        """Replace a probe's timing with a longer measurement of the same config (its first window
        and the confirmation round's, pooled); its memory stays as first measured."""
        values = {
            name: getattr(result, name)
            for name in (
                "step_seconds",
                "step_spread",
                "step_times",
                "tokens_per_s",
                "samples_per_s",
                "measured_steps",
                "measured_seconds",
            )
        }
        with self.db.writing() as session:
            session.execute(update(Probe).where(Probe.id == probe_id).values(**values))

    def studies(self) -> list[StudySummary]:
        """Every study, most recent first, with probe counts and its best config that fits (the
        leaderboard's first)."""

        def count(status: ProbeStatus) -> Any:
            return func.coalesce(func.sum(case((Probe.status == status, 1), else_=0)), 0)

        query = (
            select(
                Study,
                func.count(Probe.id),
                count(ProbeStatus.OK),
                count(ProbeStatus.OOM),
                count(ProbeStatus.SKIPPED),
                func.count(func.distinct(Probe.worker)),
            )
            .outerjoin(Probe, Probe.study_id == Study.id)
            .group_by(Study.id)
            .order_by(Study.updated_at.desc(), Study.id.desc())
        )
        with self.db.reading() as session:
            summaries = []
            for study, total, ok, oom, skipped, workers in session.execute(query).all():
                best = self._ranked_fits(session, study)[:1] if ok else []
                summaries.append(
                    StudySummary(
                        name=study.name,
                        model_reference=study.model_reference,
                        device_name=study.device_name,
                        budget_bytes=study.budget_bytes,
                        margin_bytes=study.margin_bytes,
                        status=effective_status(
                            study.status, study.owner, study.heartbeat_at, interrupted=StudyStatus.INTERRUPTED
                        ),
                        created_at=study.created_at,
                        updated_at=study.updated_at,
                        probes_total=int(total),
                        probes_ok=int(ok),
                        probes_oom=int(oom),
                        probes_skipped=int(skipped),
                        best_tokens_per_s=best[0]["tokens_per_s"] if best else None,
                        workers=int(workers),
                        best_label=_config_of(best[0]).label() if best else None,
                    )
                )
            return summaries

    # -- probes ----------------------------------------------------------------------------------

    def record_probe(
        self,
        study_id: int,
        config: ProbeConfig,
        result: ProbeResult,
        *,
        env_fingerprint: str,
        trial_number: int | None = None,
        predicted_peak_bytes: int | None = None,
        worker: str | None = None,
        started_at: datetime | None = None,
        cacheable: bool | None = None,
    ) -> int:
        """Store one probe in one transaction; returns its id.

        `cacheable` says whether later searches may reuse this outcome (find_cached). By default
        ok/oom/unstable/skipped are reusable; pass False for an outcome that was not measured on
        this environment, such as a config skipped because the estimator predicted it too big.
        `started_at` defaults to the finish time less the probe's wall time.
        """
        row = probe_values(
            study_id,
            config,
            result,
            env_fingerprint=env_fingerprint,
            trial_number=trial_number,
            predicted_peak_bytes=predicted_peak_bytes,
            worker=worker,
            started_at=started_at,
            cacheable=cacheable,
        )

        def work() -> int:
            with self.db.writing() as session:
                return add_probe(session, Probe(**row))

        return self.db.retry(work)

    def set_trial_number(self, probe_id: int, trial_number: int) -> None:
        """Link a stored probe to its Optuna trial, made after the probe was settled."""
        with self.db.writing() as session:
            session.execute(update(Probe).where(Probe.id == probe_id).values(trial_number=trial_number))

    def fill_predicted_peaks(self, study_id: int, peaks: Mapping[str, int]) -> None:
        """Record predictions that arrived after their configs were settled (the search probes
        while predicting): only where none is stored yet."""
        with self.db.writing() as session:
            for config_key, peak in peaks.items():
                session.execute(
                    update(Probe)
                    .where(
                        Probe.study_id == study_id, Probe.config_key == config_key, Probe.predicted_peak_bytes.is_(None)
                    )
                    .values(predicted_peak_bytes=peak)
                )

    def find_cached(
        self,
        config_key: str,
        env_fingerprint: str,
        model_fingerprint: str,
        budget_bytes: int,
        margin_bytes: int,
    ) -> ProbeResult | None:
        """The latest reusable result for this config key on this environment, for the same model
        architecture, from any study; None when there is none. Timeouts, crashes and errors are
        never reused (see autotune.vocabulary.status.CACHEABLE). A result under another budget is reused where
        it decides this one too: a fit whose need is within what this budget allows (it never came
        near the other cap, so it ran as it would under this one), an OOM under a cap no smaller than
        this one's, either with this budget's figures; a kernel this machine lacks or a loss that is
        not finite, whatever the budget. Anything else under another budget is probed."""
        query = (
            select(Probe, Study.budget_bytes, Study.margin_bytes)
            .join(Study, Study.id == Probe.study_id)
            .where(
                Probe.config_key == config_key,
                Probe.env_fingerprint == env_fingerprint,
                Probe.cacheable.is_(True),
                Probe.status.in_(tuple(CACHEABLE)),
                Study.model_fingerprint == model_fingerprint,
            )
            .order_by(Probe.id.desc())
            .limit(_REUSE_LOOKBACK)
        )
        allowed = budget_bytes - margin_bytes
        with self.db.reading() as session:
            for probe, their_budget, their_margin in session.execute(query).all():
                result = probe_result(probe)
                if (their_budget, their_margin) == (budget_bytes, margin_bytes):
                    return result
                need = result.required_bytes
                decides = (
                    (result.status == ProbeStatus.OK and need is not None and need <= allowed)
                    or (result.status == ProbeStatus.OOM and their_budget - their_margin >= allowed)
                    or result.status in (ProbeStatus.SKIPPED, ProbeStatus.UNSTABLE)
                )  # (what no budget changes)
                if decides:
                    result.budget_bytes, result.margin_bytes = budget_bytes, margin_bytes
                    return result
            return None

    def probes(self, study_name: str | None = None, *, after_id: int = 0) -> list[ProbeRecord]:
        """Every probe of a study (the most recent study when None), in the order they were stored;
        only those stored after probe `after_id` when given (a worker reading what others found)."""
        with self.db.reading() as session:
            study = self.db.find_study(session, study_name)
            rows = session.scalars(
                select(Probe).where(Probe.study_id == study.id, Probe.id > after_id).order_by(Probe.id)
            )
            return [probe_record(probe) for probe in rows]

    def leaderboard(self, study_name: str | None = None, top: int | None = None) -> list[LeaderboardRow]:
        """The configurations of a study that fit (status ok), best first as autotune.results.ranking ranks
        them. A config probed more than once counts once, with its latest measurement.
        `study_name` None means the most recent study; StudyNotFound if none."""
        if top is not None and not 1 <= top <= INT64_MAX:
            raise BadInput(f"--top must be a whole number from 1 to {INT64_MAX} (got {top}).")
        with self.db.reading() as session:
            study = self.db.find_study(session, study_name)
            rows = self._ranked_fits(session, study)[:top]
            return [
                LeaderboardRow(
                    rank=rank,
                    study=study.name,
                    probe_id=row["id"],
                    trial_number=row["trial_number"],
                    config=_config_of(row),
                    config_key=row["config_key"],
                    status=row["status"],
                    tokens_per_s=row["tokens_per_s"],
                    step_seconds=row["step_seconds"],
                    samples_per_s=row["samples_per_s"],
                    mfu=row["mfu"],
                    peak_allocated_bytes=row["peak_allocated_bytes"],
                    peak_reserved_bytes=row["peak_reserved_bytes"],
                    context_bytes=row["context_bytes"],
                    budget_bytes=row["budget_bytes"] if row["budget_bytes"] is not None else study.budget_bytes,
                    margin_bytes=row["margin_bytes"] if row["margin_bytes"] is not None else study.margin_bytes,
                    worker=row["worker"],
                    step_spread=row["step_spread"],
                    compile_seconds=row["compile_seconds"],
                    host_load=row["host_load"],
                    phase_peaks=row["phase_peaks"],
                    eval_batch_found=row["eval_batch_found"],
                    rank_peaks=row["rank_peaks"],
                )
                for rank, row in enumerate(rows, start=1)
            ]

    @staticmethod
    def _ranked_fits(session: Any, study: Study) -> list[Any]:
        """The latest ok probe of each config of `study` (as row mappings), ranked."""
        # The latest ok probe of each config: max(id) per key. (A window function reads the same,
        # but materialises every ok row first: 5x slower over 10,000 probes.)
        latest_ids = (
            select(func.max(Probe.id))
            .where(Probe.study_id == study.id, Probe.status == ProbeStatus.OK)
            .group_by(Probe.config_key)
        )
        probes = Probe.__table__
        rows = list(session.execute(select(probes).where(probes.c.id.in_(latest_ids))).mappings().all())
        chosen, tied = _verdict(study.confirmation, rows)
        return ranked(rows, _standing, chosen, tied)


# How many of a config's latest results (on this environment and model) a lookup reads for one that
# decides it under another budget.
_REUSE_LOOKBACK = 20


def _standing(row: Any) -> Standing:
    return Standing(
        row["config_key"],
        row["tokens_per_s"],
        required_bytes(row["peak_reserved_bytes"], row["context_bytes"]),
        row["id"],
    )


def _config_of(row: Any) -> ProbeConfig:
    return ProbeConfig(**{name: row[name] for name in CONFIG_FIELDS})


def _verdict(confirmation: Mapping[str, Any] | None, rows: list[Any]) -> tuple[str | None, set[str]]:
    """The config a study's confirmation round chose, and the keys of those it tied with (a verdict
    stored before keys were kept names them by label)."""
    if not confirmation or not confirmation.get("winner"):
        return None, set()
    tied = set(confirmation.get("tied_keys") or ())
    if not tied and confirmation.get("tied"):
        labels = set(confirmation["tied"])
        tied = {row["config_key"] for row in rows if _config_of(row).label() in labels}
    return confirmation["winner"], tied


def _check_not_running_elsewhere(study: Study, model: ModelLike) -> None:
    """A study may follow its model to another path (store/moved.py) only while no search runs it
    from the old one: that search's keys would stop matching the study's."""
    if (
        study.owner != owner_label()
        and effective_status(study.status, study.owner, study.heartbeat_at, interrupted=StudyStatus.INTERRUPTED)
        == StudyStatus.RUNNING
    ):
        raise BadInput(
            f"study {study.name!r} is being searched now with the model at {study.model_reference}; "
            f"resume it with that --model, or once that search ends (or pick another --study name)."
        )

"""The results store: every study, probe and run, in SQLite or any SQLAlchemy database.

Callers get plain dataclasses (records.py), never ORM objects bound to a closed session. Each write
is one short transaction, so a process killed at any moment leaves only whole rows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol, TypeVar

from sqlalchemy import Engine, case, delete, func, insert, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from autotune.config import ProbeConfig
from autotune.environment import Environment
from autotune.errors import BadInput, StudyNotFound
from autotune.result import ProbeResult
from autotune.store import migrate
from autotune.store.engine import display_url, make_engine, resolve_url, writer
from autotune.store.records import (
    CACHEABLE_STATUSES,
    RUN_STATUSES,
    STUDY_STATUSES,
    ClaimRecord,
    LeaderboardRow,
    ProbeRecord,
    RunRecord,
    StudyRecord,
    StudySummary,
    UpgradeReport,
)
from autotune.store.schema import Claim, Probe, Run, Study, utcnow

T = TypeVar("T")

_CONFIG_FIELDS = tuple(f.name for f in fields(ProbeConfig))
# ProbeResult fields stored as columns. A field without a column is not stored (a test flags it:
# it needs a new revision), rather than breaking every write.
_RESULT_FIELDS = tuple(f.name for f in fields(ProbeResult) if f.name in Probe.__table__.columns)
_STUDY_NAME_MAX = 200
# A write that fails because the connection dropped (a server restart, a proxy, a network blip) is
# tried again after these pauses, so that a probe that took minutes is not lost to a moment's outage.
TRANSIENT_RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0)
# A configuration whose worker stopped heartbeating is taken over once: the second worker to lose it
# records it as crashed (settle(..., how="abandoned")) rather than handing it on forever.
MAX_ATTEMPTS = 2


class ModelLike(Protocol):
    """What a study needs of a model: autotune.models.ModelSpec fits."""

    @property
    def reference(self) -> str: ...

    @property
    def fingerprint(self) -> str: ...


def open_store(url: str | os.PathLike[str] | None = None, *, upgrade: bool | None = None) -> Store:
    """Open the results database: `url` (a SQLAlchemy URL or a file path), else `$AUTOTUNE_DB`, else
    `autotune.db` in the user data directory (`$AUTOTUNE_HOME` when set).

    A local SQLite database is created or upgraded to this code's schema; a server database is
    created when it has none of our tables, and otherwise must be upgraded explicitly
    (`autotune db upgrade`). `upgrade=True`/`False` forces either way. Raises DatabaseError for
    a file that is not a database, a database newer than this autotune, or one that cannot be reached.
    """
    engine = make_engine(resolve_url(url))
    try:
        migrate.ensure_current(engine, auto_upgrade=upgrade)
    except BaseException:
        engine.dispose()
        raise
    return Store(engine)


def upgrade_database(url: str | os.PathLike[str] | None = None) -> UpgradeReport:
    """`autotune db upgrade`: bring the database to this code's schema (any backend)."""
    resolved = resolve_url(url)
    before, after = migrate.upgrade(resolved)
    return UpgradeReport(url=display_url(resolved), before=before, after=after)


class Store:
    """Reads and writes studies, probes and runs. Use `open_store()` to get one; close it (or use
    it as a context manager) to release its connections."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._read = sessionmaker(engine, expire_on_commit=False)
        # Writes take SQLite's write lock at BEGIN, so concurrent writers queue (busy_timeout)
        # instead of failing on a lock upgrade.
        self._write = sessionmaker(writer(engine), expire_on_commit=False)

    @property
    def url(self) -> str:
        """The database, for messages (password hidden)."""
        return display_url(self.engine.url)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        with self._write.begin() as session:
            yield session

    def _retry_transient(self, work: Callable[[], T]) -> T:
        """Run a write, again after a pause when the connection was lost (pool_pre_ping replaces
        the dead connection on the next checkout). Other errors propagate at once."""
        for delay in (*TRANSIENT_RETRY_DELAYS, None):
            try:
                return work()
            except (OperationalError, InterfaceError, DBAPIError) as exc:
                transient = isinstance(exc, (OperationalError, InterfaceError)) or exc.connection_invalidated
                if not transient or delay is None:
                    raise
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _retry_on_conflict(self, work: Callable[[], T]) -> T:
        """Run a get-or-create once more after a unique-key race lost to another process (possible
        on PostgreSQL; on SQLite, BEGIN IMMEDIATE serialises writers)."""
        try:
            return work()
        except IntegrityError:
            return work()

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
        name = (name or "").strip()
        if not name or len(name) > _STUDY_NAME_MAX:
            raise BadInput(f"--study must be a name of 1 to {_STUDY_NAME_MAX} characters (got {name!r}).")

        def work() -> StudyRecord:
            with self._writing() as session:
                study = session.scalars(select(Study).where(Study.name == name)).one_or_none()
                now = utcnow()
                if study is None:
                    study = Study(
                        name=name,
                        model_reference=model.reference,
                        model_fingerprint=model.fingerprint,
                        device_name=environment.device_name,
                        device_total_bytes=environment.device_total_bytes,
                        budget_bytes=budget_bytes,
                        margin_bytes=margin_bytes,
                        effective_batch=effective_batch,
                        space=dict(space),
                        env_fingerprint=environment.fingerprint(),
                        environment=environment.to_dict(),
                        status="running",
                        created_at=now,
                        updated_at=now,
                    )
                    session.add(study)
                else:
                    _check_same_study(study, model, budget_bytes, margin_bytes, effective_batch)
                    study.space = dict(space)
                    study.status = "running"
                    study.updated_at = now
                session.flush()
                return _study_record(study)

        return self._retry_on_conflict(work)

    def study(self, name: str | None = None) -> StudyRecord:
        """The study called `name` (the most recent one when None); StudyNotFound if there is none."""
        with self._read() as session:
            return _study_record(self._find_study(session, name))

    def latest_study_name(self) -> str | None:
        """The study probed most recently (resumed studies count), or None in an empty database."""
        with self._read() as session:
            return session.scalars(select(Study.name).order_by(Study.updated_at.desc(), Study.id.desc()).limit(1)).first()

    def set_study_status(self, study: int | str, status: str) -> None:
        """Mark a study (by id or name) running, finished or interrupted."""
        if status not in STUDY_STATUSES:
            raise ValueError(f"study status must be one of {STUDY_STATUSES}, not {status!r}")
        where = Study.id == study if isinstance(study, int) else Study.name == study
        with self._writing() as session:
            changed = session.execute(update(Study).where(where).values(status=status, updated_at=utcnow())).rowcount  # type: ignore[attr-defined]
        if not changed:
            raise StudyNotFound(self._not_found_message(str(study)))

    def set_study_plan(self, study_id: int, plan: Mapping[str, Any]) -> None:
        """Store what a worker needs to join the study (strategy, probe settings, predictions)."""
        with self._writing() as session:
            session.execute(update(Study).where(Study.id == study_id).values(plan=dict(plan)))

    def studies(self) -> list[StudySummary]:
        """Every study, most recent first, with probe counts and the best throughput that fits."""
        is_ok = Probe.status == "ok"
        query = (
            select(
                Study,
                func.count(Probe.id),
                func.coalesce(func.sum(case((is_ok, 1), else_=0)), 0),
                func.coalesce(func.sum(case((Probe.status == "oom", 1), else_=0)), 0),
                func.coalesce(func.sum(case((Probe.status == "skipped", 1), else_=0)), 0),
                func.max(case((is_ok, Probe.tokens_per_s))),
                func.count(func.distinct(Probe.worker)),
            )
            .outerjoin(Probe, Probe.study_id == Study.id)
            .group_by(Study.id)
            .order_by(Study.updated_at.desc(), Study.id.desc())
        )
        with self._read() as session:
            return [
                StudySummary(
                    name=study.name,
                    model_reference=study.model_reference,
                    device_name=study.device_name,
                    budget_bytes=study.budget_bytes,
                    margin_bytes=study.margin_bytes,
                    status=study.status,
                    created_at=study.created_at,
                    updated_at=study.updated_at,
                    probes_total=int(total),
                    probes_ok=int(ok),
                    probes_oom=int(oom),
                    probes_skipped=int(skipped),
                    best_tokens_per_s=best,
                    workers=int(workers),
                )
                for study, total, ok, oom, skipped, best, workers in session.execute(query)
            ]

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
        row = _probe_values(study_id, config, result, env_fingerprint=env_fingerprint, trial_number=trial_number,
                            predicted_peak_bytes=predicted_peak_bytes, worker=worker, started_at=started_at,
                            cacheable=cacheable)

        def work() -> int:
            with self._writing() as session:
                return _add_probe(session, Probe(**row))

        return self._retry_transient(work)

    # -- claims: several workers on one study ----------------------------------------------------

    def claim(self, study_id: int, config_key: str, worker: str, *, stale_after: float,
              max_attempts: int = MAX_ATTEMPTS) -> int | None:
        """Take a configuration of a study for probing; returns the attempt number (1 for a new
        claim), or None when another worker holds it, it is settled, or it has had its attempts.

        Atomic in the database, not in any worker's memory: a new claim is an INSERT that loses
        on the unique (study, config key) constraint; taking over the claim of a worker that has
        not heartbeaten for `stale_after` seconds is an UPDATE conditioned on that staleness. A
        stale claim that has had `max_attempts` is left for settle(how="abandoned")."""
        def work() -> int | None:
            with self._writing() as session:
                now = _db_now(session)
                if _insert_claim(session, study_id=study_id, config_key=config_key, worker=worker, state="running",
                                 attempts=1, claimed_at=now, heartbeat_at=now):
                    return 1
                taken = session.execute(
                    update(Claim)
                    .where(_claim_is(study_id, config_key), Claim.state == "running",
                           Claim.heartbeat_at < now - timedelta(seconds=stale_after), Claim.attempts < max_attempts)
                    .values(worker=worker, attempts=Claim.attempts + 1, claimed_at=now, heartbeat_at=now)
                ).rowcount  # type: ignore[attr-defined]
                if not taken:
                    return None
                return session.scalars(select(Claim.attempts).where(_claim_is(study_id, config_key))).one()

        return self._retry_transient(work)

    def heartbeat(self, study_id: int, config_key: str, worker: str) -> bool:
        """Say that `worker` is still probing `config_key`; False when the claim is no longer its own
        (settled, or taken over after this worker looked dead)."""
        with self._writing() as session:
            now = _db_now(session)
            changed = session.execute(
                update(Claim).where(_claim_is(study_id, config_key), Claim.worker == worker, Claim.state == "running")
                .values(heartbeat_at=now)
            ).rowcount  # type: ignore[attr-defined]
        return bool(changed)

    def release_claim(self, study_id: int, config_key: str, worker: str) -> None:
        """Give back a claim this worker holds without settling it (its probe was aborted)."""
        def work() -> None:
            with self._writing() as session:
                session.execute(delete(Claim).where(_claim_is(study_id, config_key), Claim.worker == worker,
                                                    Claim.state == "running"))

        self._retry_transient(work)

    def settle(
        self,
        study_id: int,
        config: ProbeConfig,
        result: ProbeResult,
        *,
        how: Literal["claimed", "unclaimed", "abandoned"],
        worker: str,
        env_fingerprint: str,
        trial_number: int | None = None,
        predicted_peak_bytes: int | None = None,
        started_at: datetime | None = None,
        cacheable: bool | None = None,
        stale_after: float | None = None,
        max_attempts: int = MAX_ATTEMPTS,
    ) -> int | None:
        """Record the outcome of a configuration of a study once, whichever worker gets there
        first; returns the probe id, or None when it was already settled (by another worker).

        `how`: "claimed", the outcome of a probe this worker claimed (the first worker to settle
        a running claim wins, the owner or one that took it over); "unclaimed", an outcome found
        without a probe (a skip, a reused result: its claim is inserted already settled);
        "abandoned", a crashed outcome for a claim whose worker stopped heartbeating after its
        last attempt (`stale_after` seconds). The claim and the probe row change in one
        transaction, retried when the connection drops."""
        key = config.key()
        state = "crashed" if result.status == "crashed" else "done"
        row = _probe_values(study_id, config, result, env_fingerprint=env_fingerprint, trial_number=trial_number,
                            predicted_peak_bytes=predicted_peak_bytes, worker=worker, started_at=started_at,
                            cacheable=cacheable)

        def work() -> int | None:
            with self._writing() as session:
                now = _db_now(session)
                if how == "unclaimed":
                    won = _insert_claim(session, study_id=study_id, config_key=key, worker=worker, state=state,
                                        attempts=0, claimed_at=now, heartbeat_at=now)
                else:
                    where = [_claim_is(study_id, key), Claim.state == "running"]
                    values: dict[str, Any] = {"state": state, "heartbeat_at": now}
                    if how == "abandoned":
                        assert stale_after is not None, "settle(how='abandoned') needs stale_after"
                        where += [Claim.heartbeat_at < now - timedelta(seconds=stale_after), Claim.attempts >= max_attempts]
                        values.update(state="crashed", worker=worker)
                    elif how != "claimed":
                        raise ValueError(f"how must be claimed, unclaimed or abandoned, not {how!r}")
                    won = bool(session.execute(update(Claim).where(*where).values(**values)).rowcount)  # type: ignore[attr-defined]
                if not won:
                    return None
                return _add_probe(session, Probe(**row))

        return self._retry_transient(work)

    def claims(self, study_id: int, *, stale_after: float) -> list[ClaimRecord]:
        """Every claim of a study, each marked stale when it is running but its worker has not
        heartbeaten for `stale_after` seconds (by the database's clock on a server, so that the
        workers' clocks need not agree)."""
        with self._read() as session:
            now = _db_now(session)
            cutoff = now - timedelta(seconds=stale_after)
            return [
                ClaimRecord(study_id=c.study_id, config_key=c.config_key, worker=c.worker, state=c.state,
                            attempts=c.attempts, claimed_at=c.claimed_at, heartbeat_at=c.heartbeat_at,
                            stale=c.state == "running" and c.heartbeat_at < cutoff)
                for c in session.scalars(select(Claim).where(Claim.study_id == study_id).order_by(Claim.id))
            ]

    def reopen_claims(self, study_id: int, statuses: tuple[str, ...]) -> int:
        """Release the settled claims of configs whose latest outcome has one of `statuses` (a
        timeout or crash a resumed search tries once more); returns how many."""
        with self._writing() as session:
            latest = select(func.max(Probe.id)).where(Probe.study_id == study_id).group_by(Probe.config_key)
            keys = list(session.scalars(select(Probe.config_key).where(Probe.id.in_(latest), Probe.status.in_(statuses))))
            if not keys:
                return 0
            return session.execute(
                delete(Claim).where(Claim.study_id == study_id, Claim.config_key.in_(keys), Claim.state != "running")
            ).rowcount  # type: ignore[attr-defined]

    def set_trial_number(self, probe_id: int, trial_number: int) -> None:
        """Link a stored probe to its Optuna trial, made after the probe was settled."""
        with self._writing() as session:
            session.execute(update(Probe).where(Probe.id == probe_id).values(trial_number=trial_number))

    def find_cached(
        self,
        config_key: str,
        env_fingerprint: str,
        model_fingerprint: str,
        budget_bytes: int,
        margin_bytes: int,
    ) -> ProbeResult | None:
        """The latest reusable result for this config key on this environment, for the same model
        architecture under the same budget and margin, from any study; None when there is none.
        Timeouts, crashes and errors are never reused (see CACHEABLE_STATUSES)."""
        query = (
            select(Probe)
            .join(Study, Study.id == Probe.study_id)
            .where(
                Probe.config_key == config_key,
                Probe.env_fingerprint == env_fingerprint,
                Probe.cacheable.is_(True),
                Probe.status.in_(CACHEABLE_STATUSES),
                Study.model_fingerprint == model_fingerprint,
                Study.budget_bytes == budget_bytes,
                Study.margin_bytes == margin_bytes,
            )
            .order_by(Probe.id.desc())
            .limit(1)
        )
        with self._read() as session:
            probe = session.scalars(query).first()
            return _probe_result(probe) if probe is not None else None

    def probes(self, study_name: str | None = None, *, after_id: int = 0) -> list[ProbeRecord]:
        """Every probe of a study (the most recent study when None), in the order they were stored;
        only those stored after probe `after_id` when given (a worker reading what others found)."""
        with self._read() as session:
            study = self._find_study(session, study_name)
            rows = session.scalars(select(Probe).where(Probe.study_id == study.id, Probe.id > after_id).order_by(Probe.id))
            return [_probe_record(probe) for probe in rows]

    def leaderboard(self, study_name: str | None = None, top: int | None = None) -> list[LeaderboardRow]:
        """The configurations of a study that fit (status ok), fastest first; ties go to the lower
        peak reserved memory. A config probed more than once counts once, with its latest
        measurement. `study_name` None means the most recent study; StudyNotFound if none."""
        if top is not None and top < 1:
            raise BadInput(f"--top must be at least 1 (got {top}).")
        with self._read() as session:
            study = self._find_study(session, study_name)
            # The latest ok probe of each config: max(id) per key. (A window function reads the
            # same, but materialises every ok row first: 5x slower over 10,000 probes.)
            latest_ids = (
                select(func.max(Probe.id))
                .where(Probe.study_id == study.id, Probe.status == "ok")
                .group_by(Probe.config_key)
            )
            probes = Probe.__table__
            query = (
                select(probes)
                .where(probes.c.id.in_(latest_ids))
                .order_by(
                    probes.c.tokens_per_s.desc().nulls_last(),
                    probes.c.peak_reserved_bytes.asc().nulls_last(),
                    probes.c.id,
                )
                .limit(top)
            )
            rows = session.execute(query).mappings().all()
            return [
                LeaderboardRow(
                    rank=rank,
                    study=study.name,
                    probe_id=row["id"],
                    trial_number=row["trial_number"],
                    config=ProbeConfig(**{name: row[name] for name in _CONFIG_FIELDS}),
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
                )
                for rank, row in enumerate(rows, start=1)
            ]

    # -- runs ------------------------------------------------------------------------------------

    def start_run(
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
            status="running",
            output_dir=os.fspath(output_dir) if output_dir is not None else None,
            dataset=dataset,
            started_at=utcnow(),
        )
        with self._writing() as session:
            session.add(run)
            session.flush()
            return run.id

    def finish_run(
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
        self._end_run(
            run_id, status="finished", steps=steps, tokens_per_s=tokens_per_s,
            peak_allocated_bytes=peak_allocated_bytes, peak_reserved_bytes=peak_reserved_bytes,
            final_loss=final_loss, summary=dict(summary) if summary is not None else None,
        )

    def fail_run(self, run_id: int, error: str, *, summary: Mapping[str, Any] | None = None) -> None:
        """Mark a run failed, keeping the error text (and whatever summary there is)."""
        self._end_run(run_id, status="failed", error=error, summary=dict(summary) if summary is not None else None)

    def _end_run(self, run_id: int, **values: Any) -> None:
        assert values["status"] in RUN_STATUSES
        with self._writing() as session:
            run = session.get(Run, run_id)
            if run is None:
                raise LookupError(f"no run with id {run_id}")
            for key, value in values.items():
                setattr(run, key, value)
            run.finished_at = utcnow()

    def run(self, run_id: int) -> RunRecord:
        """One run by id (LookupError when there is none)."""
        with self._read() as session:
            run = session.get(Run, run_id)
            if run is None:
                raise LookupError(f"no run with id {run_id}")
            return _run_record(run)

    def runs(self, study_name: str | None = None) -> list[RunRecord]:
        """Every run, or those of one study, oldest first."""
        with self._read() as session:
            query = select(Run).order_by(Run.id)
            if study_name is not None:
                query = query.where(Run.study_id == self._find_study(session, study_name).id)
            return [_run_record(run) for run in session.scalars(query)]

    # -- helpers ---------------------------------------------------------------------------------

    def _find_study(self, session: Session, name: str | None) -> Study:
        if name is None:
            study = session.scalars(select(Study).order_by(Study.updated_at.desc(), Study.id.desc()).limit(1)).first()
            if study is None:
                raise StudyNotFound(f"no studies in {self.url} yet; run `autotune search` first, or pass --db.")
            return study
        study = session.scalars(select(Study).where(Study.name == name)).one_or_none()
        if study is None:
            raise StudyNotFound(self._not_found_message(name))
        return study

    def _not_found_message(self, name: str) -> str:
        return f"no study named {name!r} in {self.url}; list them with `autotune studies`."


def _check_same_study(study: Study, model: ModelLike, budget_bytes: int, margin_bytes: int, effective_batch: int) -> None:
    from autotune.units import format_size

    differences = []
    if study.model_fingerprint != model.fingerprint:
        differences.append(f"model {study.model_reference!r} (not {model.reference!r})")
    if study.budget_bytes != budget_bytes:
        differences.append(f"budget {format_size(study.budget_bytes)} (not {format_size(budget_bytes)})")
    if study.margin_bytes != margin_bytes:
        differences.append(f"margin {format_size(study.margin_bytes)} (not {format_size(margin_bytes)})")
    if study.effective_batch != effective_batch:
        differences.append(f"effective batch {study.effective_batch} (not {effective_batch})")
    if differences:
        raise BadInput(
            f"study {study.name!r} already exists with {', '.join(differences)}; pick another --study name, "
            f"or resume it with the same settings."
        )


def _study_record(study: Study) -> StudyRecord:
    return StudyRecord(
        id=study.id, name=study.name, model_reference=study.model_reference,
        model_fingerprint=study.model_fingerprint, device_name=study.device_name,
        device_total_bytes=study.device_total_bytes, budget_bytes=study.budget_bytes,
        margin_bytes=study.margin_bytes, effective_batch=study.effective_batch, space=dict(study.space),
        env_fingerprint=study.env_fingerprint, environment=dict(study.environment), status=study.status,
        created_at=study.created_at, updated_at=study.updated_at,
        plan=dict(study.plan) if study.plan is not None else None,
    )


def _db_now(session: Session) -> datetime:
    """Now, by the database server's clock where there is one: claims compare heartbeats written by
    workers on different machines, whose clocks may disagree. (SQLite is one machine's file.)"""
    if session.get_bind().dialect.name == "postgresql":
        return session.scalars(select(func.now())).one()
    return utcnow()


def _claim_is(study_id: int, config_key: str) -> Any:
    return (Claim.study_id == study_id) & (Claim.config_key == config_key)


def _insert_claim(session: Session, **values: Any) -> bool:
    """INSERT a claim unless (study, config key) is taken; True when this one went in. Loses on the
    unique constraint without aborting the transaction (ON CONFLICT DO NOTHING; a savepoint on
    other databases)."""
    dialect = session.get_bind().dialect.name
    if dialect in ("postgresql", "sqlite"):
        from sqlalchemy.dialects import postgresql, sqlite

        # Both dialects' inserts have on_conflict_do_nothing; their types differ only in name.
        dialect_insert: Any = postgresql.insert if dialect == "postgresql" else sqlite.insert
        claims: Any = Claim.__table__
        statement = (dialect_insert(claims).values(**values)
                     .on_conflict_do_nothing(index_elements=["study_id", "config_key"]).returning(claims.c.id))
        # RETURNING, not rowcount: drivers disagree on rowcount for a conflict that did nothing.
        return session.execute(statement).first() is not None
    try:
        with session.begin_nested():
            session.execute(insert(Claim).values(**values))
        return True
    except IntegrityError:
        return False


def _probe_values(study_id: int, config: ProbeConfig, result: ProbeResult, *, env_fingerprint: str,
                  trial_number: int | None, predicted_peak_bytes: int | None, worker: str | None,
                  started_at: datetime | None, cacheable: bool | None) -> dict[str, Any]:
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
        **{name: getattr(config, name) for name in _CONFIG_FIELDS},
        **{name: measured[name] for name in _RESULT_FIELDS},
        cacheable=(result.status in CACHEABLE_STATUSES) if cacheable is None else cacheable,
        predicted_peak_bytes=predicted_peak_bytes,
        worker=worker,
        started_at=started_at,
        finished_at=finished_at,
        env_fingerprint=env_fingerprint,
    )


def _add_probe(session: Session, probe: Probe) -> int:
    session.add(probe)
    # The study's "last touched" time orders `autotune studies` and picks the default study.
    session.execute(update(Study).where(Study.id == probe.study_id).values(updated_at=probe.finished_at))
    session.flush()
    return probe.id


def _probe_result(probe: Probe) -> ProbeResult:
    return ProbeResult(**{name: getattr(probe, name) for name in _RESULT_FIELDS})


def _probe_record(probe: Probe) -> ProbeRecord:
    return ProbeRecord(
        id=probe.id, study_id=probe.study_id, trial_number=probe.trial_number,
        config=ProbeConfig(**{name: getattr(probe, name) for name in _CONFIG_FIELDS}),
        config_key=probe.config_key, result=_probe_result(probe), cacheable=probe.cacheable,
        predicted_peak_bytes=probe.predicted_peak_bytes, worker=probe.worker,
        started_at=probe.started_at, finished_at=probe.finished_at, env_fingerprint=probe.env_fingerprint,
    )


def _run_record(run: Run) -> RunRecord:
    return RunRecord(
        id=run.id, study_id=run.study_id, probe_id=run.probe_id, config=dict(run.config), status=run.status,
        output_dir=run.output_dir, dataset=run.dataset, steps=run.steps, tokens_per_s=run.tokens_per_s,
        peak_allocated_bytes=run.peak_allocated_bytes, peak_reserved_bytes=run.peak_reserved_bytes,
        final_loss=run.final_loss, summary=dict(run.summary) if run.summary is not None else None,
        error=run.error, started_at=run.started_at, finished_at=run.finished_at,
    )

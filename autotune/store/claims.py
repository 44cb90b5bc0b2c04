"""Claims: how several workers share one study. A worker claims a configuration in the database
before probing it, heartbeats while it probes, and settles its outcome once; a claim whose worker
stopped heartbeating is taken over (MAX_ATTEMPTS times at most) or recorded as crashed."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from autotune.levers.config import ProbeConfig
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.status import ClaimState, ProbeStatus, SettleHow
from autotune.store.base import Database
from autotune.store.liveness import worker_gone
from autotune.store.records import ClaimRecord
from autotune.store.rows import add_probe, probe_values
from autotune.store.schema import Claim, Probe, utcnow

# A configuration whose worker stopped heartbeating is taken over once: the second worker to lose it
# records it as crashed (settle(..., how=SettleHow.ABANDONED)) rather than handing it on forever.
MAX_ATTEMPTS = 2
# The claim a study's confirmation round is held by (no configuration has this key): one worker of a
# fleet runs the round (search/loop.py), and the service reads the round as under way while it is held.
ROUND_KEY = "confirmation-round"


class Claims:
    """A study's claims, as workers sharing it take, keep and settle them (see the module docstring): `store.claims`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def take(
        self, study_id: int, config_key: str, worker: str, *, stale_after: float, max_attempts: int = MAX_ATTEMPTS
    ) -> int | None:
        """Take a configuration of a study for probing; returns the attempt number (1 for a new
        claim), or None when another worker holds it, it is settled, or it has had its attempts.

        Atomic in the database, not in any worker's memory: a new claim is an INSERT that loses
        on the unique (study, config key) constraint; taking over the claim of a worker that has
        not heartbeaten for `stale_after` seconds is an UPDATE conditioned on that staleness. A
        stale claim that has had `max_attempts` is left for settle(how="abandoned")."""

        def work() -> int | None:
            with self.db.writing() as session:
                now = _db_now(session)
                if _insert_claim(
                    session,
                    study_id=study_id,
                    config_key=config_key,
                    worker=worker,
                    state=ClaimState.RUNNING,
                    attempts=1,
                    claimed_at=now,
                    heartbeat_at=now,
                ):
                    return 1
                taken = session.execute(
                    update(Claim)
                    .where(
                        _claim_is(study_id, config_key),
                        Claim.state == ClaimState.RUNNING,
                        Claim.heartbeat_at < now - timedelta(seconds=stale_after),
                        Claim.attempts < max_attempts,
                    )
                    .values(worker=worker, attempts=Claim.attempts + 1, claimed_at=now, heartbeat_at=now)
                ).rowcount  # type: ignore[attr-defined]
                if not taken:
                    return None
                return session.scalars(select(Claim.attempts).where(_claim_is(study_id, config_key))).one()

        return self.db.retry(work)

    def beat(self, study_id: int, config_key: str, worker: str) -> bool:
        """Say that `worker` is still probing `config_key`; False when the claim is no longer its own
        (settled, or taken over after this worker looked dead)."""
        with self.db.writing() as session:
            now = _db_now(session)
            changed = session.execute(
                update(Claim)
                .where(_claim_is(study_id, config_key), Claim.worker == worker, Claim.state == ClaimState.RUNNING)
                .values(heartbeat_at=now)
            ).rowcount  # type: ignore[attr-defined]
        return bool(changed)

    def release(self, study_id: int, config_key: str, worker: str, *, retry: bool = True) -> None:
        """Give back a claim this worker holds without settling it (its probe was aborted).
        `retry=False`: tried once (on the way out of a search the database just failed: what cannot
        be written now, the next search makes right, release_dead_claims)."""

        def work() -> None:
            with self.db.writing() as session:
                session.execute(
                    delete(Claim).where(
                        _claim_is(study_id, config_key), Claim.worker == worker, Claim.state == ClaimState.RUNNING
                    )
                )

        self.db.retry(work) if retry else work()

    def release_dead(self, study_id: int) -> int:
        """Make stale at once the running claims of this study whose worker's process is gone from
        this machine (killed, or it stopped on a database that failed and could not give its claim
        back), so that a resumed search takes them over now instead of waiting for them to go stale.
        Taken over, not deleted: the attempt counts, so a config that kills its worker each time
        ends as crashed after MAX_ATTEMPTS rather than being tried forever. Another machine's claims
        are left to their heartbeats. Returns how many."""
        with self.db.reading() as session:
            dead = [
                (c.config_key, c.worker)
                for c in session.scalars(
                    select(Claim).where(Claim.study_id == study_id, Claim.state == ClaimState.RUNNING)
                )
                if worker_gone(c.worker)
            ]
        if not dead:
            return 0
        with self.db.writing() as session:
            long_ago = _db_now(session) - timedelta(days=365)
            for config_key, worker in dead:
                session.execute(
                    update(Claim)
                    .where(_claim_is(study_id, config_key), Claim.worker == worker, Claim.state == ClaimState.RUNNING)
                    .values(heartbeat_at=long_ago)
                )
        return len(dead)

    def settle(
        self,
        study_id: int,
        config: ProbeConfig,
        result: ProbeResult,
        *,
        how: SettleHow,
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
        state = ClaimState.CRASHED if result.status == ProbeStatus.CRASHED else ClaimState.DONE
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

        def work() -> int | None:
            with self.db.writing() as session:
                now = _db_now(session)
                if how == SettleHow.UNCLAIMED:
                    won = _insert_claim(
                        session,
                        study_id=study_id,
                        config_key=key,
                        worker=worker,
                        state=state,
                        attempts=0,
                        claimed_at=now,
                        heartbeat_at=now,
                    )
                else:
                    where = [_claim_is(study_id, key), Claim.state == ClaimState.RUNNING]
                    values: dict[str, Any] = {"state": state, "heartbeat_at": now}
                    if how == SettleHow.ABANDONED:
                        assert stale_after is not None, "settle(how='abandoned') needs stale_after"
                        where += [
                            Claim.heartbeat_at < now - timedelta(seconds=stale_after),
                            Claim.attempts >= max_attempts,
                        ]
                        values.update(state=ClaimState.CRASHED, worker=worker)
                    elif how != SettleHow.CLAIMED:
                        raise ValueError(f"how must be claimed, unclaimed or abandoned, not {how!r}")
                    won = bool(session.execute(update(Claim).where(*where).values(**values)).rowcount)  # type: ignore[attr-defined]
                if not won:
                    return None
                return add_probe(session, Probe(**row))

        return self.db.retry(work)

    def of_study(self, study_id: int, *, stale_after: float) -> list[ClaimRecord]:
        """Every claim of a study, each marked stale when it is running but its worker has not
        heartbeaten for `stale_after` seconds (by the database's clock on a server, so that the
        workers' clocks need not agree)."""
        with self.db.reading() as session:
            now = _db_now(session)
            cutoff = now - timedelta(seconds=stale_after)
            return [
                ClaimRecord(
                    study_id=c.study_id,
                    config_key=c.config_key,
                    worker=c.worker,
                    state=c.state,
                    attempts=c.attempts,
                    claimed_at=c.claimed_at,
                    heartbeat_at=c.heartbeat_at,
                    stale=c.state == ClaimState.RUNNING and c.heartbeat_at < cutoff,
                )
                for c in session.scalars(select(Claim).where(Claim.study_id == study_id).order_by(Claim.id))
            ]

    def reopen(self, study_id: int, statuses: tuple[str, ...]) -> int:
        """Release the settled claims of configs whose latest outcome has one of `statuses` (a
        timeout or crash a resumed search tries once more); returns how many."""
        with self.db.writing() as session:
            latest = select(func.max(Probe.id)).where(Probe.study_id == study_id).group_by(Probe.config_key)
            keys = list(
                session.scalars(select(Probe.config_key).where(Probe.id.in_(latest), Probe.status.in_(statuses)))
            )
            if not keys:
                return 0
            return session.execute(
                delete(Claim).where(
                    Claim.study_id == study_id, Claim.config_key.in_(keys), Claim.state != ClaimState.RUNNING
                )
            ).rowcount  # type: ignore[attr-defined]

    def reopen_skipped(self, study_id: int, config_keys: list[str]) -> int:
        """Forget the skips of these configs (their rows and settled claims), so that the search
        decides them again: skipped for speed on a measurement that has since fallen, they could
        now win (search/loop.py). Returns how many rows went."""
        if not config_keys:
            return 0
        with self.db.writing() as session:
            gone = session.execute(
                delete(Probe).where(
                    Probe.study_id == study_id, Probe.config_key.in_(config_keys), Probe.status == ProbeStatus.SKIPPED
                )
            ).rowcount  # type: ignore[attr-defined]
            session.execute(
                delete(Claim).where(
                    Claim.study_id == study_id, Claim.config_key.in_(config_keys), Claim.state != ClaimState.RUNNING
                )
            )
            return gone


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
        statement = (
            dialect_insert(claims)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["study_id", "config_key"])
            .returning(claims.c.id)
        )
        # RETURNING, not rowcount: drivers disagree on rowcount for a conflict that did nothing.
        return session.execute(statement).first() is not None
    try:
        with session.begin_nested():
            session.execute(insert(Claim).values(**values))
        return True
    except IntegrityError:
        return False

"""The queue of searches submitted to the service: a submission waits as `queued` until a queue
worker (`autotune worker --queue`) that can serve it takes it; the worker heartbeats while its
search runs, hears of a cancel through the same row, and records how it ended. A search whose worker
is gone (its process, or its heartbeats) reads as interrupted and is taken up again by the next
worker that asks, which resumes its study: nothing it settled is lost.

Taking is atomic in the database, as claims are (claims.py): a conditional UPDATE on the state and
holder read, so two workers never both take one search."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, update

from autotune.vocabulary.errors import BadInput, Conflict, StudyNotFound
from autotune.host.processes import owner_gone
from autotune.vocabulary.status import SEARCH_ENDED, SearchState
from autotune.store.base import Database
from autotune.store.claims import _db_now
from autotune.store.names import check_same_study, check_study_name
from autotune.store.records import SearchRecord
from autotune.store.schema import Probe, Search, Study, utcnow

# A queue worker beats this often while its search runs; one silent for QUEUE_STALE_SECONDS is
# presumed dead (another machine's; on the same machine its process table says at once).
QUEUE_HEARTBEAT_SECONDS = 2.0
QUEUE_STALE_SECONDS = 30.0
# Ended searches that go back to the queue when the same request is submitted again: each resumes
# its study (a finished one answers from it).
RESUMABLE = frozenset({SearchState.INTERRUPTED, SearchState.FAILED, SearchState.CANCELLED})


@dataclass(frozen=True, slots=True)
class Submission:
    """A search as the queue stores it: its study's name, the `autotune search` arguments it
    stands for, and what a worker needs to serve it. Made by autotune/service/submissions.py."""

    name: str
    arguments: tuple[str, ...]
    request_hash: str
    model: str
    budget_bytes: int
    device_kind: str
    gpus: int
    card: str | None
    candidates: int
    # What trains, to hold a study's name to it (not stored: checked against the study of that name).
    model_fingerprint: str | None = None
    effective_batch: int | None = None


class SearchQueue:
    """The service's submitted searches, as clients submit and workers take them (see the module docstring): `store.queue`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def submit(
        self, submission: Submission, *, idempotency_key: str | None = None, submitted_by: str | None = None
    ) -> tuple[SearchRecord, bool]:
        """Queue a search; returns it and whether it is new. The same request (by its hash, or by
        `idempotency_key`) returns the search already stored, never a second one; one that ended
        without finishing goes back to the queue to resume. Conflict: a key used for another
        request, or the study's name queued or running with other settings."""
        name = check_study_name(submission.name)

        def work() -> tuple[SearchRecord, bool]:
            with self.db.writing() as session:
                now = utcnow()
                if idempotency_key is not None:
                    keyed = session.scalars(
                        select(Search).where(Search.idempotency_key == idempotency_key)
                    ).one_or_none()
                    if keyed is not None:
                        if keyed.request_hash != submission.request_hash:
                            raise Conflict(
                                f"Idempotency-Key {idempotency_key!r} was used for another request (search "
                                f"{keyed.name!r}); use a new key for a new request."
                            )
                        return self._resubmitted(keyed, now, submitted_by), False
                self._check_study_taken(session, name, submission)
                row = session.scalars(select(Search).where(Search.name == name)).one_or_none()
                if row is not None:
                    if row.request_hash == submission.request_hash:
                        return self._resubmitted(row, now, submitted_by), False
                    state = _state(row)
                    if state in (SearchState.QUEUED, SearchState.RUNNING):
                        raise Conflict(
                            f"search {name!r} is {state} with other settings; give the new one another "
                            f"study name, or cancel that one first."
                        )
                    # Ended: the same name searched again with other flags, as the command line
                    # resumes a study (its own checks refuse a change of what is trained).
                    _fill(row, submission)
                    row.idempotency_key = idempotency_key
                    _requeue(row, now)
                    row.submitted_by = submitted_by
                    session.flush()
                    return search_record(row), True
                row = Search(
                    name=name,
                    idempotency_key=idempotency_key,
                    state=SearchState.QUEUED,
                    submitted_by=submitted_by,
                    attempts=0,
                    created_at=now,
                    updated_at=now,
                )
                _fill(row, submission)
                session.add(row)
                session.flush()
                return search_record(row), True

        return self.db.retry_on_conflict(work)

    @staticmethod
    def _check_study_taken(session: Any, name: str, submission: Submission) -> None:
        """A study of that name (the command line's, or an earlier submission's) is taken over only
        for the same model, budget and effective batch, as `search --study` resumes one (Conflict)."""
        if submission.model_fingerprint is None or submission.effective_batch is None:
            return
        study = session.scalars(select(Study).where(Study.name == name)).one_or_none()
        if study is None:
            return
        try:
            check_same_study(
                study,
                submission.model_fingerprint,
                submission.model,
                submission.budget_bytes,
                None,
                submission.effective_batch,
            )
        except BadInput as exc:
            raise Conflict(str(exc).replace("--study name", "study name")) from None

    @staticmethod
    def _resubmitted(row: Search, now: Any, submitted_by: str | None) -> SearchRecord:
        """The search a request repeats: as it is, or back in the queue where it ended unfinished,
        then its submitter's (who restarted it may cancel it; the earlier submitter no longer)."""
        if _state(row) in RESUMABLE:
            _requeue(row, now)
            row.submitted_by = submitted_by
        return search_record(row)

    def get(self, name: str) -> SearchRecord:
        """The submitted search of that name; StudyNotFound if none was submitted."""
        with self.db.reading() as session:
            row = session.scalars(select(Search).where(Search.name == name)).one_or_none()
            if row is None:
                raise StudyNotFound(
                    f"no search named {name!r} was submitted to this service; list them with GET /v1/searches."
                )
            return search_record(row)

    def all(self, *, limit: int = 100, state: str | None = None) -> list[SearchRecord]:
        """The submitted searches, newest first (`state`: only those in it, as read)."""
        with self.db.reading() as session:
            rows = session.scalars(select(Search).order_by(Search.id.desc())).all()
            records = [search_record(row) for row in rows]
        return [r for r in records if state is None or r.state == state][:limit]

    def settled_counts(self, names: Sequence[str]) -> dict[str, int]:
        """For each study named: how many of its configurations have an outcome (its progress)."""
        if not names:
            return {}
        query = (
            select(Study.name, func.count(func.distinct(Probe.config_key)))
            .join(Probe, Probe.study_id == Study.id)
            .where(Study.name.in_(list(names)))
            .group_by(Study.name)
        )
        with self.db.reading() as session:
            return {name: int(count) for name, count in session.execute(query).all()}

    def take(self, worker: str, can_serve: Callable[[SearchRecord], bool]) -> SearchRecord | None:
        """Take the oldest search this worker can serve: a queued one, or a running one whose worker
        is gone (it resumes). None when there is none."""

        def work() -> SearchRecord | None:
            with self.db.writing() as session:
                now = _db_now(session)
                rows = session.scalars(
                    select(Search)
                    .where(Search.state.in_((SearchState.QUEUED, SearchState.RUNNING)))
                    .order_by(Search.id)
                ).all()
                for row in rows:
                    if _state(row, now) not in (SearchState.QUEUED, SearchState.INTERRUPTED) or row.cancel_requested:
                        continue
                    if not can_serve(search_record(row)):
                        continue
                    taken = session.execute(
                        update(Search)
                        .where(
                            Search.id == row.id,
                            Search.state == row.state,
                            _same(Search.worker, row.worker),
                            _same(Search.heartbeat_at, row.heartbeat_at),
                        )
                        .values(
                            state=SearchState.RUNNING,
                            worker=worker,
                            attempts=Search.attempts + 1,
                            started_at=now,
                            heartbeat_at=now,
                            updated_at=now,
                            reason=None,
                            exit_status=None,
                            finished_at=None,
                        )
                    ).rowcount  # type: ignore[attr-defined]
                    if taken:
                        session.expire(row)
                        return search_record(session.get(Search, row.id))  # type: ignore[arg-type]
                return None

        return self.db.retry(work)

    def running(self) -> list[SearchRecord]:
        """Searches a worker runs now (as read: not those whose worker is gone), oldest first."""
        with self.db.reading() as session:
            rows = session.scalars(select(Search).where(Search.state == SearchState.RUNNING).order_by(Search.id)).all()
            return [r for r in map(search_record, rows) if r.state == SearchState.RUNNING]

    def beat(self, search_id: int, worker: str) -> SearchRecord | None:
        """The worker running it is alive; returns the search as stored (whether a cancel was asked),
        or None when it is no longer this worker's."""

        def work() -> SearchRecord | None:
            with self.db.writing() as session:
                changed = session.execute(
                    update(Search)
                    .where(Search.id == search_id, Search.worker == worker, Search.state == SearchState.RUNNING)
                    .values(heartbeat_at=_db_now(session))
                ).rowcount  # type: ignore[attr-defined]
                return search_record(session.get(Search, search_id)) if changed else None  # type: ignore[arg-type]

        return self.db.retry(work)

    def end(
        self, search_id: int, worker: str, state: SearchState, reason: str | None, exit_status: int | None = None
    ) -> None:
        """Record how a worker's search ended (only while it is still that worker's)."""
        if state not in SEARCH_ENDED:
            raise ValueError(f"a search ends in one of {', '.join(sorted(SEARCH_ENDED))}, not {state!r}")

        def work() -> None:
            with self.db.writing() as session:
                now = utcnow()
                session.execute(
                    update(Search)
                    .where(Search.id == search_id, Search.worker == worker)
                    .values(
                        state=state,
                        reason=reason,
                        exit_status=exit_status,
                        finished_at=now,
                        updated_at=now,
                        heartbeat_at=now,
                    )
                )

        self.db.retry(work)

    def requeue(self, search_id: int, worker: str, reason: str) -> None:
        """Put a worker's search back in the queue (the worker stopped before the search ended):
        the next worker that can serve it resumes its study."""

        def work() -> None:
            with self.db.writing() as session:
                session.execute(
                    update(Search)
                    .where(Search.id == search_id, Search.worker == worker)
                    .values(
                        state=SearchState.QUEUED, reason=reason, worker=None, heartbeat_at=None, updated_at=utcnow()
                    )
                )

        self.db.retry(work)

    def cancel(self, name: str, *, by: str | None = None) -> SearchRecord:
        """Ask a search to stop: a queued one is cancelled at once; a running one's worker stops its
        search (the probe in flight ended) and records it cancelled. An ended search is left as it is."""

        def work() -> SearchRecord:
            with self.db.writing() as session:
                row = session.scalars(select(Search).where(Search.name == name)).one_or_none()
                if row is None:
                    raise StudyNotFound(
                        f"no search named {name!r} was submitted to this service; list them with GET /v1/searches."
                    )
                now, who = utcnow(), f" by {by}" if by else ""
                state = _state(row)
                if state in (SearchState.QUEUED, SearchState.INTERRUPTED):  # (interrupted: waiting to resume)
                    row.state, row.finished_at = SearchState.CANCELLED, now
                    waited = (
                        "before a worker took it up" if state == SearchState.QUEUED else "while it waited to resume"
                    )
                    row.reason = f"cancelled{who} {waited}; submit it again to resume"
                elif state == SearchState.RUNNING and not row.cancel_requested:
                    row.cancel_requested = True
                    row.reason = f"cancel asked{who}; its worker is stopping it"
                else:  # ended, or already asked: left as it is, its time and reason too
                    return search_record(row)
                row.updated_at = now
                session.flush()
                return search_record(row)

        return self.db.retry(work)


def search_record(row: Search) -> SearchRecord:
    state = _state(row)
    reason = row.reason
    if state == SearchState.INTERRUPTED and row.state == SearchState.RUNNING:
        reason = f"its worker ({row.worker}) stopped; the next queue worker that can serve it resumes it"
    return SearchRecord(
        id=row.id,
        name=row.name,
        arguments=list(row.arguments),
        request_hash=row.request_hash,
        idempotency_key=row.idempotency_key,
        model=row.model,
        budget_bytes=row.budget_bytes,
        device_kind=row.device_kind,
        gpus=row.gpus,
        card=row.card,
        candidates=row.candidates,
        state=state,
        reason=reason,
        cancel_requested=bool(row.cancel_requested),
        submitted_by=row.submitted_by,
        worker=row.worker,
        attempts=row.attempts,
        exit_status=row.exit_status,
        created_at=row.created_at,
        updated_at=row.updated_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
    )


def _state(row: Search, now: Any = None) -> SearchState:
    """The state as stored, or interrupted for a running search whose worker is gone."""
    state = SearchState(row.state)
    if state != SearchState.RUNNING:
        return state
    silent = row.heartbeat_at is not None and (now or utcnow()) - row.heartbeat_at > timedelta(
        seconds=QUEUE_STALE_SECONDS
    )
    return SearchState.INTERRUPTED if owner_gone(row.worker) or silent else state


def _fill(row: Search, submission: Submission) -> None:
    row.arguments = list(submission.arguments)
    row.request_hash = submission.request_hash
    row.model, row.budget_bytes = submission.model, submission.budget_bytes
    row.device_kind, row.gpus, row.card = submission.device_kind, submission.gpus, submission.card
    row.candidates = submission.candidates


def _requeue(row: Search, now: Any) -> None:
    row.state, row.reason, row.cancel_requested = SearchState.QUEUED, None, False
    row.worker, row.heartbeat_at, row.exit_status, row.finished_at = None, None, None, None
    row.updated_at = now


def _same(column: Any, value: Any) -> Any:
    return column.is_(None) if value is None else column == value

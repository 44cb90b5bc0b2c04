"""The queue workers connected to a service's database (`store.workers`): each `autotune worker
--queue` says what it can serve when it starts, is heard each time it polls the queue or beats its
search, and leaves when it stops. One silent past the queue's stale time, or whose process is gone
on this machine, reads as disconnected (kill -9 leaves its row; nothing reads it as connected).

What a worker can serve is decided here, once: the queue worker takes a search by it
(search/queue_worker.py) and the service says by it why a queued search waits (`why_waiting`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select, update

from autotune.host.processes import owner_gone
from autotune.store.base import Database
from autotune.store.claims import _db_now
from autotune.store.queue import QUEUE_STALE_SECONDS
from autotune.store.records import SearchRecord, _iso
from autotune.store.schema import QueueWorkerRow


@dataclass(frozen=True, slots=True)
class ServingDevice:
    """What a worker's device can serve: its kind, name, memory and ranks."""

    kind: str  # cuda | cpu
    name: str  # the device's name ('NVIDIA A10G', 'cpu: ...')
    total_bytes: int | None
    ranks: int  # GPUs visible (cuda), or CPU ranks at once

    def why_not(self, search: SearchRecord) -> str | None:
        """Why this device cannot serve `search`, in words, or None when it can."""
        from autotune.vocabulary.units import format_size

        if search.device_kind != self.kind:
            return f"it is a {self.kind} worker and the search asks for {search.device_kind}"
        if search.card and search.card.lower() not in self.name.lower():
            return f"its device is {self.name!r}, not a {search.card}"
        if self.total_bytes is not None and search.budget_bytes > self.total_bytes:
            return (
                f"its device has {format_size(self.total_bytes)}, less than the budget of "
                f"{format_size(search.budget_bytes)}"
            )
        if search.gpus > self.ranks:
            return f"it has {self.ranks} rank{'s' if self.ranks != 1 else ''} and the search asks for {search.gpus}"
        return None

    def can_serve(self, search: SearchRecord) -> bool:
        return self.why_not(search) is None

    def describe(self) -> str:
        from autotune.vocabulary.units import format_size

        memory = f", {format_size(self.total_bytes)}" if self.total_bytes else ""
        return f"{self.name}{memory}, {self.ranks} rank{'s' if self.ranks != 1 else ''}"


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A queue worker as stored: its label (host:pid), its device, and when it was last heard."""

    label: str
    device: ServingDevice
    started_at: datetime
    seen_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "device": self.device.kind,
            "device_name": self.device.name,
            "total_bytes": self.device.total_bytes,
            "ranks": self.device.ranks,
            "started_at": _iso(self.started_at),
            "seen_at": _iso(self.seen_at),
        }


class Workers:
    """The connected queue workers (see the module docstring): `store.workers`."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def announce(self, label: str, device: ServingDevice) -> None:
        """A worker starts: its row written (or rewritten, where a process of the same label left one)."""

        def work() -> None:
            with self.db.writing() as session:
                now = _db_now(session)
                session.execute(delete(QueueWorkerRow).where(QueueWorkerRow.label == label))
                session.add(
                    QueueWorkerRow(
                        label=label,
                        device_kind=device.kind,
                        device_name=device.name[:255],
                        total_bytes=device.total_bytes,
                        ranks=device.ranks,
                        started_at=now,
                        seen_at=now,
                    )
                )

        self.db.retry(work)

    def seen(self, label: str) -> None:
        """The worker is alive (it polled the queue, or beat its search)."""

        def work() -> None:
            with self.db.writing() as session:
                session.execute(
                    update(QueueWorkerRow).where(QueueWorkerRow.label == label).values(seen_at=_db_now(session))
                )

        self.db.retry(work)

    def leave(self, label: str) -> None:
        """The worker stops: its row removed."""

        def work() -> None:
            with self.db.writing() as session:
                session.execute(delete(QueueWorkerRow).where(QueueWorkerRow.label == label))

        self.db.retry(work)

    def connected(self) -> list[WorkerRecord]:
        """The workers heard within the queue's stale time whose process is not gone, oldest first."""
        with self.db.reading() as session:
            now = _db_now(session)
            rows = session.scalars(select(QueueWorkerRow).order_by(QueueWorkerRow.id)).all()
            records = [_record(row) for row in rows]
        fresh = timedelta(seconds=QUEUE_STALE_SECONDS)
        return [r for r in records if now - r.seen_at <= fresh and not owner_gone(r.label)]


def why_waiting(search: SearchRecord, workers: Sequence[WorkerRecord]) -> str:
    """Why a queued search waits, in words: no worker connected, none that can serve it (each
    connected worker's reason), or every one that can busy."""
    if not workers:
        return "waiting for a queue worker: none is connected (start one with `autotune worker --queue`)"
    reasons = {w.label: w.device.why_not(search) for w in workers}
    able = [label for label, reason in reasons.items() if reason is None]
    if able:
        return f"waiting for a queue worker: {', '.join(able)} can serve it and will take it when free"
    said = "; ".join(f"{label}: {reason}" for label, reason in reasons.items())
    return f"no connected queue worker can serve it ({said})"


def _record(row: QueueWorkerRow) -> WorkerRecord:
    return WorkerRecord(
        label=row.label,
        device=ServingDevice(row.device_kind, row.device_name, row.total_bytes, row.ranks),
        started_at=row.started_at,
        seen_at=row.seen_at,
    )

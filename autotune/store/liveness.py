"""Whether a study or run stored as `running` really is: its owner (host:pid) and heartbeat are
kept with it, and one whose process is gone (kill -9, a full disk, a machine lost) reads as
`interrupted`, never `running` forever. Read commands derive it and write nothing; the next search
or train marks it for good when it takes the study or the output directory over."""

from __future__ import annotations

from datetime import datetime, timedelta

from autotune.host.processes import owner_gone
from autotune.store.schema import utcnow

# A heartbeat older than this says the owner is gone, wherever it ran: several missed beats of the
# slowest beating owner (a training run beats every RUN_HEARTBEAT_SECONDS), with room for a
# database that is slow to take writes.
STALE_AFTER_SECONDS = 120.0
RUN_HEARTBEAT_SECONDS = 30.0


def effective_status(
    status: str,
    owner: str | None,
    heartbeat_at: datetime | None,
    *,
    interrupted: str,
    running: str = "running",
    now: datetime | None = None,
) -> str:
    """`status`, or `interrupted` for a running record whose owner is gone (this machine's process
    table) or silent (no heartbeat for STALE_AFTER_SECONDS). Records from before owners were kept
    (no owner, no heartbeat) are taken at their word."""
    if status != running or (owner is None and heartbeat_at is None):
        return status
    if owner_gone(owner):
        return interrupted
    if heartbeat_at is not None and (now or utcnow()) - heartbeat_at > timedelta(seconds=STALE_AFTER_SECONDS):
        return interrupted
    return status


def worker_gone(worker: str | None) -> bool:
    """Whether the search worker a claim names ('host:pid:device', search/worker_state.py) is gone,
    as far as this machine can tell (owner_gone: False for another host's worker)."""
    host_pid = ":".join((worker or "").split(":")[:2])
    return owner_gone(host_pid)

"""A study read back from its database while a real search process runs it (or after it ended),
and the smallest real search a fault test needs."""

from __future__ import annotations

from autotune.vocabulary.status import ClaimState
from autotune.store import open_store

# Two candidates (micro-batch 1 and 2 at an effective batch of 2): the first probe completes, the
# second is where a fault strikes. No confirmation round: a fault test resumes to see every
# candidate measured once, not the two timed again (tests/search/test_confirm.py).
TWO_CANDIDATES = [
    "--gpu-budget",
    "64MiB",
    "--device",
    "cpu",
    "--micro-batches",
    "1,2",
    "--block-sizes",
    "64",
    "--effective-batch",
    "2",
    "--precisions",
    "fp32",
    "--checkpointing",
    "off",
    "--attention",
    "sdpa",
    "--measure-steps",
    "1",
    "--no-confirm",
    "--no-predict",
    "--strategy",
    "grid",
]


class WatchedStudy:
    """`study` in `db` while a search process runs it, read through one store held for the wait
    (running_claims and probes below open one each call: some 10 ms of CPU on SQLite, 30 on
    PostgreSQL, five times a second while a test polls), opened once the search has made its
    tables. Read only: the watching creates and writes nothing."""

    def __init__(self, db: str, study: str) -> None:
        self.db, self.study = db, study
        self._store = None

    def __enter__(self) -> WatchedStudy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    def store(self):
        if self._store is None:
            self._store = open_store(self.db, read_only=True)
        return self._store

    def running_claims(self) -> list:
        """running_claims(db, study)'s answer, through the held store."""
        try:
            store = self.store()
            claims = store.claims.of_study(store.study(self.study).id, stale_after=3600)
        except Exception:  # not created yet
            return []
        return [c for c in claims if c.state == ClaimState.RUNNING]

    def probes(self) -> list:
        """probes(db, study)'s answer, through the held store (raises before the study exists)."""
        return self.store().probes(self.study)


def running_claims(db: str, study: str) -> list:
    try:
        with open_store(db) as store:
            return [
                c
                for c in store.claims.of_study(store.study(study).id, stale_after=3600)
                if c.state == ClaimState.RUNNING
            ]
    except Exception:  # not created yet
        return []


def probes(db: str, study: str) -> list:
    with open_store(db) as store:
        return store.probes(study)


def status(db: str, study: str) -> str:
    with open_store(db) as store:
        return store.study(study).status

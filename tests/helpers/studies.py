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

"""The results store: studies, probes and full runs in SQLite (default) or any SQLAlchemy database.

    from autotune.store import open_store

    with open_store() as store:                 # --db, else $AUTOTUNE_DB, else the user data dir
        study = store.get_or_create_study("gpt2-8g", model=spec, environment=env,
                                          budget_bytes=..., margin_bytes=..., effective_batch=32,
                                          space={...})
        cached = store.find_cached(config.key(), env.fingerprint(), spec.fingerprint, ...)
        store.record_probe(study.id, config, result, env_fingerprint=env.fingerprint())
        rows = store.leaderboard(study.name, top=10)

Several workers share a study through claims: `claim()` takes a config for probing (atomically, in
the database), `heartbeat()` keeps it, `settle()` records its outcome once, whichever worker wins.

Schema in `schema.py`, changed only through Alembic revisions in the repository's top-level
`migrations/` (installed as `autotune.store.migrations`). The Store is split by concern: `base.py`
(sessions, the retry policy), `store.py` (studies, probes, leaderboard), `claims.py`, `runs.py`,
`rows.py` (ORM rows to records).
Importing this package loads SQLAlchemy, not Alembic, torch or Optuna.
"""

from __future__ import annotations

from autotune.store.engine import default_url, resolve_url
from autotune.store.records import (
    ClaimRecord,
    LeaderboardRow,
    ProbeRecord,
    RunRecord,
    StudyRecord,
    StudySummary,
    UpgradeReport,
)
from autotune.store.schema import SCHEMA_REVISION
from autotune.store.claims import MAX_ATTEMPTS
from autotune.store.store import (
    ModelLike,
    Store,
    open_store,
    upgrade_database,
)

__all__ = [
    "MAX_ATTEMPTS",
    "SCHEMA_REVISION",
    "ClaimRecord",
    "LeaderboardRow",
    "ModelLike",
    "ProbeRecord",
    "RunRecord",
    "Store",
    "StudyRecord",
    "StudySummary",
    "UpgradeReport",
    "default_url",
    "open_store",
    "resolve_url",
    "upgrade_database",
]

"""The results store: studies, probes and full runs in SQLite (default) or any SQLAlchemy database.

    from autotune.store import open_store

    with open_store() as store:                 # --db, else $AUTOTUNE_DB, else the user data dir
        study = store.get_or_create_study("gpt2-8g", model=spec, environment=env,
                                          budget_bytes=..., margin_bytes=..., effective_batch=32,
                                          space={...})
        cached = store.find_cached(config.key(), env.fingerprint(), spec.fingerprint, ...)
        store.record_probe(study.id, config, result, env_fingerprint=env.fingerprint())
        rows = store.leaderboard(study.name, top=10)

The Store is studies, probes and the leaderboard (`store.py`) and four parts over the same
`Database` (`base.py`: sessions, the retry policy, the one place writes start), each an attribute:

    store.claims.take(study.id, key, worker, stale_after=15.0)   # workers sharing a study (claims.py):
    store.claims.beat(...); store.claims.settle(...)             # taken atomically, kept, settled once
    store.runs.start(...), store.runs.all()                      # full fine-tunes (runs.py)
    store.queue.submit(submission), store.queue.take(worker, ok) # the service's searches (queue.py)
    store.tokens.create("ci"), store.tokens.holder(token)        # the service's tokens (tokens.py)

Schema in `schema.py`, changed only through Alembic revisions in `migrations/` (the package
`autotune.store.migrations`); `rows.py` turns ORM rows into records (`records.py`); `failures.py`
says which database errors pass with time and words the others; `damage.py` finds what a database
that is not whole lacks; `names.py` checks study names, new and looked up. `schema_lock()` is held while a schema is created
(ours by `migrate.upgrade`, Optuna's by whoever builds its RDBStorage).
Read commands open with `open_store(db, read_only=True)`: nothing is created, upgraded or written.
Importing this package loads SQLAlchemy, not Alembic, torch or Optuna.
"""

from __future__ import annotations

from autotune.store.engine import PG_CONNECT_TIMEOUT_S, PG_STATEMENT_TIMEOUT_S, default_url, resolve_url
from autotune.store.migrate import schema_lock
from autotune.store.names import STUDY_NAME_MAX, check_study_lookup, check_study_name
from autotune.store.records import (
    ClaimRecord,
    LeaderboardRow,
    ProbeRecord,
    RunRecord,
    SearchRecord,
    StudyRecord,
    StudySummary,
    TokenRecord,
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
    "PG_CONNECT_TIMEOUT_S",
    "PG_STATEMENT_TIMEOUT_S",
    "SCHEMA_REVISION",
    "STUDY_NAME_MAX",
    "ClaimRecord",
    "LeaderboardRow",
    "ModelLike",
    "ProbeRecord",
    "RunRecord",
    "SearchRecord",
    "Store",
    "StudyRecord",
    "StudySummary",
    "TokenRecord",
    "UpgradeReport",
    "check_study_lookup",
    "check_study_name",
    "default_url",
    "open_store",
    "resolve_url",
    "schema_lock",
    "upgrade_database",
]

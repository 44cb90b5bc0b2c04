"""autotune's Alembic migrations, shipped inside the wheel.

Run them with `autotune db upgrade [--db URL]` (a local database is upgraded whenever autotune opens
it). The Alembic configuration is built in code by `autotune.store.migrate.alembic_config`, which
finds this directory from the installed package; no alembic.ini is needed.

New revision, for developers: make the model change in `autotune/store/schema.py`, then

    python -m autotune.store.migrate revision "what changed"

which autogenerates `versions/NNNN_what_changed.py` against a scratch database at the current head.
Review it (SQLite batch operations, server defaults for new non-null columns), and keep a database
written by the previous head under `tests/store/fixtures/` so that its upgrade stays tested.
"""

"""The queue workers connected to a service's database: what each can serve, and when it was last heard.

Revision ID: 0015_workers
Revises: 0014_padding_free
Create Date: 2026-12-01

`autotune_workers`: one row per `autotune worker --queue` (its host:pid label), written when it
starts, touched each time it polls the queue or heartbeats its search, and removed when it stops.
A row silent past the queue's stale time (or whose process is gone, on the same machine) reads as
disconnected. The service reads it to say which worker holds a search and, for a search left
queued, that no connected worker can serve it and why (autotune/store/workers.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015_workers"
down_revision: str | None = "0014_padding_free"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "autotune_workers",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("label", sa.String(length=255), nullable=False),
        sa.Column("device_kind", sa.String(length=16), nullable=False),
        sa.Column("device_name", sa.String(length=255), nullable=False),
        sa.Column("total_bytes", sa.BigInteger(), nullable=True),
        sa.Column("ranks", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autotune_workers")),
        sa.UniqueConstraint("label", name=op.f("uq_autotune_workers_label")),
    )


def downgrade() -> None:
    op.drop_table("autotune_workers")

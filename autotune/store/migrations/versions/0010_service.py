"""The service: a queue of submitted searches, and the tokens that may submit them.

Revision ID: 0010_service
Revises: 0009_ranks
Create Date: 2026-11-26

`autotune_searches`: one row per search submitted to `autotune serve` (POST /v1/searches), waiting
as `queued` until an `autotune worker --queue` takes it. It keeps the request as the `autotune
search` arguments it stands for (the one definition: the command line's), what a worker needs to
serve it (device kind, ranks, budget, card), its state with the reason, who holds it (host:pid and
a heartbeat) and whether a cancel was asked. The study it becomes is `autotune_studies.name`.

`autotune_tokens`: bearer tokens by name, stored only as their SHA-256 hash.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_service"
down_revision: str | None = "0009_ranks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "autotune_searches",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("arguments", sa.JSON(), nullable=False),
        sa.Column("request_hash", sa.String(length=64), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("model", sa.String(length=1000), nullable=False),
        sa.Column("budget_bytes", sa.BigInteger(), nullable=False),
        sa.Column("device_kind", sa.String(length=16), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("card", sa.String(length=255), nullable=True),
        sa.Column("candidates", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("submitted_by", sa.String(length=255), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("exit_status", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autotune_searches")),
        sa.UniqueConstraint("name", name=op.f("uq_autotune_searches_name")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_autotune_searches_idempotency_key")),
    )
    # A queue worker's question: the oldest search in a state.
    op.create_index("ix_autotune_searches_queue", "autotune_searches", ["state", "id"])
    op.create_table(
        "autotune_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autotune_tokens")),
        sa.UniqueConstraint("name", name=op.f("uq_autotune_tokens_name")),
        sa.UniqueConstraint("token_hash", name=op.f("uq_autotune_tokens_token_hash")),
    )


def downgrade() -> None:
    op.drop_table("autotune_tokens")
    op.drop_index("ix_autotune_searches_queue", table_name="autotune_searches")
    op.drop_table("autotune_searches")

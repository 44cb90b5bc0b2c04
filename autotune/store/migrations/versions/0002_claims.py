"""Claims, for several workers on one study; the study's plan, for workers that join it.

Revision ID: 0002_claims
Revises: 0001_initial
Create Date: 2026-11-21

`autotune_claims` holds one row per (study, config key): the worker probing that configuration,
its heartbeat, how many attempts it has had, and whether it is running, done or crashed. The
unique pair is what makes a configuration probed once whichever worker takes it.
`autotune_studies.plan` holds what a joining worker needs to search as the starter does.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_claims"
down_revision: str | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "autotune_claims",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("config_key", sa.String(length=64), nullable=False),
        sa.Column("worker", sa.String(length=255), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["study_id"],
            ["autotune_studies.id"],
            name=op.f("fk_autotune_claims_study_id_autotune_studies"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autotune_claims")),
        sa.UniqueConstraint("study_id", "config_key", name=op.f("uq_autotune_claims_study_id")),
    )
    # A nullable column: SQLite adds it in place (no table rebuild).
    with op.batch_alter_table("autotune_studies") as batch_op:
        batch_op.add_column(sa.Column("plan", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_studies") as batch_op:
        batch_op.drop_column("plan")
    op.drop_table("autotune_claims")

"""Tasks: a probe's task (causal-lm, seq2seq, classification, masked-lm), its seq2seq target length
and classification labels, and the parameters of the model it built.

Revision ID: 0003_tasks
Revises: 0002_claims
Create Date: 2026-11-23

Every probe stored before this revision was a causal-LM probe, so `task` is added with that as
its server default; the other columns are nullable. All are added in place (no table rebuild on
SQLite): a large probe table upgrades in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_tasks"
down_revision: str | None = "0002_claims"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("task", sa.String(length=32), server_default="causal-lm", nullable=False))
        batch_op.add_column(sa.Column("target_length", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("num_labels", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("parameters", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.drop_column("parameters")
        batch_op.drop_column("num_labels")
        batch_op.drop_column("target_length")
        batch_op.drop_column("task")

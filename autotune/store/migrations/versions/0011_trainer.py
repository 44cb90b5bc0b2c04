"""The trainer whose step each probe timed: transformers' Trainer, or TRL's SFTTrainer.

Revision ID: 0011_trainer
Revises: 0010_service
Create Date: 2026-12-01

`autotune_probes.trainer` (autotune.levers.recipes.TRAINERS): `transformers` for every row stored before,
whose probes timed Trainer's step. Added in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_trainer"
down_revision: str | None = "0010_service"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("trainer", sa.String(length=16), server_default="transformers", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.drop_column("trainer")

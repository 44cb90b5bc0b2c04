"""Whether each probe's micro-batches put their examples end to end in one row (padding-free).

Revision ID: 0014_padding_free
Revises: 0013_sampling
Create Date: 2026-12-01

`autotune_probes.padding_free` (autotune.levers.config.ProbeConfig.padding_free): false for every row
stored before, whose batches were padded (or were full rows). Added in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_padding_free"
down_revision: str | None = "0013_sampling"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("padding_free", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.drop_column("padding_free")

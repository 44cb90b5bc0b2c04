"""The example lengths each probe's timed batches were drawn from.

Revision ID: 0012_lengths
Revises: 0011_trainer
Create Date: 2026-12-01

`autotune_probes.lengths` (autotune.levers.lengths' text form: the data's example lengths as quantiles):
NULL for every row stored before, whose probes timed rows of the whole block. Added in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_lengths"
down_revision: str | None = "0011_trainer"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("lengths", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.drop_column("lengths")

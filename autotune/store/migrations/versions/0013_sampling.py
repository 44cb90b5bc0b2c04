"""How the run's sampler ordered the examples each probe's timed batches were drawn in.

Revision ID: 0013_sampling
Revises: 0012_lengths
Create Date: 2026-12-01

`autotune_probes.sampling` (autotune.levers.lengths.SAMPLINGS): `random` for every row stored before, whose
batches were drawn at random (or were full rows). Added in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_sampling"
down_revision: str | None = "0012_lengths"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("sampling", sa.String(length=20), server_default="random", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.drop_column("sampling")

"""Timing: each probe's step times and their spread; a study's confirmation of its winner.

Revision ID: 0004_timing
Revises: 0003_tasks
Create Date: 2026-11-24

`autotune_probes.step_times` (JSON list of seconds) and `step_spread` (half the interquartile range
over the median) say how steady a probe's timed window was; rows stored before have neither.
`autotune_studies.confirmation` (JSON) records the round that measured the contenders again:
margin over the runner-up, its noise, confirmed or tied. Nullable columns, added in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_timing"
down_revision: str | None = "0003_tasks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("step_spread", sa.Double(), nullable=True))
        batch_op.add_column(sa.Column("step_times", sa.JSON(), nullable=True))
    with op.batch_alter_table("autotune_studies") as batch_op:
        batch_op.add_column(sa.Column("confirmation", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_studies") as batch_op:
        batch_op.drop_column("confirmation")
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.drop_column("step_times")
        batch_op.drop_column("step_spread")

"""Speed levers: torch.compile, the CUDA allocator's setting and Liger's kernels of each probe, and
the seconds its compilation took.

Revision ID: 0006_speed_levers
Revises: 0005_recipes
Create Date: 2026-11-24

`autotune_probes.compile` and `liger` (false: what every probe stored before measured),
`allocator` (default: PYTORCH_CUDA_ALLOC_CONF unset), and `compile_seconds` (torch.compile's
one-off cost, kept apart from the timed window). TF32 needs no column: it is a precision value.
Added in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_speed_levers"
down_revision: str | None = "0005_recipes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("compile", sa.Boolean(), server_default=sa.false(), nullable=False))
        batch_op.add_column(sa.Column("allocator", sa.String(length=16), server_default="default", nullable=False))
        batch_op.add_column(sa.Column("liger", sa.Boolean(), server_default=sa.false(), nullable=False))
        batch_op.add_column(sa.Column("compile_seconds", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.drop_column("compile_seconds")
        batch_op.drop_column("liger")
        batch_op.drop_column("allocator")
        batch_op.drop_column("compile")

"""Recipe levers: the weights' dtype and PEFT adapters of each probe, and its trainable parameters.

Revision ID: 0005_recipes
Revises: 0004_timing
Create Date: 2026-11-24

`autotune_probes.weights` (fp32 master weights, or pure bf16) with a server default of fp32, what
every probe stored before measured; `peft` (the LoRA/QLoRA adapters' description, or none); and
`trainable_parameters` (fewer than `parameters` under LoRA). The optimizer had its column already.
Added in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_recipes"
down_revision: str | None = "0004_timing"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("weights", sa.String(length=16), server_default="fp32", nullable=False))
        batch_op.add_column(sa.Column("peft", sa.String(length=255), nullable=True))
        batch_op.add_column(sa.Column("trainable_parameters", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.drop_column("trainable_parameters")
        batch_op.drop_column("peft")
        batch_op.drop_column("weights")

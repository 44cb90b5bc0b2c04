"""Runs on several GPUs: the ranks and how they share the run.

Revision ID: 0009_ranks
Revises: 0008_phases
Create Date: 2026-11-25

`autotune_probes` gains the config's `gpus` (ranks on each node, one GPU each), `nodes` (machines)
and `strategy` (ddp, fsdp, fsdp-grad-op, fsdp-offload; autotune/levers/sharding.py), and what a multi-rank probe measured on each
rank: `rank_peaks` (JSON, each rank's peak allocated and reserved; the probe's peaks are the
largest). Rows written before were one-GPU probes: one rank, no strategy, which the defaults say.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_ranks"
down_revision: str | None = "0008_phases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("gpus", sa.Integer(), server_default="1", nullable=False))
        batch_op.add_column(sa.Column("strategy", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("nodes", sa.Integer(), server_default="1", nullable=False))
        batch_op.add_column(sa.Column("rank_peaks", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        for column in ("rank_peaks", "nodes", "strategy", "gpus"):
            batch_op.drop_column(column)

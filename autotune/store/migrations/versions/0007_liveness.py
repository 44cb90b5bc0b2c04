"""Liveness and load: who owns a running study or run (host:pid) and when it last beat, and the
host's load while each probe ran.

Revision ID: 0007_liveness
Revises: 0006_speed_levers
Create Date: 2026-11-25

`autotune_studies.owner` / `heartbeat_at` and `autotune_runs.owner` / `heartbeat_at`: a study or
run whose process is gone (kill -9, a full disk, a lost machine) reads as `interrupted`, never
`running` forever (autotune/store/liveness.py). `autotune_probes.host_load` (the host's one-minute
load average per core over the probe) and `gpu_processes` (other processes on its GPU, where NVML
tells): what the timing was measured beside. All nullable: rows written before carry none.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_liveness"
down_revision: str | None = "0006_speed_levers"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    for table in ("autotune_studies", "autotune_runs"):
        with op.batch_alter_table(table) as batch_op:
            batch_op.add_column(sa.Column("owner", sa.String(length=255), nullable=True))
            batch_op.add_column(sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("host_load", sa.Double(), nullable=True))
        batch_op.add_column(sa.Column("gpu_processes", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.drop_column("gpu_processes")
        batch_op.drop_column("host_load")
    for table in ("autotune_runs", "autotune_studies"):
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_column("heartbeat_at")
            batch_op.drop_column("owner")

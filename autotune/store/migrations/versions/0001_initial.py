"""Initial schema: studies, probes, runs.

Revision ID: 0001_initial
Revises: (none)
Create Date: 2026-11-21

Frozen: a database written by this revision is kept in tests/store/fixtures/autotune-0001.db.
Change the schema in a new revision, never here.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "autotune_studies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("model_reference", sa.String(length=1000), nullable=False),
        sa.Column("model_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("device_name", sa.String(length=255), nullable=False),
        sa.Column("device_total_bytes", sa.BigInteger(), nullable=True),
        sa.Column("budget_bytes", sa.BigInteger(), nullable=False),
        sa.Column("margin_bytes", sa.BigInteger(), nullable=False),
        sa.Column("effective_batch", sa.Integer(), nullable=False),
        sa.Column("space", sa.JSON(), nullable=False),
        sa.Column("env_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("environment", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autotune_studies")),
        sa.UniqueConstraint("name", name=op.f("uq_autotune_studies_name")),
    )
    op.create_table(
        "autotune_probes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=True),
        sa.Column("config_key", sa.String(length=64), nullable=False),
        # ProbeConfig
        sa.Column("model", sa.String(length=1000), nullable=False),
        sa.Column("micro_batch", sa.Integer(), nullable=False),
        sa.Column("grad_accum", sa.Integer(), nullable=False),
        sa.Column("precision", sa.String(length=16), nullable=False),
        sa.Column("checkpointing", sa.Boolean(), nullable=False),
        sa.Column("block_size", sa.Integer(), nullable=False),
        sa.Column("attention", sa.String(length=40), nullable=False),
        sa.Column("optimizer", sa.String(length=40), nullable=False),
        # ProbeResult
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("device", sa.String(length=255), nullable=False),
        sa.Column("device_total_bytes", sa.BigInteger(), nullable=True),
        sa.Column("budget_bytes", sa.BigInteger(), nullable=True),
        sa.Column("margin_bytes", sa.BigInteger(), nullable=True),
        sa.Column("cap_bytes", sa.BigInteger(), nullable=True),
        sa.Column("peak_allocated_bytes", sa.BigInteger(), nullable=True),
        sa.Column("peak_reserved_bytes", sa.BigInteger(), nullable=True),
        sa.Column("context_bytes", sa.BigInteger(), nullable=True),
        sa.Column("step_seconds", sa.Double(), nullable=True),
        sa.Column("tokens_per_s", sa.Double(), nullable=True),
        sa.Column("samples_per_s", sa.Double(), nullable=True),
        sa.Column("mfu", sa.Double(), nullable=True),
        sa.Column("first_loss", sa.Double(), nullable=True),
        sa.Column("last_loss", sa.Double(), nullable=True),
        sa.Column("warmup_steps", sa.Integer(), nullable=True),
        sa.Column("measured_steps", sa.Integer(), nullable=True),
        sa.Column("startup_seconds", sa.Double(), nullable=True),
        sa.Column("build_seconds", sa.Double(), nullable=True),
        sa.Column("measured_seconds", sa.Double(), nullable=True),
        sa.Column("wall_seconds", sa.Double(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        # Bookkeeping
        sa.Column("cacheable", sa.Boolean(), nullable=False),
        sa.Column("predicted_peak_bytes", sa.BigInteger(), nullable=True),
        sa.Column("worker", sa.String(length=255), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("env_fingerprint", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(
            ["study_id"],
            ["autotune_studies.id"],
            name=op.f("fk_autotune_probes_study_id_autotune_studies"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autotune_probes")),
    )
    op.create_index("ix_autotune_probes_leaderboard", "autotune_probes", ["study_id", "status", "tokens_per_s"])
    op.create_index("ix_autotune_probes_cache", "autotune_probes", ["config_key", "env_fingerprint"])
    op.create_table(
        "autotune_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("study_id", sa.Integer(), nullable=True),
        sa.Column("probe_id", sa.Integer(), nullable=True),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("output_dir", sa.String(length=4096), nullable=True),
        sa.Column("dataset", sa.String(length=4096), nullable=True),
        sa.Column("steps", sa.Integer(), nullable=True),
        sa.Column("tokens_per_s", sa.Double(), nullable=True),
        sa.Column("peak_allocated_bytes", sa.BigInteger(), nullable=True),
        sa.Column("peak_reserved_bytes", sa.BigInteger(), nullable=True),
        sa.Column("final_loss", sa.Double(), nullable=True),
        sa.Column("summary", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["probe_id"],
            ["autotune_probes.id"],
            name=op.f("fk_autotune_runs_probe_id_autotune_probes"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["study_id"],
            ["autotune_studies.id"],
            name=op.f("fk_autotune_runs_study_id_autotune_studies"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_autotune_runs")),
    )
    op.create_index(op.f("ix_autotune_runs_study_id"), "autotune_runs", ["study_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_autotune_runs_study_id"), table_name="autotune_runs")
    op.drop_table("autotune_runs")
    op.drop_index("ix_autotune_probes_cache", table_name="autotune_probes")
    op.drop_index("ix_autotune_probes_leaderboard", table_name="autotune_probes")
    op.drop_table("autotune_probes")
    op.drop_table("autotune_studies")

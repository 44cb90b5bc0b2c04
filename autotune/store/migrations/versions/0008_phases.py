"""The run's phases after the training step: evaluation and generation.

Revision ID: 0008_phases
Revises: 0007_liveness
Create Date: 2026-11-25

`autotune_probes` gains the recipe of the run's evaluation (autotune/levers/evaluation.py: `eval_batch`,
`auto_eval_batch`, `eval_logits`, `eval_accumulation_steps`, `generation_max_length`, `generation_num_beams`) and
what the probe measured of it: `phase_peaks` (each phase's peak allocated and reserved, JSON) and
`failed_phase` (the phase that ran out of memory or failed), and `eval_batch_found` (with
`--eval-batch auto`, the largest eval batch that fitted). Rows written before were probes of the
training phase only: no eval batch, loss-only, one beam, which the server defaults say.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_phases"
down_revision: str | None = "0007_liveness"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        batch_op.add_column(sa.Column("eval_batch", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("auto_eval_batch", sa.Boolean(), server_default=sa.false(), nullable=False))
        batch_op.add_column(sa.Column("eval_logits", sa.String(length=16), server_default="loss-only", nullable=False))
        batch_op.add_column(sa.Column("eval_accumulation_steps", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("generation_max_length", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("generation_num_beams", sa.Integer(), server_default="1", nullable=False))
        batch_op.add_column(sa.Column("phase_peaks", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("failed_phase", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("eval_batch_found", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("autotune_probes") as batch_op:
        for column in (
            "eval_batch_found",
            "failed_phase",
            "phase_peaks",
            "generation_num_beams",
            "generation_max_length",
            "eval_accumulation_steps",
            "eval_logits",
            "auto_eval_batch",
            "eval_batch",
        ):
            batch_op.drop_column(column)

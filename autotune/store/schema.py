"""The results database's tables, as SQLAlchemy 2.0 typed models.

These models describe the schema at SCHEMA_REVISION. A new database gets it in one step
(migrate.create_schema: these tables and the version row); an older one is changed by Alembic's
scripts (`autotune/store/migrations/`). Never call `metadata.create_all` anywhere else: a table made
without the version row has no revision, and the next upgrade would fail on it. A change here
needs a new revision in `autotune/store/migrations/versions/` (and SCHEMA_REVISION moved to it); the schema tests
(autogenerate finds no differences after the scripts run, and the scripts and create_schema make
the same tables) fail until there is one.

Every table carries the `autotune_` prefix so that Optuna's RDB storage (`studies`, `trials`,
`version_info`, `alembic_version`, ...) can live in the same database.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

TABLE_PREFIX = "autotune_"
VERSION_TABLE = "autotune_alembic_version"
# The revision this code writes and reads. A test checks it is Alembic's head, so reading a
# database already at this revision needs no Alembic import (start-up time of read commands).
SCHEMA_REVISION = "0015_workers"

# Deterministic constraint names: batch migrations on SQLite (which rebuild tables) and drops on
# PostgreSQL need to name constraints, and unnamed ones get backend-chosen names.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Timestamps stored in UTC and read back timezone-aware.

    SQLite keeps no zone and hands back naive values; PostgreSQL's `timestamptz` hands back aware
    ones. Normalising here means callers compare and print one kind of datetime on every backend.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to the results store; use datetime.now(timezone.utc)")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        int: Integer(),
        float: Double(),
        str: String(255),
        bool: Boolean(),
        datetime: UTCDateTime(),
        dict[str, Any]: JSON(),
    }


# Byte counts exceed 2**31 on any GPU: every *_bytes column is a BIGINT.
Bytes = BigInteger


class Study(Base):
    """One search: a model on a device under a budget. Probes and runs hang off it."""

    __tablename__ = "autotune_studies"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    model_reference: Mapped[str] = mapped_column(String(1000))
    model_fingerprint: Mapped[str] = mapped_column(String(64))
    device_name: Mapped[str]
    device_total_bytes: Mapped[int | None] = mapped_column(Bytes)
    budget_bytes: Mapped[int] = mapped_column(Bytes)
    margin_bytes: Mapped[int] = mapped_column(Bytes)
    effective_batch: Mapped[int]
    space: Mapped[dict[str, Any]]
    env_fingerprint: Mapped[str] = mapped_column(String(64))
    environment: Mapped[dict[str, Any]]
    # running | finished | interrupted. Checked in Python, not by a CHECK constraint, so that a new
    # status needs no table rebuild on SQLite.
    status: Mapped[str] = mapped_column(String(20))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    # What a worker joining from another process or machine needs to search as the starter does:
    # the strategy, how probes run, the heartbeat period, the memory predictions (0002_claims).
    plan: Mapped[dict[str, Any] | None]
    # How the winner was told apart from the runner-up, after the confirmation round (0004_timing).
    confirmation: Mapped[dict[str, Any] | None]
    # The process searching it (host:pid) and when it last beat: a running study whose process is
    # gone reads as interrupted (0007_liveness; autotune/store/liveness.py).
    owner: Mapped[str | None] = mapped_column(String(255))
    heartbeat_at: Mapped[datetime | None]


class Probe(Base):
    """One short training probe of one ProbeConfig, and what it measured (a ProbeResult)."""

    __tablename__ = "autotune_probes"
    __table_args__ = (
        # The leaderboard: ok probes of one study by throughput.
        Index("ix_autotune_probes_leaderboard", "study_id", "status", "tokens_per_s"),
        # The cache: the same config on the same environment.
        Index("ix_autotune_probes_cache", "config_key", "env_fingerprint"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    # No separate index on study_id: the leaderboard index leads with it.
    study_id: Mapped[int] = mapped_column(ForeignKey("autotune_studies.id", ondelete="CASCADE"))
    trial_number: Mapped[int | None]
    config_key: Mapped[str] = mapped_column(String(64))
    # ProbeConfig, one column per field.
    model: Mapped[str] = mapped_column(String(1000))
    micro_batch: Mapped[int]
    grad_accum: Mapped[int]
    precision: Mapped[str] = mapped_column(String(16))
    checkpointing: Mapped[bool]
    block_size: Mapped[int]
    attention: Mapped[str] = mapped_column(String(40))
    optimizer: Mapped[str] = mapped_column(String(40))
    # Rows written before 0003_tasks were all causal-LM probes: the server default says so.
    task: Mapped[str] = mapped_column(String(32), server_default="causal-lm")
    target_length: Mapped[int | None]
    num_labels: Mapped[int | None]
    weights: Mapped[str] = mapped_column(String(16), server_default="fp32")
    peft: Mapped[str | None] = mapped_column(String(255))
    # Whose step the probe timed (0011_trainer); rows before it timed transformers' Trainer's.
    trainer: Mapped[str] = mapped_column(String(16), server_default="transformers")
    # The data's example lengths the timed batches were drawn from (0012_lengths; autotune.levers.lengths).
    lengths: Mapped[str | None] = mapped_column(Text)
    sampling: Mapped[str] = mapped_column(String(20), server_default="random")  # (0013_sampling: the run's sampler)
    padding_free: Mapped[bool] = mapped_column(server_default=false())  # (0014_padding_free: rows end to end)
    # Speed levers (0006_speed_levers); rows before them ran without any.
    compile: Mapped[bool] = mapped_column(server_default=false())
    allocator: Mapped[str] = mapped_column(String(16), server_default="default")
    liger: Mapped[bool] = mapped_column(server_default=false())
    # How the run evaluates (0008_phases); rows before it ran the training phase only.
    eval_batch: Mapped[int | None]
    auto_eval_batch: Mapped[bool] = mapped_column(server_default=false())
    eval_logits: Mapped[str] = mapped_column(String(16), server_default="loss-only")
    eval_accumulation_steps: Mapped[int | None]
    generation_max_length: Mapped[int | None]
    generation_num_beams: Mapped[int] = mapped_column(server_default="1")
    # Ranks and how they share the run (0009_ranks); rows before it ran on one GPU.
    gpus: Mapped[int] = mapped_column(server_default="1")
    strategy: Mapped[str | None] = mapped_column(String(16))
    nodes: Mapped[int] = mapped_column(server_default="1")
    # ProbeResult, one column per field.
    status: Mapped[str] = mapped_column(String(16))
    device: Mapped[str] = mapped_column(String(255))
    device_total_bytes: Mapped[int | None] = mapped_column(Bytes)
    budget_bytes: Mapped[int | None] = mapped_column(Bytes)
    margin_bytes: Mapped[int | None] = mapped_column(Bytes)
    cap_bytes: Mapped[int | None] = mapped_column(Bytes)
    peak_allocated_bytes: Mapped[int | None] = mapped_column(Bytes)
    peak_reserved_bytes: Mapped[int | None] = mapped_column(Bytes)
    context_bytes: Mapped[int | None] = mapped_column(Bytes)
    step_seconds: Mapped[float | None]
    step_spread: Mapped[float | None]  # 0004_timing: the window's relative spread
    step_times: Mapped[list[float] | None] = mapped_column(JSON)  # 0004_timing: each timed step
    tokens_per_s: Mapped[float | None]
    samples_per_s: Mapped[float | None]
    mfu: Mapped[float | None]
    first_loss: Mapped[float | None]
    last_loss: Mapped[float | None]
    warmup_steps: Mapped[int | None]
    measured_steps: Mapped[int | None]
    # Process start and imports before the model build. Not yet a ProbeResult field when this
    # column was added; the probe runner measures it (issue 2), so the column is ready for it.
    startup_seconds: Mapped[float | None]
    build_seconds: Mapped[float | None]
    compile_seconds: Mapped[float | None]  # 0006_speed_levers
    measured_seconds: Mapped[float | None]
    wall_seconds: Mapped[float | None]
    host_load: Mapped[float | None]  # 0007_liveness: load average per core over the probe
    gpu_processes: Mapped[int | None]  # 0007_liveness: other processes on its GPU (NVML)
    phase_peaks: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # 0008_phases: each phase's peaks
    failed_phase: Mapped[str | None] = mapped_column(String(16))  # 0008_phases
    eval_batch_found: Mapped[int | None]  # 0008_phases: --eval-batch auto's pick
    rank_peaks: Mapped[list[dict[str, int]] | None] = mapped_column(JSON)  # 0009_ranks: each rank's peaks
    error: Mapped[str | None] = mapped_column(Text)
    parameters: Mapped[int | None] = mapped_column(BigInteger)
    trainable_parameters: Mapped[int | None] = mapped_column(BigInteger)
    # Whether another search may reuse this outcome instead of probing again (see Store.find_cached).
    cacheable: Mapped[bool]
    predicted_peak_bytes: Mapped[int | None] = mapped_column(Bytes)
    worker: Mapped[str | None] = mapped_column(String(255))
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime]
    env_fingerprint: Mapped[str] = mapped_column(String(64))


class Run(Base):
    """One full fine-tune, usually of the configuration a study chose."""

    __tablename__ = "autotune_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    # A run outlives the study or probe that chose it: deleting those keeps the run's own record.
    study_id: Mapped[int | None] = mapped_column(ForeignKey("autotune_studies.id", ondelete="SET NULL"), index=True)
    probe_id: Mapped[int | None] = mapped_column(ForeignKey("autotune_probes.id", ondelete="SET NULL"))
    config: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(20))  # running | finished | failed | interrupted
    output_dir: Mapped[str | None] = mapped_column(String(4096))
    dataset: Mapped[str | None] = mapped_column(String(4096))
    steps: Mapped[int | None]
    tokens_per_s: Mapped[float | None]
    peak_allocated_bytes: Mapped[int | None] = mapped_column(Bytes)
    peak_reserved_bytes: Mapped[int | None] = mapped_column(Bytes)
    final_loss: Mapped[float | None]
    summary: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime]
    finished_at: Mapped[datetime | None]
    owner: Mapped[str | None] = mapped_column(String(255))  # 0007_liveness: the training process, host:pid
    heartbeat_at: Mapped[datetime | None]


class Claim(Base):
    """Which worker is probing, or has settled, one configuration of a study (0002_claims).

    The unique (study, config key) pair is what makes every configuration of a study settled once,
    whichever worker takes it: a claim is an INSERT that loses on the constraint, or a conditional
    UPDATE that takes over a claim whose worker stopped heartbeating. Skipped and reused configs
    are claimed too (attempts 0), so that their rows are written once as well. One key is no
    configuration's: `confirmation-round` (store/claims.py, ROUND_KEY), held by the worker that runs
    the study's confirmation round, and deleted when it ends.
    """

    __tablename__ = "autotune_claims"
    # Leads with study_id: it also serves reading a study's claims.
    __table_args__ = (UniqueConstraint("study_id", "config_key"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    study_id: Mapped[int] = mapped_column(ForeignKey("autotune_studies.id", ondelete="CASCADE"))
    config_key: Mapped[str] = mapped_column(String(64))
    worker: Mapped[str]
    # running | done | crashed. Checked in Python, as the study status is.
    state: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int]  # probes started for this config: 0 for skipped or reused ones
    claimed_at: Mapped[datetime]
    heartbeat_at: Mapped[datetime]


class Search(Base):
    """A search submitted to the service (0010_service), queued until a worker takes it. Its study,
    once a worker starts it, is the `Study` of the same name."""

    __tablename__ = "autotune_searches"
    __table_args__ = (Index("ix_autotune_searches_queue", "state", "id"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    # The `autotune search` arguments the request stands for (autotune/service/submissions.py).
    arguments: Mapped[list[str]] = mapped_column(JSON)
    request_hash: Mapped[str] = mapped_column(String(64))  # the same request again: the same search
    idempotency_key: Mapped[str | None] = mapped_column(unique=True)
    # What a worker needs to serve it (autotune/search/queue_worker.py).
    model: Mapped[str] = mapped_column(String(1000))
    budget_bytes: Mapped[int] = mapped_column(Bytes)
    device_kind: Mapped[str] = mapped_column(String(16))  # cuda | cpu
    gpus: Mapped[int]  # ranks of each probe
    card: Mapped[str | None]  # a card's name the worker's device must carry
    candidates: Mapped[int]
    # queued | running | finished | interrupted | failed | cancelled (autotune.vocabulary.status.SearchState)
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    cancel_requested: Mapped[bool] = mapped_column(server_default=false())
    submitted_by: Mapped[str | None]  # the token's name
    worker: Mapped[str | None]  # host:pid of the queue worker holding it
    attempts: Mapped[int] = mapped_column(server_default="0")  # times a worker took it
    exit_status: Mapped[int | None]
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]


class QueueWorkerRow(Base):
    """A queue worker connected to the service's database (0015_workers): what it can serve and
    when it was last heard (autotune/store/workers.py)."""

    __tablename__ = "autotune_workers"

    id: Mapped[int] = mapped_column(primary_key=True)
    label: Mapped[str] = mapped_column(String(255), unique=True)  # host:pid
    device_kind: Mapped[str] = mapped_column(String(16))  # cuda | cpu
    device_name: Mapped[str] = mapped_column(String(255))
    total_bytes: Mapped[int | None] = mapped_column(Bytes)
    ranks: Mapped[int]
    started_at: Mapped[datetime]
    seen_at: Mapped[datetime]


class Token(Base):
    """A bearer token of the service (0010_service): only its SHA-256 hash is kept."""

    __tablename__ = "autotune_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime]
    revoked_at: Mapped[datetime | None]

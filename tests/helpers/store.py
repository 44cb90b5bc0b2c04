"""Small builders of stored records: a study, a probe's config and result, a leaderboard row, a winner."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autotune.levers.config import ProbeConfig
from autotune.host.environment import Environment
from autotune.results.probe_result import ProbeResult
from autotune.handoff import BestConfig
from autotune.store import LeaderboardRow, Store, StudyRecord

GiB = 2**30
ENV = Environment(
    "cuda",
    "NVIDIA H100 80GB HBM3",
    80 * GiB,
    cuda_version="12.8",
    driver_version="570.86",
    torch_version="2.13.0",
    transformers_version="5.23.0",
)


@dataclass(frozen=True)
class FakeModel:
    reference: str = "gpt2"
    fingerprint: str = "31d84ffb8ce5f836"

    @property
    def recorded(self) -> str:
        return self.reference


def make_study(
    store: Store,
    name: str = "s1",
    *,
    model: FakeModel = FakeModel(),
    budget: int = 8 * GiB,
    margin: int = GiB // 4,
    environment: Environment = ENV,
) -> StudyRecord:
    return store.get_or_create_study(
        name,
        model=model,
        environment=environment,
        budget_bytes=budget,
        margin_bytes=margin,
        effective_batch=32,
        space={"micro_batch": [1, 2, 4, 8]},
    )


def config(micro_batch: int = 4, **changes: object) -> ProbeConfig:
    values: dict = {"model": "gpt2", "micro_batch": micro_batch, "block_size": 512, "grad_accum": 32 // micro_batch}
    values.update(changes)
    return ProbeConfig(**values)


def result(
    status: str = "ok", tokens_per_s: float | None = 1000.0, peak: int | None = 4 * GiB, **changes: object
) -> ProbeResult:
    fits = status == "ok"
    values: dict = {
        "status": status,
        "device": ENV.device_name,
        "device_total_bytes": ENV.device_total_bytes,
        "budget_bytes": 8 * GiB,
        "margin_bytes": GiB // 4,
        "peak_reserved_bytes": peak,
        "peak_allocated_bytes": None if peak is None else peak - GiB // 2,
        "tokens_per_s": tokens_per_s if fits else None,
        "step_seconds": 16384 / tokens_per_s if fits and tokens_per_s else None,
        "wall_seconds": 12.5,
    }
    values.update(changes)
    return ProbeResult(**values)


def leaderboard_row(config: ProbeConfig) -> LeaderboardRow:
    return LeaderboardRow(
        rank=1,
        study="s",
        probe_id=1,
        trial_number=None,
        config=config,
        config_key="k",
        status="ok",
        tokens_per_s=1.0,
        step_seconds=1.0,
        samples_per_s=1.0,
        mfu=None,
        peak_allocated_bytes=1,
        peak_reserved_bytes=1,
        context_bytes=0,
        budget_bytes=2**30,
        margin_bytes=0,
    )


def best_of(config: ProbeConfig, device_type: str = "cuda", confirmation: dict | None = None, **row) -> BestConfig:
    return BestConfig(dataclasses.replace(leaderboard_row(config), **row), device_type, confirmation)


def built_by_the_scripts(url: str) -> None:
    """An empty database brought to the head by Alembic's migration scripts, one after another
    (the product creates a new database in one step instead: migrate.create_schema)."""
    from alembic import command
    from sqlalchemy.engine import make_url

    from autotune.store.engine import make_engine, writer
    from autotune.store.migrate import alembic_config

    engine = make_engine(make_url(url), foreign_keys=False)
    try:
        with writer(engine).begin() as connection:
            command.upgrade(alembic_config(connection), "head")
    finally:
        engine.dispose()


def schema_of(url: str) -> dict:
    """Our tables as the database itself describes them: each column's type, nullability and
    default, and the keys, foreign keys, indexes and unique constraints (column order aside: the
    scripts add columns at the end)."""
    from sqlalchemy import create_engine, inspect

    from autotune.store.schema import TABLE_PREFIX

    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            look = inspect(connection)

            def named(items):
                return sorted(repr(sorted(item.items(), key=lambda kv: kv[0])) for item in items)

            return {
                table: {
                    "columns": {
                        c["name"]: (str(c["type"]), c["nullable"], c.get("default")) for c in look.get_columns(table)
                    },
                    "primary_key": look.get_pk_constraint(table),
                    "foreign_keys": named(look.get_foreign_keys(table)),
                    "indexes": named(look.get_indexes(table)),
                    "unique": named(look.get_unique_constraints(table)),
                }
                for table in sorted(look.get_table_names())
                if table.startswith(TABLE_PREFIX)
            }
    finally:
        engine.dispose()

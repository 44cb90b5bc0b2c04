"""What autogenerate looks at: our tables only.

Optuna's RDB storage may share the database (`studies`, `trials`, `trial_*`, `study_*`,
`version_info`, and Optuna's own `alembic_version`). Those are Optuna's to migrate; without this
filter autogenerate would propose dropping them. Every table of ours carries the `autotune_` prefix,
so the filter keeps exactly those (our version table is excluded by Alembic itself).
"""

from __future__ import annotations

from typing import Any

TABLE_PREFIX = "autotune_"


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Reflect only our tables (and only in the default schema of a server database)."""
    if type_ == "schema":
        return name is None
    if type_ == "table":
        return name is not None and name.startswith(TABLE_PREFIX)
    return True


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Compare only our tables and what belongs to them (indexes, columns, constraints)."""
    if type_ == "table":
        return name is not None and name.startswith(TABLE_PREFIX)
    table = getattr(obj, "table", None)
    if table is not None:
        return str(table.name).startswith(TABLE_PREFIX)
    return True

"""A results database that is not whole: a table or column of this schema revision missing (dropped
by hand, a half-copied file), or a stored value that is not the JSON its column holds (edited by
hand, a torn write by another tool). Each is told in one line naming what is wrong where, instead of
a traceback from deep in a query."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import JSON, Connection, Text, inspect, literal_column, select, text
from sqlalchemy.orm import Session

from autotune.vocabulary.errors import DatabaseError
from autotune.store.schema import Base, Study

__all__ = ["DamagedValue", "check_tables", "find_damaged_json"]


def check_tables(connection: Connection, where: str, revision: str) -> None:
    """DatabaseError naming the first of this schema's tables or columns the database lacks: a
    database whose revision says it has them all, and does not, fails every query on them."""
    inspector = inspect(connection)
    present = set(inspector.get_table_names())
    for table in Base.metadata.sorted_tables:
        if table.name not in present:
            raise DatabaseError(
                f"the results database {where} is damaged: it has no table {table.name}, which its "
                f"schema revision {revision!r} has; restore the file from a backup, or pass --db "
                f"with another database."
            )
        columns = {column["name"] for column in inspector.get_columns(table.name)}
        missing = [column.name for column in table.columns if column.name not in columns]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise DatabaseError(
                f"the results database {where} is damaged: table {table.name} has no column "
                f"{missing[0]}{more}, which its schema revision {revision!r} has; restore the file "
                f"from a backup, or pass --db with another database."
            )


@dataclass(frozen=True, slots=True)
class DamagedValue:
    """A row whose JSON column holds something that is not JSON."""

    table: str
    row_id: int
    column: str
    study: str | None
    value: str
    nullable: bool

    def describe(self) -> str:
        if self.table == Study.__tablename__:
            where = f"study {self.study!r} ({self.table} id {self.row_id})"
        else:
            kind = self.table.removeprefix("autotune_").removesuffix("s")
            owner = f"study {self.study!r}, " if self.study is not None else ""
            where = f"{owner}{kind} id {self.row_id} ({self.table})"
        return f"{where}: its {self.column} is not JSON ({self.value!r})"

    def remedy(self) -> str:
        fix = "NULL" if self.nullable else "'{}'"
        return (
            f"repair it (e.g. UPDATE {self.table} SET {self.column} = {fix} WHERE id = {self.row_id}), or delete "
            f"that row, or restore the file from a backup."
        )


def find_damaged_json(session: Session) -> DamagedValue | None:
    """The first row of our tables whose JSON column does not hold JSON, or None. Only SQLite can
    hold such a value (PostgreSQL checks JSON on the way in), and it can find one itself
    (json_valid), without reading every row into Python."""
    if session.get_bind().dialect.name != "sqlite":
        return None
    for table in Base.metadata.sorted_tables:
        for column in table.columns:
            if not isinstance(column.type, JSON):
                continue
            study = Study.__table__
            # Read as text: the JSON type would try to parse it, and fail again.
            raw = literal_column(f"CAST({table.name}.{column.name} AS TEXT)", type_=Text())
            if table is study or "study_id" not in table.c:  # (the queue's searches carry their study's name)
                query = select(table.c.id, table.c.name, raw)
            else:
                query = (
                    select(table.c.id, study.c.name, raw)
                    .select_from(table)
                    .outerjoin(study, study.c.id == table.c.study_id)
                )
            stored = f"{table.name}.{column.name}"
            row = session.execute(
                query.where(text(f"{stored} IS NOT NULL AND NOT json_valid({stored})")).order_by(table.c.id).limit(1)
            ).first()
            if row is not None:
                value = row[2] if row[2] is not None else ""
                shown = value if len(value) <= 40 else value[:40] + "..."
                return DamagedValue(table.name, int(row[0]), column.name, row[1], shown, bool(column.nullable))
    return None

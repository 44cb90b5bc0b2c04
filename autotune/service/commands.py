"""A request's body read as a command's flags: what `POST /v1/searches`, `/v1/plan` and `/v1/estimate`
take is the table of `autotune search`'s, `plan`'s and `estimate`'s flags (autotune/flags/table.py),
the same rows the command line is made of. Each field is a flag's long name with '_' for '-' (`gpu_budget` for --gpu-budget), its
value a string, a number, a list (joined with commas, as the flag takes it) or, for a switch, true or
false. The body becomes the command's arguments, which click parses with the command's own types
and checks, so a request the command line would refuse is refused with the command line's line.
The arguments are also what is stored, and what a worker runs. A flag the service does not take says
why in its row (`closed`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import click

from autotune.vocabulary.errors import quoted
from autotune.flags.flag import Flag, parse, reading_command, refusal_line
from autotune.flags.table import REQUESTS

# A value longer than this is no flag's; a list longer than this no space's.
MAX_VALUE_CHARS = 4096
MAX_LIST_ITEMS = 256


class RequestRefused(Exception):
    """A request the service will not act on: `status` (422 a mistake in it, 403 a field the
    operator has not allowed) and one line saying what to change."""

    def __init__(self, message: str, status: int = 422) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class CommandRequest:
    """A body read as a command's flags: the arguments (canonical: the command's order, so the
    same request in any key order reads the same) and click's values of them."""

    arguments: tuple[str, ...]
    params: dict[str, Any]


def fields(rows: Sequence[Flag]) -> dict[str, Flag]:
    """The fields a body may give: the rows the service takes, in the command's order."""
    return {row.name: row for row in rows if row.closed is None}


def closed_fields(rows: Sequence[Flag]) -> dict[str, str]:
    """The fields the service does not take, each with why."""
    return {row.name: row.closed for row in rows if row.closed is not None}


def read_request(
    name: str, body: object, *, own: frozenset[str] = frozenset(), closed: Mapping[str, str] | None = None
) -> tuple[CommandRequest, dict[str, Any]]:
    """`body` as `autotune name`'s flags (REQUESTS[name]), parsed as the command line parses them.
    Fields the table closes are refused with why (403), as are those `closed` adds; `own`: fields
    that are the service's, not the command's, returned apart."""
    rows = REQUESTS[name]
    closed = {**closed_fields(rows), **(closed or {})}
    taken = {key: row for key, row in fields(rows).items() if key not in closed}
    if not isinstance(body, Mapping):
        raise RequestRefused(
            f"the request body must be a JSON object of `autotune {name}`'s flags "
            f'(e.g. {{"model": "gpt2", "gpu_budget": "8GiB"}}).'
        )
    extra = {}
    for key in body:
        if not isinstance(key, str):
            raise RequestRefused("the request body's keys must be strings")
        if key in own:
            extra[key] = body[key]
        elif key in closed:
            raise RequestRefused(f"field {key!r} is not taken by this service: {closed[key]}", status=403)
        elif key not in taken:
            raise RequestRefused(
                f"unknown field {quoted(key)}: `autotune {name}` has no --{key.replace('_', '-')} "
                f"(the fields are its flags: {', '.join(sorted(taken))})."
            )
    arguments: list[str] = []
    for key, row in taken.items():  # (the command's order)
        if key in body and body[key] is not None and key not in own:
            arguments += _flag_arguments(key, row, body[key])
    try:
        params = parse(reading_command(name, list(taken.values())), arguments)
    except click.ClickException as exc:
        raise RequestRefused(refusal_line(exc)) from None
    return CommandRequest(tuple(arguments), params), extra


def _flag_arguments(name: str, row: Flag, value: object) -> list[str]:
    if row.switch or row.negatable:
        if not isinstance(value, bool):
            raise RequestRefused(f"field {name!r} is a switch: give true or false (got {quoted(value)}).")
        if value:
            return [row.spelled]
        return [f"--no-{row.spelled[2:]}"] if row.negatable else []
    return [f"{row.spelled}={_text(name, value)}"]


def _text(name: str, value: object) -> str:
    """A value as the flag takes it: a list joined with commas, a number as written."""
    if isinstance(value, list):
        if not value or len(value) > MAX_LIST_ITEMS:
            raise RequestRefused(f"field {name!r}: give 1 to {MAX_LIST_ITEMS} values (got {len(value)}).")
        return ",".join(_scalar(name, item) for item in value)
    return _scalar(name, value)


def _scalar(name: str, value: object) -> str:
    if isinstance(value, bool):
        raise RequestRefused(f"field {name!r} takes a value, not true or false.")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestRefused(f"field {name!r}: {value} is not a finite number.")
    if not isinstance(value, (str, int, float)):
        raise RequestRefused(
            f"field {name!r}: give a string, a number or a list of them (got a {type(value).__name__})."
        )
    text = str(value)
    if len(text) > MAX_VALUE_CHARS:
        raise RequestRefused(
            f"field {name!r}: a value of {len(text):,} characters is no flag's (at most {MAX_VALUE_CHARS})."
        )
    if "\x00" in text:
        raise RequestRefused(f"field {name!r}: a value may not hold a NUL character.")
    return text

"""A request's body read as a command's flags: the one definition of what `POST /v1/searches`,
`/v1/plan` and `/v1/estimate` take is the command line's own (`autotune search`, `plan`,
`estimate`). Each field is a flag's long name with '_' for '-' (`gpu_budget` for --gpu-budget), its
value a string, a number, a list (joined with commas, as the flag takes it) or, for a switch, true or
false. The body becomes the command's arguments, which click parses with the command's own types
and checks, so a request the command line would refuse is refused with the command line's line.
The arguments are also what is stored, and what a worker runs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import click

from autotune.errors import quoted

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


def command(name: str) -> click.Command:
    """The command line's command a route reads its body as (from its own module: the `autotune.cli`
    package, which registers `serve`, is not imported by the service)."""
    if name == "search":
        from autotune.cli.search import search

        return search
    if name == "plan":
        from autotune.cli.plan import plan

        return plan
    if name == "estimate":
        from autotune.cli.measure import estimate

        return estimate
    raise ValueError(f"no such command: {name}")


def field_name(param: click.Parameter) -> str:
    """--gpu-budget -> gpu_budget: the field a body gives a flag as."""
    return max(param.opts, key=len).lstrip("-").replace("-", "_")


def command_fields(command: click.Command, closed: Mapping[str, str]) -> dict[str, click.Option]:
    """The fields a body may give for `command`: its options, less those `closed` names."""
    return {field_name(p): p for p in command.params if isinstance(p, click.Option) and field_name(p) not in closed}


def read_request(
    command: click.Command, body: object, *, closed: Mapping[str, str], own: frozenset[str] = frozenset()
) -> tuple[CommandRequest, dict[str, Any]]:
    """`body` as `command`'s flags, parsed by click. `closed`: fields the service does not take,
    each with why (403). `own`: fields that are the service's, not the command's; returned apart."""
    if not isinstance(body, Mapping):
        raise RequestRefused(
            f"the request body must be a JSON object of `autotune {command.name}`'s flags "
            f'(e.g. {{"model": "gpt2", "gpu_budget": "8GiB"}}).'
        )
    fields = command_fields(command, closed)
    extra = {}
    for key in body:
        if not isinstance(key, str):
            raise RequestRefused("the request body's keys must be strings")
        if key in own:
            extra[key] = body[key]
        elif key in closed:
            raise RequestRefused(f"field {key!r} is not taken by this service: {closed[key]}", status=403)
        elif key not in fields:
            raise RequestRefused(
                f"unknown field {quoted(key)}: `autotune {command.name}` has no --{key.replace('_', '-')} "
                f"(the fields are its flags: {', '.join(sorted(fields))})."
            )
    arguments: list[str] = []
    for name, param in fields.items():  # (the command's order)
        if name in body and body[name] is not None and name not in own:
            arguments += _flag_arguments(name, param, body[name])
    from autotune.cli.app import cli, usage_message

    # With the group's own context settings, as the command line has them: click caches each
    # command's help option from the first context that asks, and one made without them would leave
    # `--help` without its `-h` for the rest of the process (the command reference among it).
    parent = click.Context(cli, info_name="autotune", **cli.context_settings)
    try:
        context = command.make_context(command.name, list(arguments), parent=parent)
    except click.UsageError as exc:
        raise RequestRefused(usage_message(exc)) from None
    except click.ClickException as exc:
        raise RequestRefused(exc.format_message()) from None
    return CommandRequest(tuple(arguments), dict(context.params)), extra


def _flag_arguments(name: str, param: click.Option, value: object) -> list[str]:
    flag = max(param.opts, key=len)
    if param.is_flag:
        if not isinstance(value, bool):
            raise RequestRefused(f"field {name!r} is a switch: give true or false (got {quoted(value)}).")
        if value:
            return [flag]
        return [max(param.secondary_opts, key=len)] if param.secondary_opts else []
    return [f"{flag}={_text(name, value)}"]


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

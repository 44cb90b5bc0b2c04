"""One flag, as one row: its name, the kind of value it takes, its default, its help, what part of a
request it is (`Part`) and, where the service does not take it, why. Both doors derive from rows:
`options(rows)` decorates a command line command with them; `reading_command(name, rows)` makes the
command the service parses a request's body with (autotune/service/commands.py). Neither door spells
a flag again, so a flag added to a table is on the command line, in the service's fields and in
their refusals at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import click


NOT_GIVEN: Any = object()


class Part(StrEnum):
    """What a flag says about a request: what is searched, or how and where it runs."""

    WHAT = "what"  # the model and the memory to fit in
    SPACE = "space"  # the levers searched and the recipe kept (SearchSpace.build's arguments)
    PROBE = "probe"  # how each probe runs (ProbeSettings)
    SEARCH = "search"  # how the search goes and stops (SearchOptions)
    LAUNCH = "launch"  # where and how the workers start, or where the recipe is read from
    OUTPUT = "output"  # where the answer goes (the database, JSON)
    COMMAND = "command"  # a command's own flag (plan's --top, estimate's --device-type)


@dataclass(frozen=True, slots=True)
class Flag:
    """A flag. `name` is its long name with '_' for '-' (gpu_budget is --gpu-budget), which is also
    the field a request to the service gives it as; `param` is the Python name the command receives
    where that is not `name` (a keyword such as `from`, or a name another flag of the command has)."""

    name: str
    help: str
    part: Part = Part.SPACE
    type: Any = None
    default: Any = NOT_GIVEN  # (click's own where not given: False for a switch)
    show_default: bool = False
    required: bool = False
    switch: bool = False  # takes no value: --fresh
    negatable: bool = False  # --predict/--no-predict
    multiple: bool = False
    metavar: str | None = None
    param: str | None = None
    callback: Callable[[Any], Any] | None = None  # the value, checked further (raises click.UsageError)
    closed: str | None = None  # why the service does not take it (403), where it does not
    # It names something the command reads (a model, a data set, a tokenizer): the service lets a
    # client name only what its operator allows (service/submissions.py ServicePolicy.named).
    reads: bool = False

    @property
    def spelled(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def python_name(self) -> str:
        return self.param or self.name

    def option(self) -> click.Option:
        declared = f"{self.spelled}/--no-{self.spelled[2:]}" if self.negatable else self.spelled
        extra: dict[str, Any] = {}
        if self.switch:
            extra["is_flag"] = True
        if self.type is not None:
            extra["type"] = self.type
        if self.default is not NOT_GIVEN:
            extra["default"] = self.default
        elif not (self.switch or self.required or self.multiple):
            extra["default"] = None
        if self.show_default:
            extra["show_default"] = True
        if self.metavar is not None:
            extra["metavar"] = self.metavar
        if self.callback is not None:
            check = self.callback
            extra["callback"] = lambda ctx, param, value: check(value)
        return click.Option(
            [declared, self.python_name], help=self.help, required=self.required, multiple=self.multiple, **extra
        )


def options(rows: Sequence[Flag]) -> Callable:
    """A decorator giving a click command these flags, in this order (its --help's)."""

    def decorate(func):
        params = getattr(func, "__click_params__", [])
        # click lists a command's params in the reverse of the order they were attached.
        params.extend(row.option() for row in reversed(rows))
        func.__click_params__ = params
        return func

    return decorate


def by_part(rows: Sequence[Flag], values: dict[str, Any]) -> dict[Part, dict[str, Any]]:
    """click's values of a command's `rows`, grouped by what each says about the request (its
    row's Part), under the names the command receives them by: each part goes where it is read
    (the space's flags to space_arguments, the probe's to make_settings, ...)."""
    parts: dict[Part, dict[str, Any]] = {part: {} for part in Part}
    for row in rows:
        if row.python_name in values:
            parts[row.part][row.python_name] = values[row.python_name]
    return parts


def reading_command(name: str, rows: Sequence[Flag]) -> click.Command:
    """A command that only parses `rows`: how the service reads a request's body as `autotune
    name`'s flags, with the same types, checks and words as the command line (it runs nothing)."""
    return click.Command(name, params=[row.option() for row in rows], callback=lambda **values: values)


def parse(command: click.Command, arguments: Sequence[str]) -> dict[str, Any]:
    """`arguments` parsed as `autotune <command>`'s (a click error otherwise, as the command line's)."""
    parent = click.Context(click.Group("autotune"), info_name="autotune")
    return dict(command.make_context(command.name, list(arguments), parent=parent).params)


def usage_message(exc: click.UsageError) -> str:
    """A flag's mistake as the command line says it (after 'autotune: error: '), with where to look;
    the service answers a request with the same words."""
    names, context = [], exc.ctx
    while context is not None and context.parent is not None:  # (the root's name is how it was run: autotune, -m ...)
        names.append(context.info_name or "")
        context = context.parent
    hint = f" (see: {' '.join(['autotune', *reversed(names)])} --help)" if exc.ctx else ""
    return f"{exc.format_message()}{hint}"


def refusal_line(exc: click.ClickException | Exception) -> str:
    """A refusal as one line, in the command line's words: a flag's mistake with where to look
    (usage_message), click's other refusals, and autotune's own (AutotuneError's text)."""
    if isinstance(exc, click.UsageError):
        return usage_message(exc)
    if isinstance(exc, click.ClickException):
        return exc.format_message()
    return str(exc)

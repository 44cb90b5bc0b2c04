"""`autotune search --from FILE`: the file's recipe given to search as the flags it stands for.

Each value goes through the flag's own click type, as if typed on the command line; a flag the
command line also gives with another value is refused (one line: which key of the file, which flag),
so the search's recipe is never one the user did not write. What the file asks that the probes can
only approximate is said on stderr, one line each, before anything runs.
"""

from __future__ import annotations

import click
from click.core import ParameterSource

from autotune.vocabulary.errors import BadInput


def apply_recipe_file(path: str, flags: dict) -> None:
    """Set `flags` (search's click values) from the file at `path`, in place."""
    from autotune.recipe_files import TOOLS, read_recipe_file

    context = click.get_current_context()
    recipe = read_recipe_file(path, gpus=flags.get("gpus") or 1)
    params = {param.name: param for param in context.command.params}
    for name, value in recipe.flags.items():
        param = params[name]
        typed = param.type_cast_value(context, value)
        source = context.get_parameter_source(name)
        given = source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
        if given and flags[name] != typed:
            flag = max(param.opts, key=len)
            shown = "on" if value is True else value
            raise BadInput(
                f"{flag} {_as_typed(flags[name])} contradicts {recipe.path.name}'s {recipe.sources.get(name, name)} "
                f"({shown}); leave {flag} out, or change the file."
            )
        flags[name] = typed
    click.echo(
        f"autotune: the recipe of {TOOLS[recipe.tool]}'s {recipe.path}: "
        + ", ".join(f"{max(params[n].opts, key=len)} {_as_typed(v)}" for n, v in recipe.flags.items()),
        err=True,
    )
    for line in recipe.said:
        click.echo(f"autotune: {line}", err=True)


def _as_typed(value) -> str:
    """A flag's value as the user would type it (a switch on: on)."""
    return "on" if value is True else str(value)

"""`autotune search`'s flags (autotune/flags/table.py SEARCH) read as what the library's search takes:
the model, the budget, the space's arguments, the probe settings and the search's options, each
routed by its row's `Part`. One reading for the command line, the service (a submitted search) and
the queue worker (which checks a search before it starts one), so a request any of them would
refuse is refused by all with the same line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.vocabulary.errors import BadInput
from autotune.flags.arguments import check_cpu_ranks, make_settings, space_arguments
from autotune.flags.flag import Part, by_part
from autotune.flags.table import SEARCH
from autotune.probe.settings import ProbeSettings
from autotune.search.common import SearchOptions
from autotune.search.request import SearchRequest, resolve_search
from autotune.vocabulary.units import parse_budget


@dataclass(frozen=True, slots=True)
class SearchFlags:
    """`autotune search`'s flags, read: what the library's search takes."""

    model: str
    budget: int
    space_args: dict
    settings: ProbeSettings
    options: SearchOptions


def read_search_flags(
    values: dict[str, Any], *, workers: int | None = None, oversubscribe: bool = False
) -> SearchFlags:
    """click's values of search's flags as the library's arguments, checked as far as the flags
    alone allow (AutotuneError or click.UsageError otherwise). Where and how the workers start
    (Part.LAUNCH) and where the answer goes (Part.OUTPUT) are the caller's: `workers` and
    `oversubscribe` say what the checks need of them."""
    parts = by_part(SEARCH, values)
    what = parts[Part.WHAT]
    if what.get("model") is None:
        raise BadInput(
            "--model: give the model to search (a hub id, a gpt2-family name or a directory), or --from a "
            "config file that names it."
        )
    model, budget = what["model"], parse_budget(what["gpu_budget"])
    space_args = space_arguments(**parts[Part.SPACE])
    settings = make_settings(**parts[Part.PROBE])
    check_search_ranks(model, budget, space_args, settings.device, workers, oversubscribe)
    return SearchFlags(model, budget, space_args, settings, SearchOptions(**parts[Part.SEARCH]))


def resolve_search_flags(values: dict[str, Any]) -> tuple[SearchFlags, SearchRequest]:
    """The flags read, then the search resolved (the model, the space, its candidates, its study's
    name): all a search must pass before it is queued (the service) or started (a queue worker).
    Writes nothing, starts nothing."""
    flags = read_search_flags(values)
    resolved = resolve_search(
        flags.model, flags.budget, settings=flags.settings, options=flags.options, **flags.space_args
    )
    return flags, resolved


def check_search_ranks(
    model: str, budget: int, space_args: dict, device: str, workers: int | None, oversubscribe: bool
) -> None:
    """What search's ranks, workers and labels ask of this machine and the model, refused before
    anything starts: a search on several nodes probes from this node, one probe at a time (no
    --workers); each CPU probe's ranks compute on this machine's cores (the --workers rule: with
    --workers, the fleet checks workers x ranks); a classification head of --num-labels fits the
    budget (ModelSpec.check_shapes, as for the embedding table)."""
    if workers is not None and space_args["nodes"] > 1:
        raise BadInput(
            f"--workers {workers} with --nodes {space_args['nodes']}: a search on several nodes runs each "
            f"probe on all of them from this node, one probe at a time; leave out --workers, or --nodes."
        )
    if workers is None:
        check_cpu_ranks(space_args["gpus"], device, oversubscribe=oversubscribe)
    if space_args.get("num_labels") is not None:
        from autotune.specs.models import resolve_model

        resolve_model(model).check_shapes(budget, num_labels=space_args["num_labels"])

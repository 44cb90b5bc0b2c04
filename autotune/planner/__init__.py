"""`autotune plan`: a search space's memory and speed predicted for a card that is not here.

plan       Target (a card, a budget, or the CPU), make_plan: estimates traced or interpolated
           per group, what fits, ranked by the cost model; a measured study's figures beside
speed      the documented cost model of speed (FLOPs per token, the card's peak, a utilisation)
render     the plan as a table
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.estimate.stack import Stack
from autotune.planner.card_plan import Plan, Planned, Target, make_plan, unplannable

__all__ = ["Plan", "Planned", "Target", "make_plan", "plan_for", "unplannable"]


def plan_for(
    model: str,
    target: Target,
    space_args: dict[str, Any],
    *,
    exact: bool = False,
    timeout: float,
    use_cache: bool = True,
    trust_remote_code: bool = False,
    db: str | None = None,
    study: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    stack: Stack | None = None,
) -> Plan:
    """Resolve `model`, build the space as `autotune search` would, trace it in parallel trace
    children, and put the measurements of a matching study beside the predictions (from `db`, or
    the default database when there is one). `stack`: the run's library versions, where older than
    the installed ones (estimate/stack.py)."""
    from autotune.estimate.launch import TraceChildren
    from autotune.specs.models import resolve_model
    from autotune.search.launch import trace_processes
    from autotune.search.space import SearchSpace

    from autotune.data.shape import shaped_space_args

    spec = resolve_model(model)
    # Refused before any trace child starts: a model nothing can train, or its own code unasked.
    spec.check_usable(trust_remote_code, budget_bytes=target.budget.total_bytes)
    space = SearchSpace.build(spec, **shaped_space_args(spec, space_args, trust_remote_code))
    store = _measurements(db, study)
    try:
        if store is not None and study is not None:
            store.study(study)  # an unknown study is a mistake, said before any trace
        # (started when a trace is wanted: a plan answered from the cache starts none)
        with TraceChildren(min(trace_processes(), len(space.candidates())), spec.model_type) as children:
            return make_plan(
                spec,
                space,
                target,
                exact=exact,
                timeout=timeout,
                use_cache=use_cache,
                trust_remote_code=trust_remote_code,
                children=children,
                store=store,
                study=study,
                on_progress=on_progress,
                stack=stack,
            )
    finally:
        if store is not None:
            store.close()


def _measurements(db: str | None, study: str | None):
    """The results database to compare with, read-only: the one named (a mistake there is said),
    else the default one if it exists (none is no mistake: a plan needs no database)."""
    from autotune.vocabulary.errors import DatabaseError
    from autotune.store import open_store

    try:
        return open_store(db, read_only=True)
    except DatabaseError:
        if db is not None or study is not None:
            raise
        return None

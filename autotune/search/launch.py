"""`autotune search` as a library call: from a user's flags to a running search, in this process
(one worker) or in several worker processes (fleet.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable

from autotune.environment import Environment
from autotune.estimate.launch import TraceChildren
from autotune.margin import checked_margin_bytes
from autotune.search.common import Event, Progress, SearchOptions, SearchOutcome
from autotune.search.driver import default_study_name, preflight, run_search, stored_answer
from autotune.search.fleet import search_with_workers
from autotune.search.predictions import predict
from autotune.space import SearchSpace
from autotune.store import StudyRecord


TRACE_PROCESSES_ENV = "AUTOTUNE_TRACE_PROCESSES"


def trace_processes() -> int:
    """How many trace children predict a search's memory: $AUTOTUNE_TRACE_PROCESSES, else one per
    core up to 4 (each holds a model on fake tensors, a few hundred MB of host memory for a 7B
    model). Fewer where other work shares the cores (a test suite running searches side by side)."""
    text = os.environ.get(TRACE_PROCESSES_ENV, "").strip()
    if text.isdigit() and int(text) >= 1:
        return min(int(text), 16)
    return max(1, min(4, os.cpu_count() or 1))


def search(model: str, budget_bytes: int, *, settings, options: SearchOptions, db: str | None = None,
           on_event: Callable[[Event], None] | None = None,
           on_start: Callable[[StudyRecord, Environment, int, int], None] | None = None,
           workers: int | None = None, on_progress: Callable[[Progress], None] | None = None,
           **space_args) -> SearchOutcome:
    """Resolve the model, build the space, open the store, start a probe runner, search.
    Everything a user can get wrong is checked before the database is opened. With `workers`,
    the search runs in that many worker processes. `on_progress` hears of the probe in flight and
    its phases (one worker only: a fleet's probes run in other processes)."""
    from autotune.models import resolve_model
    from autotune.probe import ProbeRunner
    from autotune.probe.runner import check_model
    from autotune.store import open_store

    spec = resolve_model(model)
    space = SearchSpace.build(spec, **space_args)
    space.candidates()  # raises BadInput when no micro-batch keeps the effective batch exact
    check_model(spec, settings.trust_remote_code)
    margin = checked_margin_bytes(settings.margin, budget_bytes)
    if workers is not None:
        return search_with_workers(spec, space, budget_bytes, margin, workers=workers, settings=settings, options=options,
                                   db=db, on_start=on_start, on_event=on_event)
    # A finished study answers from the database before any process starts (no torch).
    name = options.study if options.study is not None else default_study_name(spec, budget_bytes)
    if not options.fresh and (answer := stored_answer(db, name, space, time.perf_counter())) is not None:
        return answer
    # The estimator's processes are started first, so that their imports overlap the probe child's
    # start-up and the preflight, and the traces share the host's cores; unused, they are killed.
    tracers = (TraceChildren(trace_processes()).start(None if spec.needs_remote_code else spec.model_type)
               if options.predict and options.strategy != "grid-full" else None)
    with tracers or contextlib.nullcontext(), ProbeRunner(settings) as runner:
        # Before the store is opened: a refused search creates no database and writes nothing.
        environment = preflight(space, spec, budget_bytes, runner)
        if tracers is not None and environment.device_type == "cuda":
            # On a GPU the first probes run while memory is predicted, on host cores the probes
            # hardly use; each timed window pauses the tracers all the same. (On a CPU device they
            # would share the cores the probes compute on: OpenMP threads that spin while others
            # hold their cores slowed a warm-up 30x on 2 cores. There predictions come first.)
            runner.neighbours = tracers
            options = dataclasses.replace(options, predict_in_background=True)
        with open_store(db) as store:
            predictor = functools.partial(predict, trust_remote_code=settings.trust_remote_code, children=tracers)
            return run_search(space, spec, budget_bytes, margin, runner, store, options, on_event, on_start,
                              predictor=predictor, on_progress=on_progress)

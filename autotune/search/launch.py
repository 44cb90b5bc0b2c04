"""`autotune search` as a library call: from a user's flags to a running search, in this process
(one worker) or in several worker processes (fleet.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from autotune.vocabulary.errors import BadInput
from autotune.estimate.launch import TraceChildren
from autotune.launchers.base import Launcher
from autotune.probe.settings import ProbeSettings
from autotune.host.processes import STARTUP_FLOOR_SECONDS
from autotune.search.common import OnStart, Event, Progress, SearchOptions, SearchOutcome
from autotune.search.driver import run_search
from autotune.search.fleet import search_with_workers
from autotune.search.predictions import predict
from autotune.search.request import check_device_chosen, preflight, resolve_search, stored_answer

if TYPE_CHECKING:
    from autotune.probe.runner import ProbeRunner


TRACE_PROCESSES_ENV = "AUTOTUNE_TRACE_PROCESSES"
MAX_TRACE_PROCESSES = 16


def trace_processes() -> int:
    """How many trace children predict a search's memory: $AUTOTUNE_TRACE_PROCESSES, else one per
    core up to 4 (each holds a model on fake tensors, a few hundred MB of host memory for a 7B
    model). Fewer where other work shares the cores (a test suite running searches side by side)."""
    text = os.environ.get(TRACE_PROCESSES_ENV, "").strip()
    if not text:
        return max(1, min(4, os.cpu_count() or 1))
    if not text.isdigit() or not 1 <= int(text) <= MAX_TRACE_PROCESSES:
        raise BadInput(
            f"${TRACE_PROCESSES_ENV} {text!r}: give a whole number of trace processes from 1 to "
            f"{MAX_TRACE_PROCESSES}, or unset it (one per core, up to 4)."
        )
    return int(text)


def search(
    model: str,
    budget_bytes: int,
    *,
    settings: ProbeSettings,
    options: SearchOptions,
    db: str | None = None,
    on_event: Callable[[Event], None] | None = None,
    on_start: OnStart | None = None,
    workers: int | None = None,
    oversubscribe: bool = False,
    on_progress: Callable[[Progress], None] | None = None,
    launcher: Launcher | None = None,
    runner: ProbeRunner | None = None,
    **space_args,
) -> SearchOutcome:
    """Resolve the search once (the model, the space, the budget, the study's name), then search:
    in this process, or with `workers` worker processes. Everything a user can get wrong is checked
    before the database is opened. `on_progress` hears of the probe in flight and its phases (one
    worker only: a fleet's probes run in other processes). `runner`, one with these `settings`,
    probes in this process and is left open for the caller's next search (its child's imports are
    seconds); by default a new one is started and stopped."""
    from autotune.store import open_store

    if runner is not None and (workers is not None or launcher is not None or runner.settings != settings):
        raise ValueError(
            "search(runner=...) takes a runner with the search's own settings, for a search in this process"
        )
    request = resolve_search(model, budget_bytes, settings=settings, options=options, **space_args)
    if workers is not None or launcher is not None:
        return search_with_workers(
            request,
            workers=workers or 1,
            oversubscribe=oversubscribe,
            db=db,
            on_start=on_start,
            on_event=on_event,
            launcher=launcher,
        )
    # A finished study answers from the database before any process starts (no torch).
    if (answer := stored_answer(db, request, time.perf_counter())) is not None:
        return answer
    # The estimator's processes are started first, so that their imports overlap the probe child's
    # start-up and the preflight, and the traces share the host's cores; unused, they are killed.
    # (Within the command's deadline: the first forked from the fork server waits for its imports.)
    tracers = (
        TraceChildren(trace_processes()).start(
            None if request.spec.needs_remote_code else request.spec.model_type,
            request.deadline.bound(STARTUP_FLOOR_SECONDS),
        )
        if options.predict and options.strategy != "grid-full"
        else None
    )
    with tracers or contextlib.nullcontext(), _probing_with(runner, settings) as runner:
        # Before the store is opened: a refused search creates no database and writes nothing.
        request = preflight(request, runner)
        check_device_chosen(request)
        if tracers is not None and request.device_type == "cuda":
            # On a GPU the first probes run while memory is predicted, on host cores the probes
            # hardly use; each timed window pauses the tracers all the same. (On a CPU device they
            # would share the cores the probes compute on: OpenMP threads that spin while others
            # hold their cores slowed a warm-up 30x on 2 cores. There predictions come first.)
            runner.neighbours = tracers
            request = dataclasses.replace(request, options=dataclasses.replace(options, predict_in_background=True))
        with open_store(db) as store:
            predictor = functools.partial(predict, trust_remote_code=settings.trust_remote_code, children=tracers)
            return run_search(request, runner, store, on_event, on_start, predictor=predictor, on_progress=on_progress)


@contextlib.contextmanager
def _probing_with(runner: ProbeRunner | None, settings: ProbeSettings) -> Iterator[ProbeRunner]:
    """The caller's runner, left open (without this search's trace children as its neighbours),
    or a new one, stopped at the end."""
    if runner is None:
        from autotune.probe import ProbeRunner  # (looked up here: tests put a scripted one in its place)

        with ProbeRunner(settings) as fresh:
            yield fresh
        return
    try:
        yield runner
    finally:
        runner.neighbours = None


def dry_run_script(
    launcher: Launcher | None,
    model: str,
    budget: int,
    settings: ProbeSettings,
    options: SearchOptions,
    workers: int,
    space_args: dict,
    db: str | None = None,
) -> str | None:
    """`search --launcher slurm --dry-run`: the job script the search would submit (its study's name
    and ranks worked out as the search works them out), without submitting or writing anything;
    None where the search would submit none: its study is finished over the same space (the
    database read, nothing created), and it would answer from there."""
    from autotune.launchers.base import WorkerSpec
    from autotune.vocabulary.devices import worker_kind
    from autotune.launchers.slurm import SlurmLauncher

    assert isinstance(launcher, SlurmLauncher)
    if (settings.device or "auto").strip().lower() == "auto":  # (the cluster's nodes have the GPUs, not this one)
        settings = dataclasses.replace(settings, device="cuda")
    request = resolve_search(model, budget, settings=settings, options=options, **space_args)
    if stored_answer(db, request, time.perf_counter()) is not None:
        return None  # (the search would answer from the database: no job to submit)
    return launcher.script(workers, WorkerSpec(request.name, "", worker_kind(settings.device), request.space.gpus))

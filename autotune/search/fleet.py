"""Several workers on one study: one per GPU of a machine (`autotune search --workers N`), or one
per GPU of many machines (`autotune worker --study NAME --db URL` on each).

There is no scheduler: the database is the meeting point. Optuna's RDB storage and autotune's
tables live in it; each worker claims a configuration there before probing it (Store.claim: an
INSERT that loses on a unique key, or a conditional UPDATE taking over a claim whose worker stopped
heartbeating), reads the study's probes before each pick, and records its outcome once
(Store.settle). Every worker runs the driver's loop (driver.py: `work`).

A study is pinned to one kind of card: its environment (device name and memory, driver and
library versions) is stored with it, and a worker on anything else refuses to join unless told
to (`--allow-other-device`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import time
from collections.abc import Callable

from autotune.results.budget import Budget
from autotune.launchers.base import Launcher, WorkerSpec
from autotune.vocabulary.devices import worker_kind
from autotune.host.environment import Environment, adopt_openmp
from autotune.vocabulary.errors import AutotuneError, BadInput, DeviceError
from autotune.specs.models import ModelSpec
from autotune.probe.settings import ProbeSettings
from autotune.search.common import OnStart, Event, Runner, SearchOptions, SearchOutcome
from autotune.search.confirm import RoundTally
from autotune.search.driver import start_study
from autotune.search.knowledge import Knowledge
from autotune.search.loop import stop_on_first_interrupt, work
from autotune.search.study_plan import StudyPlan
from autotune.search.request import SearchRequest, check_device_chosen, preflight, stored_answer
from autotune.search.trials import Trials, distributions_of
from autotune.search.worker_state import WorkerState, unmeasured, worker_label
from autotune.levers.sharding import most_cpu_ranks
from autotune.search.space import SearchSpace
from autotune.vocabulary.status import ClaimState, ProbeStatus, Settled, StopReason, StudyStatus
from autotune.store import Store, StudyRecord
from autotune.vocabulary.units import format_size

# How often `autotune search --workers` reads the database for its progress display.
POLL_SECONDS = 0.5
# How long a worker told to stop (SIGTERM) has to give its claim back before it is killed.
WORKER_STOP_GRACE_SECONDS = 10.0


# -- joining a study ---------------------------------------------------------------------------
def join_study(
    name: str,
    *,
    db: str | None = None,
    device: str = "auto",
    allow_other_device: bool = False,
    max_trials: int | None = None,
    timeout: float | None = None,
    patience: int | None = None,
    probe_timeout: float | None = None,
    on_start: OnStart | None = None,
    on_event: Callable[[Event], None] | None = None,
) -> SearchOutcome:
    """`autotune worker`: take probes of the study called `name` until its space is done, the
    study is stopped, or one of this worker's limits is reached. The study's plan (stored by the
    search that started it) says how: the strategy, the probe settings, the memory predictions."""
    from autotune.probe import ProbeRunner
    from autotune.store import open_store

    started = time.perf_counter()
    with open_store(db) as store:
        study = _joinable_study(store, name)
        if study.status == StudyStatus.FINISHED:
            return _already_finished(store, study, started)
        settings = worker_settings(study, device, probe_timeout)
        # (before the probe children start: they read the OpenMP settings when torch loads)
        adopt_openmp(study.environment.get("openmp"))
        with ProbeRunner(settings) as runner:
            return run_worker(
                store,
                name,
                runner,
                settings=settings,
                allow_other_device=allow_other_device,
                max_trials=max_trials,
                timeout=timeout,
                patience=patience,
                on_start=on_start,
                on_event=on_event,
                started=started,
            )


def worker_settings(study: StudyRecord, device: str, probe_timeout: float | None = None) -> ProbeSettings:
    """How a worker joining `study` probes: the study's plan, on this worker's device, with the
    study's margin (and its own probe timeout, when given)."""
    settings = ProbeSettings.from_plan(StudyPlan.from_dict(study.plan).probe, device=device, margin=study.margin_bytes)
    return dataclasses.replace(settings, timeout=probe_timeout) if probe_timeout else settings


def run_worker(
    store: Store,
    name: str,
    runner: Runner,
    *,
    settings: ProbeSettings | None = None,
    allow_other_device: bool = False,
    max_trials: int | None = None,
    timeout: float | None = None,
    patience: int | None = None,
    on_start: OnStart | None = None,
    on_event: Callable[[Event], None] | None = None,
    started: float | None = None,
) -> SearchOutcome:
    """Work on the study called `name` with `runner` (a ProbeRunner made with `settings`, or a
    scripted one in tests) beside whatever other workers it has. Refuses, before writing anything, a study that is
    stopped or a runner on another kind of device."""
    from autotune.specs.models import resolve_model

    started = time.perf_counter() if started is None else started
    study = _joinable_study(store, name)
    if study.status == StudyStatus.FINISHED:
        return _already_finished(store, study, started)
    plan = StudyPlan.from_dict(study.plan)
    spec = resolve_model(study.model_reference)
    _check_same_model(study, spec)
    options = SearchOptions(
        study=name,
        strategy=plan.strategy,
        fresh=plan.fresh,
        predict=False,
        predict_margin=plan.predict_margin,
        max_trials=max_trials,
        timeout=timeout,
        patience=patience if patience is not None else plan.patience,
        heartbeat_seconds=plan.heartbeat_seconds,
        confirm=plan.confirm,
    )
    settings = settings or worker_settings(study, "auto")
    request = SearchRequest.of(_space(study), spec, Budget(study.budget_bytes, study.margin_bytes), options, settings)
    environment = runner.environment()
    check_joinable(study, environment, allow_other_device)
    request = request.with_environment(environment)
    knowledge = Knowledge.of(list(request.candidates), request.budget, plan.predict_margin, plan.predictions)
    worker = WorkerState(store, request, study, knowledge, worker_label(settings.device))
    worker.refresh()
    if on_start is not None:
        on_start(study, environment, len(knowledge.candidates), len(knowledge.outcomes), ())
    # Each worker its own TPE seed: with one seed, every worker would propose the same points.
    trials = Trials(
        store.engine.url.render_as_string(hide_password=False), name, distributions_of(request.space), seed=None
    )
    try:
        return work(worker, runner, trials, on_event, starter=False, started=started)
    finally:
        trials.close()


def _joinable_study(store: Store, name: str) -> StudyRecord:
    study = store.study(name)
    if study.status in (StudyStatus.INTERRUPTED, StudyStatus.INCOMPLETE):
        raise BadInput(
            f"study {name!r} is stopped; resume it with the `autotune search` command that started it "
            f"(same --study and --db), then join it."
        )
    if study.plan is None:
        raise BadInput(
            f"study {name!r} was started by an older autotune and has no plan for workers; resume it once "
            f"with `autotune search ... --study {name}`, then join it."
        )
    return study


def _already_finished(store: Store, study: StudyRecord, started: float) -> SearchOutcome:
    space = _space(study)
    return SearchOutcome(
        study=study,
        space=space,
        leaderboard=store.leaderboard(study.name),
        candidates=len(space.candidates()),
        seconds=time.perf_counter() - started,
        answered_from_database=True,
        stop_reason=StopReason.FINISHED,
    )


def _space(study: StudyRecord) -> SearchSpace:
    return SearchSpace.from_stored(study.space)


def check_joinable(study: StudyRecord, environment: Environment, allow_other_device: bool) -> None:
    """One study, one kind of card: refuse a worker whose device or software differs from the
    study's, unless allowed (its probes then compare with measurements from elsewhere)."""
    if allow_other_device or study.env_fingerprint == environment.fingerprint():
        return
    if (study.device_name, study.device_total_bytes) != (environment.device_name, environment.device_total_bytes):
        raise DeviceError(
            f"study {study.name!r} is pinned to {study.device_name} ({format_size(study.device_total_bytes)}); this "
            f"worker has {environment.device_name} ({format_size(environment.device_total_bytes)}). Join from a machine "
            f"with the same card, or pass --allow-other-device to mix their measurements."
        )
    differences = environment.differences(study.environment)
    raise DeviceError(
        f"study {study.name!r} was measured with other software ({'; '.join(differences)}); install the "
        f"same versions, or pass --allow-other-device."
    )


def _check_same_model(study: StudyRecord, spec: ModelSpec) -> None:
    if spec.fingerprint != study.model_fingerprint:
        raise BadInput(
            f"the model {study.model_reference!r} found here is not the one study {study.name!r} measures "
            f"(its config differs); give this machine the same model files."
        )


# -- one worker per GPU of this machine --------------------------------------------------------
def visible_gpus() -> list[str]:
    """This machine's GPUs as CUDA_VISIBLE_DEVICES entries: that variable's own entries when set,
    else nvidia-smi's indices (torch is not imported here)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        entries = [e.strip() for e in env.split(",") if e.strip()]
        return [] if entries[:1] == ["-1"] else entries
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in listing.splitlines() if line.strip()]


def worker_devices(count: int, device: str, *, oversubscribe: bool = False, ranks: int = 1) -> list[tuple[str, str]]:
    """(--device, CUDA_VISIBLE_DEVICES) for each of `count` workers: `ranks` GPUs each (a study on
    several GPUs probes on that many ranks), no GPU in two workers; or the CPU, at most one rank
    per core (sharding.most_cpu_ranks). Checked before any process starts."""
    if count < 1:
        raise BadInput("--workers must be at least 1.")
    device = (device or "auto").strip().lower()
    each = f" of {ranks} ranks each" if ranks > 1 else ""
    if device == "cpu":
        cores = os.cpu_count() or 1
        most = most_cpu_ranks(oversubscribe) // ranks  # (sharding's rule, --gpus follows it too)
        if count > most:
            more = (
                ""
                if oversubscribe
                else f", or --oversubscribe for up to {most_cpu_ranks(True) // ranks} (their timings then share the cores)"
            )
            raise BadInput(
                f"--workers {count}{each}: this machine has {cores} core{'s' if cores != 1 else ''}, and each CPU "
                f"rank's probes compute on them; give --workers {max(most, 1)} or fewer{more}."
            )
        return [("cpu", "")] * count  # CPU workers see no GPU
    if device not in ("auto", "cuda"):
        raise BadInput(
            f"--workers gives each worker one GPU itself; use --device cuda (or auto) instead of {device}, "
            f"or --device cpu for CPU workers."
        )
    gpus = visible_gpus()
    if not gpus:
        raise BadInput(
            "--workers: no GPU is visible (CUDA_VISIBLE_DEVICES, nvidia-smi); pass --device cpu for CPU workers."
        )
    if count * ranks > len(gpus):
        raise BadInput(
            f"--workers {count}{each} need {count * ranks} GPUs: only {len(gpus)} are visible "
            f"({','.join(gpus)}); use at most {len(gpus) // ranks} workers, or --device cpu."
        )
    return [("cuda", ",".join(gpus[i * ranks : (i + 1) * ranks])) for i in range(count)]


def search_with_workers(
    request: SearchRequest,
    *,
    workers: int,
    oversubscribe: bool = False,
    db: str | None = None,
    on_start: OnStart | None = None,
    on_event: Callable[[Event], None] | None = None,
    launcher: Launcher | None = None,
) -> SearchOutcome:
    """`autotune search --workers N`: start (or resume) the study here, then have the launcher start
    N `autotune worker` processes on it (`local`: each with one GPU of this machine, or the CPU; Ray
    or Slurm: where the cluster places them), and show their progress from the database.
    --max-trials and --timeout hold for the study as a whole: when reached, the study is stopped and
    the workers finish the probes in flight. Whatever ends the search, nothing the launcher
    started is left running."""
    from autotune.launchers.local import LocalLauncher
    from autotune.probe import ProbeRunner
    from autotune.store import open_store

    started = time.perf_counter()
    kind = worker_kind(request.settings.device)
    if launcher is None:
        launcher = LocalLauncher(
            worker_devices(workers, request.settings.device, oversubscribe=oversubscribe, ranks=request.space.gpus)
        )
    launcher.check(workers, WorkerSpec(request.name, "", kind, request.space.gpus))
    # A finished study answers from the database before any process starts.
    if (answer := stored_answer(db, request, started, workers=0)) is not None:
        return answer
    with contextlib.ExitStack() as stack:
        runner = stack.enter_context(ProbeRunner(request.settings))
        # Before the store is opened: a refused search creates no database and writes nothing.
        request = preflight(request, runner)
        check_device_chosen(request)
        store = stack.enter_context(open_store(db))
        worker, trials = start_study(request, runner, store, on_start)
        trials.close()
        runner.close()  # its child would hold a device (a CUDA context) while the workers probe
        study = worker.study
        spec = WorkerSpec(
            study.name,
            store.engine.url.render_as_string(hide_password=False),
            kind,
            request.space.gpus,
            request.deadline.remaining() if request.deadline.at is not None else None,
        )
        try:
            launcher.start(workers, spec)
            reason, settled = _watch(store, study, worker.knowledge, worker.seen_probe_id, launcher, request, on_event)
            launcher.stop(grace=0)  # (what never started, a Slurm task still pending, is cancelled too)
        except BaseException:
            # A second Ctrl-C, SIGTERM, or a bug here: stop the workers now and leave the study resumable.
            launcher.stop(grace=WORKER_STOP_GRACE_SECONDS)
            if store.study(study.name).status == StudyStatus.RUNNING:
                store.set_study_status(study.id, StudyStatus.INTERRUPTED)
            raise
        return _gather(store, study, request.space, launcher, workers, reason, settled, started, worker.knowledge)


def _watch(
    store: Store,
    study: StudyRecord,
    knowledge: Knowledge,
    seen: int,
    launcher: Launcher,
    request: SearchRequest,
    on_event: Callable[[Event], None] | None,
) -> tuple[StopReason | None, int]:
    """Show what the workers settle until they have all exited; stop the study on Ctrl-C or when a
    study-wide limit is reached. Returns why this process stopped the study (None if it did not),
    and how many outcomes the workers stored that were not skips.

    Every worker is held to the wall clock: one whose claim stops heartbeating (stopped, wedged) is
    killed, its configuration taken over by another; and past the deadline, or once the study is
    stopped, a worker has WORKER_STOP_GRACE_SECONDS to end its probe in flight before it is killed."""
    options, deadline = request.options, request.deadline
    by_key = {c.key(): c for c in knowledge.candidates}
    first = seen
    probed = 0
    reason: StopReason | None = None
    stopped_at: float | None = None  # when the study was stopped, or the deadline passed
    beaten = time.monotonic()
    with stop_on_first_interrupt() as stop:
        while True:
            if time.monotonic() - beaten >= options.heartbeat_seconds:
                store.beat_study(study.id)  # this process owns the study: it is alive
                beaten = time.monotonic()
            running = launcher.alive()
            for row in store.probes(study.name, after_id=seen):
                seen = row.id
                config = by_key.get(row.config_key)
                if config is None:
                    continue
                knowledge.learn(config, row.result)
                probed += row.id > first and row.result.status != ProbeStatus.SKIPPED
                best = knowledge.best()
                if on_event is not None:
                    on_event(
                        Event(
                            config,
                            row.result,
                            Settled.SKIPPED if row.result.status == ProbeStatus.SKIPPED else Settled.PROBED,
                            len(knowledge.outcomes),
                            len(knowledge.candidates),
                            best is not None and best[0].key() == config.key() and row.result.status == ProbeStatus.OK,
                            row.worker,
                        )
                    )
            if not running:
                return reason, probed
            if reason is None:
                if stop.is_set():
                    reason = StopReason.INTERRUPTED
                elif options.max_trials is not None and probed >= options.max_trials:
                    reason = StopReason.MAX_TRIALS
                elif deadline.expired():
                    reason = StopReason.TIMEOUT
                if reason is not None:
                    # The workers see it before their next pick and stop after the probe in flight
                    # (at the deadline, their own --timeout stops that probe too).
                    store.set_study_status(study.id, StudyStatus.INTERRUPTED)
            if stopped_at is None and (reason is not None or store.study(study.name).status != StudyStatus.RUNNING):
                stopped_at = time.monotonic()
            _stop_silent_workers(store, study, launcher, options.stale_after)
            if stopped_at is not None and time.monotonic() - stopped_at > WORKER_STOP_GRACE_SECONDS:
                launcher.stop(grace=0)
            time.sleep(POLL_SECONDS)


def _stop_silent_workers(store: Store, study: StudyRecord, launcher: Launcher, stale_after: float) -> None:
    """Stop a worker whose claim went stale: it stopped heartbeating while it held a configuration
    (stopped with SIGSTOP, wedged in a kernel): another worker takes it over, and the search cannot
    end while the silent one lives."""
    silent = {
        claim.worker
        for claim in store.claims.of_study(study.id, stale_after=stale_after)
        if claim.state == ClaimState.RUNNING and claim.stale
    }
    if silent:
        launcher.stop_silent(silent)


def _gather(
    store: Store,
    study: StudyRecord,
    space: SearchSpace,
    launcher: Launcher,
    workers: int,
    reason: StopReason | None,
    settled: int,
    started: float,
    knowledge: Knowledge,
) -> SearchOutcome:
    summaries, failures = [], []
    for end in launcher.ends():
        if end.summary is not None:
            summaries.append(end.summary)
        else:
            failures.append(f"{end.name}: {end.failure}")
    if not summaries and failures:
        if store.study(study.name).status == StudyStatus.RUNNING:
            store.set_study_status(study.id, StudyStatus.INTERRUPTED)
        raise AutotuneError(f"every worker failed; the first: {failures[0]}")
    reused = sum(s.get("reused", 0) for s in summaries)
    record = store.study(study.name)
    if record.status in (StudyStatus.FINISHED, StudyStatus.INCOMPLETE):
        stop_reason = (
            StopReason.PATIENCE
            if any(s.get("stop_reason") == StopReason.PATIENCE for s in summaries)
            else StopReason.EXHAUSTED
        )
    else:
        stop_reason = reason or StopReason.INTERRUPTED
        if record.status == StudyStatus.RUNNING:  # every worker ended without finishing it (their own Ctrl-C, limits)
            store.set_study_status(study.id, StudyStatus.INTERRUPTED)
        record = store.study(study.name)
    return SearchOutcome(
        study=record,
        space=space,
        leaderboard=store.leaderboard(study.name),
        candidates=len(space.candidates()),
        # Counted from the database, not the workers' summaries: a worker killed mid-search prints
        # none, yet its probes are stored.
        probed=settled - reused,
        reused=reused,
        skipped=sum(s.get("skipped", 0) for s in summaries),
        seconds=time.perf_counter() - started,
        skips={
            kind: sum((s.get("skips") or {}).get(kind, 0) for s in summaries)
            for kind in {kind for s in summaries for kind in (s.get("skips") or {})}
        },
        stop_reason=stop_reason,
        workers=workers,
        failures=failures,
        unmeasured=unmeasured(knowledge),
        # (the confirmation round, which one worker ran: search/loop.py, SearchLoop._confirm_once)
        round=RoundTally(
            probes=sum(s.get("confirming_probes", 0) for s in summaries),
            seconds=sum(s.get("confirming_seconds", 0.0) for s in summaries),
            reused_windows=sum(s.get("reused_windows", 0) for s in summaries),
        ),
    )

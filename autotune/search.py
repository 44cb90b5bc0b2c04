"""The search: which configurations to probe, in what order, and when to stop.

An Optuna study (stored in the same database as autotune's tables) records every trial: a probe
that fits is a completed trial valued by its tokens/s; an OOM is a completed trial that violates
the memory constraint (Optuna's TPE ignores failed trials, so an OOM told as a failure would be
proposed again). What to probe next is chosen by a strategy:

- `frontier` (default): uses the structure of the problem. Inside a group of configs that differ
  only in micro-batch, memory grows with the micro-batch, so a binary search finds the largest one
  that fits; throughput grows with the micro-batch at a fixed effective batch, so the group's best
  is at that frontier, which one more probe (the next smaller micro-batch) confirms. An OOM skips
  every larger config of the same precision, checkpointing and attention; a config that fits
  without checkpointing skips the same config with it (same memory need met, less work).
- `tpe`: Optuna's TPE sampler with the memory constraint, plus the same OOM skipping.
- `grid`: every candidate, smallest first, with OOM skipping; `grid-full` probes even those.

`benchmarks/search_strategies.py` measures how many probes each needs to reach the exhaustive
grid's best; that measurement is why `frontier` is the default.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from autotune.config import ProbeConfig
from autotune.environment import Environment
from autotune.errors import BadInput
from autotune.models import ModelSpec
from autotune.result import ProbeResult
from autotune.space import SearchSpace, dominates_in_memory, group_key
from autotune.store import LeaderboardRow, Store, StudyRecord
from autotune.units import format_size

STRATEGIES = ("frontier", "tpe", "grid", "grid-full")
# Statuses that say nothing about a config's memory need: the search may try it again on resume.
RETRYABLE = ("timeout", "crashed", "error")


class Runner(Protocol):
    """What the search needs of a probe runner (ProbeRunner, or a scripted fake in tests)."""

    def environment(self) -> Environment: ...
    def run(self, config: ProbeConfig, budget_bytes: int, spec: ModelSpec | None = None) -> ProbeResult: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SearchOptions:
    study: str | None = None
    strategy: str = "frontier"
    max_trials: int | None = None      # probes actually run (reused and skipped ones are free)
    timeout: float | None = None       # seconds; no new probe starts after this
    patience: int | None = None        # stop after this many probes without a better config
    fresh: bool = False                # ignore stored results from other studies
    predict: bool = True               # estimate memory first: skip hopeless configs, order the rest
    predict_margin: float = 0.10       # skip only when predicted over the budget by more than this share

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise BadInput(f"--strategy {self.strategy!r} is unknown; choose from {', '.join(STRATEGIES)}.")
        if self.max_trials is not None and self.max_trials < 1:
            raise BadInput("--max-trials must be at least 1.")
        if self.patience is not None and self.patience < 1:
            raise BadInput("--patience must be at least 1.")
        if not 0 <= self.predict_margin < 10:
            raise BadInput("--predict-margin must be between 0 and 10 (a share of the budget, e.g. 0.1).")


@dataclass(slots=True)
class Event:
    """One resolved candidate, for the live display."""

    config: ProbeConfig
    result: ProbeResult
    how: str                 # 'probed', 'reused' (stored result) or 'skipped' (ruled out by structure)
    resolved: int            # candidates resolved so far, this one included
    total: int               # candidates in the space
    best: bool               # the best config so far


@dataclass(slots=True)
class SearchOutcome:
    study: StudyRecord
    space: SearchSpace
    leaderboard: list[LeaderboardRow]
    probed: int = 0
    reused: int = 0
    skipped: int = 0
    candidates: int = 0
    seconds: float = 0.0
    stop_reason: str = "exhausted"
    answered_from_database: bool = False
    probes_seconds: float = 0.0        # wall time of the probes actually run

    @property
    def best(self) -> LeaderboardRow | None:
        return self.leaderboard[0] if self.leaderboard else None

    @property
    def finished(self) -> bool:
        return self.stop_reason in ("exhausted", "patience")


@dataclass(slots=True)
class Knowledge:
    """What is known about each candidate of the space, and what it implies for the others."""

    candidates: list[ProbeConfig]
    outcomes: dict[str, ProbeResult] = field(default_factory=dict)   # by config key
    predictions: dict[str, "Prediction"] = field(default_factory=dict)
    allowed_bytes: int = 0          # budget less margin: what a config may need
    skip_over_bytes: int = 0        # predicted need above which a config is not probed

    def resolved(self, config: ProbeConfig) -> bool:
        return config.key() in self.outcomes

    def learn(self, config: ProbeConfig, result: ProbeResult) -> None:
        self.outcomes[config.key()] = result

    def ok(self) -> list[tuple[ProbeConfig, ProbeResult]]:
        return [(c, self.outcomes[c.key()]) for c in self.candidates if c.key() in self.outcomes and self.outcomes[c.key()].status == "ok"]

    def best(self) -> tuple[ProbeConfig, ProbeResult] | None:
        fitting = self.ok()
        return max(fitting, key=lambda item: item[1].tokens_per_s or 0.0) if fitting else None

    def implied_skip(self, config: ProbeConfig) -> str | None:
        """Why `config` need not be probed, from what is known of the others; None if it must be."""
        for other in self.candidates:
            result = self.outcomes.get(other.key())
            if result is None or other.key() == config.key():
                continue
            if result.status == "oom" and dominates_in_memory(other, config):
                return f"needs at least the memory of {other.label()}, which ran out of memory"
            if (config.checkpointing and not other.checkpointing and result.status == "ok"
                    and (other.precision, other.attention, other.block_size, other.micro_batch)
                    == (config.precision, config.attention, config.block_size, config.micro_batch)):
                return f"{other.label()} fits without checkpointing, which only adds recomputation"
        prediction = self.predictions.get(config.key())
        if prediction is not None and prediction.floor_bytes > self.skip_over_bytes:
            return (f"predicted to need at least {format_size(prediction.floor_bytes)}, over the "
                    f"{format_size(self.allowed_bytes)} allowed by more than the prediction margin")
        return None

    def predicted_to_fit(self, config: ProbeConfig) -> bool | None:
        prediction = self.predictions.get(config.key())
        return None if prediction is None else prediction.required_bytes <= self.allowed_bytes

    def unresolved(self) -> list[ProbeConfig]:
        return [c for c in self.candidates if not self.resolved(c)]


# -- strategies --------------------------------------------------------------------------------
def _precision_order(device_type: str) -> dict[str, int]:
    # Tensor cores make half precision fastest on GPUs; CPUs without AMX are often faster in fp32.
    order = ("bf16", "fp16", "fp32") if device_type == "cuda" else ("fp32", "bf16", "fp16")
    return {p: i for i, p in enumerate(order)}


def _group_priority(config: ProbeConfig, device_type: str) -> tuple:
    return (config.checkpointing, _precision_order(device_type).get(config.precision, 9),
            config.attention != "sdpa", -config.block_size)


class FrontierStrategy:
    """Binary-search each group's largest fitting micro-batch, then confirm the next smaller one
    is slower. Groups without checkpointing first: their results rule checkpointed configs out."""

    def __init__(self, knowledge: Knowledge, device_type: str) -> None:
        self.knowledge = knowledge
        groups: dict[tuple, list[ProbeConfig]] = {}
        for config in knowledge.candidates:
            groups.setdefault(group_key(config), []).append(config)
        self.groups = sorted((sorted(g, key=lambda c: c.micro_batch) for g in groups.values()),
                             key=lambda g: _group_priority(g[0], device_type))

    def next(self) -> tuple[ProbeConfig, str | None] | None:
        """(config, None) to probe it, (config, reason) to record it skipped, None when done."""
        for group in self.groups:
            choice = self._next_in_group(group)
            if choice is not None:
                return choice
        return None

    def _next_in_group(self, group: list[ProbeConfig]) -> tuple[ProbeConfig, str | None] | None:
        k = self.knowledge
        for config in group:  # structure first: a config already ruled out costs nothing
            if not k.resolved(config):
                reason = k.implied_skip(config)
                if reason:
                    return config, reason
        status = [k.outcomes[c.key()].status if k.resolved(c) else None for c in group]
        fits = [i for i, s in enumerate(status) if s == "ok"]
        lo = max(fits) if fits else -1                      # largest index known to fit
        tops = [i for i, s in enumerate(status) if s == "oom" and i > lo]
        hi = min(tops) if tops else len(group)              # smallest index known not to fit
        between = [i for i in range(lo + 1, hi) if status[i] is None]
        if between:
            predicted_fit = [i for i in between if k.predicted_to_fit(group[i])]
            if predicted_fit and not fits:
                # Start at the largest predicted to fit: usually the frontier itself.
                return group[predicted_fit[-1]], None
            # Binary search; an OOM in the middle rules out everything above it unprobed.
            return group[between[(len(between) - 1) // 2]], None
        if not fits:
            # Nothing fits, or what lies between failed for other reasons: nothing to learn here.
            return None
        best = max(fits, key=lambda i: k.outcomes[group[i].key()].tokens_per_s or 0.0)
        below = best - 1
        if below >= 0 and status[below] is None:
            return group[below], None                       # confirm that a smaller micro-batch is slower
        # The group is settled: smaller micro-batches fit but are slower (throughput fell going down).
        for i in range(0, best):
            if status[i] is None:
                return group[i], (f"fits (a larger micro-batch does) but {group[below].label()} was already slower "
                                  f"than {group[best].label()}")
        return None


class GridStrategy:
    def __init__(self, knowledge: Knowledge, prune: bool) -> None:
        self.knowledge, self.prune = knowledge, prune
        self.order = sorted(knowledge.candidates, key=lambda c: (group_key(c), c.micro_batch))

    def next(self) -> tuple[ProbeConfig, str | None] | None:
        for config in self.order:
            if not self.knowledge.resolved(config):
                reason = self.knowledge.implied_skip(config) if self.prune else None
                return config, reason
        return None


class TpeStrategy:
    """Optuna's TPE proposes; repeats and configs ruled out by structure are answered without a probe."""

    def __init__(self, knowledge: Knowledge, optuna_study, distributions: dict, patience_default: int = 10) -> None:
        self.knowledge, self.study, self.distributions = knowledge, optuna_study, distributions
        self.pending_trial = None
        self._misses = 0

    def next(self) -> tuple[ProbeConfig, str | None] | None:
        k = self.knowledge
        while k.unresolved():
            trial = self.study.ask(self.distributions)
            config = _config_from_params(k.candidates, trial.params)
            if config is None or k.resolved(config):
                # A repeat: answer from what is known so the sampler learns without a probe.
                known = k.outcomes.get(config.key()) if config is not None else None
                _tell(self.study, trial, known)
                self._misses += 1
                if self._misses > 20 * len(k.candidates):
                    break  # the sampler keeps repeating itself: fall back to the remaining candidates in order
                continue
            self.pending_trial = trial
            return config, k.implied_skip(config)
        for config in k.unresolved():
            return config, k.implied_skip(config)
        return None


def _config_from_params(candidates: list[ProbeConfig], params: dict) -> ProbeConfig | None:
    for c in candidates:
        if (c.micro_batch, c.block_size, c.precision, c.checkpointing, c.attention) == (
                params["micro_batch"], params["block_size"], params["precision"], params["checkpointing"], params["attention"]):
            return c
    return None  # a micro-batch/block pair that cannot keep the effective batch exact


def _tell(optuna_study, trial, result: ProbeResult | None) -> None:
    """Report an outcome to Optuna: fits -> tokens/s, feasible; OOM or ruled out -> infeasible."""
    from optuna.trial import TrialState

    if result is None or result.status in RETRYABLE:
        optuna_study.tell(trial, state=TrialState.FAIL)
        return
    if result.status == "ok":
        trial.set_constraint("memory", -1.0)
        optuna_study.tell(trial, float(result.tokens_per_s or 0.0))
    else:  # oom, unstable, skipped: the sampler should move away from here
        trial.set_constraint("memory", 1.0)
        optuna_study.tell(trial, 0.0)


# -- predictions -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Prediction:
    peak_bytes: int        # predicted peak allocated (stored beside the measurement)
    floor_bytes: int       # peak allocated + context: a floor of what the config needs
    required_bytes: int    # predicted peak reserved + context: what the probe's fit rule compares


def predict(candidates: list[ProbeConfig], device_type: str) -> dict[str, Prediction]:
    """Predicted memory of every candidate from two traces per group (smallest and largest
    micro-batch), interpolated: inside a group the need is affine in the micro-batch (fixed
    weights, gradients and optimizer state; activations per sequence)."""
    from autotune.estimate import estimate_memories

    groups: dict[tuple, list[ProbeConfig]] = {}
    for config in candidates:
        groups.setdefault(group_key(config), []).append(config)
    ends = {}
    for members in groups.values():
        members.sort(key=lambda c: c.micro_batch)
        ends[group_key(members[0])] = (members[0], members[-1])
    to_trace = list(dict.fromkeys(c for pair in ends.values() for c in pair))
    estimates = {e.config.key(): e for e in estimate_memories(to_trace, device_type=device_type)}
    out: dict[str, Prediction] = {}
    for key, (low, high) in ends.items():
        a, b = estimates[low.key()], estimates[high.key()]
        span = high.micro_batch - low.micro_batch
        for config in groups[key]:
            t = (config.micro_batch - low.micro_batch) / span if span else 0.0
            peak = round(a.peak_bytes + t * (b.peak_bytes - a.peak_bytes))
            reserved = round(a.reserved_bytes + t * (b.reserved_bytes - a.reserved_bytes))
            out[config.key()] = Prediction(peak, peak + a.context_bytes, reserved + a.context_bytes)
    return out


# -- the driver --------------------------------------------------------------------------------
@contextmanager
def stop_on_first_interrupt() -> Iterator[threading.Event]:
    """The first Ctrl-C asks the search to stop after the probe in flight; a second one aborts it."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def default_study_name(spec: ModelSpec, budget_bytes: int) -> str:
    """'gpt2-8GiB': the model's last path part and the budget, so the same command resumes."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if budget_bytes % (scale // 4) == 0:
            size = f"{budget_bytes / scale:g}{unit}"
            break
    else:
        size = f"{budget_bytes}B"
    return f"{spec.reference.rstrip('/').split('/')[-1]}-{size}"


def _optuna_study(store_url: str, name: str):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sqlite = store_url.startswith("sqlite")
    storage = optuna.storages.RDBStorage(store_url, engine_kwargs={"connect_args": {"timeout": 30}} if sqlite else {})
    if sqlite:
        # Optuna commits several times per trial; in WAL mode synchronous=NORMAL still keeps every
        # committed trial through a killed process (only a power cut could lose the last ones),
        # and saves an fsync per commit, as autotune's own engine does.
        from sqlalchemy import event

        event.listen(storage.engine, "connect", lambda conn, _record: conn.execute("PRAGMA synchronous = NORMAL"))
        storage.engine.dispose()
    study = optuna.create_study(storage=storage, study_name=f"autotune:{name}", direction="maximize",
                                load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=5))
    # Trials left running by an interrupted search will never be told: close them so they do not
    # count as pending (each was either recorded by autotune or lost with the interrupt).
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
    return study


def _distributions(space: SearchSpace) -> dict:
    from optuna.distributions import CategoricalDistribution

    return {
        "micro_batch": CategoricalDistribution(list(space.micro_batches)),
        "block_size": CategoricalDistribution(list(space.block_sizes)),
        "precision": CategoricalDistribution(list(space.precisions)),
        "checkpointing": CategoricalDistribution(list(space.checkpointing)),
        "attention": CategoricalDistribution(list(space.attentions)),
    }


def _params(config: ProbeConfig) -> dict:
    return {"micro_batch": config.micro_batch, "block_size": config.block_size, "precision": config.precision,
            "checkpointing": config.checkpointing, "attention": config.attention}


def run_search(
    space: SearchSpace,
    spec: ModelSpec,
    budget_bytes: int,
    margin_bytes: int,
    runner: Runner,
    store: Store,
    options: SearchOptions | None = None,
    on_event: Callable[[Event], None] | None = None,
    on_start: Callable[[StudyRecord, Environment, int, int], None] | None = None,
    predictor: Callable[[list[ProbeConfig], str], dict[str, Prediction]] | None = None,
) -> SearchOutcome:
    """Search `space` for the fastest configuration of `spec` that fits `budget_bytes`.

    Every resolved candidate is stored as it finishes (one transaction each), so an interrupted
    search resumes with the same study name and re-runs nothing it finished.
    """
    options = options or SearchOptions()
    started = time.perf_counter()
    candidates = space.candidates()
    name = options.study or default_study_name(spec, budget_bytes)

    # A finished study of the same space answers from the database: no worker, no torch.
    if not options.fresh:
        finished = _finished_study(store, name, space)
        if finished is not None:
            return SearchOutcome(study=finished, space=space, leaderboard=store.leaderboard(name), candidates=len(candidates),
                                 seconds=time.perf_counter() - started, answered_from_database=True)

    environment = runner.environment()
    _check_resumable(store, name, environment)
    study = store.get_or_create_study(name, model=spec, environment=environment, budget_bytes=budget_bytes,
                                      margin_bytes=margin_bytes, effective_batch=space.work_per_step, space=space.to_dict())
    knowledge = Knowledge(candidates, allowed_bytes=budget_bytes - margin_bytes,
                          skip_over_bytes=int(budget_bytes * (1 + options.predict_margin)))
    keys = {c.key() for c in candidates}
    for record in store.probes(name):  # resume: everything this study already settled
        if record.config_key in keys and record.result.status not in RETRYABLE:
            knowledge.learn(record.config, record.result)
    if on_start is not None:
        on_start(study, environment, len(candidates), len(knowledge.outcomes))
    if options.predict and options.strategy != "grid-full" and knowledge.unresolved():
        knowledge.predictions = (predictor or predict)(knowledge.unresolved(), environment.device_type)

    optuna_study = _optuna_study(store.engine.url.render_as_string(hide_password=False), name)
    distributions = _distributions(space)
    if options.strategy == "frontier":
        strategy = FrontierStrategy(knowledge, environment.device_type)
    elif options.strategy == "tpe":
        strategy = TpeStrategy(knowledge, optuna_study, distributions)
    else:
        strategy = GridStrategy(knowledge, prune=options.strategy == "grid")
    patience = options.patience if options.patience is not None else (10 if options.strategy == "tpe" else None)

    outcome = SearchOutcome(study=study, space=space, leaderboard=[], candidates=len(candidates))
    since_improvement = 0
    env_fp = environment.fingerprint()
    with stop_on_first_interrupt() as stop:
        while True:
            if stop.is_set():
                outcome.stop_reason = "interrupted"
                break
            choice = strategy.next()
            if choice is None:
                outcome.stop_reason = "exhausted"
                break
            config, skip_reason = choice
            trial = getattr(strategy, "pending_trial", None)
            if trial is None:
                optuna_study.enqueue_trial(_params(config), skip_if_exists=False)
                trial = optuna_study.ask(distributions)
            if isinstance(strategy, TpeStrategy):
                strategy.pending_trial = None

            previous_best = knowledge.best()
            if skip_reason is not None:
                result = ProbeResult(status="skipped", budget_bytes=budget_bytes, margin_bytes=margin_bytes, error=skip_reason)
                how = "skipped"
                outcome.skipped += 1
            else:
                cached = None if options.fresh else store.find_cached(config.key(), env_fp, spec.fingerprint, budget_bytes, margin_bytes)
                if cached is not None:
                    result, how = cached, "reused"
                    outcome.reused += 1
                else:
                    if options.max_trials is not None and outcome.probed >= options.max_trials:
                        _tell(optuna_study, trial, None)
                        outcome.stop_reason = "max-trials"
                        break
                    if options.timeout is not None and time.perf_counter() - started >= options.timeout:
                        _tell(optuna_study, trial, None)
                        outcome.stop_reason = "timeout"
                        break
                    result = runner.run(config, budget_bytes, spec)
                    how = "probed"
                    outcome.probed += 1
                    outcome.probes_seconds += result.wall_seconds or 0.0
            prediction = knowledge.predictions.get(config.key())
            store.record_probe(study.id, config, result, env_fingerprint=env_fp, trial_number=trial.number,
                               cacheable=None if how != "skipped" else False,
                               predicted_peak_bytes=prediction.peak_bytes if prediction else None)
            _tell(optuna_study, trial, result)
            # Timeouts, crashes and errors are learnt too, so this run does not ask again; a
            # resumed search ignores them (RETRYABLE) and tries once more.
            knowledge.learn(config, result)
            best = knowledge.best()
            improved = best is not None and (previous_best is None or best[0].key() != previous_best[0].key())
            if how == "probed":
                since_improvement = 0 if improved else since_improvement + 1
            if on_event is not None:
                on_event(Event(config, result, how, len(knowledge.outcomes), len(candidates),
                               best is not None and best[0].key() == config.key()))
            if patience is not None and since_improvement >= patience:
                outcome.stop_reason = "patience"
                break

    status = "finished" if outcome.finished else "interrupted"
    store.set_study_status(study.id, status)
    outcome.study = store.study(name)
    outcome.leaderboard = store.leaderboard(name)
    outcome.seconds = time.perf_counter() - started
    return outcome


def _check_resumable(store: Store, name: str, environment: Environment) -> None:
    """A study's probes compare only on one environment: refuse, before writing anything, to mix."""
    from autotune.errors import StudyNotFound

    try:
        study = store.study(name)
    except StudyNotFound:
        return
    if study.env_fingerprint != environment.fingerprint():
        raise BadInput(f"study {name!r} was run on {study.device_name} (or with other library versions); "
                       f"give a new --study name to search on {environment.device_name}.")


def search(model: str, budget_bytes: int, *, settings, options: SearchOptions, db: str | None = None,
           on_event: Callable[[Event], None] | None = None,
           on_start: Callable[[StudyRecord, Environment, int, int], None] | None = None, **space_args) -> SearchOutcome:
    """`autotune search`: resolve the model, build the space, open the store, start a probe runner,
    search. Everything a user can get wrong is checked before the database is opened."""
    from autotune.models import resolve_model
    from autotune.probe import ProbeRunner
    from autotune.store import open_store
    from autotune.units import format_size

    spec = resolve_model(model)
    space = SearchSpace.build(spec, **space_args)
    space.candidates()  # raises BadInput when no micro-batch keeps the effective batch exact
    margin = settings.margin_bytes(budget_bytes)
    if margin >= budget_bytes:
        raise BadInput(f"--safety-margin {format_size(margin)} leaves nothing of the {format_size(budget_bytes)} budget; use a smaller margin.")
    with open_store(db) as store, ProbeRunner(settings) as runner:
        return run_search(space, spec, budget_bytes, margin, runner, store, options, on_event, on_start)


def _finished_study(store: Store, name: str, space: SearchSpace) -> StudyRecord | None:
    from autotune.errors import StudyNotFound

    try:
        study = store.study(name)
    except StudyNotFound:
        return None
    return study if study.status == "finished" and study.space == space.to_dict() else None

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

Several workers can share one study (`autotune worker`, `autotune search --workers N`; see
autotune/workers.py): each claims a configuration in the database before probing it (Store.claim),
so every configuration is probed once whichever worker takes it, and reads what the others found
before each pick, so an OOM found by one prunes for all. Configurations in flight on other workers
are unavailable to the strategies, and so are those an in-flight probe could rule out (speculative):
a worker with nothing else to do waits for the results instead of probing what may prove needless.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from autotune.config import ProbeConfig
from autotune.environment import Environment
from autotune.errors import BadInput
from autotune.models import ModelSpec
from autotune.result import ProbeResult
from autotune.space import SearchSpace, dominates_in_memory, group_key
from autotune.store import MAX_ATTEMPTS, LeaderboardRow, Store, StudyRecord
from autotune.units import format_size

STRATEGIES = ("frontier", "tpe", "grid", "grid-full")
# Statuses that say nothing about a config's memory need: the search may try it again on resume.
RETRYABLE = ("timeout", "crashed", "error")
# A worker writes its claim's heartbeat this often; a claim is stale (its worker presumed dead, the
# config handed to another) after STALE_BEATS periods without one.
HEARTBEAT_SECONDS = 5.0
STALE_BEATS = 3
log = logging.getLogger("autotune")


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
    heartbeat_seconds: float = HEARTBEAT_SECONDS  # claims' heartbeat period, for the whole study

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise BadInput(f"--strategy {self.strategy!r} is unknown; choose from {', '.join(STRATEGIES)}.")
        if self.max_trials is not None and self.max_trials < 1:
            raise BadInput("--max-trials must be at least 1.")
        if self.patience is not None and self.patience < 1:
            raise BadInput("--patience must be at least 1.")
        if not 0 <= self.predict_margin < 10:
            raise BadInput("--predict-margin must be between 0 and 10 (a share of the budget, e.g. 0.1).")
        if not 0 < self.heartbeat_seconds <= 3600:
            raise BadInput("--heartbeat must be between 0 and 3600 seconds (e.g. 5).")

    @property
    def stale_after(self) -> float:
        return STALE_BEATS * self.heartbeat_seconds


@dataclass(slots=True)
class Event:
    """One resolved candidate, for the live display."""

    config: ProbeConfig
    result: ProbeResult
    how: str                 # 'probed', 'reused' (stored result) or 'skipped' (ruled out by structure)
    resolved: int            # candidates resolved so far, this one included
    total: int               # candidates in the space
    best: bool               # the best config so far
    worker: str | None = None  # the worker that settled it, when several share the study


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
    workers: int = 1                   # worker processes that searched (autotune search --workers)
    failures: list[str] = field(default_factory=list)  # workers that ended in error, one line each

    @property
    def best(self) -> LeaderboardRow | None:
        return self.leaderboard[0] if self.leaderboard else None

    @property
    def finished(self) -> bool:
        # 'finished': another worker of the study finished it (its patience ran out).
        return self.stop_reason in ("exhausted", "patience", "finished")


@dataclass(slots=True)
class Knowledge:
    """What is known about each candidate of the space, and what it implies for the others."""

    candidates: list[ProbeConfig]
    outcomes: dict[str, ProbeResult] = field(default_factory=dict)   # by config key
    predictions: dict[str, "Prediction"] = field(default_factory=dict)
    allowed_bytes: int = 0          # budget less margin: what a config may need
    skip_over_bytes: int = 0        # predicted need above which a config is not probed
    busy: dict[str, ProbeConfig] = field(default_factory=dict)  # in flight on other workers, by key

    def resolved(self, config: ProbeConfig) -> bool:
        return config.key() in self.outcomes

    def available(self, config: ProbeConfig) -> bool:
        """Not in flight on another worker."""
        return config.key() not in self.busy

    def speculative(self, config: ProbeConfig) -> bool:
        """Whether probes in flight elsewhere could make probing `config` needless, so that it is
        better left until they report: one of them could run out of memory and rule `config` out,
        or `config` checkpoints and its twin without checkpointing, still undecided, is in a group
        being searched (a twin that fits rules `config` out). A lone worker never waits on this."""
        if not self.busy:
            return False
        fitting = [c for c, _ in self.ok()]
        twin_group = None
        if config.checkpointing:
            twin = replace(config, checkpointing=False)
            if twin.key() in {c.key() for c in self.candidates} and not self.resolved(twin):
                twin_group = group_key(twin)
        for other in self.busy.values():
            if other.key() == config.key():
                continue
            if twin_group is not None and group_key(other) == twin_group:
                return True
            if (dominates_in_memory(other, config) and not any(dominates_in_memory(other, f) for f in fitting)
                    and not any(dominates_in_memory(config, f) for f in fitting)):
                return True  # `other` may not fit (nothing as large is known to), and then neither does `config`
        return False

    def open(self, config: ProbeConfig) -> bool:
        """Unresolved, not in flight elsewhere, and not waiting on a result in flight: worth a probe now."""
        return not self.resolved(config) and self.available(config) and not self.speculative(config)

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
                    and dominates_in_memory(replace(config, checkpointing=False), other)):
                # Its twin without checkpointing fits (it is no larger than `other`, which does).
                if (other.micro_batch, other.block_size) == (config.micro_batch, config.block_size):
                    return f"{other.label()} fits without checkpointing, which only adds recomputation"
                return (f"fits without checkpointing (the larger {other.label()} does), and checkpointing only "
                        f"adds recomputation")
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
        """(config, None) to probe it, (config, reason) to record it skipped, None when there is
        nothing to do now (done, or waiting for probes in flight on other workers)."""
        for group in self.groups:
            choice = self._next_in_group(group)
            if choice is not None:
                return choice
        return None

    def _next_in_group(self, group: list[ProbeConfig]) -> tuple[ProbeConfig, str | None] | None:
        k = self.knowledge
        for config in group:  # structure first: a config already ruled out costs nothing
            if not k.resolved(config) and k.available(config):
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
            # With other workers, what they probe now is not ours to pick, nor what their results
            # may rule out: the search goes on below a micro-batch in flight, or in another group.
            between = [i for i in between if k.open(group[i])]
            if not between:
                return None
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
            # Confirm that a smaller micro-batch is slower (unless another worker is at it).
            return (group[below], None) if k.open(group[below]) else None
        # The group is settled: smaller micro-batches fit but are slower (throughput fell going down).
        for i in range(0, best):
            if status[i] is None and k.available(group[i]):
                return group[i], (f"fits (a larger micro-batch does) but {group[below].label()} was already slower "
                                  f"than {group[best].label()}")
        return None


class GridStrategy:
    def __init__(self, knowledge: Knowledge, prune: bool) -> None:
        self.knowledge, self.prune = knowledge, prune
        self.order = sorted(knowledge.candidates, key=lambda c: (group_key(c), c.micro_batch))

    def next(self) -> tuple[ProbeConfig, str | None] | None:
        k = self.knowledge
        for config in self.order:
            if k.resolved(config) or not k.available(config):
                continue
            reason = k.implied_skip(config) if self.prune else None
            if reason is None and self.prune and k.speculative(config):
                continue  # an OOM in flight elsewhere may rule it out: probe others first
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
        while any(k.available(c) for c in k.unresolved()) and self._misses <= 20 * len(k.candidates):
            trial = self.study.ask(self.distributions)
            config = _config_from_params(k.candidates, trial.params)
            if config is None or k.resolved(config):
                # A repeat: answer from what is known so the sampler learns without a probe.
                known = k.outcomes.get(config.key()) if config is not None else None
                _tell(self.study, trial, known)
                self._misses += 1  # past 20 per candidate, fall back to the remaining ones in order
                continue
            if not k.available(config):
                # In flight on another worker: its result will reach the sampler; take other work.
                _tell(self.study, trial, None)
                break
            self.pending_trial = trial
            return config, k.implied_skip(config)
        for config in k.unresolved():
            if k.available(config):
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

    # skip_if_finished: a search starting beside running workers may have closed this trial.
    if result is None or result.status in RETRYABLE:
        optuna_study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        return
    if result.status == "ok":
        trial.set_constraint("memory", -1.0)
        optuna_study.tell(trial, float(result.tokens_per_s or 0.0), skip_if_finished=True)
    else:  # oom, unstable, skipped: the sampler should move away from here
        trial.set_constraint("memory", 1.0)
        optuna_study.tell(trial, 0.0, skip_if_finished=True)


def _frozen_trial(config: ProbeConfig, result: ProbeResult, distributions: dict):
    """The Optuna trial of a settled config, made after the fact, as _tell would have told it."""
    from optuna.trial import TrialState, create_trial

    params = _params(config)
    if result.status in RETRYABLE:
        return create_trial(state=TrialState.FAIL, params=params, distributions=distributions)
    if result.status == "ok":
        return create_trial(value=float(result.tokens_per_s or 0.0), params=params, distributions=distributions,
                            constraints={"memory": -1.0})
    return create_trial(value=0.0, params=params, distributions=distributions, constraints={"memory": 1.0})


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


def _optuna_study(store_url: str, name: str, seed: int | None = 0, storage=None):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage or _optuna_storage(store_url)
    return optuna.create_study(storage=storage, study_name=f"autotune:{name}", direction="maximize",
                               load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=5))


def _optuna_storage(store_url: str):
    import optuna

    sqlite = store_url.startswith("sqlite")
    # A server connection dropped while a long probe ran is replaced quietly, as in our own engine.
    engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 30}} if sqlite else {"pool_pre_ping": True}
    storage = optuna.storages.RDBStorage(store_url, engine_kwargs=engine_kwargs)
    if sqlite:
        # Optuna commits several times per trial; in WAL mode synchronous=NORMAL still keeps every
        # committed trial through a killed process (only a power cut could lose the last ones),
        # and saves an fsync per commit, as autotune's own engine does.
        from sqlalchemy import event

        event.listen(storage.engine, "connect", lambda conn, _record: conn.execute("PRAGMA synchronous = NORMAL"))
        storage.engine.dispose()
    return storage


class _Trials:
    """The study's Optuna record, in the same database: one trial per settled configuration.

    Only TPE asks Optuna what to probe. The other strategies' picks become trials after they are
    settled (a finished trial added to the storage), never by enqueue_trial + ask: with several
    workers on one study, a worker's ask() can pop the trial another worker enqueued. Optuna's
    record is secondary to autotune's own tables, so a write that fails even after retries is
    logged and the search goes on."""

    def __init__(self, store_url: str, name: str, distributions: dict, seed: int | None) -> None:
        self.storage = _optuna_storage(store_url)
        self.study = _optuna_study(store_url, name, seed, storage=self.storage)
        self.study_id = self.storage.get_study_id_from_name(self.study.study_name)
        self.distributions = distributions

    def add(self, config: ProbeConfig, result: ProbeResult) -> int | None:
        """Record a settled config as a finished trial; returns its number."""
        def work() -> int:
            trial_id = self.storage.create_new_trial(self.study_id, template_trial=_frozen_trial(config, result, self.distributions))
            return self.storage.get_trial_number_from_id(trial_id)

        return _optuna_retry(work)

    def tell(self, trial, result: ProbeResult | None) -> None:
        _optuna_retry(lambda: _tell(self.study, trial, result))

    def close_running(self) -> None:
        """Trials left running by an interrupted search will never be told: close them so they do
        not count as pending (each was either recorded by autotune or lost with the interrupt)."""
        from optuna.trial import TrialState

        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)

    def close(self) -> None:
        self.storage.engine.dispose()


def _optuna_retry(work: Callable[[], Any]) -> Any:
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import InterfaceError, OperationalError

    for delay in (0.5, 1.0, 2.0, 4.0, 8.0, None):
        try:
            return work()
        except (StorageInternalError, OperationalError, InterfaceError) as exc:
            if delay is None:
                log.warning("could not record an Optuna trial (%s); autotune's own record is kept", exc)
                return None
            time.sleep(delay)


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


def worker_label(device: str | None = None) -> str:
    """'host:pid:device', stored with each probe: which worker ran it. A worker given one GPU by
    CUDA_VISIBLE_DEVICES names that GPU."""
    device = device or "auto"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if device in ("auto", "cuda", "cuda:0") and visible and "," not in visible and visible != "-1":
        device = f"cuda:{visible}"
    return f"{socket.gethostname()}:{os.getpid()}:{device}"


class Heartbeat:
    """A daemon thread that keeps this worker's claim alive while it probes: it writes the claim's
    heartbeat every `interval` seconds. A worker killed mid-probe stops beating, and after
    STALE_BEATS periods another worker takes the configuration over."""

    def __init__(self, store: Store, study_id: int, worker: str, interval: float) -> None:
        self.store, self.study_id, self.worker, self.interval = store, study_id, worker, interval
        self._key: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autotune-heartbeat", daemon=True)
        self._thread.start()

    @contextmanager
    def holding(self, config_key: str) -> Iterator[None]:
        self._key = config_key
        try:
            yield
        finally:
            self._key = None

    def _run(self) -> None:
        from sqlalchemy.exc import InterfaceError, OperationalError

        while not self._stop.wait(self.interval):
            key = self._key
            if key is None:
                continue
            try:
                self.store.heartbeat(self.study_id, key, self.worker)
            except (OperationalError, InterfaceError) as exc:
                # One missed beat is not fatal: a claim goes stale only after STALE_BEATS of them.
                log.warning("heartbeat of %s failed: %s", key, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@dataclass(slots=True)
class _Worker:
    """One worker's part in a study: what it searches, on what, and what it has read of the others."""

    store: Store
    study: StudyRecord
    space: SearchSpace
    spec: ModelSpec
    budget_bytes: int
    margin_bytes: int
    environment: Environment
    options: SearchOptions
    knowledge: Knowledge
    label: str
    seen_probe_id: int = 0
    by_key: dict[str, ProbeConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_key = {c.key(): c for c in self.knowledge.candidates}

    def refresh(self, on_event: Callable[[Event], None] | None = None) -> str:
        """Learn what the study's workers settled since the last look, mark what is in flight on
        others, record configs whose claims were abandoned once too often as crashed. Returns the
        study's status (a worker stops when it is no longer running)."""
        k = self.knowledge
        # Probes before claims: a probe row and its claim's new state commit together, so a row
        # read here has its claim settled in the read below.
        rows = self.store.probes(self.study.name, after_id=self.seen_probe_id)
        claims = {c.config_key: c for c in self.store.claims(self.study.id, stale_after=self.options.stale_after)}
        for row in rows:
            self.seen_probe_id = max(self.seen_probe_id, row.id)
            config = self.by_key.get(row.config_key)
            claim = claims.get(row.config_key)
            # A claim settled, or (studies from before claims) an outcome a resumed search keeps.
            settled = claim.state != "running" if claim is not None else row.result.status not in RETRYABLE
            if config is None or not settled:
                continue
            new = not k.resolved(config)
            k.learn(config, row.result)
            if new and on_event is not None and row.worker != self.label:
                on_event(self._event(config, row.result, "skipped" if row.result.status == "skipped" else "probed", row.worker))
        k.busy = {}
        for key, claim in claims.items():
            config = self.by_key.get(key)
            if config is None or claim.state != "running" or k.resolved(config):
                continue
            if not claim.stale:
                k.busy[key] = config
            elif claim.attempts >= MAX_ATTEMPTS:
                self._abandon(config, claim, on_event)
        return self.store.study(self.study.name).status

    def _abandon(self, config: ProbeConfig, claim, on_event: Callable[[Event], None] | None) -> None:
        result = ProbeResult(status="crashed", budget_bytes=self.budget_bytes, margin_bytes=self.margin_bytes,
                             error=f"the worker probing it stopped heartbeating, {claim.attempts} times (last {claim.worker}); "
                                   f"not retried")
        probe_id = self.store.settle(self.study.id, config, result, how="abandoned", worker=self.label,
                                     env_fingerprint=self.study.env_fingerprint, stale_after=self.options.stale_after)
        if probe_id is not None:  # else another worker recorded it: the next refresh reads it
            self.knowledge.learn(config, result)
            if on_event is not None:
                on_event(self._event(config, result, "probed", claim.worker))

    def _event(self, config: ProbeConfig, result: ProbeResult, how: str, worker: str | None) -> Event:
        best = self.knowledge.best()
        return Event(config, result, how, len(self.knowledge.outcomes), len(self.knowledge.candidates),
                     best is not None and best[0].key() == config.key() and result.status == "ok", worker)


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
    search resumes with the same study name and re-runs nothing it finished. This process is the
    study's first worker; others may join it (autotune.workers.join_study) from any machine that
    reaches the database.
    """
    options = options or SearchOptions()
    started = time.perf_counter()
    name = options.study or default_study_name(spec, budget_bytes)

    # A finished study of the same space answers from the database: no worker, no torch.
    if not options.fresh:
        finished = _finished_study(store, name, space)
        if finished is not None:
            return SearchOutcome(study=finished, space=space, leaderboard=store.leaderboard(name), candidates=len(space.candidates()),
                                 seconds=time.perf_counter() - started, answered_from_database=True)
    worker, trials = start_study(space, spec, budget_bytes, margin_bytes, runner, store, options, on_start, predictor)
    try:
        return _work(worker, runner, trials, on_event, starter=True, started=started)
    finally:
        trials.close()


def start_study(
    space: SearchSpace,
    spec: ModelSpec,
    budget_bytes: int,
    margin_bytes: int,
    runner: Runner,
    store: Store,
    options: SearchOptions,
    on_start: Callable[[StudyRecord, Environment, int, int], None] | None = None,
    predictor: Callable[[list[ProbeConfig], str], dict[str, Prediction]] | None = None,
) -> tuple[_Worker, _Trials]:
    """Create or resume the study, predict memory, and store the plan that joining workers follow.
    Returns the first worker's state (run_search goes on to search with it)."""
    candidates = space.candidates()
    name = options.study or default_study_name(spec, budget_bytes)
    environment = runner.environment()
    _check_resumable(store, name, environment)
    study = store.get_or_create_study(name, model=spec, environment=environment, budget_bytes=budget_bytes,
                                      margin_bytes=margin_bytes, effective_batch=space.work_per_step, space=space.to_dict())
    store.reopen_claims(study.id, RETRYABLE)  # resume: timeouts and crashes get one more try
    knowledge = Knowledge(candidates, allowed_bytes=budget_bytes - margin_bytes,
                          skip_over_bytes=int(budget_bytes * (1 + options.predict_margin)))
    settings = getattr(runner, "settings", None)
    worker = _Worker(store, study, space, spec, budget_bytes, margin_bytes, environment, options, knowledge,
                     worker_label(getattr(settings, "device", None)))
    worker.refresh()  # everything this study already settled
    if on_start is not None:
        on_start(study, environment, len(candidates), len(knowledge.outcomes))
    stored = _predictions_from_plan(study.plan) if not options.fresh else {}
    if options.predict and options.strategy != "grid-full" and knowledge.unresolved():
        missing = [c for c in knowledge.unresolved() if c.key() not in stored]
        if missing:
            stored.update((predictor or predict)(missing, environment.device_type))
        knowledge.predictions = stored
    # Optuna's tables and study exist before the plan does: a worker may join as soon as it is
    # stored, and several processes creating Optuna's tables at once collide.
    trials = _Trials(store.engine.url.render_as_string(hide_password=False), name, _distributions(space), seed=0)
    store.set_study_plan(study.id, {
        "strategy": options.strategy, "fresh": options.fresh, "predict_margin": options.predict_margin,
        "patience": options.patience, "heartbeat_seconds": options.heartbeat_seconds,
        "probe": None if settings is None else {
            "warmup_steps": settings.warmup_steps, "measure_steps": settings.measure_steps,
            "timeout": settings.timeout, "trust_remote_code": settings.trust_remote_code,
        },
        "predictions": {key: [p.peak_bytes, p.floor_bytes, p.required_bytes] for key, p in knowledge.predictions.items()},
    })
    worker.study = store.study(name)
    if not any(c.state == "running" and not c.stale for c in store.claims(study.id, stale_after=options.stale_after)):
        trials.close_running()  # (only when no other worker is in the middle of a trial)
    return worker, trials


def _predictions_from_plan(plan: dict | None) -> dict[str, Prediction]:
    return {key: Prediction(*values) for key, values in ((plan or {}).get("predictions") or {}).items()}


def make_strategy(options: SearchOptions, knowledge: Knowledge, device_type: str, trials: _Trials):
    if options.strategy == "frontier":
        return FrontierStrategy(knowledge, device_type)
    if options.strategy == "tpe":
        return TpeStrategy(knowledge, trials.study, trials.distributions)
    return GridStrategy(knowledge, prune=options.strategy == "grid")


def _work(w: _Worker, runner: Runner, trials: _Trials, on_event: Callable[[Event], None] | None, *,
          starter: bool, started: float) -> SearchOutcome:
    """Take configurations of the study until none is left, the study is stopped, or a limit of
    this worker is reached. The starter sets the study's status when it stops; a joining worker
    marks it finished when the space is done and leaves it alone otherwise."""
    store, k, options = w.store, w.knowledge, w.options
    strategy = make_strategy(options, k, w.environment.device_type, trials)
    patience = options.patience if options.patience is not None else (10 if options.strategy == "tpe" else None)
    outcome = SearchOutcome(study=w.study, space=w.space, leaderboard=[], candidates=len(k.candidates))
    since_improvement = 0
    env_fp = w.environment.fingerprint()
    heartbeat = Heartbeat(store, w.study.id, w.label, options.heartbeat_seconds)
    try:
        with stop_on_first_interrupt() as stop:
            while True:
                if stop.is_set():
                    outcome.stop_reason = "interrupted"
                    break
                status = w.refresh(on_event)
                if status != "running":
                    outcome.stop_reason = "finished" if status == "finished" else "stopped"
                    break
                choice = strategy.next()
                if choice is None:
                    if not k.busy:
                        outcome.stop_reason = "exhausted"
                        break
                    if options.timeout is not None and time.perf_counter() - started >= options.timeout:
                        outcome.stop_reason = "timeout"
                        break
                    # Nothing to do until probes in flight on other workers report: wait for them.
                    stop.wait(min(1.0, options.heartbeat_seconds))
                    continue
                config, skip_reason = choice
                trial = getattr(strategy, "pending_trial", None)
                if isinstance(strategy, TpeStrategy):
                    strategy.pending_trial = None

                previous_best = k.best()
                prediction = k.predictions.get(config.key())
                settle: dict[str, Any] = {"worker": w.label, "env_fingerprint": env_fp,
                                          "trial_number": trial.number if trial is not None else None,
                                          "predicted_peak_bytes": prediction.peak_bytes if prediction else None}
                if skip_reason is not None:
                    result = ProbeResult(status="skipped", budget_bytes=w.budget_bytes, margin_bytes=w.margin_bytes, error=skip_reason)
                    how = "skipped"
                    probe_id = store.settle(w.study.id, config, result, how="unclaimed", cacheable=False, **settle)
                    outcome.skipped += probe_id is not None
                else:
                    cached = None if options.fresh else store.find_cached(config.key(), env_fp, w.spec.fingerprint, w.budget_bytes, w.margin_bytes)
                    if cached is not None:
                        result, how = cached, "reused"
                        probe_id = store.settle(w.study.id, config, result, how="unclaimed", **settle)
                        outcome.reused += probe_id is not None
                    else:
                        limit = ("max-trials" if options.max_trials is not None and outcome.probed >= options.max_trials
                                 else "timeout" if options.timeout is not None and time.perf_counter() - started >= options.timeout
                                 else None)
                        if limit is not None:
                            if trial is not None:
                                trials.tell(trial, None)
                            outcome.stop_reason = limit
                            break
                        if store.claim(w.study.id, config.key(), w.label, stale_after=options.stale_after) is None:
                            # Another worker took it between our look and our claim: pick again.
                            if trial is not None:
                                trials.tell(trial, None)
                            continue
                        result = _probe(w, runner, heartbeat, config)
                        how = "probed"
                        outcome.probed += 1
                        outcome.probes_seconds += result.wall_seconds or 0.0
                        probe_id = store.settle(w.study.id, config, result, how="claimed", **settle)
                if probe_id is None:
                    # Settled by another worker first (the same skip found at once, or a claim taken
                    # over from this worker while it looked dead): theirs is the stored outcome.
                    if trial is not None:
                        trials.tell(trial, None)
                    continue
                if trial is not None:
                    trials.tell(trial, result)
                else:
                    number = trials.add(config, result)
                    if number is not None:
                        store.set_trial_number(probe_id, number)
                # Timeouts, crashes and errors are learnt too, so this run does not ask again; a
                # resumed search ignores them (RETRYABLE) and tries once more.
                k.learn(config, result)
                best = k.best()
                improved = best is not None and (previous_best is None or best[0].key() != previous_best[0].key())
                if how == "probed":
                    since_improvement = 0 if improved else since_improvement + 1
                if on_event is not None:
                    on_event(Event(config, result, how, len(k.outcomes), len(k.candidates),
                                   best is not None and best[0].key() == config.key(), w.label))
                if patience is not None and since_improvement >= patience:
                    outcome.stop_reason = "patience"
                    break
    finally:
        heartbeat.close()

    if starter:
        store.set_study_status(w.study.id, "finished" if outcome.finished else "interrupted")
    elif outcome.finished and outcome.stop_reason != "finished":
        store.set_study_status(w.study.id, "finished")
    outcome.study = store.study(w.study.name)
    outcome.leaderboard = store.leaderboard(w.study.name)
    outcome.seconds = time.perf_counter() - started
    return outcome


def _probe(w: _Worker, runner: Runner, heartbeat: Heartbeat, config: ProbeConfig) -> ProbeResult:
    """Run a claimed probe, heartbeating; a probe that does not end (a second Ctrl-C, a user error
    raised by the runner) gives its claim back, so that it is not left to go stale."""
    try:
        with heartbeat.holding(config.key()):
            return runner.run(config, w.budget_bytes, w.spec)
    except BaseException:
        w.store.release_claim(w.study.id, config.key(), w.label)
        raise


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
           on_start: Callable[[StudyRecord, Environment, int, int], None] | None = None,
           workers: int | None = None, **space_args) -> SearchOutcome:
    """`autotune search`: resolve the model, build the space, open the store, start a probe runner,
    search. Everything a user can get wrong is checked before the database is opened. With
    `workers`, the search runs in that many worker processes (autotune.workers)."""
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
    if workers is not None:
        from autotune.workers import search_with_workers

        return search_with_workers(spec, space, budget_bytes, margin, workers=workers, settings=settings, options=options,
                                   db=db, on_start=on_start, on_event=on_event)
    with open_store(db) as store, ProbeRunner(settings) as runner:
        return run_search(space, spec, budget_bytes, margin, runner, store, options, on_event, on_start)


def _finished_study(store: Store, name: str, space: SearchSpace) -> StudyRecord | None:
    from autotune.errors import StudyNotFound

    try:
        study = store.study(name)
    except StudyNotFound:
        return None
    return study if study.status == "finished" and study.space == space.to_dict() else None

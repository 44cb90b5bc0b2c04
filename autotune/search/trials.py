"""Optuna's record of a study, in the same database as autotune's tables: one trial per settled
configuration. An OOM is a completed trial that violates the memory constraint (TPE ignores failed
trials, so an OOM told as a failure would be proposed again)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from autotune.config import ProbeConfig
from autotune.result import ProbeResult
from autotune.status import RETRYABLE, ProbeStatus
from autotune.space import SearchSpace

log = logging.getLogger("autotune")


def tell(optuna_study, trial, result: ProbeResult | None) -> None:
    """Report an outcome to Optuna: fits -> tokens/s, feasible; OOM or ruled out -> infeasible."""
    from optuna.trial import TrialState

    # skip_if_finished: a search starting beside running workers may have closed this trial.
    if result is None or result.status in RETRYABLE:
        optuna_study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        return
    if result.status == ProbeStatus.OK:
        trial.set_constraint("memory", -1.0)
        optuna_study.tell(trial, float(result.tokens_per_s or 0.0), skip_if_finished=True)
    else:  # oom, unstable, skipped: the sampler should move away from here
        trial.set_constraint("memory", 1.0)
        optuna_study.tell(trial, 0.0, skip_if_finished=True)


def frozen_trial(config: ProbeConfig, result: ProbeResult, distributions: dict):
    """The Optuna trial of a settled config, made after the fact, as _tell would have told it."""
    from optuna.trial import TrialState, create_trial

    params = params_of(config)
    if result.status in RETRYABLE:
        return create_trial(state=TrialState.FAIL, params=params, distributions=distributions)
    if result.status == ProbeStatus.OK:
        return create_trial(value=float(result.tokens_per_s or 0.0), params=params, distributions=distributions,
                            constraints={"memory": -1.0})
    return create_trial(value=0.0, params=params, distributions=distributions, constraints={"memory": 1.0})


def optuna_study(store_url: str, name: str, seed: int | None = 0, storage=None):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage or optuna_storage(store_url)
    return optuna.create_study(storage=storage, study_name=optuna_study_name(storage, name), direction="maximize",
                               load_if_exists=True, sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=5))


# Studies created before this release named their Optuna study with this prefix; they keep it.
LEGACY_PREFIX = "autotune:"


def optuna_study_name(storage, name: str) -> str:
    """The Optuna study of autotune study `name`: the same name, so that
    `optuna.load_study(study_name=name, storage=URL)` finds it (an older study keeps its
    'autotune:' name, which its trials are stored under)."""
    try:
        storage.get_study_id_from_name(LEGACY_PREFIX + name)
    except KeyError:
        return name
    return LEGACY_PREFIX + name


def optuna_storage(store_url: str):
    import optuna

    from sqlalchemy.engine import make_url

    from autotune.store.engine import postgres_connect_args

    url = make_url(store_url)
    sqlite = url.get_backend_name() == "sqlite"
    # A server connection dropped while a long probe ran is replaced quietly, as in our own engine;
    # a server that never answers is given up on, with the same timeouts as ours.
    engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 30}} if sqlite else {"pool_pre_ping": True}
    if url.get_backend_name() == "postgresql":
        engine_kwargs["connect_args"] = postgres_connect_args(url)
    storage = optuna.storages.RDBStorage(store_url, engine_kwargs=engine_kwargs)
    if sqlite:
        # Optuna commits several times per trial; in WAL mode synchronous=NORMAL still keeps every
        # committed trial through a killed process (only a power cut could lose the last ones),
        # and saves an fsync per commit, as autotune's own engine does.
        from sqlalchemy import event

        event.listen(storage.engine, "connect", lambda conn, _record: conn.execute("PRAGMA synchronous = NORMAL"))
        storage.engine.dispose()
    return storage


class Trials:
    """The study's Optuna record, in the same database: one trial per settled configuration.

    Only TPE asks Optuna what to probe. The other strategies' picks become trials after they are
    settled (a finished trial added to the storage), never by enqueue_trial + ask: with several
    workers on one study, a worker's ask() can pop the trial another worker enqueued. Optuna's
    record is secondary to autotune's own tables, so a write that fails even after retries is
    logged and the search goes on."""

    def __init__(self, store_url: str, name: str, distributions: dict, seed: int | None) -> None:
        self.storage = optuna_storage(store_url)
        self.study = optuna_study(store_url, name, seed, storage=self.storage)
        self.study_id = self.storage.get_study_id_from_name(self.study.study_name)
        self.distributions = distributions

    def add(self, config: ProbeConfig, result: ProbeResult) -> int | None:
        """Record a settled config as a finished trial; returns its number."""
        def work() -> int:
            trial_id = self.storage.create_new_trial(self.study_id, template_trial=frozen_trial(config, result, self.distributions))
            return self.storage.get_trial_number_from_id(trial_id)

        return optuna_retry(work)

    def tell(self, trial, result: ProbeResult | None) -> None:
        optuna_retry(lambda: tell(self.study, trial, result))

    def close_running(self) -> None:
        """Trials left running by an interrupted search will never be told: close them so they do
        not count as pending (each was either recorded by autotune or lost with the interrupt)."""
        from optuna.trial import TrialState

        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self.study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)

    def close(self) -> None:
        self.storage.engine.dispose()


def optuna_retry(work: Callable[[], Any]) -> Any:
    """Run an Optuna storage call under the store's retry policy (Optuna wraps the driver's error
    in StorageInternalError: the cause decides whether waiting helps). A trial that cannot be
    written is logged and dropped: autotune's own record of the probe is kept, and a database
    that fails for good (a full disk) stops the search at autotune's next write, in one line."""
    from optuna.exceptions import StorageInternalError
    from sqlalchemy.exc import SQLAlchemyError

    from autotune.store.base import is_transient, retry_transient

    def transient(exc: BaseException) -> bool:
        cause = exc.__cause__ if isinstance(exc, StorageInternalError) and exc.__cause__ is not None else exc
        return is_transient(cause)

    try:
        return retry_transient(work, transient=transient)
    except (StorageInternalError, SQLAlchemyError) as exc:
        log.warning("could not record an Optuna trial (%s); autotune's own record is kept", exc)
        return None


def distributions_of(space: SearchSpace) -> dict:
    from optuna.distributions import CategoricalDistribution

    return {
        "micro_batch": CategoricalDistribution(list(space.micro_batches)),
        "block_size": CategoricalDistribution(list(space.block_sizes)),
        "precision": CategoricalDistribution(list(space.precisions)),
        "checkpointing": CategoricalDistribution(list(space.checkpointing)),
        "attention": CategoricalDistribution(list(space.attentions)),
        "optimizer": CategoricalDistribution(list(space.optimizers)),
        "weights": CategoricalDistribution(list(space.weights)),
    }


def params_of(config: ProbeConfig) -> dict:
    return {"micro_batch": config.micro_batch, "block_size": config.block_size, "precision": config.precision,
            "checkpointing": config.checkpointing, "attention": config.attention, "optimizer": config.optimizer,
            "weights": config.weights}

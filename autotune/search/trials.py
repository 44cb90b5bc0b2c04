"""Optuna's record of a study, in the same database as autotune's tables: one trial per settled
configuration, which Optuna's own tools open (`optuna.load_study`, optuna-dashboard).

- a config that fits: a COMPLETE trial valued by its tokens/s, feasible;
- an OOM (or an unstable loss): a COMPLETE trial valued 0 that violates the constraint (TPE ignores
  failed trials, so an OOM told as a failure would be proposed again);
- a config ruled out without a probe: a PRUNED trial, also infeasible, its reason a user attribute
  (TPE ranks an unconstrained pruned trial above every infeasible one: the sampler would be drawn
  to the configs larger than an OOM);
- a timeout, crash or error: a FAILED trial (a resumed search probes it again).

Each trial carries what was measured as user attributes (USER_ATTRS; a repeat TPE proposed, only
its status) and the probe's real start and end."""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from autotune.levers.config import ProbeConfig
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.status import RETRYABLE, ProbeStatus
from autotune.search.space import SearchSpace

log = logging.getLogger("autotune")

OBJECTIVE = "tokens_per_s"
# The one constraint, in the list form that both Optuna (as constraint "0") and optuna-dashboard
# 0.21 show: Optuna 5's set_constraint writes "constraints:NAME" keys, which the dashboard does not
# read (it showed every list empty), and Optuna 4 has no set_constraint at all.
CONSTRAINTS_KEY = "constraints"
FEASIBLE, INFEASIBLE = -1.0, 1.0
CONSTRAINT_MEANING = "constraint 0 > 0: not usable (out of memory, unstable, or ruled out without a probe)"
# The result fields kept on each trial (where the result has them).
USER_ATTRS = (
    "tokens_per_s",
    "step_spread",
    "mfu",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "required_bytes",
    "budget_bytes",
    "device",
)
ERROR_LINES, ERROR_CHARS = 5, 1000


def outcome(result: ProbeResult | None) -> tuple[Any, float | None, float | None]:
    """The (TrialState, value, constraint) of a settled outcome."""
    from optuna.trial import TrialState

    if result is None or result.status in RETRYABLE:
        return TrialState.FAIL, None, None
    if result.status == ProbeStatus.OK:
        return TrialState.COMPLETE, float(result.tokens_per_s or 0.0), FEASIBLE
    if result.status == ProbeStatus.SKIPPED:
        return TrialState.PRUNED, None, INFEASIBLE
    return TrialState.COMPLETE, 0.0, INFEASIBLE  # oom, unstable: ran and cannot be used


def user_attrs(result: ProbeResult, config: ProbeConfig | None = None) -> dict[str, Any]:
    """What a trial shows of its probe: status, measurements, the skip's reason or the error's tail."""
    attrs: dict[str, Any] = {"status": str(result.status)}
    if config is not None:
        attrs.update(label=config.label(), key=config.key())
    for name in USER_ATTRS:
        value = getattr(result, name)
        if value is not None and value != "" and not (isinstance(value, float) and not math.isfinite(value)):
            attrs[name] = value
    if result.error:
        if result.status == ProbeStatus.SKIPPED:
            attrs["reason"] = result.error[:ERROR_CHARS]
        else:
            attrs["error"] = error_tail(result.error)
    return attrs


def error_tail(error: str) -> str:
    """The last lines of an error (a traceback ends with what went wrong), bounded."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return "\n".join(lines[-ERROR_LINES:])[-ERROR_CHARS:]


def tell(
    optuna_study, trial, result: ProbeResult | None, config: ProbeConfig | None = None, *, repeat: bool = True
) -> None:
    """Report an outcome to Optuna (see the module's docstring). The trial of a config settled
    here gets every user attribute; a repeat (TPE proposing a config already settled, answered from
    what is known) only its status, marked as a repeat: Optuna writes each attribute in a commit of
    its own, and TPE may repeat itself many times."""
    from optuna.exceptions import UpdateFinishedTrialError

    state, value, constraint = outcome(result)
    try:
        if result is not None:
            attrs = {"status": str(result.status), "repeat": True} if repeat else user_attrs(result, config)
            for key, attr in attrs.items():
                trial.set_user_attr(key, attr)
        if constraint is not None:
            # (Trial has no public way to write the list form; optuna-dashboard reads _trial_id too.)
            trial.storage.set_trial_system_attr(trial._trial_id, CONSTRAINTS_KEY, [constraint])
    except UpdateFinishedTrialError:
        return  # a search starting beside running workers closed this trial: it stays as they left it
    # skip_if_finished: the same race, between the attributes and the tell.
    optuna_study.tell(trial, value, state=state, skip_if_finished=True)


def frozen_trial(config: ProbeConfig, result: ProbeResult, distributions: dict, end: datetime | None = None):
    """The Optuna trial of a settled config, made after the fact, as `tell` would have told it.
    It ends at `end` (now: it is added as the outcome is settled) and started the probe's wall
    time before (a skip takes none)."""
    from optuna.trial import FrozenTrial

    state, value, constraint = outcome(result)
    end = end or datetime.now()  # naive local time, as Optuna's own trials
    wall = result.wall_seconds
    start = end - timedelta(seconds=wall) if wall is not None and math.isfinite(wall) and wall > 0 else end
    # (create_trial sets both times to now and has no arguments for them.)
    return FrozenTrial(
        number=-1,
        trial_id=-1,
        state=state,
        value=value,
        datetime_start=start,
        datetime_complete=end,
        params=params_of(config),
        distributions=distributions,
        user_attrs=user_attrs(result, config),
        system_attrs={} if constraint is None else {CONSTRAINTS_KEY: [constraint]},
        intermediate_values={},
    )


def describe(optuna_study, distributions: dict, about: Mapping[str, Any] | None = None) -> None:
    """Label the study for Optuna's tools: the objective's name, what the constraint means, the
    space searched, and `about` (model, budget) as user attributes. Writes only what changed, so
    each joining worker does not rewrite them."""
    from optuna.exceptions import ExperimentalWarning

    if optuna_study.metric_names != [OBJECTIVE]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            optuna_study.set_metric_names([OBJECTIVE])
    wanted = {
        "objective": f"{OBJECTIVE} of a config that fits (0 when it does not)",
        "constraints": CONSTRAINT_MEANING,
        "space": {name: list(d.choices) for name, d in distributions.items()},
        **(about or {}),
    }
    current = optuna_study.user_attrs
    for key, value in wanted.items():
        if current.get(key) != value:
            optuna_study.set_user_attr(key, value)


def optuna_study(store_url: str, name: str, seed: int | None = 0, storage=None):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = storage or optuna_storage(store_url)
    return optuna.create_study(
        storage=storage,
        study_name=optuna_study_name(storage, name),
        direction="maximize",
        load_if_exists=True,
        sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=5),
    )


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
    from sqlalchemy.engine import make_url

    from autotune.store import schema_lock
    from autotune.store.engine import postgres_connect_args

    url = make_url(store_url)
    sqlite = url.get_backend_name() == "sqlite"
    # A server connection dropped while a long probe ran is replaced quietly, as in our own engine;
    # a server that never answers is given up on, with the same timeouts as ours.
    engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 30}} if sqlite else {"pool_pre_ping": True}
    if url.get_backend_name() == "postgresql":
        engine_kwargs["connect_args"] = postgres_connect_args(url)
    # Optuna creates its tables with no lock of its own: two searches started together on a new
    # database would both try (`table studies already exists`).
    with schema_lock(store_url):
        storage = _settled_trials_storage()(store_url, engine_kwargs=engine_kwargs)
    if sqlite:
        # Optuna commits several times per trial; in WAL mode synchronous=NORMAL still keeps every
        # committed trial through a killed process (only a power cut could lose the last ones),
        # and saves an fsync per commit, as autotune's own engine does.
        from sqlalchemy import event

        event.listen(storage.engine, "connect", lambda conn, _record: conn.execute("PRAGMA synchronous = NORMAL"))
        storage.engine.dispose()
    return storage


_STORAGE_CLASS: Any = None


def _settled_trials_storage():
    """Optuna's RDBStorage, but a settled trial (a finished template: what `Trials.add` writes) is
    written as its rows at once. Optuna's own path sets each parameter and attribute as it would
    on a running trial, with two queries each (the trial, and the parameter's earlier distribution):
    ~40 statements, 30-50 ms a trial on a small host, which was most of a scripted search's time.
    The rows are Optuna's own models, so every reader (Optuna, optuna-dashboard) sees the same
    trial; a parameter's distribution is still checked against the study's, once per parameter."""
    global _STORAGE_CLASS
    if _STORAGE_CLASS is not None:
        return _STORAGE_CLASS
    import json

    from optuna.distributions import check_distribution_compatibility, distribution_to_json, json_to_distribution
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models

    class SettledTrialsStorage(RDBStorage):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._checked: set[tuple[int, str, str]] = set()  # (study, parameter, distribution) checked

        def _get_prepared_new_trial(self, study_id, template_trial, session):
            if template_trial is None or template_trial.intermediate_values or len(template_trial.values or ()) > 1:
                return super()._get_prepared_new_trial(study_id, template_trial, session)
            trial = models.TrialModel(
                study_id=study_id,
                number=None,
                state=template_trial.state,
                datetime_start=template_trial.datetime_start,
                datetime_complete=template_trial.datetime_complete,
            )
            session.add(trial)
            session.flush()  # (its trial_id)
            rows: list[Any] = []
            if template_trial.value is not None:
                stored, kind = models.TrialValueModel.value_to_stored_repr(template_trial.value)
                rows.append(models.TrialValueModel(trial_id=trial.trial_id, objective=0, value=stored, value_type=kind))
            for name, value in template_trial.params.items():
                distribution = template_trial.distributions[name]
                text = distribution_to_json(distribution)
                if (study_id, name, text) not in self._checked:
                    earlier = (
                        session.query(models.TrialParamModel)
                        .join(models.TrialModel)
                        .filter(models.TrialModel.study_id == study_id)
                        .filter(models.TrialParamModel.param_name == name)
                        .first()
                    )
                    if earlier is not None:
                        check_distribution_compatibility(json_to_distribution(earlier.distribution_json), distribution)
                    self._checked.add((study_id, name, text))
                rows.append(
                    models.TrialParamModel(
                        trial_id=trial.trial_id,
                        param_name=name,
                        param_value=distribution.to_internal_repr(value),
                        distribution_json=text,
                    )
                )
            for model, attrs in (
                (models.TrialUserAttributeModel, template_trial.user_attrs),
                (models.TrialSystemAttributeModel, template_trial.system_attrs),
            ):
                rows += [
                    model(trial_id=trial.trial_id, key=key, value_json=json.dumps(value))
                    for key, value in attrs.items()
                ]
            session.add_all(rows)
            trial.number = trial.count_past_trials(session)
            session.add(trial)
            return trial

        def add_settled(self, study_id: int, template_trial) -> int:
            """Add a finished trial; its number (create_new_trial's id would take another query)."""
            return self._create_new_trial(study_id, template_trial).number

    _STORAGE_CLASS = SettledTrialsStorage
    return _STORAGE_CLASS


class Trials:
    """The study's Optuna record, in the same database: one trial per settled configuration.

    Only TPE asks Optuna what to probe. The other strategies' picks become trials after they are
    settled (a finished trial added to the storage), never by enqueue_trial + ask: with several
    workers on one study, a worker's ask() can pop the trial another worker enqueued. Optuna's
    record is secondary to autotune's own tables, so a write that fails even after retries is
    logged and the search goes on."""

    def __init__(
        self, store_url: str, name: str, distributions: dict, seed: int | None, about: Mapping[str, Any] | None = None
    ) -> None:
        self.storage = optuna_storage(store_url)
        self.study = optuna_study(store_url, name, seed, storage=self.storage)
        self.study_id = self.storage.get_study_id_from_name(self.study.study_name)
        self.distributions = distributions
        optuna_retry(lambda: describe(self.study, distributions, about))

    def add(self, config: ProbeConfig, result: ProbeResult) -> int | None:
        """Record a settled config as a finished trial; returns its number."""

        def work() -> int:
            return self.storage.add_settled(self.study_id, frozen_trial(config, result, self.distributions))

        return optuna_retry(work)

    def tell(self, trial, result: ProbeResult | None, config: ProbeConfig | None = None) -> None:
        """Tell the trial TPE proposed for `config` its outcome, settled here."""
        optuna_retry(lambda: tell(self.study, trial, result, config, repeat=False))

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
    from autotune.store.failures import fails_for_good

    def transient(exc: BaseException) -> bool:
        cause = exc.__cause__ if isinstance(exc, StorageInternalError) and exc.__cause__ is not None else exc
        return is_transient(cause)

    try:
        return retry_transient(work, transient=transient)
    except (StorageInternalError, SQLAlchemyError) as exc:
        level = logging.DEBUG if fails_for_good(exc) else logging.WARNING  # a full disk: said by the next write
        log.log(level, "could not record an Optuna trial (%s); autotune's own record is kept", exc)
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
        "compile": CategoricalDistribution(list(space.compiles)),
        "allocator": CategoricalDistribution(list(space.allocators)),
        "liger": CategoricalDistribution(list(space.ligers)),
    }


def params_of(config: ProbeConfig) -> dict:
    return {
        "micro_batch": config.micro_batch,
        "block_size": config.block_size,
        "precision": config.precision,
        "checkpointing": config.checkpointing,
        "attention": config.attention,
        "optimizer": config.optimizer,
        "weights": config.weights,
        "compile": config.compile,
        "allocator": config.allocator,
        "liger": config.liger,
    }

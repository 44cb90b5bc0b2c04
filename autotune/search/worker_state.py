"""One search worker's part in a study: its label, the heartbeat that keeps its claim alive, and
what it has read of the other workers' results."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.host.environment import Environment
from autotune.results.probe_result import ProbeResult
from autotune.search.common import Event, SearchOptions
from autotune.search.knowledge import Knowledge
from autotune.search.study_plan import StudyPlan
from autotune.search.predictions import Predicting
from autotune.search.request import SearchRequest
from autotune.vocabulary.status import RETRYABLE, ClaimState, ProbeStatus, SettleHow, Settled, StudyStatus
from autotune.store import MAX_ATTEMPTS, Store, StudyRecord

log = logging.getLogger("autotune")


def unmeasured(knowledge: Knowledge) -> list[tuple[ProbeConfig, ProbeResult]]:
    """The candidates `knowledge` holds an outcome for that is not a measurement (RETRYABLE)."""
    outcomes = knowledge.outcomes
    return [
        (c, outcomes[c.key()])
        for c in knowledge.candidates
        if c.key() in outcomes and outcomes[c.key()].status in RETRYABLE
    ]


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
    defaults.STALE_BEATS periods another worker takes the configuration over. The worker that owns
    the study (its starter) beats the study too: a running study whose owner is gone reads as
    interrupted (store/liveness.py)."""

    def __init__(self, store: Store, study_id: int, worker: str, interval: float, *, owns_study: bool = False) -> None:
        self.store, self.study_id, self.worker, self.interval = store, study_id, worker, interval
        self.owns_study = owns_study
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

        from autotune.vocabulary.errors import DatabaseError
        from autotune.store.failures import fails_for_good, is_transient

        while not self._stop.wait(self.interval):
            key = self._key
            if key is None and not self.owns_study:
                continue
            try:
                if self.owns_study:
                    self.store.beat_study(self.study_id)
                if key is not None:
                    self.store.claims.beat(self.study_id, key, self.worker)
            except (OperationalError, InterfaceError, DatabaseError) as exc:
                # One missed beat is not fatal: a claim goes stale only after defaults.STALE_BEATS of them.
                # A full disk, or a server gone or restarting, is said once, by the search's own next
                # write (after its retries): a line per beat would bury it.
                quiet = fails_for_good(exc) or is_transient(exc)
                log.log(logging.DEBUG if quiet else logging.WARNING, "heartbeat of %s failed: %s", key, exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@dataclass(slots=True)
class WorkerState:
    """One worker's part in a study: what it searches (the request, preflighted), and what it has
    read of the others."""

    store: Store
    request: SearchRequest
    study: StudyRecord
    knowledge: Knowledge
    label: str
    seen_probe_id: int = 0
    by_key: dict[str, ProbeConfig] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # said with the outcome (a prediction that failed)
    plan: StudyPlan = field(default_factory=StudyPlan)  # how the study searches (stored for joining workers)
    predicting: Predicting | None = None  # memory predictions still being computed

    def __post_init__(self) -> None:
        self.by_key = {c.key(): c for c in self.knowledge.candidates}

    @property
    def options(self) -> SearchOptions:
        return self.request.options

    @property
    def budget(self) -> Budget:
        return self.request.budget

    @property
    def environment(self) -> Environment:
        assert self.request.environment is not None
        return self.request.environment

    def refresh(self, on_event: Callable[[Event], None] | None = None) -> str:
        """Learn what the study's workers settled since the last look, mark what is in flight on
        others, record configs whose claims were abandoned once too often as crashed. Returns the
        study's status (a worker stops when it is no longer running)."""
        k = self.knowledge
        # Probes before claims: a probe row and its claim's new state commit together, so a row
        # read here has its claim settled in the read below.
        rows = self.store.probes(self.study.name, after_id=self.seen_probe_id)
        claims = {
            c.config_key: c for c in self.store.claims.of_study(self.study.id, stale_after=self.options.stale_after)
        }
        for row in rows:
            self.seen_probe_id = max(self.seen_probe_id, row.id)
            config = self.by_key.get(row.config_key)
            claim = claims.get(row.config_key)
            # A claim settled, or (studies from before claims) an outcome a resumed search keeps.
            settled = claim.state != ClaimState.RUNNING if claim is not None else row.result.status not in RETRYABLE
            if config is None or not settled:
                continue
            new = not k.resolved(config)
            k.learn(config, row.result)
            if new and on_event is not None and row.worker != self.label:
                how = Settled.SKIPPED if row.result.status == ProbeStatus.SKIPPED else Settled.PROBED
                on_event(self._event(config, row.result, how, row.worker))
        k.busy = {}
        for key, claim in claims.items():
            config = self.by_key.get(key)
            if config is None or claim.state != ClaimState.RUNNING or k.resolved(config):
                continue
            if not claim.stale:
                k.busy[key] = config
            elif claim.attempts >= MAX_ATTEMPTS:
                self._abandon(config, claim, on_event)
        return self.store.study(self.study.name).status

    def take_predictions(self) -> bool:
        """Let the search use the predictions that arrived since the last look, and keep them in the
        study's plan (for workers that join later). True when any were taken."""
        predicting = self.predicting
        if predicting is None:
            return False
        ready = predicting.ready  # (looked at first: whatever arrived before is taken below)
        arrived = predicting.take()
        if ready:
            self.predicting = None
            if predicting.error is not None:
                # Predictions only order and prune the probes: without them every config is probed.
                # (Some models cannot be traced on fake tensors: deberta reads values, `nonzero`.)
                self.warnings.append(f"memory predictions unavailable, every config is probed: {predicting.error}")
        if not arrived:
            return False
        self.knowledge.predictions = {**self.knowledge.predictions, **arrived}
        self.plan = replace(self.plan, predictions=dict(self.knowledge.predictions))
        return True

    def unmeasured(self) -> list[tuple[ProbeConfig, ProbeResult]]:
        """Candidates whose latest outcome says nothing of their memory (a crash, a timeout, an
        error), with that outcome: the study is not finished while there are any."""
        return unmeasured(self.knowledge)

    def settled_status(self) -> StudyStatus:
        """The status of a study whose every candidate has an outcome."""
        return StudyStatus.INCOMPLETE if self.unmeasured() else StudyStatus.FINISHED

    def _abandon(self, config: ProbeConfig, claim, on_event: Callable[[Event], None] | None) -> None:
        result = ProbeResult(
            status=ProbeStatus.CRASHED,
            budget_bytes=self.budget.total_bytes,
            margin_bytes=self.budget.margin_bytes,
            error=f"the worker probing it stopped heartbeating, {claim.attempts} times (last {claim.worker})",
        )
        probe_id = self.store.claims.settle(
            self.study.id,
            config,
            result,
            how=SettleHow.ABANDONED,
            worker=self.label,
            env_fingerprint=self.study.env_fingerprint,
            stale_after=self.options.stale_after,
        )
        if probe_id is not None:  # else another worker recorded it: the next refresh reads it
            self.knowledge.learn(config, result)
            if on_event is not None:
                on_event(self._event(config, result, Settled.PROBED, claim.worker))

    def _event(self, config: ProbeConfig, result: ProbeResult, how: Settled, worker: str | None) -> Event:
        best = self.knowledge.best()
        return Event(
            config,
            result,
            how,
            len(self.knowledge.outcomes),
            len(self.knowledge.candidates),
            best is not None and best[0].key() == config.key() and result.status == ProbeStatus.OK,
            worker,
        )

"""The loop every search worker runs (`work`): choose a candidate, settle it (probe, reuse, or skip),
learn from the outcome, until none is left, the study is stopped, or a limit is reached. Every
settled candidate is stored as it finishes, so the same command resumes an interrupted search."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from autotune.vocabulary import defaults
from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.host.deadline import DeadlineReached
from autotune.store.claims import ROUND_KEY
from autotune.store.failures import written_if_possible
from autotune.host.processes import Terminated, on_termination
from autotune.results.timing import median_seconds
from autotune.vocabulary.units import format_duration
from autotune.results.probe_result import ProbeResult
from autotune.search.common import Event, Progress, Runner, SearchOutcome
from autotune.search.confirm import Confirmation, RoundStopped, confirm, judged_as_measured
from autotune.search.knowledge import skip_kind
from autotune.search.strategies import make_strategy
from autotune.search.trials import Trials
from autotune.search.worker_state import Heartbeat, WorkerState
from autotune.vocabulary.status import ProbeStatus, Settled, SettleHow, StopReason, StudyStatus
from autotune.store import LeaderboardRow

log = logging.getLogger("autotune")
# Fresh-process retries of a probe whose process died without a result.
CRASH_RETRIES = 2
# Times a search goes back to configs skipped for speed whose skip rested on a figure the
# confirmation round then lowered (each pass probes what could win, and confirms again).
MAX_REVISITS = 2
# The study's confirmation round is held as a claim of its own (store/claims.ROUND_KEY), so that one
# worker of a fleet runs it. Taken over after a dead holder as often as it takes: a round's windows
# are timing-only probes of configs that already ran, not a config that may kill its worker.
ROUND_ATTEMPTS = 1_000_000


@contextlib.contextmanager
def stop_on_first_interrupt() -> Iterator[threading.Event]:
    """The first Ctrl-C asks the search to stop after the probe in flight; a second one aborts it.
    SIGTERM (what Slurm, Kubernetes and systemd send, often with a short grace period) and SIGHUP
    (the terminal closed) abort at once, as a second Ctrl-C does: the probe in flight is killed and
    its claim given back."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_interrupt(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    def on_terminate(signum, frame):
        stop.set()
        raise Terminated

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, on_interrupt), **on_termination(on_terminate)}
    try:
        yield stop
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclass(frozen=True, slots=True)
class Choice:
    """The candidate to settle next: probe it, or record it skipped with `skip_reason`."""

    config: ProbeConfig
    skip_reason: str | None
    trial: Any = None  # TPE's trial for it, when TPE proposed it


@dataclass(frozen=True, slots=True)
class Settlement:
    """A candidate's outcome as stored (probe_id None: another worker stored one first)."""

    choice: Choice
    result: ProbeResult
    how: Settled
    probe_id: int | None


class SearchLoop:
    """One worker's loop over a study (see the module's docstring). The starter (the process that
    started the study) sets the study's status when it stops; a joining worker marks it finished
    when the space is done and leaves it alone otherwise."""

    def __init__(
        self,
        w: WorkerState,
        runner: Runner,
        trials: Trials,
        on_event: Callable[[Event], None] | None,
        *,
        starter: bool,
        started: float,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        self.w, self.runner, self.trials, self.on_event, self.on_progress = w, runner, trials, on_event, on_progress
        self.starter, self.started = starter, started
        options = w.options
        self.strategy = make_strategy(options, w.knowledge, w.environment.device_type, trials)
        self.patience = (
            options.patience
            if options.patience is not None
            else (defaults.TPE_PATIENCE if options.strategy == "tpe" else None)
        )
        self.outcome = SearchOutcome(
            study=w.study, space=w.request.space, leaderboard=[], candidates=len(w.knowledge.candidates)
        )
        self.since_improvement = 0
        self.env_fingerprint = w.environment.fingerprint()
        self.stop_reason: StopReason | None = None  # set where a reason to stop is found
        self.deadline = w.request.deadline
        self.probe_walls: list[float] = []  # each probe's wall time, to tell whether another fits the deadline
        self.skipped_here: dict[str, str] = {}  # configs this run recorded skipped, by key: the kind of skip
        self.held_round = False  # this worker ran the study's confirmation round
        self.round_elsewhere = False  # another worker of the fleet holds the round

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> SearchOutcome:
        w, outcome = self.w, self.outcome
        heartbeat = Heartbeat(w.store, w.study.id, w.label, w.options.heartbeat_seconds, owns_study=self.starter)
        try:
            with stop_on_first_interrupt() as stop:
                for passes in range(MAX_REVISITS + 1):
                    while (reason := self._stop_reason(stop)) is None:
                        choice = self._choose(stop)
                        settled = self._settle(choice, heartbeat) if choice is not None else None
                        if settled is not None:
                            self._learn(settled)
                    outcome.stop_reason = reason
                    if self._should_confirm():
                        self._confirm_once(stop, heartbeat)  # the verdict is stored with the study
                    elif self._judged_as_reused():
                        # No probe of this study ran (all reused): decided on the stored windows, so that a
                        # pick their noise cannot resolve is said not to be reliable, as a round would.
                        decision = judged_as_measured(w.store.leaderboard(w.study.name))
                        if decision is not None:
                            w.store.set_confirmation(w.study.id, decision.to_dict())
                    if passes == MAX_REVISITS or outcome.stop_reason != StopReason.EXHAUSTED or not self._revisit():
                        break
                    self.stop_reason = None  # back to the candidates a fallen figure let back in
        except BaseException:
            # Aborted (a second Ctrl-C, SIGTERM, a user error from the runner, a full disk): the study
            # is not left `running`, so that every later command sees it stopped and resumable. (A
            # database that just failed may fail again: then the study reads as interrupted anyway,
            # its owner gone: store/liveness.py.)
            if self.starter:
                with written_if_possible("the study's status"):
                    w.store.set_study_status(w.study.id, StudyStatus.INTERRUPTED)
            raise
        finally:
            heartbeat.close()
        return self._finish()

    def _stop_reason(self, stop: threading.Event) -> StopReason | None:
        """Why to stop before choosing again (one found while choosing, settling or learning, or
        now), having read what the study's other workers settled and the predictions that arrived."""
        w = self.w
        if self.stop_reason is not None:
            return self.stop_reason
        if stop.is_set():
            return StopReason.INTERRUPTED
        if self.deadline.expired():
            self.outcome.deadline_note = self.outcome.deadline_note or "it came before the next candidate"
            return StopReason.TIMEOUT
        status = w.refresh(self.on_event)
        if w.take_predictions():
            k = w.knowledge
            w.store.set_study_plan(w.study.id, w.plan.to_dict())
            w.store.fill_predicted_peaks(
                w.study.id, {key: k.predictions[key].peak_bytes for key in k.outcomes if key in k.predictions}
            )
        if status != StudyStatus.RUNNING:
            return StopReason.FINISHED if status == StudyStatus.FINISHED else StopReason.STOPPED
        return None

    def _choose(self, stop: threading.Event) -> Choice | None:
        """The strategy's next candidate; None to look again (after waiting for probes in flight on
        other workers, or for the candidate's memory prediction)."""
        w = self.w
        proposed = self.strategy.next()
        if proposed is None:
            if not w.knowledge.busy:
                self.stop_reason = StopReason.EXHAUSTED
                return None
            if self.deadline.expired():
                self.stop_reason = StopReason.TIMEOUT
                return None
            # Nothing to do until probes in flight on other workers report: wait for them.
            stop.wait(min(1.0, w.options.heartbeat_seconds))
            return None
        config, skip_reason = proposed
        trial = getattr(self.strategy, "pending_trial", None)
        if trial is not None:
            self.strategy.pending_trial = None  # type: ignore[attr-defined]
        if skip_reason is None and trial is None and w.predicting is not None and w.predicting.expects(config):
            # Predicting in the background: groups arrive in the order the search visits them, so
            # this wait is short; then choose again with the group's predictions.
            w.predicting.wait_for(config, timeout=self.deadline.remaining())
            return None
        return Choice(config, skip_reason, trial)

    def _settle(self, choice: Choice, heartbeat: Heartbeat) -> Settlement | None:
        """Skip, reuse or probe the chosen candidate and store its outcome; None when nothing was
        stored (a limit reached before its probe, or another worker claimed it first)."""
        w, config, outcome = self.w, choice.config, self.outcome
        if choice.skip_reason is not None:
            result = ProbeResult(
                status=ProbeStatus.SKIPPED,
                budget_bytes=w.budget.total_bytes,
                margin_bytes=w.budget.margin_bytes,
                error=choice.skip_reason,
            )
            probe_id = self._store(choice, result, SettleHow.UNCLAIMED, cacheable=False)
            if probe_id is not None:
                kind = self.skipped_here[config.key()] = skip_kind(choice.skip_reason)
                outcome.skipped += 1
                outcome.skips[kind] = outcome.skips.get(kind, 0) + 1
            return Settlement(choice, result, Settled.SKIPPED, probe_id)
        cached = (
            None
            if w.options.fresh
            else w.store.find_cached(
                config.key(),
                self.env_fingerprint,
                w.request.spec.fingerprint,
                w.budget.total_bytes,
                w.budget.margin_bytes,
            )
        )
        if cached is not None:
            probe_id = self._store(choice, cached, SettleHow.UNCLAIMED)
            outcome.reused += probe_id is not None
            return Settlement(choice, cached, Settled.REUSED, probe_id)
        self.stop_reason = self._limit()
        if self.stop_reason is not None:
            self._give_back(choice)
            return None
        # From the claim's INSERT to the outcome's row, whatever ends this worker (SIGTERM, a second
        # Ctrl-C, a user error raised by the runner, a database that fails) gives the claim back: a
        # claim left running waits out its staleness before anyone probes its config again. claims.take()
        # is inside too: a signal that arrives while SQLite commits is handled as the commit returns,
        # so SIGTERM's Terminated comes out of a claims.take() whose row is written.
        try:
            if w.store.claims.take(w.study.id, config.key(), w.label, stale_after=w.options.stale_after) is None:
                self._give_back(choice)  # another worker took it between our look and our claim
                return None
            with showing_phases(
                self.runner, self.on_progress, config, len(w.knowledge.outcomes), len(w.knowledge.candidates)
            ):
                result = probe_claimed(w, self.runner, heartbeat, config)
            self.probe_walls.append(result.wall_seconds or 0.0)
            outcome.probed += 1
            outcome.probes_seconds += result.wall_seconds or 0.0
            probe_id = self._store(choice, result, SettleHow.CLAIMED)
        except BaseException as exc:
            with written_if_possible("the claim"):
                w.store.claims.release(w.study.id, config.key(), w.label, retry=False)
            if not isinstance(exc, DeadlineReached):
                raise
            # Not a measurement: nothing is stored for it, and the same command probes it again.
            self.stop_reason = StopReason.TIMEOUT
            outcome.deadline_note = f"the probe of {config.label()} in flight was stopped"
            return None
        return Settlement(choice, result, Settled.PROBED, probe_id)

    def _store(self, choice: Choice, result: ProbeResult, how: SettleHow, cacheable: bool | None = None) -> int | None:
        """Store a candidate's outcome once for the study (None: another worker's came first)."""
        w = self.w
        prediction = w.knowledge.predictions.get(choice.config.key())
        return w.store.claims.settle(
            w.study.id,
            choice.config,
            result,
            how=how,
            worker=w.label,
            env_fingerprint=self.env_fingerprint,
            cacheable=cacheable,
            trial_number=choice.trial.number if choice.trial is not None else None,
            predicted_peak_bytes=prediction.peak_bytes if prediction else None,
        )

    def _learn(self, settled: Settlement) -> None:
        """Tell Optuna and the knowledge, and say it; stop when the search's patience has run out."""
        w, k, config, result = self.w, self.w.knowledge, settled.choice.config, settled.result
        if settled.probe_id is None:
            # Settled by another worker first (the same skip found at once, or a claim taken over
            # from this worker while it looked dead): theirs is the stored outcome.
            self._give_back(settled.choice)
            return
        if settled.choice.trial is not None:
            self.trials.tell(settled.choice.trial, result, config)
        elif (number := self.trials.add(config, result)) is not None:
            w.store.set_trial_number(settled.probe_id, number)
        previous_best = k.best()
        # Timeouts, crashes and errors are learnt too, so this run does not ask again; a resumed
        # search ignores them (RETRYABLE) and tries once more.
        k.learn(config, result)
        best = k.best()
        improved = best is not None and (previous_best is None or best[0].key() != previous_best[0].key())
        if settled.how == Settled.PROBED:
            self.since_improvement = 0 if improved else self.since_improvement + 1
        if self.on_event is not None:
            self.on_event(
                Event(
                    config,
                    result,
                    settled.how,
                    len(k.outcomes),
                    len(k.candidates),
                    best is not None and best[0].key() == config.key(),
                    w.label,
                )
            )
        if self.patience is not None and self.since_improvement >= self.patience:
            self.stop_reason = StopReason.PATIENCE

    # -- limits, confirmation, the end ---------------------------------------------------------------
    def _limit(self) -> StopReason | None:
        """A limit of this worker that forbids starting another probe: --max-trials, or --timeout
        when the deadline has passed or another probe (as long as this run's have taken) could
        not end before it."""
        max_trials = self.w.options.max_trials
        if max_trials is not None and self.outcome.probed >= max_trials:
            return StopReason.MAX_TRIALS
        expected = self.expected_probe_seconds()
        if self.deadline.expired() or not self.deadline.allows(expected):
            self.outcome.deadline_note = (
                f"no probe was started with {format_duration(self.deadline.remaining())} left: "
                f"a probe takes about {format_duration(expected)} here"
            )
            return StopReason.TIMEOUT
        return None

    def expected_probe_seconds(self) -> float:
        """How long the next probe should take: the median of this run's probes (0 before the first,
        which the deadline stops if it must)."""
        return median_seconds(self.probe_walls) if self.probe_walls else 0.0

    def _may_start(self) -> bool:
        return self.deadline.allows(self.expected_probe_seconds()) and not self.deadline.expired()

    def _should_confirm(self) -> bool:
        """A search that settled every candidate is confirmed, unless told not to. The starter
        confirms when it probed something, or when the study's own probes were never confirmed (a
        confirmation round the deadline cut short); a study answered wholly from other studies'
        probes is not. A fleet's worker (`search --workers`, `autotune worker`: every worker waits
        until nothing is in flight on the others before it stops) confirms a study no round has
        decided yet, or again after it probed configs the round let back in (`_revisit`)."""
        w = self.w
        if not (self.outcome.stop_reason == StopReason.EXHAUSTED and w.options.confirm):
            return False
        confirmation = w.store.study(w.study.name).confirmation
        if not self.starter:
            return confirmation is None or bool(confirmation.get("partial")) or self.outcome.revisited > 0
        if self.outcome.probed:
            return True
        if confirmation is not None:
            return bool(confirmation.get("partial"))  # a round an earlier run left unfinished goes on
        return any(
            claim.attempts > 0
            for claim in w.store.claims.of_study(w.study.id, stale_after=w.options.stale_after)
            if claim.config_key != ROUND_KEY
        )

    def _confirm_once(self, stop: threading.Event, heartbeat: Heartbeat) -> None:
        """Run the confirmation round holding the study's round claim (ROUND_KEY), so that of a
        fleet's workers, which all reach the end of the space together, one runs it; its windows are
        heartbeaten like a probe's, and a worker killed mid-round leaves a claim that goes stale and
        is taken over. A joining worker that finds the round held leaves it (and the study's
        status) to its holder; the starter waits for it, and confirms after it only if no verdict
        was stored."""
        w = self.w
        waited = False
        while (
            w.store.claims.take(
                w.study.id, ROUND_KEY, w.label, stale_after=w.options.stale_after, max_attempts=ROUND_ATTEMPTS
            )
            is None
        ):
            if not self.starter:
                self.round_elsewhere = True
                return
            if stop.is_set():
                return
            if self.deadline.expired():
                self.outcome.stop_reason = StopReason.TIMEOUT
                self.outcome.deadline_note = "it came while another worker's confirmation round went on"
                return
            waited = True
            stop.wait(min(1.0, w.options.heartbeat_seconds))
        try:
            confirmation = w.store.study(w.study.name).confirmation
            if waited and confirmation is not None and not confirmation.get("partial"):
                return  # the round it waited for decided
            if not self.starter and not self._should_confirm():
                return  # another worker's round decided between this worker's look and its claim
            self.held_round = True
            with heartbeat.holding(ROUND_KEY):
                self._confirm(stop.is_set)
        finally:
            with written_if_possible("the confirmation round's claim"):
                w.store.claims.release(w.study.id, ROUND_KEY, w.label, retry=False)

    def _revisit(self) -> bool:
        """After a confirmation round pooled the contenders' windows, the configs skipped for speed
        that could win now (their skip rested on a figure that has fallen: an outlier window) go
        back to be decided again; True when any did. Only the predictive strategy skips for speed."""
        w, k = self.w, self.w.knowledge
        if not (self.starter or self.held_round) or not hasattr(self.strategy, "revisitable"):
            return False
        for row in w.store.leaderboard(w.study.name):  # the figures as the round pooled them
            if (known := k.outcomes.get(row.config_key)) is not None:
                k.outcomes[row.config_key] = dataclasses.replace(
                    known, tokens_per_s=row.tokens_per_s, step_seconds=row.step_seconds, step_spread=row.step_spread
                )
        again = self.strategy.revisitable()
        if not again:
            return False
        w.store.claims.reopen_skipped(w.study.id, [c.key() for c in again])
        for config in again:
            del k.outcomes[config.key()]
            if (kind := self.skipped_here.pop(config.key(), None)) is not None:  # (decided again: counted again)
                self.outcome.skipped -= 1
                self.outcome.skips[kind] -= 1
        self.outcome.revisited += len(again)
        return True

    def _skipped_for_speed(self) -> bool:
        """Whether configs were ruled out against the best's figure (skipped for speed): then that
        figure is measured again, even where nothing else contends."""
        return "speed" in self.skipped_here.values()

    def _judged_as_reused(self) -> bool:
        """A study the starter settled wholly from earlier studies' probes, with no decision yet."""
        w = self.w
        return (
            self.starter
            and self.outcome.stop_reason == StopReason.EXHAUSTED
            and w.options.confirm
            and not self.outcome.probed
            and w.store.study(w.study.name).confirmation is None
        )

    def _give_back(self, choice: Choice) -> None:
        if choice.trial is not None:
            self.trials.tell(choice.trial, None)

    def _confirm(self, stop: Callable[[], bool]) -> Confirmation | None:
        """Every candidate is settled: measure the contenders within noise of the best again."""
        w, total = self.w, len(self.w.knowledge.candidates)

        def measured_again(row: LeaderboardRow, result: ProbeResult) -> None:
            if self.on_event is not None:
                self.on_event(Event(row.config, result, Settled.CONFIRMING, total, total, False, w.label))

        def run(config: ProbeConfig, budget: Budget) -> ProbeResult:
            with showing_phases(self.runner, self.on_progress, config, total, total, confirming=True):
                result = self.runner.run(
                    config, budget, w.request.spec, self.deadline, timing_only=True, fresh_process=True
                )
            self.probe_walls.append(result.wall_seconds or 0.0)
            return result

        try:
            return confirm(
                w.store,
                w.study,
                run,
                w.budget,
                on_probe=measured_again,
                stop=lambda: stop() or not self._may_start(),
                tally=self.outcome.round,
                alone_too=self._skipped_for_speed(),
            )
        except (RoundStopped, DeadlineReached):
            if not stop():
                # The deadline ended the round before its verdict: the pick stays unconfirmed, the
                # study is not finished, and the same command confirms it.
                self.outcome.stop_reason = StopReason.TIMEOUT
                self.outcome.deadline_note = "the confirmation round was cut short: the pick is not confirmed yet"
            return None

    def _finish(self) -> SearchOutcome:
        w, outcome = self.w, self.outcome
        outcome.unmeasured = w.unmeasured()
        outcome.failures = list(w.warnings)
        outcome.settled = len(w.knowledge.outcomes)
        if self.starter:
            w.store.set_study_status(w.study.id, w.settled_status() if outcome.finished else StudyStatus.INTERRUPTED)
        elif outcome.finished and outcome.stop_reason != StopReason.FINISHED and not self.round_elsewhere:
            # (a round another worker holds: its holder marks the study when the verdict is in)
            w.store.set_study_status(w.study.id, w.settled_status())
        outcome.study = w.store.study(w.study.name)
        outcome.leaderboard = w.store.leaderboard(w.study.name)
        outcome.seconds = time.perf_counter() - self.started
        return outcome


def work(
    w: WorkerState,
    runner: Runner,
    trials: Trials,
    on_event: Callable[[Event], None] | None,
    *,
    starter: bool,
    started: float,
    on_progress: Callable[[Progress], None] | None = None,
) -> SearchOutcome:
    """Take configurations of the study until none is left, the study is stopped, or a limit of
    this worker is reached (SearchLoop)."""
    return SearchLoop(w, runner, trials, on_event, starter=starter, started=started, on_progress=on_progress).run()


@contextlib.contextmanager
def showing_phases(
    runner: Runner,
    on_progress: Callable[[Progress], None] | None,
    config: ProbeConfig,
    resolved: int,
    total: int,
    confirming: bool = False,
) -> Iterator[None]:
    """Tell `on_progress` that a probe of `config` starts, and each phase it reaches."""
    if on_progress is None:
        yield
        return
    started = time.monotonic()

    def reached(phase: str) -> None:
        on_progress(Progress(config, phase, resolved, total, started, confirming))

    reached("starting")
    runner.on_phase = reached
    try:
        yield
    finally:
        runner.on_phase = None


def probe_claimed(w: WorkerState, runner: Runner, heartbeat: Heartbeat, config: ProbeConfig) -> ProbeResult:
    """Run a claimed probe, heartbeating. A crash (the child killed, a segfault, a CUDA fault) is
    not a measurement: it is tried again in a fresh process, CRASH_RETRIES times. (A probe that does
    not end gives its claim back: the caller, SearchLoop._settle.)"""
    with heartbeat.holding(config.key()):
        result = runner.run(config, w.budget, w.request.spec, w.request.deadline)
        for attempt in range(2, CRASH_RETRIES + 2):
            if result.status != ProbeStatus.CRASHED:
                break
            log.warning(
                "%s crashed (%s); trying again in a fresh process (attempt %d)", config.label(), result.error, attempt
            )
            result = runner.run(config, w.budget, w.request.spec, w.request.deadline)
        else:
            if result.status == ProbeStatus.CRASHED:
                result.error = f"crashed {CRASH_RETRIES + 1} times, each in a fresh process; last: {result.error}"
        return result

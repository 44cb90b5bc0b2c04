"""The search's vocabulary: its options, the runner it drives, what it reports as it goes and
when it ends."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from autotune.vocabulary import defaults
from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.host.deadline import NO_DEADLINE, Deadline
from autotune.host.environment import Environment
from autotune.vocabulary.errors import EXIT_INTERRUPTED, EXIT_NOTHING_FITS, EXIT_UNMEASURED, BadInput
from autotune.specs.models import ModelSpec
from autotune.probe.runner import Neighbours
from autotune.results.probe_result import ProbeResult
from autotune.search.confirm import RoundTally
from autotune.search.space import SearchSpace
from autotune.vocabulary.status import FINISHING, Settled, StopReason
from autotune.store import LeaderboardRow, StudyRecord, check_study_name

STRATEGIES = ("predictive", "frontier", "tpe", "grid", "grid-full")

# Told when a search (or a worker) starts on its study: (study, environment, candidates, those
# already settled, notes on what it assumed).
OnStart = Callable[[StudyRecord, Environment, int, int, tuple[str, ...]], None]


class Runner(Protocol):
    """What the search needs of a probe runner (ProbeRunner, or a scripted fake in tests): the
    whole contract, so that the search never reaches past it."""

    # Told each phase of the probe in flight ('start-up', 'build', 'warm-up', 'timing'), when set.
    on_phase: Callable[[str], None] | None
    # Processes of this search paused while a probe times its window (the estimator's tracers), when set.
    neighbours: Neighbours | None

    def environment(self, deadline: Deadline = NO_DEADLINE) -> Environment: ...
    def check(
        self, spec: ModelSpec, config: ProbeConfig, attentions: tuple[str, ...], deadline: Deadline = NO_DEADLINE
    ) -> dict[str, str]: ...
    def run(
        self,
        config: ProbeConfig,
        budget: Budget,
        spec: ModelSpec | None = None,
        deadline: Deadline = NO_DEADLINE,
        timing_only: bool = False,
        fresh_process: bool = False,
    ) -> ProbeResult: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class SearchOptions:
    study: str | None = None
    strategy: str = defaults.STRATEGY
    max_trials: int | None = None  # probes actually run (reused and skipped ones are free)
    timeout: float | None = None  # seconds: the whole command's deadline, confirmation included
    patience: int | None = None  # stop after this many probes without a better config
    fresh: bool = False  # ignore stored results from other studies
    predict: bool = True  # estimate memory first: skip hopeless configs, order the rest
    # Skip only when predicted over the budget by more than this share; None: the device type's
    # (defaults.PREDICT_MARGINS, resolved by `margin_for`).
    predict_margin: float | None = None
    heartbeat_seconds: float = defaults.HEARTBEAT_SECONDS  # claims' heartbeat period, for the whole study
    confirm: bool = True  # measure the contenders within noise of the best again (search/confirm.py)
    # Probe while memory is predicted rather than after: the predictions join the search when
    # ready. Only where the trace children are paused during each timed window (launch.search).
    predict_in_background: bool = False

    def __post_init__(self) -> None:
        if self.study is not None:
            check_study_name(self.study)
        if self.strategy not in STRATEGIES:
            raise BadInput(f"--strategy {self.strategy!r} is unknown; choose from {', '.join(STRATEGIES)}.")
        if self.max_trials is not None and self.max_trials < 1:
            raise BadInput("--max-trials must be at least 1.")
        if self.patience is not None and self.patience < 1:
            raise BadInput("--patience must be at least 1.")
        if self.predict_margin is not None and not 0 <= self.predict_margin < 10:
            raise BadInput("--predict-margin must be between 0 and 10 (a share of the budget, e.g. 0.1).")
        if not 0 < self.heartbeat_seconds <= 3600:
            raise BadInput("--heartbeat must be between 0 and 3600 seconds (e.g. 5).")

    def margin_for(self, device_type: str, peft: str | None = None) -> float:
        """The prediction margin a search on `device_type` of a model trained with `peft` (None:
        full fine-tuning) uses: the one given; on CUDA the estimator's stated error of the peak
        allocated for that method, measured against published GPU figures
        (estimate/stated_error.py), so that a config is skipped only beyond it; else the device
        type's default (a CPU prediction equals the probe to the byte)."""
        if self.predict_margin is not None:
            return self.predict_margin
        if device_type == "cuda":
            from autotune.estimate.stated_error import skip_margin

            stated = skip_margin(peft)
            if stated is not None:
                return stated
        return defaults.PREDICT_MARGINS.get(device_type, defaults.PREDICT_MARGIN)

    @property
    def stale_after(self) -> float:
        """A claim is stale (its worker presumed dead, the config handed to another) after this
        many seconds without a heartbeat."""
        return defaults.STALE_BEATS * self.heartbeat_seconds


@dataclass(slots=True)
class Event:
    """One resolved candidate, for the live display."""

    config: ProbeConfig
    result: ProbeResult
    how: Settled
    resolved: int  # candidates resolved so far, this one included
    total: int  # candidates in the space
    best: bool  # the best config so far
    worker: str | None = None  # the worker that settled it, when several share the study


@dataclass(frozen=True, slots=True)
class Progress:
    """The probe in flight, for the live display: its config and the phase it reached
    ('starting', 'start-up', 'build', 'warm-up', 'timing')."""

    config: ProbeConfig
    phase: str
    resolved: int  # candidates settled before this one
    total: int
    started: float  # time.monotonic() when the probe started
    confirming: bool = False  # measured again by the confirmation round


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
    stop_reason: StopReason = StopReason.EXHAUSTED
    answered_from_database: bool = False
    probes_seconds: float = 0.0  # wall time of the probes actually run
    workers: int = 1  # worker processes that searched (autotune search --workers)
    failures: list[str] = field(default_factory=list)  # workers that ended in error, one line each
    # Crashed, timed out or failed: not measurements. With their latest outcome, for the report.
    unmeasured: list[tuple[ProbeConfig, ProbeResult]] = field(default_factory=list)
    # What the --timeout deadline stopped, when it did: the probe in flight, or a probe not started
    # because it could not end in time, or the confirmation round (said with the footer).
    deadline_note: str | None = None
    settled: int | None = None  # candidates with an outcome when the search stopped
    # What the confirmation round did in this run (its windows are probes too), and the windows it
    # took over from a round an earlier run left unfinished.
    round: RoundTally = field(default_factory=RoundTally)
    skips: dict[str, int] = field(default_factory=dict)  # `skipped` by kind (search.knowledge.SkipReason)
    revisited: int = 0  # speed skips decided again once the figure they rested on fell

    @property
    def best(self) -> LeaderboardRow | None:
        return self.leaderboard[0] if self.leaderboard else None

    @property
    def complete(self) -> bool:
        """Searched through, and every candidate measured or ruled out."""
        return self.finished and not self.unmeasured

    @property
    def finished(self) -> bool:
        # 'finished': another worker of the study finished it (its patience ran out).
        return self.stop_reason in FINISHING

    @property
    def exit_status(self) -> int:
        """What `autotune search` exits with (autotune/vocabulary/errors.py): 0, a configuration fits and every
        candidate is settled (or a limit stopped the search as asked); 1, nothing fits; 3, some
        candidates could not be measured; 130, interrupted."""
        if self.stop_reason == StopReason.INTERRUPTED:
            return EXIT_INTERRUPTED
        if self.unmeasured:
            return EXIT_UNMEASURED
        if self.finished and self.best is None:
            return EXIT_NOTHING_FITS
        return 0

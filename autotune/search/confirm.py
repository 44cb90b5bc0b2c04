"""The confirmation round: before a search says which config wins, the best, the runner-up and
the configs within noise of the best are measured again, alternating, until the winner is told
apart or the round declares a tie. Each window runs in a process of its own, and each round goes
the other way round from the last (A B, then B A): the same config measured 82,507 and 63,373
tokens/s in two processes minutes apart on an H100, and figures drifted down over the minutes on
an H200, while each window's own steps spread by 2-6%. Each config's noise is the spread of its
steps or of its windows' throughputs (so, of its processes), whichever is wider: one more window
of each is always measured, since a single window cannot show how much whole windows vary.

Why: a search ranks on one short window per config, and on a shared machine (or between close
GPU configs) the order of the top few can be noise. The user pastes the winner into a run of
hours, in a process of its own, so the pick is worth a few more windows of the configs that could
have won, and its figure is what several processes agree on, not one process's luck.

Each re-measurement is pooled with the config's earlier windows (all their step times), the
probe row's timing is replaced by the pooled one, and the study keeps the verdict (margin over
the runner-up, the noise it was judged against, confirmed or tied) in `confirmation`.
"""

from __future__ import annotations

from collections.abc import Callable
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from autotune.results.budget import Budget, required_bytes
from autotune.levers.config import ProbeConfig
from autotune.results.ranking import Standing, ranked
from autotune.results.probe_result import ProbeResult
from autotune.search.space import micro_batch_family
from autotune.vocabulary.status import ProbeStatus
from autotune.store import LeaderboardRow, ProbeRecord, Store, StudyRecord
from autotune.results.timing import noise, window_seconds


class RoundStopped(Exception):
    """The round was told to stop (Ctrl-C, or no time left before the command's deadline) before
    its verdict: the pick stays unconfirmed."""


MAX_CONTENDERS = 3  # besides the best: the closest ones within noise
MAX_ROUNDS = 3  # windows of each contender at most, beyond the first
# A window is measured again when within this of the best, or within the noise if wider: one
# window on a busy machine can read several percent slow (a neighbour, a page fault storm) while
# its own steps look steady. Telling apart still needs a margin above the steps' noise.
CONTENDER_BAND = 0.05
# A tie among configs whose noise (the two spreads together) is within this is a real one: they are
# as fast as each other. Beyond it the timing cannot tell them apart, and the pick is not reliable
# (said, with what to do). Windows of a few seconds on an idle 2-core CPU spread by about 5% each.
RELIABLE_NOISE = 0.15


@dataclass(slots=True)
class Contender:
    row: LeaderboardRow
    result: ProbeResult  # pooled timing so far
    step_times: list[float] = field(default_factory=list)
    windows: list[float] = field(default_factory=list)  # each window's own tokens/s
    by_round: dict[int, float] = field(default_factory=dict)  # the windows of the round's alternating passes

    @property
    def tokens_per_s(self) -> float:
        return self.result.tokens_per_s or 0.0

    @property
    def spread(self) -> float:
        """Its noise: the spread of its steps, or of its windows' throughputs if wider. On a shared
        machine a whole window can run slow while its steps look steady (seen here: the same config
        at 979 and 12,091 tokens/s); only measuring it again shows that."""
        steps = self.result.step_spread or 0.0
        if len(self.windows) < 2:
            return steps
        middle = statistics.median(self.windows)
        return max(steps, (max(self.windows) - min(self.windows)) / (2 * middle)) if middle > 0 else steps

    def measured_again(self, result: ProbeResult, round_number: int | None = None) -> None:
        """Pool another window into this contender: its steps with the others', its throughput as a
        window of its own (kept by round when it was one of a round's alternating passes), and a
        spread that shows how much whole windows disagree (a stored "±0%" must not hide windows of
        979 and 12,091 tokens/s)."""
        self.windows.append(result.tokens_per_s or 0.0)
        if round_number is not None:
            self.by_round[round_number] = result.tokens_per_s or 0.0
        self.step_times += result.step_times or []
        self.result = _pooled(self.row, self.step_times)
        self.result = replace(self.result, step_spread=self.spread)


def clearly_faster(a: Contender, b: Contender) -> bool:
    """`a`'s pooled speed beats `b`'s by more than their noise, and `a` won every round in which the
    two were measured back to back (so under the same load): then the order is no accident of a
    busy moment. (A window measured long apart, the search's first, may be an outlier: it counts
    in the pooled speed and the noise, not as a round.)"""
    rounds = a.by_round.keys() & b.by_round.keys()
    return a.tokens_per_s > b.tokens_per_s * (1 + noise(a.spread, b.spread)) and all(
        a.by_round[r] > b.by_round[r] for r in rounds
    )


@dataclass(slots=True)
class Confirmation:
    """The verdict, as stored with the study (`to_dict`) and said by `autotune search`."""

    winner: str  # config key of the chosen config
    winner_label: str
    runner_up: str | None  # its label
    margin: float | None  # winner's tokens/s over the runner-up's, minus 1
    noise: float | None  # the relative difference within which they are not told apart
    confirmed: bool  # told apart (or alone); False: a tie, decided by memory to spare
    rounds: int  # extra windows of each contender
    probes: int  # probes the study's rounds ran (every round, earlier runs' too)
    seconds: float  # and their wall time
    tied: list[str] = field(default_factory=list)  # labels of the configs tied with the winner
    tied_keys: list[str] = field(default_factory=list)  # and their config keys (autotune.results.ranking reads them)
    # False: the timing could not tell the contenders apart (a tie beyond RELIABLE_NOISE, or nothing
    # measured again): the pick is not reliable, and every command that shows it says so.
    reliable: bool = True
    host_load: float | None = None  # the highest host load per core the round's windows saw
    reused: bool = False  # no round: every window was measured by earlier studies (judged_as_measured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "winner": self.winner,
            "winner_label": self.winner_label,
            "runner_up": self.runner_up,
            "margin": self.margin,
            "noise": self.noise,
            "confirmed": self.confirmed,
            "rounds": self.rounds,
            "probes": self.probes,
            "seconds": self.seconds,
            "tied": self.tied,
            "tied_keys": self.tied_keys,
            "reliable": self.reliable,
            "host_load": self.host_load,
            "reused": self.reused,
        }


def contenders_of(rows: list[LeaderboardRow]) -> list[LeaderboardRow]:
    """The best and the configs whose throughput is within the noise of it (at most MAX_CONTENDERS)."""
    best_speed = rows[0].tokens_per_s if rows else None
    if best_speed is None:
        return rows[:1]
    best = rows[0]
    close = [
        r
        for r in rows[1:]
        if r.tokens_per_s is not None
        and r.tokens_per_s >= best_speed * (1 - max(CONTENDER_BAND, noise(best.step_spread, r.step_spread)))
    ]
    # The runner-up always: one window each tells nothing of how much a window varies.
    return [best, *(close[:MAX_CONTENDERS] or rows[1:2])]


def suspects_of(rows: list[LeaderboardRow], contenders: list[LeaderboardRow]) -> list[LeaderboardRow]:
    """Configs measured slower than a smaller micro-batch of the same recipe that contends: more
    sequences per micro-step is not slower per token computed (padding included) unless something slowed that window, so
    each is measured again (at most one per contender)."""

    def family(row: LeaderboardRow) -> tuple:
        return micro_batch_family(row.config)

    def work(
        row: LeaderboardRow,
    ) -> float:  # (padding included: a larger micro-batch pads more, autotune.levers.lengths)
        return (row.tokens_per_s or 0.0) * row.config.padded_per_real

    taken = {r.config_key for r in contenders}
    out = []
    for leader in contenders:
        slower_larger = [
            r
            for r in rows
            if r.config_key not in taken
            and family(r) == family(leader)
            and r.config.micro_batch > leader.config.micro_batch
            and work(r) * (1 + CONTENDER_BAND) < work(leader)
        ]
        if slower_larger:
            suspect = max(slower_larger, key=lambda r: r.config.micro_batch)
            taken.add(suspect.config_key)
            out.append(suspect)
    return out


@dataclass(slots=True)
class RoundTally:
    """What a confirmation round did in this run, for the search's footer: the windows it measured
    and those it took over from a round an earlier run left unfinished."""

    probes: int = 0
    seconds: float = 0.0
    reused_windows: int = 0


@dataclass(slots=True)
class _Earlier:
    """A round an earlier run left unfinished (a deadline, Ctrl-C): its windows, kept as they were
    measured in the study's `confirmation` (`partial`), so that the same command goes on with them."""

    rounds: int = 0
    probes: int = 0
    seconds: float = 0.0
    windows: dict[str, list[float]] = field(default_factory=dict)
    by_round: dict[str, dict[int, float]] = field(default_factory=dict)

    @classmethod
    def of(cls, confirmation: dict[str, Any] | None) -> _Earlier:
        if not confirmation:
            return cls()
        if not confirmation.get("partial"):
            # A finished round's windows are pooled in the leaderboard now; what it cost stays the
            # study's (a search that revisits confirms twice; a study resumed later confirms again).
            return cls(probes=int(confirmation.get("probes") or 0), seconds=float(confirmation.get("seconds") or 0.0))
        return cls(
            int(confirmation.get("rounds") or 0),
            int(confirmation.get("probes") or 0),
            float(confirmation.get("seconds") or 0.0),
            {key: [float(v) for v in values] for key, values in (confirmation.get("windows") or {}).items()},
            {
                key: {int(r): float(v) for r, v in rounds.items()}
                for key, rounds in (confirmation.get("by_round") or {}).items()
            },
        )


def partial_state(pool: list[Contender], rounds: int, probes: int, seconds: float) -> dict[str, Any]:
    """A round not finished yet, as the study keeps it: no `winner` (nothing is decided, and the
    ranking reads none), every contender's windows by round."""
    return {
        "partial": True,
        "rounds": rounds,
        "probes": probes,
        "seconds": seconds,
        "windows": {c.row.config_key: list(c.windows) for c in pool},
        "by_round": {c.row.config_key: {str(r): v for r, v in c.by_round.items()} for c in pool},
    }


# Configs outside the round found as fast as its best once the round's windows are pooled (a config
# measured once, in a lucky window, while the contenders' repeated windows came out slower) join it
# this many times at most; past that the round cannot decide, and says so.
MAX_JOINS = 2


def confirm(
    store: Store,
    study: StudyRecord,
    run: Callable[[ProbeConfig, Budget], ProbeResult],
    budget: Budget,
    on_probe: Callable[[LeaderboardRow, ProbeResult], None] | None = None,
    stop: Callable[[], bool] = lambda: False,
    tally: RoundTally | None = None,
    alone_too: bool = False,
) -> Confirmation | None:
    """Measure the study's suspects (suspects_of) and contenders again until the best is told
    apart or a tie is declared; store the pooled timings and the verdict. None when nothing fits;
    RoundStopped when `stop` says to stop (Ctrl-C, the deadline) before the verdict: the pick then
    stays unconfirmed, and every window measured so far is kept (each is stored as it is measured,
    with the round's state), so that the same command goes on with them. `tally` hears what this
    run measured and took over. `alone_too`: configs were ruled out against the best's figure
    (skipped for speed): it is measured again even when no other config contends."""
    tally = tally if tally is not None else RoundTally()
    rows = store.leaderboard(study.name)
    if not rows:
        return None
    stored = {p.id: p for p in store.probes(study.name)}
    earlier = _Earlier.of(store.study(study.name).confirmation)

    def contending(row: LeaderboardRow) -> Contender:
        windows = earlier.windows.get(row.config_key)
        if windows:
            tally.reused_windows += len(windows) - 1
        return Contender(
            row,
            _as_result(row),
            _stored_step_times(stored[row.probe_id], row),
            list(windows) if windows else [row.tokens_per_s or 0.0],
            dict(earlier.by_round.get(row.config_key, {})),
        )

    pool = [contending(r) for r in contenders_of(rows)]
    total = RoundTally(earlier.probes, earlier.seconds)  # every round's windows, earlier runs' included
    loads: list[float | None] = [row.host_load for row in rows[:1]]

    def measure(contender: Contender, round_number: int | None) -> float | None:
        """One more window of `contender`, pooled and stored at once: its throughput, None if it
        measured nothing."""
        if stop():
            raise RoundStopped
        result = run(contender.row.config, budget)
        if result.status == ProbeStatus.OK and result.peak_reserved_bytes is None:
            # (a window for its timing alone: its memory is the config's, as first measured)
            result = replace(
                result,
                peak_allocated_bytes=contender.row.peak_allocated_bytes,
                peak_reserved_bytes=contender.row.peak_reserved_bytes,
            )
        loads.append(result.host_load)
        total.probes += 1
        total.seconds += result.wall_seconds or 0.0
        tally.probes += 1
        tally.seconds += result.wall_seconds or 0.0
        if on_probe is not None:
            on_probe(contender.row, result)
        if result.status != ProbeStatus.OK or not result.step_times:
            return None  # a window that failed now says nothing of speed: the earlier ones stand
        contender.measured_again(result, round_number)
        store.update_timing(contender.row.probe_id, contender.result)
        store.set_confirmation(study.id, partial_state(pool, rounds, total.probes, total.seconds))
        return result.tokens_per_s or 0.0

    rounds = earlier.rounds
    remeasured = sum(len(c.by_round) for c in pool)
    # Suspects first (not on a resumed round: they were measured again before it began): a window
    # slowed a lot by a neighbour (steady steps, 3x slow) falls far outside the band and would never
    # be measured again. Measured once more; within the band now, it contends like the others.
    band = pool[0].tokens_per_s * (1 - CONTENDER_BAND)
    for row in suspects_of(rows, [c.row for c in pool]) if not rounds else ():
        suspect = contending(row)
        window = measure(suspect, None)
        if window is not None and window >= band:
            pool.append(suspect)
    if rounds:  # a round an earlier run left unfinished: its missing windows first
        for contender in [c for c in pool if rounds not in c.by_round]:
            remeasured += measure(contender, rounds) is not None
    joins = 0
    while True:
        while rounds < MAX_ROUNDS + joins and _round_needed(pool, rounds, remeasured, alone_too):
            rounds += 1
            # Every other round in reverse (A B, then B A): a drift over the minutes (a card's
            # clocks, a neighbour) weighs on both alike.
            for contender in list(pool) if rounds % 2 else list(reversed(pool)):
                remeasured += measure(contender, rounds) is not None
            pool.sort(key=lambda c: -c.tokens_per_s)
        joining = _as_fast_outside(store.leaderboard(study.name), pool)
        if not joining or joins >= MAX_JOINS or not remeasured:
            break
        joins += 1
        pool += [contending(row) for row in joining]
    outside = _as_fast_outside(store.leaderboard(study.name), pool)
    if rounds and not remeasured and len(pool) > 1:
        # Nothing could be measured again: the first windows' order stands, unconfirmed.
        best, second = pool[0], pool[1]
        verdict = Confirmation(
            best.row.config_key,
            best.row.label,
            second.row.label,
            best.tokens_per_s / second.tokens_per_s - 1 if second.tokens_per_s else None,
            noise(best.spread, second.spread),
            False,
            rounds,
            total.probes,
            total.seconds,
            reliable=False,
        )
    elif outside:
        verdict = _undecided(pool, outside, rounds, total.probes, total.seconds)
    else:
        verdict = _verdict(pool, rounds, total.probes, total.seconds)
    verdict = _as_ranked(verdict, ranked(store.leaderboard(study.name), _standing), pool)
    verdict.host_load = max((load for load in loads if load is not None), default=None)
    store.set_confirmation(study.id, verdict.to_dict())
    return verdict


def _as_ranked(verdict: Confirmation, rows: list[LeaderboardRow], pool: list[Contender]) -> Confirmation:
    """The verdict, where the leaderboard puts its winner first (every config faster than it is
    one it tied with: autotune.results.ranking); else the fastest measured, unconfirmed and not reliable,
    so that no surface names another pick than the decision. (`rows`: in plain speed order.)"""
    faster = []
    for row in rows:
        if row.config_key == verdict.winner:
            break
        faster.append(row.config_key)
    if not faster or set(faster) <= set(verdict.tied_keys):
        return verdict
    fastest = rows[0]
    second = next((c for c in pool if c.row.config_key != fastest.config_key), None)
    runner_up = second.row.label if second is not None else verdict.winner_label
    margin = (
        (fastest.tokens_per_s or 0.0) / second.tokens_per_s - 1 if second is not None and second.tokens_per_s else None
    )
    return Confirmation(
        fastest.config_key,
        fastest.label,
        runner_up,
        margin,
        verdict.noise,
        False,
        verdict.rounds,
        verdict.probes,
        verdict.seconds,
        reliable=False,
    )


def judged_as_measured(rows: list[LeaderboardRow]) -> Confirmation | None:
    """The decision on a study whose windows were all measured before it (every candidate reused
    from earlier studies: no round runs, since no probe of it ran), from their stored spreads: the
    fastest measured, unconfirmed, and not reliable when its contenders' noise is beyond what the
    timing resolves. None when nothing fits."""
    if not rows:
        return None
    pool = [Contender(row, _as_result(row)) for row in contenders_of(rows)]
    if len(pool) == 1:
        return Confirmation(pool[0].row.config_key, pool[0].row.label, None, None, None, True, 0, 0, 0.0, reused=True)
    best, second = pool[0], pool[1]
    within = max(noise(best.spread, c.spread) for c in pool[1:])
    margin = best.tokens_per_s / second.tokens_per_s - 1 if second.tokens_per_s else None
    return Confirmation(
        best.row.config_key,
        best.row.label,
        second.row.label,
        margin,
        within,
        False,
        0,
        0,
        0.0,
        reliable=within <= RELIABLE_NOISE,
        host_load=best.row.host_load,
        reused=True,
    )


def _as_fast_outside(rows: list[LeaderboardRow], pool: list[Contender]) -> list[LeaderboardRow]:
    """Configs outside the round measured within the band of its best's pooled speed, or faster
    than any of its contenders: a verdict that left them out could name a pick the leaderboard
    does not put first."""
    keys = {c.row.config_key for c in pool}
    speeds = [c.tokens_per_s for c in pool]
    bar = min(max(speeds) * (1 - CONTENDER_BAND), min(speeds))
    return [r for r in rows if r.config_key not in keys and (r.tokens_per_s or 0.0) > bar][:MAX_CONTENDERS]


def _undecided(
    pool: list[Contender], outside: list[LeaderboardRow], rounds: int, probes: int, seconds: float
) -> Confirmation:
    """The round could not take in every config as fast as its best (MAX_JOINS): the fastest
    measured is the pick, unconfirmed and not reliable, and the verdict says what it rests on."""
    fastest = max(outside, key=lambda r: r.tokens_per_s or 0.0)
    best = max(pool, key=lambda c: c.tokens_per_s)
    if (fastest.tokens_per_s or 0.0) <= best.tokens_per_s:
        return _verdict(pool, rounds, probes, seconds)
    return Confirmation(
        fastest.config_key,
        fastest.label,
        best.row.label,
        (fastest.tokens_per_s or 0.0) / best.tokens_per_s - 1 if best.tokens_per_s else None,
        noise(fastest.step_spread, best.spread),
        False,
        rounds,
        probes,
        seconds,
        reliable=False,
    )


def _round_needed(pool: list[Contender], rounds: int, remeasured: int, alone_too: bool) -> bool:
    """Whether another round of windows can still change the verdict. At least one more window
    each (the verdict needs to see how much windows vary); then until the best is told apart, or
    the two fastest have each won a round (no further round can tell them apart), or a round
    measured nothing (every window failed: another would not either). Where configs were skipped
    against the best's figure (`alone_too`), also until that figure settles: its windows agree, or
    three of them outvote one that was an outlier."""
    if rounds and not remeasured:
        return False
    if len(pool) == 1:
        return alone_too and not _settled(pool[0])
    if rounds == 0:
        return True
    if _split(pool):
        return False
    return not _told_apart(pool) or (alone_too and not _settled(pool[0]))


def _settled(contender: Contender) -> bool:
    """Its figure is what its windows agree on: two within the noise a tie allows, or three (the
    pooled median then lies with the two that agree)."""
    return len(contender.windows) >= 3 or (len(contender.windows) >= 2 and contender.spread <= RELIABLE_NOISE)


def _split(pool: list[Contender]) -> bool:
    """The two fastest each won a round against the other: neither can ever be clearly faster."""
    first, second = sorted(pool, key=lambda c: -c.tokens_per_s)[:2]
    rounds = first.by_round.keys() & second.by_round.keys()
    return any(first.by_round[r] > second.by_round[r] for r in rounds) and any(
        second.by_round[r] > first.by_round[r] for r in rounds
    )


def _told_apart(pool: list[Contender]) -> bool:
    ranked = sorted(pool, key=lambda c: -c.tokens_per_s)
    return clearly_faster(ranked[0], ranked[1])


def _verdict(pool: list[Contender], rounds: int, probes: int, seconds: float) -> Confirmation:
    ranked = sorted(pool, key=lambda c: -c.tokens_per_s)
    best = ranked[0]
    if len(ranked) == 1:  # the only config that fits (contenders_of adds the runner-up when there is one)
        return Confirmation(best.row.config_key, best.row.label, None, None, None, True, rounds, probes, seconds)
    second = ranked[1]
    within = noise(best.spread, second.spread)
    margin = best.tokens_per_s / second.tokens_per_s - 1 if second.tokens_per_s else None
    if clearly_faster(best, second):
        return Confirmation(
            best.row.config_key, best.row.label, second.row.label, margin, within, True, rounds, probes, seconds
        )
    # A tie: the configs the fastest is not clearly faster than. Within a small noise they are as
    # fast as each other, and the one with the most memory to spare is chosen (never one another of
    # them was clearly faster than). Beyond it the timing cannot tell them apart: the fastest
    # measured stays first, and the pick is marked not reliable.
    tied = [c for c in ranked if not clearly_faster(best, c)]
    reliable = max(noise(best.spread, c.spread) for c in tied if c is not best) <= RELIABLE_NOISE
    eligible = [c for c in tied if not any(clearly_faster(other, c) for other in tied)] if reliable else [best]
    chosen = min(
        eligible, key=lambda c: (required_bytes(c.row.peak_reserved_bytes, c.row.context_bytes) or 0, -c.tokens_per_s)
    )
    others = [c for c in tied if c is not chosen]
    return Confirmation(
        chosen.row.config_key,
        chosen.row.label,
        others[0].row.label if others else None,
        margin,
        within,
        False,
        rounds,
        probes,
        seconds,
        tied=[c.row.label for c in others],
        tied_keys=[c.row.config_key for c in others],
        reliable=reliable,
    )


def _standing(row: LeaderboardRow) -> Standing:
    return Standing(
        row.config_key, row.tokens_per_s, required_bytes(row.peak_reserved_bytes, row.context_bytes), row.probe_id
    )


def _as_result(row: LeaderboardRow) -> ProbeResult:
    return ProbeResult(
        status=ProbeStatus.OK,
        step_seconds=row.step_seconds,
        step_spread=row.step_spread,
        tokens_per_s=row.tokens_per_s,
        samples_per_s=row.samples_per_s,
    )


def _stored_step_times(record: ProbeRecord, row: LeaderboardRow) -> list[float]:
    """The first window's step times (a probe stored before step times were kept: its mean step)."""
    if record.result.step_times:
        return list(record.result.step_times)
    steps = record.result.measured_steps or 1
    return [row.step_seconds] * steps if row.step_seconds else []


def _pooled(row: LeaderboardRow, step_times: list[float]) -> ProbeResult:
    config = row.config
    # (each window of batches drawn from the data's lengths is whole cycles: pooled, they still are)
    seconds, spread = window_seconds(step_times, config.timing_cycle)
    return replace(
        _as_result(row),
        step_seconds=seconds,
        step_spread=spread,
        step_times=list(step_times),
        tokens_per_s=config.tokens_per_step / seconds,
        samples_per_s=config.effective_batch / seconds,
        measured_steps=len(step_times),
        measured_seconds=sum(step_times),
    )

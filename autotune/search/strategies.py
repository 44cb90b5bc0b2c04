"""Strategies: which candidate to settle next. See the package docstring for what each does and why
`predictive` is the default."""

from __future__ import annotations

from dataclasses import dataclass, replace

from autotune.levers import speed_levers
from autotune.levers.config import ProbeConfig
from autotune.search.common import SearchOptions
from autotune.search.confirm import RELIABLE_NOISE
from autotune.search.knowledge import Knowledge, MemorySkip, SpeedSkip
from autotune.search.speed_model import FittedSpeed, SpeedGuess, SpeedModel
from autotune.search.trials import Trials, params_of, tell
from autotune.search.space import group_key, group_priority, micro_batch_family
from autotune.vocabulary.status import ProbeStatus

# A candidate is probed only while it could beat the best measured by more than this share: less
# than that is inside what one window of steps can tell apart (the confirmation round measures the
# configs within noise of the best again).
WORTH_PROBING = 0.02


class FrontierStrategy:
    """Binary-search each group's largest fitting micro-batch, then confirm the next smaller one
    is slower. Groups without checkpointing first: their results rule checkpointed configs out."""

    def __init__(self, knowledge: Knowledge, device_type: str) -> None:
        self.knowledge = knowledge
        groups: dict[tuple, list[ProbeConfig]] = {}
        for config in knowledge.candidates:
            groups.setdefault(group_key(config), []).append(config)
        self.groups = sorted(
            (sorted(g, key=lambda c: c.micro_batch) for g in groups.values()),
            key=lambda g: group_priority(g[0], device_type),
        )

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
        fits = [i for i, s in enumerate(status) if s == ProbeStatus.OK]
        lo = max(fits) if fits else -1  # largest index known to fit
        tops = [i for i, s in enumerate(status) if s == ProbeStatus.OOM and i > lo]
        hi = min(tops) if tops else len(group)  # smallest index known not to fit
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
                return group[i], (
                    f"fits (a larger micro-batch does) but {group[below].label()} was already slower "
                    f"than {group[best].label()}"
                )
        return None


@dataclass(frozen=True, slots=True)
class Relations:
    """A candidate's structural relatives among the candidates (keys), worked out once."""

    family: tuple  # space.micro_batch_family
    without_checkpointing: str | None
    default_allocator: str | None
    plain: str | None  # plain_twin: no speed lever


class PredictiveStrategy:
    """Predict every candidate's speed (search/speed_model.py, refitted after each probe) and
    memory (the estimator), probe the candidate that could be fastest, and stop when none left
    could beat the best measured. See the package docstring."""

    def __init__(self, knowledge: Knowledge, device_type: str) -> None:
        self.knowledge = knowledge
        self.model = SpeedModel(knowledge.candidates, device_type)
        self.by_key = {c.key(): c for c in knowledge.candidates}
        groups: dict[tuple, list[ProbeConfig]] = {}
        for config in sorted(knowledge.candidates, key=lambda c: c.micro_batch):
            groups.setdefault(group_key(config), []).append(config)
        self.groups = groups

        def relative(config: ProbeConfig, twin: ProbeConfig) -> str | None:
            return twin.key() if twin != config and twin.key() in self.by_key else None

        self.relations = {
            key: Relations(
                micro_batch_family(c),
                relative(c, replace(c, checkpointing=False)),
                relative(c, replace(c, allocator=speed_levers.DEFAULT_ALLOCATOR)),
                relative(c, plain_twin(c)),
            )
            for key, c in self.by_key.items()
        }
        self._fitted: tuple[int, FittedSpeed] | None = None

    def fitted(self) -> FittedSpeed:
        """The speed model fitted to every config measured so far (refitted when one more is)."""
        measured = self.knowledge.ok()
        if self._fitted is None or self._fitted[0] != len(measured):
            self._fitted = (len(measured), self.model.fit(measured))
        return self._fitted[1]

    def next(self) -> tuple[ProbeConfig, str | None] | None:
        """(config, None) to probe it, (config, reason) to record it skipped, None when there is
        nothing to do now (done, or waiting for probes in flight on other workers)."""
        k = self.knowledge
        unresolved = k.unresolved()
        for config in unresolved:  # structure first: a config already ruled out costs nothing
            if k.available(config):
                reason = k.implied_skip(config) or self.rescue_ruled_out(config)
                if reason:
                    return config, reason
        best = k.best()
        bar = (best[1].tokens_per_s or 0.0) * (1 + WORTH_PROBING) if best is not None else 0.0
        guesses = self.guesses(unresolved)
        # The most promising first (the highest optimistic speed: where the model knows least of a
        # config that could be fast, measuring it teaches the most), but the plain configs before
        # those with a speed lever (compile, Liger, another allocator): a lever is tried only where
        # the plain frontier measured says it could win (and a compile costs minutes of its own).
        # And those predicted to fit before those predicted not to, within the prediction's margin:
        # each of these is verified by a probe only if it could still win once what fits is measured.
        worth = sorted(
            (
                c
                for c in unresolved
                if guesses[c.key()].optimistic_tokens_per_s > bar and self.plain_twin_probed(c) is True
            ),
            key=lambda c: (
                uses_speed_lever(c),
                k.predicted_to_fit(c) is False,
                -guesses[c.key()].optimistic_tokens_per_s,
            ),
        )
        for config in worth:
            if k.open(config):
                step = self._toward(config)
                if step is not None:
                    return step, None
        if worth or k.busy:
            return None  # what may still win is in flight elsewhere, or waits on what is: wait for it
        for config in sorted(unresolved, key=uses_speed_lever):  # a speed lever's plain twins first
            if k.available(config):
                if not self.plain_twin_probed(config):
                    return config, SpeedSkip(
                        f"{plain_twin(config).label()} was not probed (it could not win): a speed "
                        f"lever is tried only where the plain configs could"
                    )
                guess = guesses[config.key()]
                assert best is not None  # (without a best, every unresolved config is worth probing)
                return config, SpeedSkip(
                    f"{guess.describe()}: not faster than {best[0].label()}, measured at "
                    f"{best[1].tokens_per_s or 0.0:,.0f}"
                )
        return None

    def revisitable(self) -> list[ProbeConfig]:
        """Configs skipped for speed that could win now: no structure rules them out, and their
        optimistic speed beats the best measured as it stands now (the confirmation round pooled
        its windows: a first window that was an outlier no longer holds the bar up), less that
        figure's noise. The round measured the best in several processes, and their spread is how
        far the figure a config was skipped against can be from the run's: a config predicted
        within it could be the faster one, so it is decided by a probe. (Widened by at most the
        noise a reliable pick allows: beyond it the pick is said not reliable whatever is probed.)"""
        k = self.knowledge
        self._fitted = None  # measured figures changed: fit again
        best = k.best()
        if best is None:
            return []
        noise = min(best[1].step_spread or 0.0, RELIABLE_NOISE)
        bar = (best[1].tokens_per_s or 0.0) * (1 + WORTH_PROBING) * (1 - noise)
        skipped = [
            c
            for c in k.candidates
            if (result := k.outcomes.get(c.key())) is not None
            and result.status == ProbeStatus.SKIPPED
            and k.implied_skip(c) is None
            and self.rescue_ruled_out(c) is None
            and self.plain_twin_probed(c) is True
        ]
        guesses = self.guesses(skipped)
        return [c for c in skipped if guesses[c.key()].optimistic_tokens_per_s > bar]

    def rescue_ruled_out(self, config: ProbeConfig) -> str | None:
        """A speed lever tried where its plain twin ran out of memory (a rescue: compile and
        expandable segments may need less) is not tried again on a config the estimator predicts
        to need at least as much as one it already failed to rescue (the estimator traces both as
        their plain twins: what it ranks is their plain need)."""
        k = self.knowledge
        plain = self.relations[config.key()].plain
        mine = k.predictions.get(config.key())
        if plain is None or mine is None or plain not in k.outcomes or k.outcomes[plain].status != ProbeStatus.OOM:
            return None
        levers = (config.compile, config.allocator, config.liger)
        for key, result in k.outcomes.items():
            other, theirs = self.by_key.get(key), k.predictions.get(key)
            if (
                other is not None
                and theirs is not None
                and result.status == ProbeStatus.OOM
                and self.relations[key].plain is not None
                and (other.compile, other.allocator, other.liger) == levers
                and theirs.required_bytes <= mine.required_bytes
            ):
                return MemorySkip(
                    f"predicted to need at least what {other.label()} needs, which ran out of memory "
                    f"with the same speed levers"
                )
        return None

    def plain_twin_probed(self, config: ProbeConfig) -> bool | None:
        """For a config with a speed lever, whether its twin without (plain_twin) was probed: the
        plain frontier decides where a lever may win. None while that twin is unsettled; True for
        a plain config, or where the space has no plain twin."""
        plain = self.relations[config.key()].plain
        if plain is None:
            return True
        outcome = self.knowledge.outcomes.get(plain)
        if outcome is None:
            return None
        return outcome.status in (ProbeStatus.OK, ProbeStatus.OOM)

    def guesses(self, configs: list[ProbeConfig]) -> dict[str, SpeedGuess]:
        """The speed model's guess of each config, held to what structure says it cannot beat: a
        larger micro-batch of its family measured (space.micro_batch_family: a smaller one is not
        faster; the larger one stands for the family's chance), and its twin without checkpointing
        or with the default allocator."""
        k, fitted = self.knowledge, self.fitted()
        measured: dict[tuple, list[tuple[ProbeConfig, float]]] = {}
        for config, result in k.ok():
            measured.setdefault(self.relations[config.key()].family, []).append((config, result.tokens_per_s or 0.0))
        known: dict[str, SpeedGuess] = {}

        def guess(key: str) -> SpeedGuess:
            if key in known:
                return known[key]
            config, related, result = self.by_key[key], self.relations[key], k.outcomes.get(key)
            if result is not None and result.status == ProbeStatus.OK and result.tokens_per_s:
                out = SpeedGuess(result.tokens_per_s, result.tokens_per_s, 0.0, fitted.measured)  # measured: known
            else:
                out = fitted.guess(config)
                larger = [
                    (c, speed) for c, speed in measured.get(related.family, ()) if c.micro_batch > config.micro_batch
                ]
                if larger and self.model.departures.monotone_micro_batch:
                    # (in the model's work per second: a larger micro-batch pads more, autotune.levers.lengths)
                    by, ceiling = min(
                        ((c, speed * c.padded_per_real / config.padded_per_real) for c, speed in larger),
                        key=lambda item: item[1],
                    )
                    out = out.capped(ceiling, f"a smaller micro-batch than {by.label()}, measured at")
                # Speed bounds whether or not the twin fits: checkpointing only adds recomputation,
                # and another allocator setting runs the same kernels.
                for twin, why in (
                    (related.without_checkpointing, "without checkpointing"),
                    (related.default_allocator, "with the default allocator"),
                ):
                    if twin is not None:
                        out = out.capped(
                            guess(twin).optimistic_tokens_per_s,
                            f"its twin {why} ({self.by_key[twin].label()}) could reach",
                        )
            known[key] = out
            return out

        return {config.key(): guess(config.key()) for config in configs}

    def _toward(self, target: ProbeConfig) -> ProbeConfig | None:
        """The probe that leads to `target`: itself where its memory is predicted (or known), else
        the middle of the micro-batches of its group between the largest known to fit and it
        (a binary search: an OOM rules out everything above it unprobed)."""
        k = self.knowledge
        twin = self.relations[target.key()].without_checkpointing
        if (
            twin is not None
            and not k.resolved(self.by_key[twin])
            and k.predicted_to_fit(self.by_key[twin]) is not False
        ):
            # Without checkpointing first: where it fits, checkpointing only adds recomputation.
            target = self.by_key[twin]
        if target.key() in k.predictions:
            return target if k.open(target) else None
        group = self.groups[group_key(target)]
        at = group.index(target)
        fits = [i for i, c in enumerate(group[:at]) if k.resolved(c) and k.outcomes[c.key()].status == ProbeStatus.OK]
        between = [c for c in group[(max(fits) if fits else -1) + 1 : at + 1] if not k.resolved(c)]
        if not all(k.open(c) for c in between):
            return target if k.open(target) else None
        return between[(len(between) - 1) // 2]


def plain_twin(config: ProbeConfig) -> ProbeConfig:
    """`config` without its speed levers: eager, the default allocator, no Liger."""
    return replace(config, compile=False, allocator=speed_levers.DEFAULT_ALLOCATOR, liger=False)


def uses_speed_lever(config: ProbeConfig) -> bool:
    return plain_twin(config) != config


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
            config = _config_fromparams_of(k.candidates, trial.params)
            if config is None or k.resolved(config):
                # A repeat: answer from what is known so the sampler learns without a probe.
                known = k.outcomes.get(config.key()) if config is not None else None
                tell(self.study, trial, known)
                self._misses += 1  # past 20 per candidate, fall back to the remaining ones in order
                continue
            if not k.available(config):
                # In flight on another worker: its result will reach the sampler; take other work.
                tell(self.study, trial, None)
                break
            self.pending_trial = trial
            return config, k.implied_skip(config)
        for config in k.unresolved():
            if k.available(config):
                return config, k.implied_skip(config)
        return None


def _config_fromparams_of(candidates: list[ProbeConfig], params: dict) -> ProbeConfig | None:
    for c in candidates:
        if params_of(c) == params:
            return c
    return None  # a micro-batch/block pair that cannot keep the effective batch exact


def make_strategy(options: SearchOptions, knowledge: Knowledge, device_type: str, trials: Trials):
    if options.strategy == "frontier":
        return FrontierStrategy(knowledge, device_type)
    if options.strategy == "predictive":
        return PredictiveStrategy(knowledge, device_type)
    if options.strategy == "tpe":
        return TpeStrategy(knowledge, trials.study, trials.distributions)
    return GridStrategy(knowledge, prune=options.strategy == "grid")

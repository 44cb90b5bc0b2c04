"""Strategies: which candidate to settle next. See the package docstring for why `frontier` is the
default."""

from __future__ import annotations

from autotune.config import ProbeConfig
from autotune.search.common import SearchOptions
from autotune.search.knowledge import Knowledge
from autotune.search.trials import Trials, params_of, tell
from autotune.space import group_key, group_priority
from autotune.status import ProbeStatus


class FrontierStrategy:
    """Binary-search each group's largest fitting micro-batch, then confirm the next smaller one
    is slower. Groups without checkpointing first: their results rule checkpointed configs out."""

    def __init__(self, knowledge: Knowledge, device_type: str) -> None:
        self.knowledge = knowledge
        groups: dict[tuple, list[ProbeConfig]] = {}
        for config in knowledge.candidates:
            groups.setdefault(group_key(config), []).append(config)
        self.groups = sorted((sorted(g, key=lambda c: c.micro_batch) for g in groups.values()),
                             key=lambda g: group_priority(g[0], device_type))

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
        lo = max(fits) if fits else -1                      # largest index known to fit
        tops = [i for i, s in enumerate(status) if s == ProbeStatus.OOM and i > lo]
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
    if options.strategy == "tpe":
        return TpeStrategy(knowledge, trials.study, trials.distributions)
    return GridStrategy(knowledge, prune=options.strategy == "grid")

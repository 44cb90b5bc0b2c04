"""Knowledge: what a search knows of each candidate, and what that implies for the others."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from autotune.results.budget import Budget
from autotune.levers.config import ProbeConfig
from autotune.results.ranking import Standing, ranked
from autotune.levers.speed_levers import DEFAULT_ALLOCATOR
from autotune.results.probe_result import ProbeResult
from autotune.search.predictions import Prediction
from autotune.search.space import dominates_in_memory, group_key
from autotune.vocabulary.status import ProbeStatus
from autotune.vocabulary.units import format_size


class SkipReason(str):
    """Why a candidate is recorded skipped, and of which kind (`kind`): "structure" (what another's
    outcome implies: a larger one ran out of memory, a twin fits without checkpointing), "memory"
    (predicted too big), "speed" (the speed model says it cannot beat what is measured: a skip that
    rests on a measurement, revisited when that measurement falls: search/loop.py)."""

    kind = "structure"


class MemorySkip(SkipReason):
    kind = "memory"


class SpeedSkip(SkipReason):
    kind = "speed"


def skip_kind(reason: str) -> str:
    return getattr(reason, "kind", SkipReason.kind)


@dataclass(slots=True)
class Knowledge:
    """What is known about each candidate of the space, and what it implies for the others."""

    candidates: list[ProbeConfig]
    outcomes: dict[str, ProbeResult] = field(default_factory=dict)  # by config key
    predictions: dict[str, Prediction] = field(default_factory=dict)
    allowed_bytes: int = 0  # budget less margin: what a config may need
    skip_over_bytes: int = 0  # predicted need above which a config is not probed
    busy: dict[str, ProbeConfig] = field(default_factory=dict)  # in flight on other workers, by key
    _keyed: list[tuple[str, ProbeConfig]] = field(default_factory=list, repr=False)  # (key, config), in order
    _sans_allocator: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._keyed = [(c.key(), c) for c in self.candidates]
        # Each config's key with the default allocator: twins that differ only in it share one.
        self._sans_allocator = {key: replace(c, allocator=DEFAULT_ALLOCATOR).key() for key, c in self._keyed}

    @classmethod
    def of(
        cls,
        candidates: list[ProbeConfig],
        budget: Budget,
        predict_margin: float,
        predictions: dict[str, Prediction] | None = None,
    ) -> Knowledge:
        """What a search of `candidates` under `budget` starts knowing: a config may need what the
        budget allows less its margin, and is skipped unprobed only when predicted over the
        budget by more than `predict_margin` of it."""
        return cls(
            list(candidates),
            predictions=dict(predictions or {}),
            allowed_bytes=budget.allowed_bytes,
            skip_over_bytes=int(budget.total_bytes * (1 + predict_margin)),
        )

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
            if any(twin.key() == key for key, _ in self._keyed) and not self.resolved(twin):
                twin_group = group_key(twin)
        for other in self.busy.values():
            if other.key() == config.key():
                continue
            if twin_group is not None and group_key(other) == twin_group:
                return True
            if (
                dominates_in_memory(other, config)
                and not any(dominates_in_memory(other, f) for f in fitting)
                and not any(dominates_in_memory(config, f) for f in fitting)
            ):
                return True  # `other` may not fit (nothing as large is known to), and then neither does `config`
        return False

    def open(self, config: ProbeConfig) -> bool:
        """Unresolved, not in flight elsewhere, and not waiting on a result in flight: worth a probe now."""
        return not self.resolved(config) and self.available(config) and not self.speculative(config)

    def learn(self, config: ProbeConfig, result: ProbeResult) -> None:
        self.outcomes[config.key()] = result

    def ok(self) -> list[tuple[ProbeConfig, ProbeResult]]:
        return [
            (c, self.outcomes[key])
            for key, c in self._keyed
            if key in self.outcomes and self.outcomes[key].status == ProbeStatus.OK
        ]

    def best(self) -> tuple[ProbeConfig, ProbeResult] | None:
        """The best config that fits so far, as autotune.results.ranking ranks (no confirmation yet)."""
        learnt = {key: i for i, key in enumerate(self.outcomes)}  # the order they were learnt in

        def standing(item: tuple[ProbeConfig, ProbeResult]) -> Standing:
            config, result = item
            return Standing(config.key(), result.tokens_per_s, result.required_bytes, learnt[config.key()])

        fitting = ranked(self.ok(), standing)
        return fitting[0] if fitting else None

    def implied_skip(self, config: ProbeConfig) -> str | None:
        """Why `config` need not be probed, from what is known of the others; None if it must be."""
        key = config.key()
        without_checkpointing = replace(config, checkpointing=False) if config.checkpointing else None
        for other_key, other in self._keyed:  # (in the candidates' order: the first reason found is said)
            result = self.outcomes.get(other_key)
            if result is None or other_key == key:
                continue
            if result.status == ProbeStatus.OOM and dominates_in_memory(other, config):
                return f"needs at least the memory of {other.label()}, which ran out of memory"
            if (
                without_checkpointing is not None
                and not other.checkpointing
                and result.status == ProbeStatus.OK
                and dominates_in_memory(without_checkpointing, other)
            ):
                # Its twin without checkpointing fits (it is no larger than `other`, which does).
                if (other.micro_batch, other.block_size) == (config.micro_batch, config.block_size):
                    return f"{other.label()} fits without checkpointing, which only adds recomputation"
                return (
                    f"fits without checkpointing (the larger {other.label()} does), and checkpointing only "
                    f"adds recomputation"
                )
            if (
                config.allocator != other.allocator
                and result.status == ProbeStatus.OK
                and self._sans_allocator[key] == self._sans_allocator[other_key]
            ):
                # The allocator setting decides where memory goes, not which kernels run: where the
                # other setting fits too, it is as fast (searched only for what it lets fit).
                return f"{other.label()} fits with the {other.allocator} allocator, which runs the same kernels"
        prediction = self.predictions.get(config.key())
        if prediction is not None and prediction.floor_bytes > self.skip_over_bytes:
            return MemorySkip(
                f"predicted to need at least {format_size(prediction.floor_bytes)}, over the "
                f"{format_size(self.allowed_bytes)} allowed by more than the prediction margin"
            )
        return None

    def predicted_to_fit(self, config: ProbeConfig) -> bool | None:
        prediction = self.predictions.get(config.key())
        return None if prediction is None else prediction.required_bytes <= self.allowed_bytes

    def unresolved(self) -> list[ProbeConfig]:
        return [c for key, c in self._keyed if key not in self.outcomes]

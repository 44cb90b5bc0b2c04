"""`autotune plan`: the whole search space predicted for a card, without one.

Every candidate's memory comes from the estimator (autotune.estimate), which traces the probe's
own training step on fake tensors: within a group of configs that differ only in micro-batch
(space.group_key) the need grows piecewise affinely with the micro-batch, so the group's ends
(and its middle, for four or more) are traced and the members between them interpolated, as the
search's predictions are (estimate/interpolate.py; `exact` traces every config). Traces are cached under $AUTOTUNE_HOME (estimate/cache.py), keyed as the search's are,
so a search after a plan of the same space and device type starts with every prediction in hand.

Speed comes from a documented cost model (planner/speed.py), labelled "predicted" throughout: a
plan ranks what fits, a search measures it. On several GPUs (`--gpus N`, `--strategies`) each
candidate's memory is one rank's (the largest's; every rank needs it on its own card) and its speed
the whole run's, the collectives of its strategy counted over the card's link (cards.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.results.budget import Budget
from autotune.specs.cards import Card
from autotune.levers.config import ProbeConfig
from autotune.estimate import untraceable
from autotune.estimate import stated_error
from autotune.estimate.interpolate import between, interpolated, traced_members
from autotune.estimate.stack import Stack
from autotune.estimate.stated_error import StatedError
import autotune.planner.speed_error as speed_error
from autotune.planner.speed_error import SpeedError
from autotune.vocabulary.errors import BadInput
from autotune.specs.models import ModelSpec
from autotune.search.space import SearchSpace, group_key, group_priority
from autotune.vocabulary.status import ProbeStatus
from autotune.vocabulary.units import format_size

if TYPE_CHECKING:
    from autotune.estimate import MemoryEstimate
    from autotune.estimate.launch import TraceChildren
    from autotune.planner.card_speed import SpeedPrediction
    from autotune.store import Store


@dataclass(frozen=True, slots=True)
class Target:
    """What a plan predicts for: a card from autotune.specs.cards, a CUDA card known only by its budget
    (no speed can be predicted for it), or the CPU (what a CPU probe accounts); and the budget to
    fit in (the card's memory unless the user gives less)."""

    card: Card | None
    device_type: str  # cuda or cpu
    budget: Budget

    @property
    def name(self) -> str:
        if self.card is not None:
            return self.card.name
        return "cpu" if self.device_type == "cpu" else f"a CUDA card with {format_size(self.budget.total_bytes)}"

    @classmethod
    def of(cls, card: Card | None, budget_bytes: int | None, margin: int | float, *, cpu: bool = False) -> "Target":
        """Check a budget against the card: above its memory is a user's mistake (one line)."""
        if card is None and budget_bytes is None:
            raise BadInput(
                "--gpu cpu needs --gpu-budget: the CPU has no memory size of its own to plan for."
                if cpu
                else "give --gpu NAME or --gpu-budget SIZE."
            )
        if card is not None and budget_bytes is not None and budget_bytes > card.memory_bytes:
            raise BadInput(
                f"--gpu-budget {format_size(budget_bytes)} is more than the {card.name}'s memory "
                f"({format_size(card.memory_bytes)}); give at most that, or leave --gpu-budget out."
            )
        budget = budget_bytes if budget_bytes is not None else card.memory_bytes  # type: ignore[union-attr]
        return cls(card, "cpu" if cpu else "cuda", Budget.of(budget, margin))


@dataclass(slots=True)
class Planned:
    """One candidate of the plan."""

    config: ProbeConfig
    estimate: MemoryEstimate | None = None  # None when it cannot be predicted (see `why_not`)
    traced: bool = False  # False: interpolated between its group's traced ends
    why_not: str | None = None  # the card lacks the lever, or the estimator cannot trace it
    fits: bool = False
    speed: SpeedPrediction | None = None
    measured: dict[str, Any] | None = None  # the same config's probe in a study on such a card

    @property
    def need_bytes(self) -> int | None:
        return None if self.estimate is None else self.estimate.required_bytes

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.speed is None else self.speed.tokens_per_s

    def breakdown(self) -> dict[str, int]:
        """Where the need goes: the estimator's parts at the peak, the allocator's slack (reserved
        beyond the peak), the context outside the allocator; the logits (a share of the
        activations, for a sense of scale) apart."""
        e = self.estimate
        if e is None:
            return {}
        return {
            "weights": e.params,
            "grads": e.grads,
            "optimizer": e.optimizer,
            "activations": e.activations,
            "temporaries": e.temporaries,
            "workspace": e.workspace,
            "allocator_slack": e.reserved_bytes - e.peak_bytes,
            "context": e.context_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.config.label(),
            "config": self.config.to_dict(),
            "config_key": self.config.key(),
            "predicted": True,
            "traced": self.traced,
            "why_not": self.why_not,
            "fits": self.fits,
            "peak_allocated_bytes": None if self.estimate is None else self.estimate.peak_bytes,
            "peak_reserved_bytes": None if self.estimate is None else self.estimate.reserved_bytes,
            "need_bytes": self.need_bytes,
            "breakdown": self.breakdown(),
            "gpus": self.config.gpus,
            "strategy": self.config.strategy,
            "nodes": self.config.nodes,
            "per_rank": self.config.ranks > 1,
            "tokens_per_s": self.tokens_per_s,
            "speed": None if self.speed is None else dataclasses.asdict(self.speed),
            "measured": self.measured,
        }


@dataclass(slots=True)
class Plan:
    model: str  # the model's reference
    target: Target
    space: SearchSpace
    planned: list[Planned]  # fitting ones first, fastest first; then the rest by need
    seconds: float = 0.0
    traces: int = 0  # configs traced now (the rest: interpolated or cached)
    study: str | None = None  # the study whose measurements stand beside the predictions
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Planned | None:
        return next((p for p in self.planned if p.fits), None)

    @property
    def stated_error(self) -> StatedError | None:
        """How far a need predicted for a card (reserved + context: what nvidia-smi shows) was from
        published GPU measurements of this method (None on a CPU, which the estimate equals)."""
        return stated_error.stated("nvidia-smi", self.space.peft) if self.target.device_type == "cuda" else None

    @property
    def speed_error(self) -> SpeedError | None:
        """How far predicted speeds were from published GPU training throughputs (None on a CPU:
        the card model does not price CPUs)."""
        return speed_error.load() if self.target.device_type == "cuda" else None

    def to_dict(self) -> dict[str, Any]:
        error, speed = self.stated_error, self.speed_error
        return {
            "model": self.model,
            "target": self.target.name,
            "device_type": self.target.device_type,
            "budget_bytes": self.target.budget.total_bytes,
            "margin_bytes": self.target.budget.margin_bytes,
            "space": self.space.to_dict(),
            "seconds": self.seconds,
            "traces": self.traces,
            "compared_with_study": self.study,
            "notes": self.notes,
            "stated_error": None
            if error is None
            else {
                "kind": error.kind,
                "method": error.method,
                "count": error.count,
                "median": error.median,
                "worst": error.worst,
            },
            "speed_error": None
            if speed is None
            else {"count": speed.count, "median": speed.median, "worst": speed.worst},
            "candidates": [p.to_dict() for p in self.planned],
        }


def make_plan(
    spec: ModelSpec,
    space: SearchSpace,
    target: Target,
    *,
    exact: bool = False,
    timeout: float,
    use_cache: bool = True,
    trust_remote_code: bool = False,
    children: TraceChildren | None = None,
    store: Store | None = None,
    study: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    stack: Stack | None = None,
) -> Plan:
    """Predict every candidate of `space` on `target`; measurements of a matching study in `store`
    (or the study named) stand beside them."""
    started = time.perf_counter()
    traced = trace_space(
        space,
        [target],
        exact=exact,
        timeout=timeout,
        use_cache=use_cache,
        trust_remote_code=trust_remote_code,
        children=children,
        on_progress=on_progress,
        stack=stack,
    )
    plan = judge_plan(spec, space, target, traced, stack=stack)
    if store is not None:
        plan.study = _compare(plan, store, spec, study)
    plan.seconds = time.perf_counter() - started
    return plan


@dataclass(frozen=True, slots=True)
class Traced:
    """A space's memory estimates by config key (traced or interpolated), the keys traced, and how
    many traces ran now: what does not depend on the card, shared by every card a plan weighs."""

    estimates: dict[str, MemoryEstimate]
    traced: frozenset[str]
    traces: int


def trace_space(
    space: SearchSpace,
    targets: list[Target],
    *,
    exact: bool = False,
    timeout: float,
    use_cache: bool = True,
    trust_remote_code: bool = False,
    children: TraceChildren | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    stack: Stack | None = None,
    memo: dict[str, MemoryEstimate] | None = None,
) -> Traced:
    """The estimates of every candidate some target can run, traced once for all of them (the
    targets share a device type: a card changes only its context and which levers it has)."""
    device_type, groups = _groups(space, targets)
    to_trace = [c for members in groups.values() for c in _to_trace(members, exact)]
    tracer = _Tracer(device_type, timeout, use_cache, trust_remote_code, children, stack, memo, on_progress)
    tracer.trace(to_trace, len(to_trace))
    return tracer.traced(groups)


def planned_traces(space: SearchSpace, targets: list[Target], *, exact: bool = False) -> int:
    """How many traces `space` takes on `targets` at most: trace_space's count, which trace_fastest
    reports against until it knows it needs fewer."""
    return _planned(_groups(space, targets)[1], exact)


def _planned(groups: dict[tuple, list[ProbeConfig]], exact: bool = False) -> int:
    return sum(len(_to_trace(members, exact)) for members in groups.values())


def trace_fastest(
    spec: ModelSpec,
    space: SearchSpace,
    targets: list[Target],
    *,
    timeout: float,
    use_cache: bool = True,
    trust_remote_code: bool = False,
    children: TraceChildren | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    stack: Stack | None = None,
    memo: dict[str, MemoryEstimate] | None = None,
) -> Traced:
    """As much of `space` traced as it takes to know each target's fastest config that fits (what a
    rental plan reports), no more. A group (configs that differ only in micro-batch) is traced in two
    stages: its largest micro-batch first (if that fits, so does every smaller one, and it is most
    often the fastest), then the rest of the members interpolation needs (trace_space's). Stages go
    in order of the fastest speed a member they would tell is predicted on a target still undecided;
    a target is decided once the fastest config known to fit it is predicted at least as fast as
    every member not yet known. Speed needs no trace (predict_speed takes only the parameter count
    of a trace, the same for every one-rank config of the recipe: known after the first), so the
    answer is the one tracing everything gives. A target on which nothing fits is never decided: the
    whole space is traced, and its smallest need known."""
    from autotune.planner.card_speed import model_dims_of, predict_speed

    dims = model_dims_of(spec)
    device_type, groups = _groups(space, targets)
    planned_total = _planned(groups)
    tracer = _Tracer(device_type, timeout, use_cache, trust_remote_code, children, stack, memo, on_progress)
    if dims is None or any(t.card is None for t in targets):  # (no speed to bound by: every group)
        tracer.trace([c for members in groups.values() for c in _to_trace(members, False)], planned_total)
        return tracer.traced(groups)
    per_batch = len(children.children) if children is not None else 1  # (traces side by side)
    stages = {group: _stages(members) if not _outdone(members[0], groups) else [] for group, members in groups.items()}
    undecided = list(targets)
    known: dict[str, MemoryEstimate] = {}

    def speed(config: ProbeConfig, target: Target) -> float | None:
        """`config`'s predicted tokens/s on `target` (None: it cannot run there), with the parameter
        count a trace of its recipe gave; before any such trace, unbounded (inf)."""
        if unplannable(config, target) is not None:
            return None
        estimate = tracer.estimates.get(config.key()) or tracer.recipe_estimate(config)
        if estimate is None and config.ranks == 1:
            return float("inf")
        predicted = predict_speed(config, dims, target.card, estimate, stack)  # type: ignore[arg-type]
        return None if predicted is None else predicted.tokens_per_s

    def bound(group: tuple, target: Target) -> float:
        """The fastest a member of `group` not yet known could be on `target` (0: none left)."""
        if not stages[group]:
            return 0.0
        speeds = [speed(c, target) for c in groups[group] if c.key() not in known]
        return max((s for s in speeds if s is not None), default=0.0)

    def best_fitting(target: Target) -> float | None:
        fitting = [
            s for estimate in known.values() if _fits(estimate, target) and (s := speed(estimate.config, target))
        ]
        return max(fitting, default=None)

    while undecided and any(stages.values()):
        bounds = {group: max(bound(group, t) for t in undecided) for group in groups if stages[group]}
        batch: list[ProbeConfig] = []
        # The most promising stage, and the next while a child would be left idle: stages that would
        # be traced next anyway, most of the time.
        for group in sorted(bounds, key=lambda g: -bounds[g]):
            if len(batch) >= per_batch:
                break
            batch += stages[group].pop(0)
        tracer.trace(batch, planned_total)
        known = tracer.interpolate(groups)
        undecided = [
            target
            for target in undecided
            if (best := best_fitting(target)) is None
            or best < max((bound(group, target) for group in groups), default=0.0)
        ]
    if on_progress is not None:  # (the traces not needed: the progress ends where the tracing did)
        on_progress(tracer.done, tracer.done)
    return tracer.traced(groups)


def _outdone(config: ProbeConfig, groups: dict[tuple, list[ProbeConfig]]) -> bool:
    """Whether `config`'s group can never hold a card's fastest fit because its SDPA twin is in the
    space: eager attention keeps its S x S scores (and their dropout mask) for backward where SDPA's
    kernels keep a row's statistics, so the twin needs no more memory, and the card model prices
    eager's scores' traffic on top of the same dispatch (card_speed), so the twin is no slower. A
    card the twin does not fit, eager does not fit either."""
    if config.attention != "eager":
        return False
    return group_key(dataclasses.replace(config, attention="sdpa")) in groups


def _stages(members: list[ProbeConfig]) -> list[list[ProbeConfig]]:
    """A group's traces in trace_fastest's order: its largest micro-batch, then the rest of what
    trace_space traces of it (its smallest, and middle)."""
    largest, rest = members[-1], [c for c in _to_trace(members, False) if c is not members[-1]]
    return [[largest], rest] if rest else [[largest]]


def _groups(space: SearchSpace, targets: list[Target]) -> tuple[str, dict[tuple, list[ProbeConfig]]]:
    """The targets' device type and the configs some target can run, by group (space.group_key),
    groups in the order the search visits them, members by micro-batch."""
    kinds = {t.device_type for t in targets}
    if len(kinds) != 1:
        raise ValueError(f"one plan's targets share a device type, not {sorted(kinds)}")
    device_type = kinds.pop()
    traceable = [c for c in space.candidates() if any(unplannable(c, t) is None for t in targets)]
    groups: dict[tuple, list[ProbeConfig]] = {}
    for config in sorted(traceable, key=lambda c: group_priority(c, device_type)):
        groups.setdefault(group_key(config), []).append(config)
    for members in groups.values():
        members.sort(key=lambda c: c.micro_batch)
    return device_type, groups


def _to_trace(members: list[ProbeConfig], exact: bool) -> list[ProbeConfig]:
    """A group's configs to trace: every one with `exact`, else its smallest and largest micro-batch
    (and its middle); the rest are interpolated between them."""
    return members if exact else list(dict.fromkeys(traced_members(members)))


def _fits(estimate: MemoryEstimate, target: Target) -> bool:
    """Whether `estimate` fits `target`'s budget with the card's own context."""
    if target.card is not None and target.card.context_bytes:
        estimate = dataclasses.replace(estimate, context_bytes=target.card.context_bytes)
    return target.budget.fits(estimate.required_bytes)


class _Tracer:
    """The estimator's calls of one trace_space or trace_fastest: every estimate found, traces
    counted, progress reported against the plan's whole count."""

    def __init__(self, device_type, timeout, use_cache, trust_remote_code, children, stack, memo, on_progress):
        self.device_type, self.timeout, self.use_cache = device_type, timeout, use_cache
        self.trust_remote_code, self.children, self.stack = trust_remote_code, children, stack
        self.memo, self.on_progress = memo, on_progress
        self.estimates: dict[str, MemoryEstimate] = {}
        self.done = 0
        self.traces = 0

    def trace(self, configs: list[ProbeConfig], total: int) -> None:
        from autotune.estimate import estimate_memories

        def arrived(estimate: MemoryEstimate) -> None:
            self.done += 1
            if self.on_progress is not None:
                self.on_progress(self.done, total)

        found = estimate_memories(
            configs,
            device_type=self.device_type,
            timeout=self.timeout,
            use_cache=self.use_cache,
            trust_remote_code=self.trust_remote_code,
            children=self.children,
            on_estimate=arrived,
            stack=self.stack,
            memo=self.memo,
        )
        self.estimates.update((e.config.key(), e) for e in found)
        self.traces += sum(not e.cached for e in found)

    def recipe_estimate(self, config: ProbeConfig) -> MemoryEstimate | None:
        """A traced estimate of a one-rank config of `config`'s recipe (its weights and adapters):
        what predict_speed reads of a trace (the parameter count) is the same for all of them."""
        if config.ranks != 1:
            return None
        return next(
            (
                e
                for e in self.estimates.values()
                if e.config.ranks == 1 and e.config.weights == config.weights and e.config.peft == config.peft
            ),
            None,
        )

    def interpolate(self, groups: dict[tuple, list[ProbeConfig]]) -> dict[str, MemoryEstimate]:
        """The traced estimates and every member of a group between two of them."""
        estimates = dict(self.estimates)
        for members in groups.values():
            ends = [self.estimates[c.key()] for c in traced_members(members) if c.key() in self.estimates]
            for config in members:
                if config.key() not in estimates and len(ends) >= 2:
                    estimates[config.key()] = interpolated(config, *between(config, ends))
        return estimates

    def traced(self, groups: dict[tuple, list[ProbeConfig]]) -> Traced:
        return Traced(self.interpolate(groups), frozenset(self.estimates), self.traces)


def judge_plan(spec: ModelSpec, space: SearchSpace, target: Target, traced: Traced, *, stack: Stack | None) -> Plan:
    """`space` on `target` from estimates traced for it (or for several cards at once): each
    candidate's need with the card's context, whether it fits, its predicted speed, ranked."""
    planned = [Planned(config) for config in space.candidates()]
    dims = None
    if target.card is not None:
        from autotune.planner.card_speed import model_dims_of

        dims = model_dims_of(spec)
    for item in planned:
        item.why_not = unplannable(item.config, target)
        if item.why_not is not None:
            continue
        item.estimate = traced.estimates.get(item.config.key())
        item.traced = item.config.key() in traced.traced
        if item.estimate is None:
            continue
        if target.card is not None and target.card.context_bytes:
            item.estimate = dataclasses.replace(item.estimate, context_bytes=target.card.context_bytes)
        item.fits = _fits(item.estimate, target)
        if target.card is not None and dims is not None:
            from autotune.planner.card_speed import predict_speed

            item.speed = predict_speed(item.config, dims, target.card, item.estimate, stack)
    notes = (stack or Stack()).notes()
    if space.trainer == "trl" and dims is not None:
        # (its memory is traced through TRL's own head; its speed model is Trainer's step)
        notes.append(
            "--trainer trl: the speeds predict transformers' Trainer step; TRL's fused LM head also scores "
            "each token's entropy and accuracy, work the speed model leaves out (a search measures it)"
        )
    return Plan(spec.reference, target, space, _ranked(planned, target), traces=traced.traces, notes=notes)


def unplannable(config: ProbeConfig, target: Target) -> str | None:
    """Why `config` has no prediction on `target`: a lever the card lacks, or one the estimator
    cannot trace (those configs a search probes unpredicted)."""
    card = target.card
    if target.device_type == "cpu":
        if config.precision == "tf32" or config.allocator != "default" or config.liger:
            return "a CUDA lever: a CPU probe skips it"
        if config.attention in ("flash_attention_2", "flash_attention_3", "flex_attention"):
            return f"{config.attention} has no CPU kernel"
    elif card is not None:
        if config.precision == "bf16" and not card.has_bf16:
            return f"bf16: not on the {card.name}"
        if config.precision == "tf32" and not card.has_tf32:
            return f"tf32: not on the {card.name}"
        if config.attention.startswith("flash_attention") and not card.has_flash_attention:
            return f"{config.attention}: not on the {card.name}"
    return untraceable(config)


def _ranked(planned: list[Planned], target: Target) -> list[Planned]:
    """Fitting configs fastest first (by need where no speed is predicted: on CPU), then the rest
    by need, then the unpredicted."""

    def order(p: Planned) -> tuple:
        if p.estimate is None:
            return (2, 0.0, 0)
        if p.fits:
            return (0, -(p.tokens_per_s or 0.0), p.need_bytes or 0)
        return (1, float(p.need_bytes or 0), 0)

    return sorted(planned, key=order)


def _compare(plan: Plan, store: Store, spec: ModelSpec, study: str | None) -> str | None:
    """Put the measurements of `study` (or of the latest study of this model, space and device
    kind) beside the predictions; returns the study's name, or None when there is none."""
    from autotune.vocabulary.errors import StudyNotFound

    record = None
    if study is not None:
        record = store.study(study)
    else:
        for summary in store.studies():
            if summary.model_reference not in (spec.reference, spec.recorded):
                continue
            try:
                candidate = store.study(summary.name)
            except StudyNotFound:
                continue
            same_kind = candidate.environment.get("device_type") == plan.target.device_type
            if (
                same_kind
                and _card_matches(plan.target.card, candidate.device_name)
                and {c.key() for c in SearchSpace.from_stored(candidate.space).candidates()}
                >= {p.config.key() for p in plan.planned}
            ):
                record = candidate
                break
    if record is None:
        return None
    latest = {probe.config_key: probe for probe in store.probes(record.name)}
    for item in plan.planned:
        probe = latest.get(item.config.key())
        if probe is None:
            continue
        result = probe.result
        need = result.required_bytes
        item.measured = {
            "status": str(result.status),
            "need_bytes": need,
            "tokens_per_s": result.tokens_per_s,
            "need_error": None
            if need in (None, 0) or item.need_bytes is None or result.status != ProbeStatus.OK
            else (item.need_bytes - need) / need,
            "speed_error": None
            if not result.tokens_per_s or item.tokens_per_s is None
            else (item.tokens_per_s - result.tokens_per_s) / result.tokens_per_s,
        }
    return record.name


def _card_matches(card: Card | None, device_name: str) -> bool:
    if card is None:
        return True
    name = device_name.lower()
    return any(fragment in name for fragment in card.name_fragments)

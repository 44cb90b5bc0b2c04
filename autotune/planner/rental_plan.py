"""Which card to rent, how many, how long, how much: `autotune plan --gpu h100,a100-80gb,l4 --gpus
1,2,4,8 --tokens 100M [--prices FILE]`.

For each card and GPU count, the fastest configuration that fits the card (its `plan`, as
card_plan.py predicts it: memory from the estimator, speed from the card model), or why none does;
the whole run's time at that speed (the run's tokens over predicted tokens/s, with the speed model's
stated error), and with a price (planner/prices.py: the cheapest offer of that card and count), its
cost. The cheapest, the fastest and the Pareto front (no other option both sooner and cheaper) are
named.

Memory that does not depend on the card is traced once per GPU count for every card (card_plan.
trace_space): a card changes only its CUDA context and which levers it has, so a plan over ten
cards costs about what one does. Torch-free here; the traces run in trace children."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune.estimate.stack import Stack
from autotune.planner.card_plan import Plan, Target, judge_plan, planned_traces, trace_fastest, trace_space
from autotune.planner.prices import Offer, PriceBook
from autotune.planner.speed_error import SpeedError
from autotune.specs.cards import Card
from autotune.vocabulary.units import format_duration, format_size

SORTS = ("cost", "time")


@dataclass(slots=True)
class Rental:
    """One card and GPU count: its plan's fastest fitting config, the run's time and cost."""

    card: Card
    gpus: int
    plan: Plan
    offer: Offer | None
    tokens: int

    @property
    def best(self):
        return self.plan.best

    @property
    def tokens_per_s(self) -> float | None:
        best = self.best
        return None if best is None else best.tokens_per_s

    @property
    def seconds(self) -> float | None:
        """The whole run's predicted time: its tokens at the predicted throughput."""
        speed = self.tokens_per_s
        return None if not speed else self.tokens / speed

    @property
    def cost(self) -> float | None:
        """Dollars for the run on demand: GPU hours at the offer's price; None without a price."""
        if self.seconds is None or self.offer is None:
            return None
        return self.seconds / 3600 * self.gpus * self.offer.per_gpu_hour

    @property
    def spot_cost(self) -> float | None:
        if self.seconds is None or self.offer is None or self.offer.spot_per_gpu_hour is None:
            return None
        return self.seconds / 3600 * self.gpus * self.offer.spot_per_gpu_hour

    @property
    def why_none(self) -> str | None:
        """Why no configuration of the space runs here, in words (None when one does)."""
        if self.best is not None:
            if self.tokens_per_s is None:
                return "no speed can be predicted for it"
            return None
        needs = [p.need_bytes for p in self.plan.planned if p.need_bytes is not None]
        allowed = self.plan.target.budget.allowed_bytes
        if needs:
            return f"nothing fits: the smallest need is {format_size(min(needs))}, {format_size(allowed)} allowed"
        reasons = [p.why_not for p in self.plan.planned if p.why_not]
        return reasons[0] if reasons else "no configuration of the space can be predicted here"

    @property
    def key(self) -> tuple[str, int]:
        return (self.card.short_name, self.gpus)

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            "card": self.card.short_name,
            "card_name": self.card.name,
            "gpus": self.gpus,
            "fits": best is not None,
            "why_none": self.why_none,
            "config": None if best is None else best.config.label(),
            "config_key": None if best is None else best.config.key(),
            "need_bytes": None if best is None else best.need_bytes,
            "memory_bytes": self.card.memory_bytes,
            "tokens_per_s": self.tokens_per_s,
            "seconds": self.seconds,
            "per_gpu_hour": None if self.offer is None else self.offer.per_gpu_hour,
            "cost": self.cost,
            "spot_cost": self.spot_cost,
            "price_source": None if self.offer is None else self.offer.source,
        }


@dataclass(slots=True)
class RentalPlan:
    """Every card and count weighed, sorted, with the cheapest, the fastest and the front named."""

    model: str
    tokens: int
    rentals: list[Rental]
    prices: str | None  # the price file read (None: no prices)
    speed_error: SpeedError | None
    sort: str = "cost"
    seconds: float = 0.0
    traces: int = 0
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rentals = sorted(self.rentals, key=self._order)

    def _order(self, rental: Rental) -> tuple:
        if rental.seconds is None:
            return (3, 0.0, 0.0, rental.card.short_name, rental.gpus)
        cost = rental.cost
        if self.sort == "time":
            return (0, rental.seconds, cost if cost is not None else float("inf"), rental.card.short_name, rental.gpus)
        if cost is None:  # time only: after every priced one
            return (1, rental.seconds, 0.0, rental.card.short_name, rental.gpus)
        return (0, cost, rental.seconds, rental.card.short_name, rental.gpus)

    @property
    def runnable(self) -> list[Rental]:
        return [r for r in self.rentals if r.seconds is not None]

    @property
    def fastest(self) -> Rental | None:
        return min(self.runnable, key=lambda r: (r.seconds, r.gpus), default=None)

    @property
    def cheapest(self) -> Rental | None:
        priced = [r for r in self.runnable if r.cost is not None]
        return min(priced, key=lambda r: (r.cost, r.seconds), default=None)

    @property
    def front(self) -> list[Rental]:
        """The Pareto front of time and cost: the priced options no other beats on both (sooner and
        no dearer, or cheaper and no slower), cheapest first."""
        priced = [r for r in self.runnable if r.cost is not None]
        front = [
            r
            for r in priced
            if not any(
                o is not r
                and o.seconds <= r.seconds
                and o.cost <= r.cost
                and (o.seconds < r.seconds or o.cost < r.cost)
                for o in priced
            )
        ]
        return sorted(front, key=lambda r: (r.cost, r.seconds))

    def marks(self, rental: Rental) -> list[str]:
        """What the table says of a row: cheapest, fastest, on the front."""
        said = []
        if rental is self.cheapest:
            said.append("cheapest")
        if rental is self.fastest:
            said.append("fastest")
        if rental in self.front and not said:
            said.append("front")
        return said

    def to_dict(self) -> dict[str, Any]:
        error = self.speed_error
        return {
            "model": self.model,
            "tokens": self.tokens,
            "sort": self.sort,
            "prices": self.prices,
            "speed_error": None
            if error is None
            else {"count": error.count, "median": error.median, "worst": error.worst},
            "seconds": self.seconds,
            "traces": self.traces,
            "notes": self.notes,
            "cheapest": None if self.cheapest is None else list(self.cheapest.key),
            "fastest": None if self.fastest is None else list(self.fastest.key),
            "front": [list(r.key) for r in self.front],
            "options": [{**r.to_dict(), "marks": self.marks(r)} for r in self.rentals],
        }


def plan_rentals(
    model: str,
    cards: list[Card],
    counts: tuple[int, ...],
    space_args: dict[str, Any],
    *,
    tokens: int | None,
    epochs: float | None = None,
    prices: PriceBook | None,
    margin: int | float,
    sort: str = "cost",
    exact: bool = False,
    timeout: float,
    use_cache: bool = True,
    trust_remote_code: bool = False,
    on_progress: Callable[[int, int], None] | None = None,
    stack: Stack | None = None,
) -> RentalPlan:
    """Weigh every card in `cards` at every GPU count in `counts` for a run of `tokens` tokens, or
    of `epochs` passes over the data of `space_args` (its training split's tokens counted)."""
    from autotune.data.shape import shaped_space_args
    from autotune.estimate.launch import TraceChildren
    import autotune.planner.speed_error as speed_error
    from autotune.search.launch import trace_processes
    from autotune.search.space import SearchSpace
    from autotune.specs.models import resolve_model

    started = time.perf_counter()
    spec = resolve_model(model)
    spec.check_usable(trust_remote_code, budget_bytes=max(card.memory_bytes for card in cards))
    # (the data measured once; its tokens counted where they size the run)
    shaped = shaped_space_args(spec, space_args, trust_remote_code, count_tokens=epochs is not None)
    notes: list[str] = []
    if epochs is not None:
        shape = shaped["data_shape"]
        tokens = max(1, round(shape.tokens * epochs))
        notes.append(
            f"the run: {epochs:g} epoch{'s' if epochs != 1 else ''} of {shape.dataset}'s training split, "
            f"{shape.tokens:,} tokens each ({shape.examples:,} examples): {tokens:,} tokens"
        )
    assert tokens is not None
    targets = [Target.of(card, None, margin) for card in cards]
    # (--strategies share a run across ranks: one GPU has none to choose)
    spaces = {
        count: SearchSpace.build(spec, **{**shaped, "gpus": count, **({"strategies": None} if count == 1 else {})})
        for count in counts
    }
    rentals: list[Rental] = []
    traces = 0
    done = [0]
    memo: dict = {}  # (each config traced once over the counts: DDP's rank is the same on 2, 4 or 8)
    widest = max(len(space.candidates()) for space in spaces.values())
    # Progress is counted against the whole plan's most traces, every count's, less what a count
    # that is done turned out not to need: the total only shrinks, and the count never starts again
    # (a count's own total after the last one's end would read "6 of 6", then "7 of 102").
    planned = [planned_traces(space, targets, exact=exact) for space in spaces.values()]
    # (started when a trace is wanted: a plan answered from the cache starts none)
    with TraceChildren(min(trace_processes(), widest), spec.model_type) as children:
        for index, (count, space) in enumerate(spaces.items()):
            base, later = done[0], sum(planned[index + 1 :])

            def progress(finished: int, total: int, base: int = base, later: int = later) -> None:
                done[0] = base + finished
                if on_progress is not None:
                    on_progress(done[0], base + total + later)

            common = dict(
                timeout=timeout,
                use_cache=use_cache,
                trust_remote_code=trust_remote_code,
                children=children,
                on_progress=progress,
                stack=stack,
                memo=memo,
            )
            # Only each card's fastest fit is reported: traced until it is known (all with --exact).
            if exact:
                traced = trace_space(space, targets, exact=True, **common)  # type: ignore[arg-type]
            else:
                traced = trace_fastest(spec, space, targets, **common)  # type: ignore[arg-type]
            traces += traced.traces
            for target in targets:
                plan = judge_plan(spec, space, target, traced, stack=stack)
                offer = prices.offer(target.card, count) if prices is not None else None  # type: ignore[arg-type]
                rentals.append(Rental(target.card, count, plan, offer, tokens))  # type: ignore[arg-type]
    notes += list(rentals[0].plan.notes) if rentals else []
    if prices is not None:
        unpriced = sorted({r.card.short_name for r in rentals if r.offer is None and r.seconds is not None})
        if unpriced:
            notes.append(f"no price in {prices.path} for {', '.join(unpriced)} (at some counts): time only")
    result = RentalPlan(
        spec.reference,
        tokens,
        rentals,
        prices.path if prices is not None else None,
        speed_error.load(),
        sort=sort,
        traces=traces,
        notes=notes,
    )
    result.seconds = time.perf_counter() - started
    return result


def describe(rental: Rental) -> str:
    """One option in words, for the summary lines under the table."""
    parts = [f"{rental.gpus} x {rental.card.name}"]
    if rental.best is not None:
        parts.append(rental.best.config.label())
    if rental.seconds is not None:
        parts.append(format_duration(rental.seconds))
    if rental.cost is not None:
        parts.append(f"${rental.cost:,.2f}")
    return ", ".join(parts)

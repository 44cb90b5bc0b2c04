"""How measured configurations rank: the one order that the leaderboard, `best`, `studies`,
`report`, the search's "Chosen:" line and its best-so-far all follow. No torch, no database.

Fastest first (tokens/s); equal speeds go to the config that needs less memory (reserved +
context), then to the one measured first. A study's confirmation round (search/confirm.py) may
have found the fastest few tied within their noise and chosen one of them: that one then ranks
first, over the configs it tied with and over no other. A faster config outside the tie keeps its
place (the verdict is stale: the study was resumed, or timings changed since).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Standing:
    """What the ranking reads of one measured config."""

    key: str  # the config's key
    tokens_per_s: float | None
    required_bytes: int | None  # peak reserved + context (autotune.results.budget.required_bytes)
    order: int  # when it was measured (a probe id): earlier first among equals


def speed_order(standing: Standing) -> tuple[float, float, int]:
    """The sort key of plain ranking: faster, then smaller, then earlier."""
    need = standing.required_bytes if standing.required_bytes is not None else math.inf
    return (-(standing.tokens_per_s or 0.0), need, standing.order)


def ranked(
    items: Sequence[T], standing: Callable[[T], Standing], chosen: str | None = None, tied: Collection[str] = ()
) -> list[T]:
    """`items` best first. `chosen` and `tied`: the key of the config a confirmation round chose
    among a tie, and the keys of the configs it tied with."""
    order = sorted(items, key=lambda item: speed_order(standing(item)))
    if chosen is None:
        return order
    at = next((i for i, item in enumerate(order) if standing(item).key == chosen), None)
    if not at or not all(standing(item).key in tied for item in order[:at]):
        return order
    return [order[at], *order[:at], *order[at + 1 :]]

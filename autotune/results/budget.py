"""What "fits" means: a memory budget, the safety margin kept free under it, and what a
configuration needs of the card. The one home of that rule, for the probe, the estimator, the
search, the reports and `train`. No torch here.

A configuration needs its peak *reserved* memory (what the caching allocator held, fragmentation
included) plus the memory the process holds outside the allocator (the CUDA context; 0 on CPU).
It fits when that need plus the margin is within the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.vocabulary.errors import BadInput
from autotune.vocabulary.units import format_size


def margin_bytes(margin: int | float, budget_bytes: int) -> int:
    """The margin in bytes: `margin` is bytes, or a fraction of the budget when below 1 (as
    `autotune.vocabulary.units.parse_margin` returns it)."""
    return int(margin * budget_bytes) if margin < 1 else int(margin)


def required_bytes(peak_reserved_bytes: int | None, context_bytes: int | None) -> int | None:
    """What a configuration needs of the card: its peak reserved plus the context outside the
    allocator; None when nothing was measured."""
    if peak_reserved_bytes is None:
        return None
    return peak_reserved_bytes + (context_bytes or 0)


@dataclass(frozen=True, slots=True)
class Budget:
    """A memory budget and the margin kept free under it, in bytes."""

    total_bytes: int
    margin_bytes: int

    @classmethod
    def of(cls, budget_bytes: int, margin: int | float) -> Budget:
        """The budget with `margin` (bytes, or a fraction of the budget below 1), refusing a margin
        that leaves nothing of the budget."""
        margin_in_bytes = margin_bytes(margin, budget_bytes)
        if margin_in_bytes >= budget_bytes:
            raise BadInput(
                f"--safety-margin {format_size(margin_in_bytes)} leaves nothing of the "
                f"{format_size(budget_bytes)} budget; use a smaller margin."
            )
        return cls(budget_bytes, margin_in_bytes)

    @property
    def allowed_bytes(self) -> int:
        """What a configuration may need: the budget less the margin."""
        return self.total_bytes - self.margin_bytes

    def headroom(self, need_bytes: int) -> int:
        """Bytes to spare after the margin when a configuration needs `need_bytes`; negative when over."""
        return self.allowed_bytes - need_bytes

    def fits(self, need_bytes: int) -> bool:
        """Whether a configuration that needs `need_bytes` (reserved + context) fits."""
        return self.headroom(need_bytes) >= 0

    def share(self, need_bytes: int) -> float:
        """`need_bytes` as a share of the whole budget."""
        return need_bytes / self.total_bytes if self.total_bytes else 0.0

    def scaled_to(self, total_bytes: int) -> Budget:
        """Another budget with the margin kept as the same share of it."""
        if total_bytes == self.total_bytes:
            return self
        return Budget.of(
            total_bytes, round(self.margin_bytes * total_bytes / self.total_bytes) if self.total_bytes else 0
        )

"""The safety margin between a configuration's peak and the budget: one rule, used by probe,
estimate, search and train. No torch here."""

from __future__ import annotations

from autotune.errors import BadInput
from autotune.units import format_size


def margin_bytes(margin: int | float, budget_bytes: int) -> int:
    """The margin in bytes: `margin` is bytes, or a fraction of the budget when below 1 (as
    `autotune.units.parse_margin` returns it)."""
    return int(margin * budget_bytes) if margin < 1 else int(margin)


def checked_margin_bytes(margin: int | float, budget_bytes: int) -> int:
    """`margin_bytes`, refusing a margin that leaves nothing of the budget."""
    margin_in_bytes = margin_bytes(margin, budget_bytes)
    if margin_in_bytes >= budget_bytes:
        raise BadInput(f"--safety-margin {format_size(margin_in_bytes)} leaves nothing of the {format_size(budget_bytes)} "
                       f"budget; use a smaller margin.")
    return margin_in_bytes

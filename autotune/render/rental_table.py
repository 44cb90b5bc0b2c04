"""Which card to rent, for people (a table, every figure predicted, the speed's stated error beside
it) and for pipelines (CSV; `--json` is RentalPlan.to_dict)."""

from __future__ import annotations

import csv
import io

from autotune.planner.rental_plan import Rental, RentalPlan, describe
from autotune.vocabulary.units import format_duration, format_size, format_tokens

CSV_COLUMNS = (
    "card",
    "gpus",
    "config",
    "tokens_per_s",
    "seconds",
    "per_gpu_hour",
    "cost",
    "spot_cost",
    "mark",
    "why_none",
    "price_source",
)


def render_rentals(result: RentalPlan) -> str:
    """The cards and counts as a table, sorted by cost (or time), the cheapest, the fastest and the
    Pareto front named under it, and the notes."""
    error = result.speed_error
    band = f" ±{error.median:.0%}" if error is not None else ""
    cards = len({r.card.short_name for r in result.rentals})
    counts = sorted({r.gpus for r in result.rentals})
    lines = [
        f"plan: {result.model}, {format_tokens(result.tokens)} tokens, on {cards} card{'s' if cards != 1 else ''} "
        f"x {','.join(map(str, counts))} GPUs; every figure predicted (speed{band}: "
        + (error.text() if error is not None else "no stated error")
        + f"), sorted by {result.sort}",
        "",
    ]
    header = ["card", "GPUs", "config", "tokens/s", "run time", "$/GPU-h", "cost", ""]
    rows = [_row(result, rental, band) for rental in result.rentals]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    right = {1, 3, 4, 5, 6}
    for cells in [header, *rows]:
        lines.append(
            "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
        )
    lines.append("")
    if result.cheapest is not None:
        lines.append(f"cheapest: {describe(result.cheapest)}")
    if result.fastest is not None:
        lines.append(f"fastest:  {describe(result.fastest)}")
    if result.front:
        lines.append("front (none both sooner and cheaper): " + "; ".join(describe(r) for r in result.front))
    if result.prices is not None:
        lines.append(f"prices: {result.prices} (on demand; spot in --json and --format csv)")
    lines += [f"note: {note}" for note in result.notes]
    lines.append(
        f"{result.traces} configs traced in {format_duration(result.seconds)} (as far as each card's fastest fit "
        "needed: the others interpolated, cached, or ruled out by their predicted speed)"
    )
    return "\n".join(lines)


def _row(result: RentalPlan, rental: Rental, band: str) -> list[str]:
    best = rental.best
    if rental.seconds is None:
        return [rental.card.short_name, str(rental.gpus), "-", "-", "-", _price(rental), "-", rental.why_none or ""]
    marks = result.marks(rental)
    need = f" ({format_size(best.need_bytes)})" if best is not None and best.need_bytes is not None else ""
    return [
        rental.card.short_name,
        str(rental.gpus),
        (best.config.label() if best is not None else "-") + need,
        f"{rental.tokens_per_s:,.0f}{band}",
        format_duration(rental.seconds),
        _price(rental),
        "-" if rental.cost is None else f"${rental.cost:,.2f}",
        ", ".join(marks),
    ]


def _price(rental: Rental) -> str:
    return "-" if rental.offer is None else f"{rental.offer.per_gpu_hour:.2f}"


def rentals_csv(result: RentalPlan) -> str:
    """One row per card and count, in the table's order: the figures unrounded, for a pipeline."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for rental in result.rentals:
        data = rental.to_dict()
        writer.writerow(
            [
                data["card"],
                data["gpus"],
                data["config"] or "",
                _blank(data["tokens_per_s"]),
                _blank(data["seconds"]),
                _blank(data["per_gpu_hour"]),
                _blank(data["cost"]),
                _blank(data["spot_cost"]),
                ";".join(result.marks(rental)),
                data["why_none"] or "",
                data["price_source"] or "",
            ]
        )
    return out.getvalue()


def _blank(value: float | None) -> str:
    return "" if value is None else f"{value:.6g}"

"""The pages' plots, drawn on the server as inline SVG (no script, no CDN, no matplotlib): a search's
tokens/s against memory needed (peak reserved + context) for each measured config that fits, with a
line at the budget and one at what it allows (the budget less the margin); and a rental plan's run
time against its cost, one point per card and count, as `autotune plan --plot` draws it
(render/rental_plot.py). Every text drawn is escaped here; the rest is numbers and fixed words."""

from __future__ import annotations

import math
from html import escape
from typing import Any

PLOT_W, PLOT_H = 640, 320
PAD_L, PAD_R, PAD_T, PAD_B = 76, 24, 16, 48


def speed_memory_svg(board: list[dict[str, Any]], budget_bytes: int | None, margin: int | None) -> str:
    """An inline SVG, drawn here: one point per measured config that fits, a line at the budget
    and one at what it allows (the budget less the margin)."""
    from autotune.results.budget import Budget, required_bytes

    points = [
        (need, float(row["tokens_per_s"]), row)
        for row in board
        if (need := required_bytes(row["peak_reserved_bytes"], row["context_bytes"])) is not None
        and row["tokens_per_s"]
    ]
    allowed = Budget(budget_bytes, margin).allowed_bytes if budget_bytes and margin is not None else None
    head = (
        f'<div id="plot"><h2>Speed against memory needed</h2><svg class="plot" '
        f'viewBox="0 0 {PLOT_W} {PLOT_H}" width="{PLOT_W}" height="{PLOT_H}" role="img" '
        f'aria-label="tokens per second against memory needed">'
    )
    if not points:
        return (
            head + f'<text class="empty" x="{PLOT_W / 2}" y="{PLOT_H / 2}" text-anchor="middle">'
            "no measurement fits yet</text></svg></div>"
        )
    x_top = max([budget_bytes or 0] + [need for need, _, _ in points]) * 1.04
    y_top = max(speed for _, speed, _ in points) * 1.1
    inner_w, inner_h = PLOT_W - PAD_L - PAD_R, PLOT_H - PAD_T - PAD_B

    def x(value: float) -> float:
        return PAD_L + inner_w * value / x_top

    def y(value: float) -> float:
        return PAD_T + inner_h * (1 - value / y_top)

    parts = [head, f'<rect class="frame" x="{PAD_L}" y="{PAD_T}" width="{inner_w}" height="{inner_h}"/>']
    scale, unit = _size_unit(x_top)
    for tick in _ticks(x_top / scale):
        px = x(tick * scale)
        parts.append(
            f'<line class="grid" x1="{px:.1f}" y1="{PAD_T}" x2="{px:.1f}" y2="{PAD_T + inner_h}"/>'
            f'<text class="tick" x="{px:.1f}" y="{PAD_T + inner_h + 16}" text-anchor="middle">'
            f"{_tick_text(tick)} {unit}</text>"
        )
    for tick in _ticks(y_top):
        py = y(tick)
        parts.append(
            f'<line class="grid" x1="{PAD_L}" y1="{py:.1f}" x2="{PAD_L + inner_w}" y2="{py:.1f}"/>'
            f'<text class="tick" x="{PAD_L - 6}" y="{py + 4:.1f}" text-anchor="end">'
            f"{_tick_text(tick)}</text>"
        )
    # Labels run up their lines: "allowed" on its left, "budget" on its right, so they never overlap.
    for value, cls, label, side in ((budget_bytes, "budget", "budget", 11), (allowed, "allowed", "allowed", -4)):
        if value and (cls == "allowed" or value != allowed):
            px = x(value)
            text = f"{label} {size_text(value)}"
            parts.append(
                f'<line class="{cls}" x1="{px:.1f}" y1="{PAD_T}" x2="{px:.1f}" y2="{PAD_T + inner_h}">'
                f"<title>{escape(text)}</title></line>"
                f'<text class="{cls}-label" x="{px + side:.1f}" y="{PAD_T + 4}" text-anchor="end" '
                f'transform="rotate(-90 {px + side:.1f} {PAD_T + 4})">{escape(text)}</text>'
            )
    for need, speed, row in sorted(points, key=lambda p: -int(p[2]["rank"])):  # the best drawn last, on top
        cls = "point best" if row["rank"] == 1 else "point"
        tip = f"#{int(row['rank'])} {row['label']}: {speed_text(speed)} tokens/s, needs {size_text(need)}"
        parts.append(
            f'<circle class="{cls}" cx="{x(need):.1f}" cy="{y(speed):.1f}" r="{6 if row["rank"] == 1 else 4}">'
            f"<title>{escape(tip)}</title></circle>"
        )
    parts.append(
        f'<text class="axis" x="{PAD_L + inner_w / 2}" y="{PLOT_H - 8}" text-anchor="middle">'
        "memory needed (peak reserved + context)</text>"
        f'<text class="axis" x="14" y="{PAD_T + inner_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {PAD_T + inner_h / 2})">tokens/s</text></svg></div>'
    )
    return "".join(parts)


RENTAL_STRIP_H = 56  # the strip under the plot where options without a price sit, by time alone


def time_cost_svg(rows: list[dict[str, Any]]) -> str:
    """A rental plan's options (views.rental_view's rows) as an inline SVG: the run's time across
    (log), its cost up (log), one point per card and count that runs and has a price, the Pareto
    front joined (cheapest first), the cheapest and the fastest marked and named; the options without
    a price on a strip below, by time alone."""
    running = [row for row in rows if row["seconds"]]
    priced = [row for row in running if row["cost"]]
    unpriced = [row for row in running if not row["cost"]]
    strip = RENTAL_STRIP_H if unpriced else 0
    height = PLOT_H + strip
    head = (
        f'<div id="rental-plot"><h2>Run time against cost</h2><svg class="plot rentals" '
        f'viewBox="0 0 {PLOT_W} {height}" width="{PLOT_W}" height="{height}" role="img" '
        f'aria-label="the run&#x27;s predicted time against its cost, per card and GPU count">'
    )
    if not running:
        return (
            head + f'<text class="empty" x="{PLOT_W / 2}" y="{PLOT_H / 2}" text-anchor="middle">'
            "no card and count runs this space</text></svg></div>"
        )
    inner_w, inner_h = PLOT_W - PAD_L - PAD_R, PLOT_H - PAD_T - PAD_B
    x_lo, x_hi = _log_range([float(row["seconds"]) for row in running])
    y_lo, y_hi = _log_range([float(row["cost"]) for row in priced] or [1.0])

    def x(seconds: float) -> float:
        return PAD_L + inner_w * math.log(seconds / x_lo) / math.log(x_hi / x_lo)

    def y(cost: float) -> float:
        return PAD_T + inner_h * (1 - math.log(cost / y_lo) / math.log(y_hi / y_lo))

    axis_y = PAD_T + inner_h + strip  # the time axis, under the strip where there is one
    parts = [head, f'<rect class="frame" x="{PAD_L}" y="{PAD_T}" width="{inner_w}" height="{inner_h}"/>']
    for tick in _time_ticks(x_lo, x_hi):
        px = x(tick)
        parts.append(
            f'<line class="grid" x1="{px:.1f}" y1="{PAD_T}" x2="{px:.1f}" y2="{axis_y}"/>'
            f'<text class="tick" x="{px:.1f}" y="{axis_y + 16}" text-anchor="middle">{escape(_time_tick(tick))}</text>'
        )
    if priced:
        for tick in _log_ticks(y_lo, y_hi):
            py = y(tick)
            parts.append(
                f'<line class="grid" x1="{PAD_L}" y1="{py:.1f}" x2="{PAD_L + inner_w}" y2="{py:.1f}"/>'
                f'<text class="tick" x="{PAD_L - 6}" y="{py + 4:.1f}" text-anchor="end">{escape(_money(tick))}</text>'
            )
    else:
        parts.append(
            f'<text class="empty" x="{PAD_L + inner_w / 2}" y="{PAD_T + inner_h / 2}" text-anchor="middle">'
            "no option has a price: each by its time alone, below</text>"
        )
    front = sorted((row for row in priced if row["on_front"]), key=lambda row: (row["cost"], row["seconds"]))
    if front:
        joined = " ".join(f"{x(row['seconds']):.1f},{y(row['cost']):.1f}" for row in front)
        names = ", ".join(row["label"] for row in front)
        parts.append(
            f'<polyline class="front" points="{joined}"><title>{escape(f"front (none both sooner and cheaper): {names}")}'
            "</title></polyline>"
            f'<text class="front-label" x="{PAD_L + inner_w - 6}" y="{PAD_T + 14}" text-anchor="end">'
            "— front: none both sooner and cheaper</text>"
        )
    # The marked drawn last, on top.
    for row in sorted(priced, key=lambda row: (bool(row["marks"]), row["on_front"])):
        parts.append(_rental_point(row, x(row["seconds"]), y(row["cost"]), PAD_L + inner_w))
    if unpriced:
        top = PAD_T + inner_h + 8
        parts.append(
            f'<rect class="strip" x="{PAD_L}" y="{top}" width="{inner_w}" height="{strip - 16}"/>'
            f'<text class="tick" x="{PAD_L - 6}" y="{top + (strip - 16) / 2 + 4:.1f}" text-anchor="end">no price</text>'
        )
        for row in unpriced:
            parts.append(_rental_point(row, x(row["seconds"]), top + (strip - 16) / 2, PAD_L + inner_w, square=True))
    parts.append(
        f'<text class="axis" x="{PAD_L + inner_w / 2}" y="{height - 8}" text-anchor="middle">'
        "the run&#x27;s time (predicted)</text>"
        f'<text class="axis" x="14" y="{PAD_T + inner_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {PAD_T + inner_h / 2})">the run&#x27;s cost, $ on demand (predicted)</text>'
        "</svg></div>"
    )
    return "".join(parts)


def _rental_point(row: dict[str, Any], px: float, py: float, right: float, *, square: bool = False) -> str:
    """One card and count: a point (a square where it has no price) with its tip, and its name beside
    it, its marks in brackets (to its left near the plot's right edge)."""
    classes = " ".join(["rental", *(["unpriced"] if square else []), *(["front"] if row["on_front"] else [])])
    classes += "".join(f" {mark}" for mark in row["marks"] if mark != "front")
    cost = f", ${row['cost']:,.2f}" if row["cost"] else ", no price"
    tip = f"{row['label']}: {row['config']}, {speed_text(row['tokens_per_s'])} tokens/s, {_duration(row['seconds'])}{cost}"
    if row["marks"]:
        tip += f" ({', '.join(row['marks'])})"
    marked = any(mark in ("cheapest", "fastest") for mark in row["marks"])
    size = 6 if marked else 4
    if square:
        shape = (
            f'<rect class="{classes}" x="{px - size:.1f}" y="{py - size:.1f}" width="{2 * size}" height="{2 * size}">'
            f"<title>{escape(tip)}</title></rect>"
        )
    else:
        shape = (
            f'<circle class="{classes}" cx="{px:.1f}" cy="{py:.1f}" r="{size}"><title>{escape(tip)}</title></circle>'
        )
    named = [mark for mark in row["marks"] if mark != "front"]
    text = row["label"] + (f" ({', '.join(named)})" if named else "")
    left = px > right - 120
    return shape + (
        f'<text class="rental-label{" marked" if marked else ""}" x="{px + (-8 if left else 8):.1f}" y="{py - 6:.1f}" '
        f'text-anchor="{"end" if left else "start"}">{escape(text)}</text>'
    )


def _log_range(values: list[float]) -> tuple[float, float]:
    """A log axis' ends around `values` (positive), with room on either side: a quarter of the span,
    at least a factor 1.5 each way where the values lie close."""
    lo, hi = min(values), max(values)
    room = max(1.5, (hi / lo) ** 0.25)
    return lo / room, hi * room


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Round values between `lo` and `hi` for a log axis: the decades, else 1-2-5 of each, else the
    nine of each, whichever first gives two or more (at most eight)."""
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for mantissas in ((1,), (1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10.0**p for p in range(first, last + 1) for m in mantissas if lo <= m * 10.0**p <= hi]
        if 2 <= len(ticks) <= 8 or (len(ticks) > 8 and mantissas == (1,)):
            return ticks[:: max(1, math.ceil(len(ticks) / 8))]
    return [float(f"{math.sqrt(lo * hi):.2g}")]  # (a span too narrow for two round values: its middle)


# Round times, in seconds: what a time axis marks where they fall in its span (a minute, ten, an hour, a day).
ROUND_TIMES = tuple(
    [1, 2, 5, 10, 20, 30]
    + [60 * n for n in (1, 2, 5, 10, 20, 30)]
    + [3600 * n for n in (1, 2, 3, 6, 12)]
    + [86400 * n for n in (1, 2, 5, 10, 20, 50, 100, 200, 500)]
)


def _time_ticks(lo: float, hi: float) -> list[float]:
    """Round times between `lo` and `hi` seconds (at most eight), else round numbers as any log axis."""
    ticks = [float(t) for t in ROUND_TIMES if lo <= t <= hi]
    if len(ticks) < 2:
        return _log_ticks(lo, hi)
    return ticks[:: max(1, math.ceil(len(ticks) / 8))]


def _time_tick(seconds: float) -> str:
    """'30 s', '20 min', '6 h', '2 d': a time axis' mark."""
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.2g} s"


def _duration(seconds: float) -> str:
    from autotune.vocabulary.units import format_duration

    return format_duration(seconds) if seconds >= 1 else f"{seconds:.2g} s"


def _money(dollars: float) -> str:
    return f"${dollars:,.0f}" if dollars >= 100 else f"${dollars:.3g}"


def _size_unit(top: float) -> tuple[int, str]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= 2 * scale:
            return scale, unit
    return 1, "B"


def _ticks(top: float, count: int = 5) -> list[float]:
    """Round values from 0 up to `top`, about `count` of them."""
    if top <= 0:
        return [0.0]
    rough = top / count
    power = 10 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= rough)
    return [i * step for i in range(int(top / step) + 1)]


def _tick_text(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) else f"{value:,.1f}"


def size_text(value: int | float | None) -> str:
    from autotune.vocabulary.units import format_size

    return format_size(value)


def speed_text(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"

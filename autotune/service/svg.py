"""The search page's plot, drawn on the server as inline SVG (no script, no CDN): tokens/s against
memory needed (peak reserved + context) for each measured config that fits, with a line at the
budget and one at what it allows (the budget less the margin)."""

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

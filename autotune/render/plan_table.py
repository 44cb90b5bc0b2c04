"""A plan for people (a table, every number labelled predicted) and for scripts (JSON)."""

from __future__ import annotations

from collections import Counter

from autotune.estimate.stated_error import skip_margin
from autotune.levers.evaluation import LOWER_EVAL_NEED
from autotune.planner.card_plan import Plan, Planned
from autotune.vocabulary.status import ProbeStatus
from autotune.vocabulary.units import format_size, size_as_read

# Columns of the breakdown, in the order a reader adds them up.
_PARTS = (
    ("weights", "weights"),
    ("grads", "grads"),
    ("optimizer", "optim"),
    ("activations", "activ"),
    ("temporaries", "temp"),
    ("allocator_slack", "slack"),
    ("context", "context"),
)


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def render_plan(plan: Plan, top: int | None = None) -> str:
    """The plan as a table: what fits, fastest first (predicted), with the need's breakdown; the
    measured figures beside when a study of such a card exists. Candidates without a prediction (a
    lever the card lacks, or one the estimator cannot trace) are no rows: one line says which and why."""
    t = plan.target
    lines = [
        f"plan: {len(plan.planned)} candidates on {t.name}, budget {size_as_read(t.budget.total_bytes)} "
        f"(margin {format_size(t.budget.margin_bytes)}"
        + (
            f", each of {plan.space.ranks} ranks; memory per rank, tokens/s of the whole run"
            if plan.space.ranks > 1
            else ""
        )
        + "); all figures predicted"
        + (f", measured beside them from study {plan.study!r}" if plan.study else ""),
        "",
    ]
    per_rank = plan.space.ranks > 1
    header = ["#", "config", "fits", "need/rank" if per_rank else "need", "tokens/s", *(short for _, short in _PARTS)]
    if plan.study:
        header += ["measured need", "error", "measured tok/s"]
    predicted = [p for p in plan.planned if p.estimate is not None]
    rows = []
    shown = predicted if top is None else predicted[:top]
    for rank, item in enumerate(shown, start=1):
        rows.append(_row(rank, item, plan.study is not None))
    if rows:
        widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
        for row in (header, *rows):
            lines.append(
                "  ".join(
                    str(cell).rjust(w) if i not in (1,) else str(cell).ljust(w)
                    for i, (cell, w) in enumerate(zip(row, widths))
                ).rstrip()
            )
    if top is not None and len(predicted) > top:
        lines.append(f"... and {len(predicted) - top} more (--top, or --json for all)")
    lines.append("")
    best = plan.best
    if best is None:
        evaluating = f" {LOWER_EVAL_NEED}" if plan.space.eval_batch is not None else ""
        lines.append(
            f"predicted: nothing fits; try checkpointing, a smaller block, LoRA or pure bf16 weights.{evaluating}"
        )
    else:
        speed = f", {best.tokens_per_s:,.0f} tokens/s" if best.tokens_per_s else ""
        lines.append(
            f"predicted pick: {best.config.label()}{speed}, needs {format_size(best.need_bytes or 0)} of "
            f"{format_size(t.budget.total_bytes)}; measure it with `autotune search` on the card"
        )
    fitting = sum(p.fits for p in plan.planned)
    unplanned = [p for p in plan.planned if p.estimate is None]
    lines.append(
        f"{fitting} of {len(plan.planned)} fit (predicted); {plan.traces} estimated now (configs that trace "
        f"alike share one trace), the rest cached or interpolated; {plan.seconds:.1f} s"
    )
    if unplanned:
        reasons = Counter(p.why_not or "not predicted" for p in unplanned)
        lines.append(
            f"{len(unplanned)} not predicted, not shown: "
            + "; ".join(f"{why} ({count})" if len(reasons) > 1 else why for why, count in sorted(reasons.items()))
        )
    error = plan.stated_error
    margin = skip_margin(plan.space.peft)
    if error is not None and margin is not None:
        lines.append(
            f"stated error of a need: {error.text()} (benchmarks/published); a search skips a config as too "
            f"big only when predicted over the budget by more than {margin:.0%} (its peak allocated's worst "
            f"error), and probes the rest"
        )
    if (speed_error := plan.speed_error) is not None:
        lines.append(
            f"stated error of a speed: {speed_error.text()} (benchmarks/published --speed); the search measures it"
        )
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _row(rank: int, item: Planned, with_measured: bool) -> list[str]:
    parts = item.breakdown()
    fits = "-" if item.estimate is None else ("yes" if item.fits else "no")
    row = [
        str(rank),
        item.config.label(),
        fits,
        _size(item.need_bytes),
        "-" if item.tokens_per_s is None else f"{item.tokens_per_s:,.0f}",
        *(_size(parts.get(name)) if parts else "-" for name, _ in _PARTS),
    ]
    if with_measured:
        m = item.measured or {}
        measured_need = m.get("need_bytes") if m.get("status") == ProbeStatus.OK else None
        row += [
            _size(measured_need) if m else "-",
            _percent(m.get("need_error")),
            "-" if not m.get("tokens_per_s") else f"{m['tokens_per_s']:,.0f}",
        ]
        if m and m.get("status") != ProbeStatus.OK:
            row[-3] = str(m.get("status"))
    return row

"""Rendering results for people (tables) and scripts (JSON, CSV). No database or torch here."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime
from typing import TYPE_CHECKING, Any

from autotune.config import ProbeConfig
from autotune.result import ProbeResult
from autotune.units import format_size

if TYPE_CHECKING:
    from autotune.store import LeaderboardRow, StudySummary


def _fmt_float(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_probe_result(config: ProbeConfig, result: ProbeResult) -> str:
    """A short report of one probe for a terminal."""
    budget = result.budget_bytes or 0
    lines = [
        f"probe   {config.model}  {config.label()}",
        f"device  {result.device or '-'}",
        f"status  {result.status}" + (f"  ({result.error.splitlines()[-1]})" if result.error else ""),
        f"memory  peak allocated {format_size(result.peak_allocated_bytes)}, reserved {format_size(result.peak_reserved_bytes)}, "
        f"context {format_size(result.context_bytes)}, margin {format_size(result.margin_bytes)}, budget {format_size(budget)}",
    ]
    if result.required_bytes is not None and budget:
        headroom = budget - (result.margin_bytes or 0) - result.required_bytes
        lines.append(f"        headroom {format_size(headroom)} ({100 * result.required_bytes / budget:.1f}% of the budget used)")
    if result.tokens_per_s is not None:
        mfu = f", MFU {100 * result.mfu:.1f}%" if result.mfu is not None else ""
        lines.append(f"speed   {result.tokens_per_s:,.0f} tokens/s, {result.samples_per_s:.2f} samples/s, "
                     f"{result.step_seconds:.3f} s per optimizer step{mfu}")
    if result.first_loss is not None:
        lines.append(f"loss    {_fmt_float(result.first_loss, '.4f')} -> {_fmt_float(result.last_loss, '.4f')}")
    lines.append(f"time    wall {_fmt_float(result.wall_seconds, '.2f')} s = start-up {_fmt_float(result.startup_seconds, '.2f')} s "
                 f"+ build {_fmt_float(result.build_seconds, '.2f')} s + steps (measured window {_fmt_float(result.measured_seconds, '.2f')} s)")
    return "\n".join(lines)


# -- stored results: leaderboard and studies -------------------------------------------------------
# Rows come from autotune.store (LeaderboardRow, StudySummary); only their attributes and to_dict()
# are used here, so rendering needs no database and importing this module loads no SQLAlchemy.

# CSV columns of `autotune leaderboard --format csv`: LeaderboardRow.to_dict()'s keys, in order (a
# test keeps them in step), named here so that an empty leaderboard still prints its header.
LEADERBOARD_FIELDS = (
    "rank", "label", *(f.name for f in fields(ProbeConfig)), "status", "tokens_per_s", "step_seconds",
    "samples_per_s", "mfu", "peak_reserved_bytes", "peak_allocated_bytes", "context_bytes", "budget_bytes",
    "margin_bytes", "study", "probe_id", "trial_number", "config_key",
)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Plain aligned columns: numbers (columns in `right`) right-aligned, the rest left-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _csv(fieldnames: Sequence[str], records: Sequence[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(fieldnames), lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
    return out.getvalue().rstrip("\n")


def _local_time(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone().strftime("%Y-%m-%d %H:%M")


def render_leaderboard(rows: Sequence[LeaderboardRow], fmt: str = "table") -> str:
    """The ranked configs that fit, as a table for people, a JSON list, or CSV (header + rows)."""
    if fmt == "json":
        return json.dumps([row.to_dict() for row in rows], indent=2)
    if fmt == "csv":
        return _csv(LEADERBOARD_FIELDS, [row.to_dict() for row in rows])
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}")
    if not rows:
        return "No configuration fits yet."
    cells = [
        [str(row.rank), row.label, row.status, format_size(row.peak_reserved_bytes),
         _fmt_float(row.tokens_per_s, ",.0f"), _fmt_float(row.step_seconds, ".3f")]
        for row in rows
    ]
    return _table(["rank", "config", "status", "peak reserved", "tokens/s", "step s"], cells, right=(0, 3, 4, 5))


def render_studies(rows: Sequence[StudySummary], fmt: str = "table") -> str:
    """Every study with its probe counts and best throughput, as a table or a JSON list."""
    if fmt == "json":
        return json.dumps([row.to_dict() for row in rows], indent=2)
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}")
    if not rows:
        return "No studies yet: run `autotune search` to make one."
    cells = [
        [row.name, row.model_reference, row.device_name, format_size(row.budget_bytes),
         str(row.probes_total), str(row.probes_ok), str(row.probes_oom), str(row.probes_skipped),
         _fmt_float(row.best_tokens_per_s, ",.0f"), row.status, _local_time(row.updated_at)]
        for row in rows
    ]
    headers = ["study", "model", "device", "budget", "probes", "ok", "oom", "skipped", "best tokens/s", "status", "updated"]
    return _table(headers, cells, right=(3, 4, 5, 6, 7, 8))

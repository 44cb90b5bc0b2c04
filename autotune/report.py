"""Rendering results for people (tables) and scripts (JSON, CSV). No database or torch here."""

from __future__ import annotations

from autotune.config import ProbeConfig
from autotune.result import ProbeResult
from autotune.units import format_size


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

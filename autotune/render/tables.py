"""Rendering results for people (tables) and scripts (JSON, CSV). No database or torch here."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime
from typing import TYPE_CHECKING, Any

from autotune.results.budget import Budget, required_bytes
from autotune.vocabulary.defaults import EFFECTIVE_BATCH as TRAINER_EFFECTIVE_BATCH
from autotune.levers.evaluation import LOWER_EVAL_NEED, describe_phases
from autotune.specs.models import shown_reference
from autotune.levers.config import ProbeConfig
from autotune.levers.recipes import memory_caveats
from autotune.results.probe_result import ProbeResult
from autotune.search.space import micro_batch_family
from autotune.vocabulary.status import ProbeStatus, Settled
from autotune.results.timing import noise
from autotune.vocabulary.units import format_size, size_as_read
from autotune.results import verdict

if TYPE_CHECKING:
    from autotune.store import LeaderboardRow, RunRecord, StudySummary
    from autotune.train import RunSummary


def _fmt_float(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_probe_result(config: ProbeConfig, result: ProbeResult) -> str:
    """A short report of one probe for a terminal."""
    budget = result.budget_bytes or 0
    parameters = f", {result.parameters:,} parameters" if result.parameters is not None else ""
    if result.trainable_parameters is not None and result.trainable_parameters != result.parameters:
        parameters += f" ({result.trainable_parameters:,} trainable)"
    lines = [
        f"probe   {config.model}  {config.label()}",
        f"task    {describe_task(config)}{parameters}",
        f"device  {result.device or '-'}",
        f"status  {result.status}" + (f"  ({result.error.splitlines()[-1]})" if result.error else ""),
        f"memory  peak allocated {format_size(result.peak_allocated_bytes)}, reserved {format_size(result.peak_reserved_bytes)}, "
        f"context {format_size(result.context_bytes)}, margin {format_size(result.margin_bytes)}, budget {size_as_read(budget)}",
    ]
    if result.phase_peaks:
        lines.append(
            f"phases  {describe_phases(config, result.phase_peaks, result.failed_phase, result.eval_batch_found)}"
        )
    if result.required_bytes is not None and budget and result.status == ProbeStatus.OK:
        held = Budget(budget, result.margin_bytes or 0)
        lines.append(
            f"        headroom {format_size(held.headroom(result.required_bytes))} "
            f"({100 * held.share(result.required_bytes):.1f}% of the budget used)"
        )
    elif result.status == ProbeStatus.OOM and result.cap_bytes:
        lines.append(
            f"        needs more than the {format_size(result.cap_bytes)} the budget leaves it "
            f"(the peak above is where it stopped)"
        )
    if result.rank_peaks:
        each = ", ".join(
            f"{rank}: {format_size(peaks['reserved'])}" if peaks else f"{rank}: -"
            for rank, peaks in enumerate(result.rank_peaks)
        )
        lines.append(
            f"ranks   {config.ranks} x {config.strategy}, peak reserved per rank {each} (the budget is each card's)"
        )
    if result.tokens_per_s is not None:
        mfu = f", MFU {100 * result.mfu:.1f}%" if result.mfu is not None else ""
        lines.append(
            f"speed   {result.tokens_per_s:,.0f} tokens/s, {result.samples_per_s:.2f} samples/s, "
            f"{result.step_seconds:.3f} s per optimizer step{mfu}"
        )
    if result.first_loss is not None:
        lines.append(f"loss    {_fmt_float(result.first_loss, '.4f')} -> {_fmt_float(result.last_loss, '.4f')}")
    lines.append(
        f"time    wall {_fmt_float(result.wall_seconds, '.2f')} s = start-up {_fmt_float(result.startup_seconds, '.2f')} s "
        f"+ build {_fmt_float(result.build_seconds, '.2f')} s"
        + (f" + compile {result.compile_seconds:.2f} s" if result.compile_seconds is not None else "")
        + f" + steps (measured window {_fmt_float(result.measured_seconds, '.2f')} s)"
    )
    lines += [f"note    {caveat}" for caveat in memory_caveats(config.optimizer)]
    return "\n".join(lines)


# -- stored results: leaderboard and studies -------------------------------------------------------
# Rows come from autotune.store (LeaderboardRow, StudySummary); only their attributes and to_dict()
# are used here, so rendering needs no database and importing this module loads no SQLAlchemy.

# CSV columns of `autotune leaderboard --format csv`: LeaderboardRow.to_dict()'s keys, in order (a
# test keeps them in step), named here so that an empty leaderboard still prints its header.
LEADERBOARD_FIELDS = (
    "rank",
    "label",
    *(f.name for f in fields(ProbeConfig)),
    "status",
    "tokens_per_s",
    "step_seconds",
    "step_spread",
    "samples_per_s",
    "mfu",
    "padding_share",
    "peak_reserved_bytes",
    "peak_allocated_bytes",
    "context_bytes",
    "budget_bytes",
    "margin_bytes",
    "study",
    "probe_id",
    "trial_number",
    "config_key",
    "worker",
    "compile_seconds",
    "host_load",
    "phase_peaks",
    "eval_batch_found",
    "rank_peaks",
)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Plain aligned columns: numbers (columns in `right`) right-aligned, the rest left-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _csv(fieldnames: Sequence[str], records: Sequence[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(fieldnames), lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
    return out.getvalue().rstrip("\n")


def _local_time(value: datetime | None) -> str:
    return "-" if value is None else value.astimezone().strftime("%Y-%m-%d %H:%M")


def render_leaderboard(rows: Sequence[LeaderboardRow], fmt: str = "table", confirmation: dict | None = None) -> str:
    """The ranked configs that fit, as a table for people, a JSON list, or CSV (header + rows);
    the table says under it when the study's confirmation found the order not reliable."""
    if fmt == "json":
        return json.dumps([row.to_dict() for row in rows], indent=2)
    if fmt == "csv":  # (a nested value, the phases' peaks, as its JSON text in its cell)
        return _csv(
            LEADERBOARD_FIELDS,
            [{k: json.dumps(v) if isinstance(v, dict) else v for k, v in row.to_dict().items()} for row in rows],
        )
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}")
    if not rows:
        return "No configuration fits yet."
    cells = [
        [
            str(row.rank),
            row.label,
            row.status,
            format_size(row.peak_reserved_bytes),
            _fmt_float(row.tokens_per_s, ",.0f") + spread_text(row.step_spread),
            _fmt_float(row.step_seconds, ".3f"),
        ]
        for row in rows
    ]
    headers = ["rank", "config", "status", "peak reserved", "tokens/s", "step s"]
    right = [0, 3, 4, 5]
    if any(row.config.lengths is not None for row in rows):  # batches of the data's lengths: real tokens, and padding
        headers[4:], right = ["real tokens/s", "step s", "padding"], [*right, 6]
        for cell, row in zip(cells, rows):
            cell.append("-" if row.config.padding_share is None else f"{100 * row.config.padding_share:.0f}%")
    if len({row.worker for row in rows}) > 1:  # a study probed by several workers says which ran what
        headers.append("worker")
        for cell, row in zip(cells, rows):
            cell.append(row.worker or "-")
    lines = [_table(headers, cells, right=right)]
    if (padded := larger_batch_slower(rows)) is not None:
        lines.append(f"note: {padded}")
    if (warning := verdict.unreliable_warning(confirmation)) is not None:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def larger_batch_slower(rows: Sequence[LeaderboardRow]) -> str | None:
    """Where a larger micro-batch measured slower in real tokens/s than a smaller one of its family
    beyond their noise, each of its batches padded to a longer longest example (ms-swift's benchmark
    found it on one A100): said, with both configs' padding."""
    worst = None  # (the largest slowdown)
    for small in rows:
        for large in rows:
            if (
                large.config.micro_batch > small.config.micro_batch
                and large.config.lengths is not None
                and micro_batch_family(large.config) == micro_batch_family(small.config)
                and (large.tokens_per_s or 0.0) * (1 + noise(large.step_spread, small.step_spread))
                < (small.tokens_per_s or 0.0)
            ):
                ratio = (large.tokens_per_s or 0.0) / (small.tokens_per_s or 1.0)
                if worst is None or ratio < worst[0]:
                    worst = (ratio, small, large)
    if worst is None:
        return None
    ratio, small, large = worst
    return (
        f"on this data a larger micro-batch is slower: {large.label} trains {ratio:.2f}x the real tokens/s of "
        f"{small.label}, padding {100 * (large.config.padding_share or 0):.0f}% of each batch against "
        f"{100 * (small.config.padding_share or 0):.0f}% (every batch is padded to its longest example)"
    )


def render_runs(rows: Sequence[RunRecord], fmt: str = "table") -> str:
    """Full fine-tunes (`autotune train`) with how each ended, as a table or a JSON list."""
    if fmt == "json":
        return json.dumps([row.to_dict() for row in rows], indent=2)
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}")
    if not rows:
        return "No runs yet: `autotune train` makes one."
    cells = [
        [
            str(row.id),
            str((row.summary or {}).get("study") or "-"),
            str(row.config.get("label") or _label(row.config)),
            row.status,
            str(row.steps if row.steps is not None else "-"),
            _fmt_float(row.tokens_per_s, ",.0f"),
            format_size(row.peak_reserved_bytes),
            _local_time(row.started_at),
            row.output_dir or "-",
        ]
        for row in rows
    ]
    headers = ["run", "study", "config", "status", "steps", "tokens/s", "peak reserved", "started", "output dir"]
    return _table(headers, cells, right=(0, 4, 5, 6))


def _label(config: dict) -> str:
    try:
        return ProbeConfig.from_dict(config).label()
    except (TypeError, ValueError):
        return "-"


def render_studies(rows: Sequence[StudySummary], fmt: str = "table") -> str:
    """Every study with its probe counts and best throughput, as a table or a JSON list."""
    if fmt == "json":
        return json.dumps([row.to_dict() for row in rows], indent=2)
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}")
    if not rows:
        return "No studies yet: run `autotune search` to make one."
    cells = [
        [
            row.name,
            row.model_reference,
            row.device_name,
            format_size(row.budget_bytes),
            str(row.probes_total),
            str(row.probes_ok),
            str(row.probes_oom),
            str(row.probes_skipped),
            _fmt_float(row.best_tokens_per_s, ",.0f"),
            row.status,
            _local_time(row.updated_at),
        ]
        for row in rows
    ]
    headers = [
        "study",
        "model",
        "device",
        "budget",
        "probes",
        "ok",
        "oom",
        "skipped",
        "best tokens/s",
        "status",
        "updated",
    ]
    if any(row.workers > 1 for row in rows):  # studies shared by several workers
        headers.insert(8, "workers")
        for cell, row in zip(cells, rows):
            cell.insert(8, str(row.workers))
        return _table(headers, cells, right=(3, 4, 5, 6, 7, 8, 9))
    return _table(headers, cells, right=(3, 4, 5, 6, 7, 8))


# -- the search's live display and summary -------------------------------------------------------
def format_event(event, show_worker: bool = False) -> str:
    """One line per resolved candidate: progress, config, outcome, peak, speed."""
    r = event.result
    width = len(str(event.total))
    progress = f"[{event.resolved:>{width}}/{event.total}]"
    if event.how == Settled.SKIPPED:
        detail = r.error or ""
    elif r.status == ProbeStatus.OK:
        detail = f"peak {format_size(r.peak_reserved_bytes):>10}  {r.tokens_per_s:>10,.0f} tok/s"
        if event.best:
            detail += "  * best so far"
    else:
        detail = f"peak {format_size(r.peak_reserved_bytes):>10}  {error_gist(r.error)}"
    how = "" if event.how in (Settled.PROBED, Settled.SKIPPED) else f" ({event.how})"
    worker = f"  [{event.worker}]" if show_worker and getattr(event, "worker", None) else ""
    return f"{progress} {event.config.label():<34} {r.status:<8}{detail}{how}{worker}"


_TRIED = re.compile(r"Tried to allocate ([\d.]+) ?(bytes|[KMGT]iB|B)\b")
_UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def error_gist(error: str | None, width: int = 80) -> str:
    """An outcome's error in one line of at most `width` characters: an out-of-memory error as what
    it tried to allocate (whole numbers, never cut mid-figure), else its last line, cut at a word."""
    text = (error or "").strip()
    last = text.splitlines()[-1] if text else ""
    if (found := _TRIED.search(text)) is not None and "out of memory" in text.lower():
        tried = format_size(int(float(found.group(1)) * _UNITS[found.group(2)]))
        return f"out of memory: tried to allocate {tried} more"[:width]
    if len(last) <= width:
        return last
    cut = last[: width - 1].rsplit(" ", 1)[0]
    return cut + "…"


def describe_task(config) -> str:
    """'seq2seq (source 512 + target 128 tokens)', 'classification (3 labels)', 'causal-lm'."""
    if config.target_length is not None:
        return f"{config.task} (source {config.block_size} + target {config.target_length} tokens)"
    if config.num_labels is not None:
        return f"{config.task} ({config.num_labels} label{'s' if config.num_labels != 1 else ''})"
    return str(config.task)


def _task_levers(config) -> str:
    """The recipe levers of a task other than causal-lm, as `explain_winner` lists levers."""
    if config.task == "causal-lm":
        return ""
    extra = f", target_length={config.target_length}" if config.target_length is not None else ""
    extra += f", num_labels={config.num_labels}" if config.num_labels is not None else ""
    return f", task={config.task}{extra}"


def format_search_header(study, environment, candidates: int, already: int, notes: Sequence[str] = ()) -> str:
    resumed = f", resuming with {already} already settled" if already else ""
    task = study.space.get("task")
    trained = f" ({task})" if task else ""
    header = (
        f"study {study.name}: {shown_reference(study.model_reference)}{trained} on {environment.device_name}, budget "
        f"{size_as_read(study.budget_bytes)} (margin {format_size(study.margin_bytes)}); "
        f"{_effective_batch(study.space)}; {candidates} candidate configs{resumed}"
    )
    return "\n".join([header, *(f"note: {note}" for note in notes)])


def _effective_batch(space: dict) -> str:
    """The work per optimizer step every candidate keeps: the user's recipe, never searched."""
    if space.get("effective_tokens"):
        return f"{space['effective_tokens']:,} tokens per optimizer step (your recipe: --effective-tokens)"
    return (
        f"{space.get('effective_batch')} sequences per optimizer step (your recipe: --effective-batch; Trainer's "
        f"default is {TRAINER_EFFECTIVE_BATCH})"
    )


def explain_winner(outcome) -> str:
    """Why the chosen config won: speed, memory against the budget, and the runner-up."""
    best = outcome.best
    unmeasured = _unmeasured_lines(outcome)
    if best is None and unmeasured:
        return "\n".join(
            ["No configuration measured so far fits the budget, and some could not be measured:", *unmeasured]
        )
    if best is None:
        evaluating = (getattr(outcome.study, "space", None) or {}).get("eval_batch")
        return (
            "No configuration fits the budget. Try a larger --gpu-budget, smaller --micro-batches or "
            "--block-sizes, --precisions bf16, or --checkpointing on." + (f" {LOWER_EVAL_NEED}" if evaluating else "")
        )
    required = required_bytes(best.peak_reserved_bytes, best.context_bytes) or 0
    headroom = Budget(best.budget_bytes, best.margin_bytes).headroom(required)
    confirmation = getattr(outcome.study, "confirmation", None)
    lines = [
        f"Chosen: {best.label}  (micro_batch={best.config.micro_batch}, grad_accum={best.config.grad_accum}, "
        f"precision={best.config.precision}, checkpointing={best.config.checkpointing}, "
        f"block_size={best.config.block_size}, attention={best.config.attention}{_task_levers(best.config)})",
        f"  why: {verdict.ranked_as(confirmation)} that fits, "
        f"{best.tokens_per_s:,.0f} tokens/s; needs {format_size(required)} "
        f"(peak reserved {format_size(best.peak_reserved_bytes)} + context {format_size(best.context_bytes)}) "
        f"of the {format_size(best.budget_bytes)} budget, {format_size(headroom)} to spare after the "
        f"{format_size(best.margin_bytes)} margin",
    ]
    if best.config.lengths is not None:
        lines.append(
            f"  padding: {100 * (best.config.padding_share or 0):.0f}% of its batches' tokens are padding, "
            f"left out of its tokens/s (batches drawn from your data's lengths)"
        )
        if (padded := larger_batch_slower(outcome.leaderboard)) is not None:
            lines.append(f"  note: {padded}")
    if confirmation:
        lines.append(f"  {verdict.describe(confirmation)}")
        if (warning := verdict.unreliable_warning(confirmation)) is not None:
            lines.append(f"  warning: {warning}")
    elif len(outcome.leaderboard) > 1:
        second = outcome.leaderboard[1]
        lines.append(f"  runner-up: {second.label}, {best.tokens_per_s / second.tokens_per_s:.2f}x slower")
    if (hint := _larger_batch_hint(best, required)) is not None:
        lines.append(f"  hint: {hint}")
    if best.phase_peaks:
        lines.append(
            f"  phases: {describe_phases(best.config, best.phase_peaks, None, best.eval_batch_found)} (all fit)"
        )
    lines += [f"  note: {caveat}" for caveat in memory_caveats(best.config.optimizer)]
    if unmeasured:
        lines += [
            "Not a final answer: some configurations could not be measured (one of them may be faster):",
            *unmeasured,
        ]
    return "\n".join(lines)


# A winner that needs at most this share of what the budget allows leaves room for larger micro-batches.
ROOM_FOR_LARGER_BATCH = 0.6


def _larger_batch_hint(best, required: int) -> str | None:
    """When the winner runs its whole effective batch in one micro-step (no larger micro-batch is
    in the space) and uses little of the budget, a larger effective batch would likely be faster:
    said as a hint, since the effective batch is the user's recipe and the pick keeps it."""
    allowed = Budget(best.budget_bytes, best.margin_bytes).allowed_bytes
    if best.config.grad_accum != 1 or not allowed or required > ROOM_FOR_LARGER_BATCH * allowed:
        return None
    return (
        f"{best.label} needs {100 * required / allowed:.0f}% of what the budget allows; a larger --effective-batch "
        f"(your recipe: it changes the optimization) would let larger micro-batches run, usually faster per token"
    )


def spread_text(spread: float | None) -> str:
    """' ±3%' after a throughput: its noise, half the interquartile range of its step times (the
    leaderboard, the report and the service's page say it so)."""
    return f" ±{100 * spread:.0f}%" if spread is not None else ""


def _unmeasured_lines(outcome) -> list[str]:
    """The candidates the search could not measure, with why, and what to do."""
    unmeasured = getattr(outcome, "unmeasured", None) or []
    if not unmeasured:
        return []
    lines = []
    for config, result in unmeasured:
        why = (result.error or "").strip().splitlines()[-1:] or [""]
        lines.append(f"  {config.label()}  ({result.status}: {why[0][:160]})")
    lines.append("  run the same command to try them again.")
    return lines


def format_search_footer(outcome) -> str:
    if outcome.answered_from_database:
        return (
            f"study {outcome.study.name} finished earlier ({outcome.study.device_name}); answered from the "
            f"database without probing. --fresh re-probes."
        )
    reasons = {
        "exhausted": "every candidate settled"
        if not getattr(outcome, "unmeasured", None)
        else f"searched through; {len(outcome.unmeasured)} could not be measured",
        "patience": "no better config for a while (--patience)",
        "max-trials": "--max-trials reached; run the same command to go on",
        "timeout": f"--timeout reached{_deadline_detail(outcome)}; run the same command to go on from where it stopped",
        "interrupted": "interrupted; run the same command to resume",
        "stopped": "the study was stopped; resume it with the search command that started it",
        "finished": "the study is finished",
    }
    workers = getattr(outcome, "workers", 1)
    by = f" by {workers} workers" if workers > 1 else ""
    tally = getattr(outcome, "round", None)
    confirming = tally.probes if tally is not None else 0
    probes = outcome.probed + confirming
    said = [
        f"{probes} probe{'s' if probes != 1 else ''} run"
        + (f" ({confirming} in the confirmation round)" if confirming else "")
    ]
    if tally is not None and tally.reused_windows:
        said.append(
            f"{tally.reused_windows} window{'s' if tally.reused_windows != 1 else ''} of an earlier "
            f"unfinished round reused"
        )
    said.append(f"{outcome.reused} reused from earlier studies")
    said.append(describe_skips(getattr(outcome, "skips", None), outcome.skipped))
    if revisited := getattr(outcome, "revisited", 0):
        said.append(f"{revisited} skipped for speed decided again after the round lowered the figure they rested on")
    return (
        f"{', '.join(said)}, of {outcome.candidates} candidates, in {outcome.seconds:.1f} s{by} "
        f"({reasons.get(outcome.stop_reason, outcome.stop_reason)})."
    )


def describe_skips(skips, skipped: int) -> str:
    """'3 skipped by structure, 29 by the speed model, 2 as predicted too big': each kind of skip
    counted for what it is (search.knowledge.SkipKind)."""
    if not skips:
        return f"{skipped} skipped"
    words = {"structure": "by structure", "speed": "by the speed model", "memory": "as predicted too big"}
    parts = [f"{count} {words.get(kind, kind)}" for kind, count in skips.items() if count]
    if not parts:
        return "0 skipped"
    return (
        parts[0].replace(" ", " skipped ", 1)
        if len(parts) == 1
        else ", ".join([parts[0].replace(" ", " skipped ", 1), *parts[1:]])
    )


def _deadline_detail(outcome) -> str:
    """What the --timeout deadline stopped, and what is left to do."""
    note = getattr(outcome, "deadline_note", None)
    settled = getattr(outcome, "settled", None)
    parts = [note] if note else []
    if settled is not None and settled < outcome.candidates:
        parts.append(f"{outcome.candidates - settled} of {outcome.candidates} candidates not settled yet")
    return f": {'; '.join(parts)}" if parts else ""


def search_summary(outcome) -> dict:
    """`autotune search --json`: the chosen config, the leaderboard, and what the search cost."""
    tally = getattr(outcome, "round", None)  # the confirmation round's windows in this run
    return {
        "study": outcome.study.name,
        "status": outcome.study.status,
        "stop_reason": outcome.stop_reason,
        "device": outcome.study.device_name,
        "budget_bytes": outcome.study.budget_bytes,
        "candidates": outcome.candidates,
        "probed": outcome.probed,
        "reused": outcome.reused,
        "skipped": outcome.skipped,
        "skips": dict(getattr(outcome, "skips", {}) or {}),
        "confirming_probes": tally.probes if tally is not None else 0,
        "reused_windows": tally.reused_windows if tally is not None else 0,
        "confirming_seconds": round(tally.seconds, 3) if tally is not None else 0.0,
        "seconds": round(outcome.seconds, 3),
        "workers": getattr(outcome, "workers", 1),
        "answered_from_database": outcome.answered_from_database,
        "unmeasured": [
            {"config_key": c.key(), "label": c.label(), "status": r.status, "error": r.error}
            for c, r in getattr(outcome, "unmeasured", [])
        ],
        "deadline_note": getattr(outcome, "deadline_note", None),
        "best": outcome.best.to_dict() if outcome.best else None,
        "confirmation": getattr(outcome.study, "confirmation", None),
        "leaderboard": [row.to_dict() for row in outcome.leaderboard],
    }


# -- a training run ------------------------------------------------------------------------------


def render_run_summary(summary: RunSummary) -> str:
    """`autotune train`'s closing lines: steps and speed, memory against the budget and the probe, loss."""
    from autotune.train.summary import SUMMARY_FILE

    s = summary
    speed = f", {s.tokens_per_s:,.0f} tokens/s" if s.tokens_per_s else ""
    took = f" in {s.train_seconds:.1f} s" if s.train_seconds else ""
    lines = [
        f"run #{s.run_id} {s.status}: {s.steps} steps ({s.steps_this_run} this run){took}{speed}; "
        f"{s.config.label()} on {s.device}"
    ]
    reached = "" if s.finished else " before it stopped"
    memory = (
        f"memory: peak allocated {format_size(s.peak_allocated_bytes)}, reserved "
        f"{format_size(s.peak_reserved_bytes)}{reached}"
    )
    if s.device_type == "cuda":
        memory += f" + context {format_size(s.context_bytes)}"
    memory += f" of the {format_size(s.budget_bytes)} budget (margin {format_size(s.margin_bytes)})"
    required = s.required_bytes
    if required is not None and s.finished:
        spare = s.budget.headroom(required)
        memory += f": fits, {format_size(spare)} to spare" if spare >= 0 else ": over the budget"
    lines.append(memory)
    probe, ratio = s.probe, s.peak_vs_probe
    probe_speed = f", {probe.tokens_per_s:,.0f} tokens/s" if probe.tokens_per_s else ""
    compared = f"; run/probe peak {ratio:.2f}" if ratio and s.finished else ""
    lines.append(f"probe #{s.probe_id}: peak reserved {format_size(probe.peak_reserved_bytes)}{probe_speed}{compared}")
    for rank in s.ranks:  # (a run on several ranks)
        ratio_text = f"; run/probe {rank.ratio:.2f}" if rank.ratio else ""
        lines.append(
            f"  {rank.phase}: peak reserved {format_size(rank.run_bytes)}, probe's {format_size(rank.probe_bytes)}"
            f"{ratio_text}"
        )
    for phase in s.phases:  # (a run or a probe that evaluated)
        stopped = " (stopped here)" if phase.phase == s.failed_phase else ""
        ratio_text = f"; run/probe {phase.ratio:.2f}" if phase.ratio else ""
        lines.append(
            f"  {phase.phase} phase: peak reserved {format_size(phase.run_bytes)}{stopped}, "
            f"probe's {format_size(phase.probe_bytes)}{ratio_text}"
        )
    if s.final_loss is not None:
        evaluation = ""
        if s.eval_loss is not None:
            perplexity = s.perplexity
            evaluation = f", eval loss {s.eval_loss:.4f}" + (f" (perplexity {perplexity:,.1f})" if perplexity else "")
        lines.append(f"loss: {s.final_loss:.4f}{evaluation}")
    if s.finished:
        saved = "LoRA adapter" if s.config.peft is not None else "model"
        lines.append(f"saved: {s.output_dir} ({saved}, tokenizer, {SUMMARY_FILE})")
        if s.merged_dir is not None:
            lines.append(f"merged: {s.merged_dir} (the base with the adapters merged in, whole)")
    lines.extend(f"warning: {warning}" for warning in s.warnings)
    return "\n".join(lines)

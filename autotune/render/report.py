"""`autotune report`: a study as Markdown to paste into an issue or a pull request: what was
searched, where, the leaderboard, the pick and why (the lines `autotune search` ends with), what
the probes found, and the plot beside it (autotune.render.plot) when matplotlib is there.

`render_report` is the pure part (store records in, text out); `study_report` reads the store,
draws the plot and renders. No torch here.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.results.budget import Budget, required_bytes
from autotune.host.output import Output
from autotune.render.plot import (
    MATPLOTLIB_MISSING,
    check_out_file,
    check_out_path,
    have_matplotlib,
    latest_outcomes,
    plot_study,
    probe_device,
)
from autotune.render.tables import explain_winner, spread_text
from autotune.vocabulary.status import RETRYABLE, ProbeStatus
from autotune.vocabulary.units import format_size

if TYPE_CHECKING:
    from autotune.levers.config import ProbeConfig
    from autotune.results.probe_result import ProbeResult
    from autotune.store import ClaimRecord, LeaderboardRow, ProbeRecord, StudyRecord

TOP = 10
# How the probes' sentence words each outcome, in this order.
OUTCOME_WORDS: dict[str, str] = {
    ProbeStatus.OK: "fit",
    ProbeStatus.OOM: "ran out of memory",
    ProbeStatus.SKIPPED: "skipped",
    ProbeStatus.TIMEOUT: "timed out",
    ProbeStatus.CRASHED: "crashed",
    ProbeStatus.ERROR: "failed",
    ProbeStatus.UNSTABLE: "diverged",
}


@dataclass(frozen=True, slots=True)
class Counts:
    """What a study's configurations came to: how each was settled, and what it found."""

    configs: int
    probed: int
    reused: int  # answered from an earlier study's probe of the same config
    skipped: int  # ruled out without a probe (by structure or prediction, or unsupported)
    statuses: dict[str, int]

    @classmethod
    def of(cls, probes: Sequence[ProbeRecord], claims: Sequence[ClaimRecord] = ()) -> Counts:
        latest = latest_outcomes(probes)
        # A config settled without a probe of its own has a claim with no attempts (Store.settle).
        unclaimed = {c.config_key for c in claims if c.attempts == 0}
        skipped = sum(p.result.status == ProbeStatus.SKIPPED for p in latest)
        reused = sum(p.config_key in unclaimed and p.result.status != ProbeStatus.SKIPPED for p in latest)
        statuses = Counter(str(p.result.status) for p in latest)
        return cls(
            configs=len(latest),
            probed=len(latest) - skipped - reused,
            reused=reused,
            skipped=skipped,
            statuses=dict(statuses),
        )

    def sentence(self) -> str:
        order = list(OUTCOME_WORDS)
        ranked = sorted(
            self.statuses.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)
        )
        found = ", ".join(f"{n} {OUTCOME_WORDS.get(status, status)}" for status, n in ranked)
        return (
            f"{self.configs} configurations: {self.probed} probed, {self.reused} reused from earlier studies, "
            f"{self.skipped} skipped without a probe. {found or 'nothing settled yet'}."
        )


def confirmation_sentence(decision: dict | None) -> list[str]:
    """The confirmation round's own probes (windows measured again), which the configurations'
    count above leaves out; nothing where no round measured any."""
    probes = int((decision or {}).get("probes") or 0)
    if not probes:
        return []
    rounds = int((decision or {}).get("rounds") or 0)
    return [
        "",
        f"The confirmation round measured {probes} more window{'s' if probes != 1 else ''} of the contenders "
        f"({rounds} round{'s' if rounds != 1 else ''}, {(decision or {}).get('seconds') or 0:.1f} s): "
        f"{probes} probes beyond those above.",
    ]


@dataclass(frozen=True, slots=True)
class _StoredOutcome:
    """The parts of a search outcome that `explain_winner` reads, rebuilt from the store."""

    study: StudyRecord
    leaderboard: list[LeaderboardRow]
    unmeasured: list[tuple[ProbeConfig, ProbeResult]] = field(default_factory=list)

    @property
    def best(self) -> LeaderboardRow | None:
        return self.leaderboard[0] if self.leaderboard else None


def unmeasured(probes: Sequence[ProbeRecord]) -> list[tuple[ProbeConfig, ProbeResult]]:
    """Configs whose latest outcome says nothing of their memory (timeout, crash, error)."""
    return [(p.config, p.result) for p in latest_outcomes(probes) if p.result.status in RETRYABLE]


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


def leaderboard_table(rows: Sequence[LeaderboardRow], top: int = TOP) -> str:
    """The fastest `top` configs that fit, as a Markdown table."""
    padded = any(row.config.lengths is not None for row in rows)  # (the data's lengths: real tokens, padding shown)
    lines = [
        f"| rank | config | {'real ' if padded else ''}tokens/s | step s | peak reserved | needs | of the budget |"
        + (" padding |" if padded else ""),
        "|---:|---|---:|---:|---:|---:|---:|" + ("---:|" if padded else ""),
    ]
    for row in rows[:top]:
        needs = required_bytes(row.peak_reserved_bytes, row.context_bytes)
        share = f"{100 * Budget(row.budget_bytes, row.margin_bytes).share(needs):.0f}%" if needs is not None else "-"
        speed = f"{row.tokens_per_s:,.0f}{spread_text(row.step_spread)}" if row.tokens_per_s is not None else "-"
        step = f"{row.step_seconds:.3f}" if row.step_seconds is not None else "-"
        lines.append(
            f"| {row.rank} | `{_cell(row.label)}` | {speed} | {step} | {format_size(row.peak_reserved_bytes)} "
            f"| {format_size(needs)} | {share} |"
            + (f" {100 * (row.config.padding_share or 0):.0f}% |" if padded else "")
        )
    return "\n".join(lines)


def _space(space: dict[str, Any]) -> str:
    def values(value: Any) -> str:
        items = value if isinstance(value, (list, tuple)) else [value]
        return ", ".join("on" if v is True else "off" if v is False else str(v) for v in items)

    # The model and the effective batch have lines of their own.
    shown = {
        name: value
        for name, value in space.items()
        if value not in (None, [], "") and name not in ("model", "effective_batch", "task")
    }
    return "; ".join(f"{name} {values(value)}" for name, value in shown.items())


def _software(environment: dict[str, Any]) -> str:
    names = (
        ("torch", "torch_version"),
        ("transformers", "transformers_version"),
        ("CUDA", "cuda_version"),
        ("driver", "driver_version"),
        ("autotune", "autotune_version"),
    )
    return ", ".join(f"{name} {environment[key]}" for name, key in names if environment.get(key)) or "not recorded"


def render_report(
    study: StudyRecord,
    probes: Sequence[ProbeRecord],
    leaderboard: Sequence[LeaderboardRow],
    *,
    claims: Sequence[ClaimRecord] = (),
    device: str | None = None,
    image: str | None = None,
    image_note: str | None = None,
) -> str:
    """The Markdown report of one study: `image` is the plot's path as the Markdown links it (relative
    to the report); without one, `image_note` says why there is none."""
    board = list(leaderboard)
    lines = [f"## autotune: `{study.model_reference}` under {format_size(study.budget_bytes)}", ""]
    lines += [
        f"- **study**: `{study.name}` ({study.status})",
        f"- **model**: `{study.model_reference}`" + (f" ({study.space['task']})" if study.space.get("task") else ""),
        f"- **budget**: {format_size(study.budget_bytes)}, of which a {format_size(study.margin_bytes)} safety margin "
        f"stays free; effective batch {study.effective_batch}",
        f"- **device**: {device or study.device_name}",
        f"- **software**: {_software(study.environment)}",
        f"- **space**: {_space(study.space) or 'not recorded'}",
        "",
        "### Pick",
        "",
    ]
    best = board[0] if board else None
    if best is not None:
        lines += [
            f"**`{_cell(best.label)}`**: {best.tokens_per_s or 0:,.0f} tokens/s. Hand it to a fine-tune with "
            f"`autotune best --study {study.name} --format trainer-args` or `autotune train --study {study.name}`.",
            "",
        ]
    lines += ["```text", explain_winner(_StoredOutcome(study, board, unmeasured(probes))), "```", ""]
    if study.status != "finished":
        lines += [f"The study is {study.status}, not finished: a later search may change the pick.", ""]
    shown = f"top {TOP} of {len(board)}" if len(board) > TOP else f"{len(board)}"
    lines += [f"### Leaderboard ({shown} that fit)", ""]
    lines += [leaderboard_table(board) if board else "No configuration fits yet.", ""]
    lines += ["### Probes", "", Counts.of(probes, claims).sentence(), *confirmation_sentence(study.confirmation), ""]
    if image is not None:
        lines += [f"![{study.name}: tokens/s against memory needed]({image})", ""]
    elif image_note:
        lines += [image_note, ""]
    lines.append("<sub>Made by `autotune report`.</sub>")
    return "\n".join(lines)


def _link(image: Path, out: Path | None) -> str:
    """The image's path as the report links it: relative to the report's folder."""
    base = out.parent if out is not None else Path.cwd()
    return Path(os.path.relpath(image.resolve(), base.resolve())).as_posix()


def study_report(
    study: str | None,
    db: str | None,
    out: str | os.PathLike[str] | None = None,
    plot: str | os.PathLike[str] | None = None,
) -> str:
    """The Markdown report of `study` (the most recent when None), written to `out` when given, and
    returned. The plot goes to `plot`, else beside `out` (same name, .png); with neither, or
    without matplotlib, the report says there is none. Reads the database only; refuses, before
    reading it, a file that cannot be written (a missing directory is not made)."""
    from autotune.store import open_store

    if out is not None:
        check_out_path(Path(out), "--out")
    if plot is not None:
        if have_matplotlib():
            check_out_file(plot, "--plot")
        else:
            check_out_path(Path(plot), "--plot")
    # Whole files or none (autotune.host.output): the report's is opened (checked, hidden) now, filled
    # before the plot is drawn and moved into place after it.
    with Output(out, "--out") if out is not None else contextlib.nullcontext() as report_out:
        with open_store(db, read_only=True) as store:
            record = store.study(study)
            probes = store.probes(record.name)
            board = store.leaderboard(record.name)
            claims = store.claims.of_study(record.id, stale_after=0.0)
        out_path = Path(out) if out is not None else None
        image_path = Path(plot) if plot is not None else out_path.with_suffix(".png") if out_path is not None else None
        image = note = None
        if image_path is None:
            note = "(No plot: pass `--plot FILE.png` to draw one.)"
        elif not have_matplotlib():
            note = f"(No plot: {MATPLOTLIB_MISSING}.)"
        else:
            image = _link(image_path, out_path)
        text = render_report(
            record, probes, board, claims=claims, device=probe_device(probes, record), image=image, image_note=note
        )
        if report_out is not None:
            report_out.write_text(text + "\n")
        if image_path is not None and image is not None:
            with Output(image_path, "--plot" if plot is not None else "--out") as image_out:
                plot_study(record.name, db, image_out)
        if report_out is not None:
            report_out.commit()
    return text

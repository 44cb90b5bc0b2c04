"""`autotune plot`: a study's probes as tokens/s against the memory each config needs, with the
budget, the feasible frontier, what ran out of memory or was ruled out, and the pick.

`plot_points` is the pure part (records in, points and frontier out); `write_plot` draws them
(matplotlib for PNG/SVG/PDF, plotly for HTML, each imported only there); `plot_study` reads a
study from the store and does both. No torch here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.results.budget import Budget
from autotune.vocabulary.errors import BadInput
from autotune.specs.models import shown_reference
from autotune.host.output import Output, check_destination
from autotune.results.ranking import Standing, ranked
from autotune.vocabulary.status import ProbeStatus
from autotune.vocabulary.units import format_size

if TYPE_CHECKING:
    from autotune.store import ProbeRecord, StudyRecord
    from autotune.planner import Plan

MATPLOTLIB_MISSING = "autotune plot needs matplotlib: pip install 'autotune[plot]'"
PLOTLY_MISSING = "an HTML plot needs plotly: pip install plotly (or write a PNG: --out FILE.png)"
IMAGE_SUFFIXES = (".png", ".svg", ".pdf")
PRECISION_COLORS = {"fp32": "tab:gray", "fp16": "tab:green", "bf16": "tab:orange"}
DPI = 100  # the README's figure stays well under 150 KB


@dataclass(frozen=True, slots=True)
class Point:
    """One configuration as drawn: its latest outcome, at the memory it needs where known."""

    label: str
    config_key: str
    status: str
    precision: str
    checkpointing: bool
    required_bytes: int | None  # peak reserved + context: what autotune compares with the budget
    tokens_per_s: float | None
    predicted: bool = False  # required_bytes is the estimator's prediction, not a measurement
    spread: float | None = None  # the throughput's stored spread (relative): drawn as an error bar


@dataclass(frozen=True, slots=True)
class PlotData:
    budget_bytes: int
    margin_bytes: int
    fits: list[Point]  # ok: measured memory and throughput
    frontier: list[Point]  # of `fits`, the fastest at each memory level, by increasing memory
    oom: list[Point]  # out of memory, where a memory figure is known
    skipped: list[Point]  # ruled out without a probe, where predicted memory is known
    failed: list[Point]  # timeout, crash, error, unstable, where a memory figure is known
    unplaced: dict[str, int]  # status -> configs with no memory figure at all (not drawn)
    pick: Point | None
    over: list[Point] = dataclasses.field(default_factory=list)  # a plan's: predicted not to fit (never probed)
    contenders: list[Point] = dataclasses.field(default_factory=list)  # the pick's closest rivals: labelled too

    @property
    def limit_bytes(self) -> int:
        """A config fits when it needs at most this: the budget less the safety margin."""
        return Budget(self.budget_bytes, self.margin_bytes).allowed_bytes


def have_matplotlib() -> bool:
    return _installed("matplotlib")


def _installed(name: str) -> bool:
    # find_spec answers None for a module hidden as sys.modules[name] = None (as the tests do).
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def latest_outcomes(probes: Sequence[ProbeRecord]) -> list[ProbeRecord]:
    """One probe per configuration, as the leaderboard counts them: its latest ok measurement, else
    its latest outcome. In the order the configurations were first settled."""
    chosen: dict[str, ProbeRecord] = {}
    for probe in sorted(probes, key=lambda p: p.id):
        held = chosen.get(probe.config_key)
        if held is None or probe.result.status == ProbeStatus.OK or held.result.status != ProbeStatus.OK:
            chosen[probe.config_key] = probe
    return list(chosen.values())


def frontier(points: Sequence[Point]) -> list[Point]:
    """The points nothing beats with less memory: the fastest for each memory limit, by increasing
    memory (a step line through them is the best throughput each budget buys)."""
    ranked = sorted(
        (p for p in points if p.required_bytes is not None and p.tokens_per_s is not None),
        key=lambda p: (p.required_bytes, -(p.tokens_per_s or 0.0)),
    )
    out: list[Point] = []
    for point in ranked:
        if not out or (point.tokens_per_s or 0.0) > (out[-1].tokens_per_s or 0.0):
            out.append(point)
    return out


def plot_points(
    probes: Sequence[ProbeRecord],
    *,
    budget_bytes: int,
    margin_bytes: int,
    pick_key: str | None = None,
    predicted_required: Mapping[str, int] | None = None,
) -> PlotData:
    """What the plot shows, from a study's stored probes. `pick_key`: the chosen config (the
    leaderboard's first, which a confirmation round may have reordered; default the fastest that
    fits). `predicted_required`: the estimator's predicted need (reserved + context) by config key,
    from the study's plan; where a failed or skipped config has none, its stored predicted peak
    allocated stands in, and an OOM without either is drawn where it failed."""
    predicted_required = predicted_required or {}
    fits: list[Point] = []
    oom: list[Point] = []
    skipped: list[Point] = []
    failed: list[Point] = []
    unplaced: Counter[str] = Counter()
    for probe in latest_outcomes(probes):
        r, status = probe.result, ProbeStatus(probe.result.status)
        predicted = predicted_required.get(probe.config_key, probe.predicted_peak_bytes)
        if status == ProbeStatus.OK and r.required_bytes is not None and r.tokens_per_s is not None:
            required, is_prediction = r.required_bytes, False
        elif status == ProbeStatus.OK:
            unplaced[status] += 1
            continue
        elif predicted is not None:
            # An OOM's measured peak is where it failed (about the cap), not what it needs.
            required, is_prediction = predicted, True
        elif status != ProbeStatus.SKIPPED and r.required_bytes is not None:
            required, is_prediction = r.required_bytes, False
        else:
            unplaced[status] += 1
            continue
        point = Point(
            label=probe.config.label(),
            config_key=probe.config_key,
            status=status,
            precision=probe.config.precision,
            checkpointing=probe.config.checkpointing,
            required_bytes=required,
            tokens_per_s=r.tokens_per_s if status == ProbeStatus.OK else None,
            predicted=is_prediction,
            spread=r.step_spread if status == ProbeStatus.OK else None,
        )
        {ProbeStatus.OK: fits, ProbeStatus.OOM: oom, ProbeStatus.SKIPPED: skipped}.get(status, failed).append(point)
    if pick_key is None:
        order = ranked(fits, lambda p: Standing(p.config_key, p.tokens_per_s, p.required_bytes, fits.index(p)))
        pick_key = order[0].config_key if order else None
    pick = next((p for p in fits if p.config_key == pick_key), None)
    return PlotData(
        budget_bytes=budget_bytes,
        margin_bytes=margin_bytes,
        fits=fits,
        frontier=frontier(fits),
        oom=oom,
        skipped=skipped,
        failed=failed,
        unplaced=dict(unplaced),
        pick=pick,
        contenders=rivals(fits, pick),
    )


# Besides the pick, the fastest configs labelled on the plot (each with its spread as an error bar).
LABELLED_RIVALS = 3


def rivals(fits: Sequence[Point], pick: Point | None) -> list[Point]:
    """The fastest configs that fit besides the pick: those a reader compares it with."""
    others = sorted(
        (p for p in fits if pick is None or p.config_key != pick.config_key), key=lambda p: -(p.tokens_per_s or 0.0)
    )
    return others[:LABELLED_RIVALS]


def probe_device(probes: Sequence[ProbeRecord], study: StudyRecord) -> str:
    """The device the probes ran on, as they reported it (the study's own name for it otherwise)."""
    devices = Counter(p.result.device for p in probes if p.result.device)
    return devices.most_common(1)[0][0] if devices else study.device_name


def plot_title(study: StudyRecord, device: str) -> str:
    return (
        f"{shown_reference(study.model_reference)} under {format_size(study.budget_bytes)} "
        f"(margin {format_size(study.margin_bytes)}), study {study.name}\n{device}"
    )


def predicted_needs(study: StudyRecord) -> dict[str, int]:
    """The estimator's predicted need (reserved + context) of each config, from the study's plan."""
    from autotune.search.study_plan import StudyPlan

    return {key: p.required_bytes for key, p in StudyPlan.from_dict(study.plan).predictions.items()}


def plot_study(study: str | None, db: str | None, out: str | os.PathLike[str] | Output | None = None) -> Path:
    """Draw a study (the most recent when None) to `out` (default `<study>.png` here), whole or not
    at all (autotune.host.output); returns the path. Reads only. Raises BadInput, before reading
    anything, when the drawing library is missing or `out` cannot be written (check_out_file)."""
    check_out_file(
        out.path if isinstance(out, Output) else out if out is not None else "plot.png",
        out.flag if isinstance(out, Output) else "--out",
    )
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        record = store.study(study)
        probes = store.probes(record.name)
        top = store.leaderboard(record.name, top=1)
    data = plot_points(
        probes,
        budget_bytes=record.budget_bytes,
        margin_bytes=record.margin_bytes,
        pick_key=top[0].config_key if top else None,
        predicted_required=predicted_needs(record),
    )
    title = plot_title(record, probe_device(probes, record))
    if isinstance(out, Output):
        return write_plot(data, title, out)
    with Output(out if out is not None else f"{record.name}.png", "--out") as opened:
        return write_plot(data, title, opened)


def check_writer(suffix: str, flag: str = "--out") -> None:
    """Refuse, before any work, a file type that cannot be written here."""
    if suffix == ".html":
        if not _installed("plotly"):
            raise BadInput(PLOTLY_MISSING)
    elif suffix not in IMAGE_SUFFIXES:
        raise BadInput(f"{flag}: cannot draw a {suffix or 'suffix-less'} file; name it .png, .svg, .pdf or .html")
    elif not have_matplotlib():
        raise BadInput(MATPLOTLIB_MISSING)


def check_out_file(out: str | os.PathLike[str], flag: str = "--out") -> Path:
    """Refuse, before any work, a figure that cannot be written: a file type this machine cannot
    draw (check_writer), or a place no file can go (check_out_path). Returns the path."""
    path = Path(out)
    check_writer(path.suffix.lower(), flag)
    check_out_path(path, flag)
    return path


def check_out_path(path: Path, flag: str) -> None:
    """Refuse a place no file can go (autotune.host.output.check_destination): a missing directory (none
    is made from a typo: nothing is created for a refused command), a directory, a FIFO or device,
    a directory this user cannot write in."""
    check_destination(path, flag)


def write_plot(data: PlotData, title: str, out: Path | Output) -> Path:
    """Draw `data` to `out` whole or not at all (autotune.host.output): HTML with plotly, else an image
    with matplotlib (by the suffix). `out` may be an Output already open (plan --plot opens its
    own before its traces): it is committed here."""
    if not isinstance(out, Output):
        with Output(check_out_file(out), "--out") as opened:
            return write_plot(data, title, opened)
    check_out_file(out.path, out.flag)
    draw = _plotly if out.path.suffix.lower() == ".html" else _matplotlib
    out.fill(lambda temp: draw(data, title, temp))
    return out.commit()


def _scale(budget_bytes: int) -> tuple[float, str]:
    return (2**30, "GiB") if budget_bytes >= 2**30 else (2**20, "MiB")


def _x_range(data: PlotData) -> tuple[float, float]:
    """From 0, unless every config needs most of the budget: then from just left of the smallest,
    so that configs a few MiB apart do not sit on one another."""
    drawn = [p.required_bytes or 0 for p in (*data.fits, *data.oom, *data.skipped, *data.failed, *data.over)]
    right = max([data.budget_bytes * 1.08, *(x * 1.04 for x in drawn)])
    low = min([*drawn, data.limit_bytes])
    if low < 0.6 * data.budget_bytes:
        return 0.0, right
    return low - 0.15 * (right - low), right


def _unplaced_note(data: PlotData) -> str | None:
    if not data.unplaced:
        return None
    counts = ", ".join(f"{n} {status}" for status, n in sorted(data.unplaced.items()))
    return f"not drawn (no memory figure): {counts}"


def _strip_groups(data: PlotData) -> list[tuple[list[Point], dict[str, Any]]]:
    """The bottom strip's series (no throughput): each with its matplotlib style."""
    measured_oom = [p for p in data.oom if not p.predicted]
    return [
        (
            data.over,
            dict(
                marker="o", facecolors="none", edgecolors="tab:red", s=40, label="predicted not to fit (never probed)"
            ),
        ),
        (
            [p for p in data.oom if p.predicted],
            dict(marker="x", color="tab:red", s=46, label="OOM (at its predicted need)"),
        ),
        (measured_oom, dict(marker="x", color="darkred", s=46, label="OOM (where it failed)")),
        (
            data.skipped,
            dict(marker="d", facecolors="none", edgecolors="tab:gray", s=40, label="skipped (at its predicted need)"),
        ),
        (
            data.failed,
            dict(marker="v", color="tab:purple", s=36, label="not measured (timeout, crash, error, unstable)"),
        ),
    ]


def _matplotlib(data: PlotData, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: draws to files only
    import matplotlib.pyplot as plt

    scale, unit = _scale(data.budget_bytes)
    fig, (ax, strip) = plt.subplots(
        2, 1, sharex=True, figsize=(8.4, 6.6), gridspec_kw={"height_ratios": [6, 1], "hspace": 0.06}
    )
    for precision, color in PRECISION_COLORS.items():
        for ckpt in (False, True):
            pts = [p for p in data.fits if p.precision == precision and p.checkpointing == ckpt]
            if pts:
                xs, ys = [(p.required_bytes or 0) / scale for p in pts], [p.tokens_per_s or 0.0 for p in pts]
                ax.scatter(
                    xs,
                    ys,
                    s=34,
                    color=color if not ckpt else "none",
                    edgecolors=color,
                    zorder=3,
                    label=f"fits: {precision}{', checkpointing' if ckpt else ''}",
                )
                # Each throughput's stored spread (half its interquartile range): what a window varies by.
                ax.errorbar(
                    xs,
                    ys,
                    yerr=[(p.spread or 0.0) * (p.tokens_per_s or 0.0) for p in pts],
                    fmt="none",
                    ecolor=color,
                    elinewidth=1.0,
                    capsize=2,
                    alpha=0.7,
                    zorder=2,
                )
    if data.frontier:
        xs = [(p.required_bytes or 0) / scale for p in data.frontier] + [data.limit_bytes / scale]
        ys = [p.tokens_per_s or 0.0 for p in data.frontier] + [data.frontier[-1].tokens_per_s or 0.0]
        ax.step(xs, ys, where="post", color="tab:blue", alpha=0.5, linewidth=1.5, zorder=2, label="feasible frontier")
    for axis in (ax, strip):
        axis.axvline(
            data.budget_bytes / scale,
            color="black",
            linestyle="--",
            linewidth=1.2,
            label=f"budget {format_size(data.budget_bytes)}" if axis is ax else None,
        )
        axis.axvline(
            data.limit_bytes / scale,
            color="black",
            linestyle=":",
            linewidth=1.0,
            label=f"budget - {format_size(data.margin_bytes)} margin: fits left of it" if axis is ax else None,
        )
        axis.grid(alpha=0.3)
    if data.pick is not None:
        x, y = (data.pick.required_bytes or 0) / scale, data.pick.tokens_per_s or 0.0
        ax.scatter(
            [x], [y], marker="*", s=260, color="gold", edgecolors="black", linewidths=0.8, zorder=4, label="pick"
        )
    for points, style in _strip_groups(data):
        if points:
            # Spread within the strip so that configs needing the same memory stay apart.
            ys = [0.25 + 0.5 * (i % 3) / 2 for i in range(len(points))]
            strip.scatter([(p.required_bytes or 0) / scale for p in points], ys, zorder=3, **style)
    note = _unplaced_note(data)
    if note:
        ax.text(0.01, 0.98, note, transform=ax.transAxes, va="top", fontsize=8)
    top = max([(p.tokens_per_s or 0.0) * (1 + (p.spread or 0.0)) for p in data.fits], default=1.0)
    ax.set_ylim(bottom=0, top=top * 1.15)
    left, right = _x_range(data)
    ax.set_xlim(left=left / scale, right=right / scale)
    ax.set_ylabel("tokens/s")
    ax.set_title(title, fontsize=10)
    strip.set_ylim(0, 1)
    strip.set_yticks([])
    strip.set_ylabel("no\nthroughput", rotation=0, ha="right", va="center", fontsize=8)
    strip.set_xlabel(f"memory needed: peak reserved + context ({unit})")
    handles, labels = ax.get_legend_handles_labels()
    strip_handles, strip_labels = strip.get_legend_handles_labels()
    fig.legend(handles + strip_handles, labels + strip_labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.subplots_adjust(left=0.11, right=0.97, top=0.91, bottom=0.22)
    _label_contenders(fig, ax, data, scale)  # (once the layout is final: labels are placed in display space)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# A point's marker reaches this far from its centre, in display pixels: no label may cover it.
_MARKER = 6
# Where a label may go around its point, in points (x, y), nearest first: beside, above, below, then
# farther out (a leader line joins a label to its point).
_LABEL_SLOTS = tuple(
    (dx, dy)
    for reach in (1, 2, 3)
    for dx, dy in ((10, -10), (-10, -10), (10, 12), (-10, 12), (10, -34), (-10, -34), (10, 36), (-10, 36))
    for dx, dy in [(dx * reach, dy * reach)]
)


def _label_contenders(fig, ax, data: PlotData, scale: float) -> None:
    """Label the pick and its rivals, each where its box covers no other label and no point (the
    first free slot around it, nearest first; where none is free, the one that covers least), so
    that none hides another contender."""
    labelled = [(f"pick: {data.pick.label}", data.pick, True)] if data.pick is not None else []
    labelled += [(p.label, p, False) for p in data.contenders]
    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    points = [ax.transData.transform(((p.required_bytes or 0) / scale, p.tokens_per_s or 0.0)) for p in data.fits]
    taken: list[Any] = []

    def covered(box) -> float:
        """How much of what must stay visible `box` covers (0: nothing), in square pixels."""
        area = sum(
            max(0.0, min(box.x1, o.x1) - max(box.x0, o.x0)) * max(0.0, min(box.y1, o.y1) - max(box.y0, o.y0))
            for o in taken
        )
        area += sum(
            400.0
            for px, py in points
            if box.x0 - _MARKER <= px <= box.x1 + _MARKER and box.y0 - _MARKER <= py <= box.y1 + _MARKER
        )
        outside = (
            max(0.0, inside.x0 - box.x0)
            + max(0.0, box.x1 - inside.x1)
            + max(0.0, inside.y0 - box.y0)
            + max(0.0, box.y1 - inside.y1)
        )
        return area + 1000.0 * outside

    for text, point, is_pick in labelled:
        x, y = (point.required_bytes or 0) / scale, point.tokens_per_s or 0.0
        words = f"{text}\n{y:,.0f} tokens/s, needs {format_size(point.required_bytes)}"
        best: tuple[float, Any, Any] | None = None
        for dx, dy in _LABEL_SLOTS:
            note = ax.annotate(
                words,
                (x, y),
                xytext=(dx, dy),
                textcoords="offset points",
                fontsize=7.5 if not is_pick else 8,
                ha="left" if dx >= 0 else "right",
                va="top" if dy < 0 else "bottom",
                bbox=dict(
                    boxstyle="round,pad=0.25", facecolor="white", alpha=0.85, edgecolor="0.4" if is_pick else "0.75"
                ),
                arrowprops=dict(arrowstyle="-", color="0.6", linewidth=0.6),
            )
            box = note.get_window_extent(renderer).expanded(1.02, 1.05)
            cost = covered(box)
            if best is None or cost < best[0]:
                if best is not None:
                    best[2].remove()
                best = (cost, box, note)
            else:
                note.remove()
            if cost == 0:
                break
        assert best is not None
        taken.append(best[1])


def _plotly(data: PlotData, title: str, path: Path) -> None:
    import plotly.graph_objects as go  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from plotly.subplots import make_subplots  # type: ignore[import-not-found,import-untyped,unused-ignore]

    scale, unit = _scale(data.budget_bytes)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.85, 0.15], vertical_spacing=0.03)

    def x(points: Sequence[Point]) -> list[float]:
        return [(p.required_bytes or 0) / scale for p in points]

    fig.add_trace(
        go.Scatter(
            x=x(data.fits),
            y=[p.tokens_per_s for p in data.fits],
            mode="markers",
            name="fits",
            text=[p.label for p in data.fits],
            marker=dict(size=9),
            error_y=dict(array=[(p.spread or 0.0) * (p.tokens_per_s or 0.0) for p in data.fits]),
        ),
        row=1,
        col=1,
    )
    if data.frontier:
        fig.add_trace(
            go.Scatter(
                x=x(data.frontier) + [data.limit_bytes / scale],
                y=[p.tokens_per_s for p in data.frontier] + [data.frontier[-1].tokens_per_s],
                mode="lines",
                line=dict(shape="hv"),
                name="feasible frontier",
            ),
            row=1,
            col=1,
        )
    if data.pick is not None:
        fig.add_trace(
            go.Scatter(
                x=x([data.pick]),
                y=[data.pick.tokens_per_s],
                mode="markers+text",
                text=[f"pick: {data.pick.label}"],
                textposition="bottom left",
                marker=dict(symbol="star", size=18, color="gold", line=dict(width=1)),
                name="pick",
            ),
            row=1,
            col=1,
        )
    symbols = {"oom": "x", "skipped": "diamond-open", "failed": "triangle-down", "predicted not to fit": "circle-open"}
    for name, points in (
        ("oom", data.oom),
        ("skipped", data.skipped),
        ("failed", data.failed),
        ("predicted not to fit", data.over),
    ):
        if points:
            fig.add_trace(
                go.Scatter(
                    x=x(points),
                    y=[0.5] * len(points),
                    mode="markers",
                    name=name,
                    text=[p.label for p in points],
                    marker=dict(symbol=symbols[name], size=10),
                ),
                row=2,
                col=1,
            )
    for bytes_, dash, text in (
        (data.budget_bytes, "dash", f"budget {format_size(data.budget_bytes)}"),
        (data.limit_bytes, "dot", "budget - margin"),
    ):
        fig.add_vline(x=bytes_ / scale, line_dash=dash, annotation_text=text)
    fig.update_yaxes(title_text="tokens/s", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(showticklabels=False, range=[0, 1], row=2, col=1)
    fig.update_xaxes(
        title_text=f"memory needed: peak reserved + context ({unit})",
        range=[x / scale for x in _x_range(data)],
        row=2,
        col=1,
    )
    fig.update_layout(title=title.replace("\n", "<br>"), template="plotly_white")
    fig.write_html(path, include_plotlyjs=True)  # the library inside the file: it opens offline too


def save_plan_plot(plan: Plan, out: str | os.PathLike[str] | Output) -> Path:
    """Draw a plan's predicted points (autotune plan --plot) as a study's are drawn: what fits at its
    predicted need and speed, what does not on the bottom strip; every point a prediction. Whole
    or not at all; `out` may be an Output already open (committed here)."""
    path = check_out_file(out.path if isinstance(out, Output) else out, "--plot")
    fits: list[Point] = []
    over: list[Point] = []
    unplaced: Counter[str] = Counter()
    for item in plan.planned:
        if item.estimate is None or (item.fits and item.tokens_per_s is None):
            unplaced["not predicted" if item.estimate is None else "no speed predicted"] += 1
            continue
        point = Point(
            label=item.config.label(),
            config_key=item.config.key(),
            status=ProbeStatus.OK if item.fits else ProbeStatus.SKIPPED,
            precision=item.config.precision,
            checkpointing=item.config.checkpointing,
            required_bytes=item.need_bytes,
            tokens_per_s=item.tokens_per_s if item.fits else None,
            predicted=True,
        )
        (fits if item.fits else over).append(point)
    pick = max(fits, key=lambda p: p.tokens_per_s or 0.0, default=None)
    data = PlotData(
        budget_bytes=plan.target.budget.total_bytes,
        margin_bytes=plan.target.budget.margin_bytes,
        fits=fits,
        frontier=frontier(fits),
        oom=[],
        skipped=[],
        failed=[],
        unplaced=dict(unplaced),
        pick=pick,
        over=over,
        contenders=rivals(fits, pick),
    )
    title = f"{plan.model} on {plan.target.name}: predicted by autotune plan (no probe ran)"
    if isinstance(out, Output):
        return write_plot(data, title, out)
    with Output(path, "--plot") as opened:
        return write_plot(data, title, opened)

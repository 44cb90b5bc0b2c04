"""The benchmark's report: figures, a printed table, a plot and a JSON file.

Works on the JSON-ready document that `benchmarks.run` builds (one entry per case under `cases`),
so a document merged from several runs (one model per command on a time-limited machine) reports
the same way as one produced in a single run.

Figures, per case:
- pick quality: tokens/s of autotune's pick / tokens/s of the ground truth's best, both as the
  exhaustive ground truth measured them (so the figure judges the choice, not run-to-run noise);
  target >= 0.98. The search's own measurement of its pick is reported beside it.
- search cost: autotune's device seconds (probe wall time) / the ground truth's; target <= 0.15.
- speed-up of autotune's pick over each alternative's pick (tokens/s ratio), where both fit.
- estimator error: |predicted peak - measured peak allocated| / measured, median over the
  configurations that fit.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from autotune.levers.config import ProbeConfig
from autotune.results.probe_result import ProbeResult
from autotune.vocabulary.units import format_size

PICK_QUALITY_TARGET = 0.98
SEARCH_COST_TARGET = 0.15
_CONFIG_FIELDS = (
    "model",
    "micro_batch",
    "block_size",
    "grad_accum",
    "precision",
    "checkpointing",
    "attention",
    "optimizer",
)


# -- rows -----------------------------------------------------------------------------------------


def result_row(config: ProbeConfig, result: ProbeResult) -> dict:
    """One measured configuration, flat and JSON-ready."""
    return {
        "key": config.key(),
        "label": config.label(),
        **config.to_dict(),
        "status": result.status,
        "tokens_per_s": result.tokens_per_s,
        "step_seconds": result.step_seconds,
        "peak_allocated_bytes": result.peak_allocated_bytes,
        "peak_reserved_bytes": result.peak_reserved_bytes,
        "context_bytes": result.context_bytes,
        "required_bytes": result.required_bytes,
        "mfu": result.mfu,
        "wall_seconds": result.wall_seconds,
        "error": (result.error or "")[:300] or None,
    }


def row_config(row: dict) -> ProbeConfig:
    return ProbeConfig(**{name: row[name] for name in _CONFIG_FIELDS if name in row})


def _by_key(case: dict) -> dict[str, dict]:
    return {row["key"]: row for row in case.get("ground_truth", {}).get("rows", [])}


def reference(case: dict, row: dict | None) -> dict | None:
    """`row` as the ground truth measured it when its configuration is in the space (same run,
    same conditions for every pick); else as its own probe measured it."""
    if row is None:
        return None
    truth = _by_key(case).get(row["key"])
    if truth is not None:
        return {**truth, "source": "ground truth"}
    return {**row, "source": "own probe"}


def ground_truth_best(case: dict) -> dict | None:
    fitting = [r for r in case.get("ground_truth", {}).get("rows", []) if r["status"] == "ok" and r.get("tokens_per_s")]
    return max(fitting, key=lambda r: r["tokens_per_s"]) if fitting else None


def pareto_frontier(rows: list[dict]) -> list[dict]:
    """The configurations that fit and that nothing uses less memory and runs faster than:
    the fastest config for each memory limit, by increasing memory."""
    fitting = sorted(
        (r for r in rows if r["status"] == "ok" and r.get("tokens_per_s") and r.get("required_bytes")),
        key=lambda r: (r["required_bytes"], -r["tokens_per_s"]),
    )
    frontier, best = [], -math.inf
    for row in fitting:
        if row["tokens_per_s"] > best:
            frontier.append(row)
            best = row["tokens_per_s"]
    return frontier


# -- figures --------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compute_figures(case: dict) -> dict:
    """The case's figures; also writes each ground-truth row's predicted peak and estimator error."""
    figures: dict = {}
    best = ground_truth_best(case)
    # Figures only from phases that finished: a search cut short by a deadline says nothing yet.
    search = case.get("autotune") if (case.get("autotune") or {}).get("complete", True) else None
    pick = reference(case, search.get("pick")) if search else None
    truth = case.get("ground_truth") if (case.get("ground_truth") or {}).get("complete", True) else None
    if truth is None:
        best = None
    if best is not None and pick is not None:
        figures["pick_quality"] = _ratio(pick["tokens_per_s"], best["tokens_per_s"])
        figures["pick_quality_as_searched"] = _ratio(search["pick"]["tokens_per_s"], best["tokens_per_s"])
        figures["pick_is_ground_truth_best"] = pick["key"] == best["key"]
    if truth and search:
        figures["search_cost"] = _ratio(search.get("gpu_seconds"), truth.get("gpu_seconds"))
        figures["search_cost_wall"] = _ratio(search.get("wall_seconds"), truth.get("wall_seconds"))
        figures["search_probe_share"] = _ratio(search.get("probed"), truth.get("probed"))
    speedups: dict[str, float | None] = {}
    for alt in case.get("alternatives", []):
        alt_pick = reference(case, alt.get("pick")) if alt.get("status") == "ok" else None
        speedups[alt["name"]] = _ratio(
            pick["tokens_per_s"] if pick else None, alt_pick["tokens_per_s"] if alt_pick else None
        )
    if speedups:
        figures["speedup_over"] = speedups

    # Run-to-run noise: configs measured twice (by the ground truth and again by the search or an
    # alternative). A pick quality a few points off 1.0 means little when this is as large.
    truth_rows = _by_key(case)
    repeats = [
        (row, truth_rows[row["key"]])
        for row in (search or {}).get("probes", [])
        + [t for alt in case.get("alternatives", []) for t in alt.get("tried", [])]
        if row["status"] == "ok" and row.get("tokens_per_s") and truth_rows.get(row["key"], {}).get("tokens_per_s")
    ]
    figures["repeat_configs"] = len(repeats)
    figures["repeat_median_abs_diff"] = (
        statistics.median(abs(a["tokens_per_s"] / b["tokens_per_s"] - 1) for a, b in repeats) if repeats else None
    )

    estimates = case.get("estimates") or {}
    predicted = estimates.get("predicted") or {}
    errors = []
    for row in case.get("ground_truth", {}).get("rows", []):
        row["predicted_peak_bytes"] = predicted.get(row["key"])
        row["estimate_error"] = None
        if row["status"] == "ok" and row["predicted_peak_bytes"] and row.get("peak_allocated_bytes"):
            row["estimate_error"] = (row["predicted_peak_bytes"] - row["peak_allocated_bytes"]) / row[
                "peak_allocated_bytes"
            ]
            errors.append(abs(row["estimate_error"]))
    figures["estimator_configs"] = len(errors)
    figures["estimator_median_abs_error"] = statistics.median(errors) if errors else None
    figures["estimator_max_abs_error"] = max(errors) if errors else None
    case["figures"] = figures
    return figures


# -- text -----------------------------------------------------------------------------------------


def _fmt_speed(v: float | None) -> str:
    return f"{v:,.0f}" if v else "-"


def _fmt_ratio(v: float | None, digits: int = 3) -> str:
    return f"{v:.{digits}f}" if v is not None else "-"


def _fmt_pct(v: float | None) -> str:
    return f"{100 * v:+.1f}%" if v is not None else "-"


def format_case(case: dict, device: str, all_rows: bool = True) -> str:
    figures = case.get("figures") or compute_figures(case)
    lines = []
    head = (
        f"== {case['model']} under {format_size(case['budget_bytes'])} (margin {format_size(case['margin_bytes'])}) on {device}: "
        f"{case['candidates']} configs, effective batch {case['effective_batch']} x {case['block_size']} tokens =="
    )
    lines.append(head)
    truth = case.get("ground_truth")
    if truth and all_rows:
        lines.append(
            f"{'ground truth (every config)':<38}{'status':>8}{'tokens/s':>12}{'peak alloc':>12}{'required':>12}"
            f"{'predicted':>12}{'est err':>9}{'probe s':>9}"
        )
        best = ground_truth_best(case)
        for row in sorted(
            truth["rows"], key=lambda r: (r["precision"], r["checkpointing"], r["attention"], r["micro_batch"])
        ):
            mark = " *" if best is not None and row["key"] == best["key"] else ""
            fits = row["status"] == "ok"  # an OOM's figures are where it failed, not what it needs
            lines.append(
                f"{row['label'] + mark:<38}{row['status']:>8}{_fmt_speed(row['tokens_per_s']):>12}"
                f"{format_size(row['peak_allocated_bytes'] if fits else None):>12}{format_size(row['required_bytes'] if fits else None):>12}"
                f"{format_size(row.get('predicted_peak_bytes')):>12}{_fmt_pct(row.get('estimate_error')):>9}"
                f"{(row['wall_seconds'] or 0):>9.1f}"
            )
        lines.append("")
    lines.append(
        f"{'method':<27}{'pick':<34}{'tokens/s':>11}{'required':>12}{'probes':>8}{'device s':>10}"
        f"{'vs best':>9}{'autotune x':>11}"
    )
    best = ground_truth_best(case)

    def line(
        title: str,
        pick: dict | None,
        probes,
        seconds,
        status: str | None = None,
        speedup: float | None = None,
        note: str = "",
    ) -> str:
        ref = reference(case, pick) if pick is not None else None
        label = ref["label"] if ref else (status or "-")
        speed = ref["tokens_per_s"] if ref and ref["status"] == "ok" else None
        text = (
            f"{title:<27}{label:<34}{_fmt_speed(speed):>11}{format_size(ref['required_bytes'] if ref else None):>12}"
            f"{probes if probes is not None else '-':>8}{seconds if seconds is not None else 0:>10.1f}"
            f"{_fmt_ratio(_ratio(speed, best['tokens_per_s'] if best else None)):>9}"
            f"{(f'{speedup:.2f}x' if speedup else '-'):>11}"
        )
        return text + (f"  ({note})" if note else "")

    if truth:
        lines.append(line(f"ground truth ({truth['strategy']})", best, truth["probed"], truth["gpu_seconds"]))
    search = case.get("autotune")
    if search:
        lines.append(
            line(
                f"autotune ({search['strategy']})",
                search.get("pick"),
                search["probed"],
                search["gpu_seconds"],
                note=f"{search['skipped']} skipped, {search['wall_seconds']:.1f} s wall",
            )
        )
    for alt in case.get("alternatives", []):
        status = {"oom": "OOM", "not-installed": "not installed", "failed": "failed"}.get(alt["status"], alt["status"])
        pick = alt.get("pick") if alt["status"] in ("ok", "oom") else None
        if alt["status"] == "oom" and pick is not None:
            pick = {**pick, "label": f"{pick['label']} OOM"}
        lines.append(
            line(
                alt["title"],
                pick if alt["status"] == "ok" else None,
                alt.get("probed"),
                alt.get("gpu_seconds"),
                status=(pick["label"] if pick else status),
                speedup=(figures.get("speedup_over") or {}).get(alt["name"]),
                note=alt.get("note", ""),
            )
        )
    lines.append("")
    if case.get("pending"):
        lines.append(f"INCOMPLETE, still to run: {', '.join(case['pending'])} (figures below are provisional)")
    lines.append("figures: " + " | ".join(_figure_texts(case)))
    return "\n".join(lines)


def _figure_texts(case: dict) -> list[str]:
    f = case.get("figures") or {}
    out = []
    if f.get("pick_quality") is not None:
        ok = "meets" if f["pick_quality"] >= PICK_QUALITY_TARGET else "MISSES"
        out.append(
            f"pick quality {f['pick_quality']:.3f} ({ok} >= {PICK_QUALITY_TARGET}; "
            f"{f['pick_quality_as_searched']:.3f} as the search measured it)"
        )
    if f.get("search_cost") is not None:
        ok = "meets" if f["search_cost"] <= SEARCH_COST_TARGET else "MISSES"
        out.append(
            f"search cost {f['search_cost']:.3f} of ground truth device-seconds ({ok} <= {SEARCH_COST_TARGET}; "
            f"{f['search_probe_share']:.2f} of its probes, {f['search_cost_wall']:.3f} of its wall time)"
        )
    if f.get("repeat_median_abs_diff") is not None:
        out.append(
            f"run-to-run noise {100 * f['repeat_median_abs_diff']:.1f}% (median tokens/s difference over "
            f"{f['repeat_configs']} configs measured twice)"
        )
    for name, value in (f.get("speedup_over") or {}).items():
        alt = next(a for a in case["alternatives"] if a["name"] == name)
        why = {"oom": "its pick runs out of memory", "not-installed": "not installed", "failed": "failed"}.get(
            alt["status"], "-"
        )
        out.append(f"autotune vs {alt['title']}: " + (f"{value:.2f}x" if value is not None else why))
    estimates = case.get("estimates") or {}
    if f.get("estimator_median_abs_error") is not None:
        out.append(
            f"estimator ({estimates.get('device_type')}) median abs error {100 * f['estimator_median_abs_error']:.1f}% "
            f"(max {100 * f['estimator_max_abs_error']:.1f}%) over {f['estimator_configs']} configs that fit"
        )
    else:
        out.append(f"estimator: {estimates.get('note') or 'not run'}")
    return out


def format_report(doc: dict, all_rows: bool = True) -> str:
    parts = [
        f"autotune benchmark on {doc['device']} ({doc['date']}; torch {doc.get('torch_version')}, "
        f"transformers {doc.get('transformers_version')}, accelerate {doc.get('accelerate_version')}, "
        f"lightning {doc.get('lightning_version') or 'not installed'})"
    ]
    for case in doc["cases"]:
        parts.append(format_case(case, doc["device"], all_rows))
    return "\n\n".join(parts)


# -- plot -----------------------------------------------------------------------------------------

PICK_STYLES = {
    "ground-truth": dict(marker="*", s=380, facecolor="gold", edgecolor="black", label="ground-truth best"),
    "autotune": dict(marker="o", s=260, facecolor="none", edgecolor="red", linewidth=2.2, label="autotune pick"),
    "trainer-defaults": dict(
        marker="s", s=140, facecolor="none", edgecolor="black", linewidth=1.8, label="Trainer defaults"
    ),
    "auto-find-batch-size": dict(
        marker="^", s=170, facecolor="none", edgecolor="tab:blue", linewidth=1.8, label="auto_find_batch_size"
    ),
    "lightning-binsearch": dict(
        marker="D", s=140, facecolor="none", edgecolor="tab:purple", linewidth=1.8, label="Lightning binsearch"
    ),
}
PRECISION_COLORS = {"fp32": "tab:gray", "fp16": "tab:green", "bf16": "tab:orange"}


def _scale(case: dict) -> tuple[float, str]:
    return (2**30, "GiB") if case["budget_bytes"] >= 2**30 else (2**20, "MiB")


def plot(doc: dict, path: Path) -> Path:
    """Tokens/s against the memory each config needs, one panel per case: the budget line, the
    feasible frontier and every method's pick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = doc["cases"]
    fig, axes = plt.subplots(1, len(cases), figsize=(7.2 * len(cases), 7.2), squeeze=False)
    for ax, case in zip(axes[0], cases):
        scale, unit = _scale(case)
        rows = case.get("ground_truth", {}).get("rows", [])
        for precision, color in PRECISION_COLORS.items():
            for ckpt in (False, True):
                pts = [
                    r
                    for r in rows
                    if r["status"] == "ok"
                    and r["precision"] == precision
                    and r["checkpointing"] == ckpt
                    and r.get("required_bytes")
                    and r.get("tokens_per_s")
                ]
                if pts:
                    ax.scatter(
                        [r["required_bytes"] / scale for r in pts],
                        [r["tokens_per_s"] for r in pts],
                        s=28,
                        color=color if not ckpt else "none",
                        edgecolors=color,
                        zorder=2,
                        label=f"{precision}{' + ckpt' if ckpt else ''}",
                    )
        frontier = pareto_frontier(rows)
        if frontier:
            xs = [r["required_bytes"] / scale for r in frontier] + [case["budget_bytes"] / scale]
            ys = [r["tokens_per_s"] for r in frontier] + [frontier[-1]["tokens_per_s"]]
            ax.step(
                xs, ys, where="post", color="tab:red", alpha=0.45, linewidth=1.4, zorder=1, label="feasible frontier"
            )
        ax.axvline(
            case["budget_bytes"] / scale,
            color="black",
            linestyle="--",
            linewidth=1.2,
            label=f"budget {format_size(case['budget_bytes'])}",
        )
        ooms = sum(r["status"] == "oom" for r in rows)
        notes = [f"{ooms} of {len(rows)} configs OOM (not plotted)"] if rows else []
        picks: list[tuple[str, dict | None]] = [("ground-truth", ground_truth_best(case))]
        if case.get("autotune"):
            picks.append(("autotune", reference(case, case["autotune"].get("pick"))))
        for alt in case.get("alternatives", []):
            if alt["status"] == "ok":
                picks.append((alt["name"], reference(case, alt.get("pick"))))
            else:
                why = {"oom": "OOM", "not-installed": "not installed", "failed": "failed"}.get(
                    alt["status"], alt["status"]
                )
                notes.append(f"{alt['title']}: {why}")
        for name, pick in picks:
            if pick is None or not pick.get("required_bytes") or not pick.get("tokens_per_s"):
                continue
            style = dict(PICK_STYLES.get(name, dict(marker="P", s=140, label=name)))
            style["label"] = f"{style['label']}: {pick['label']}"
            ax.scatter([pick["required_bytes"] / scale], [pick["tokens_per_s"]], zorder=4, **style)
        ax.set_xlabel(f"memory required: peak reserved + context ({unit})")
        ax.set_ylabel("tokens/s")
        ax.set_xlim(left=0, right=case["budget_bytes"] / scale * 1.08)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{case['model']} under {format_size(case['budget_bytes'])}\n{doc['device']}", fontsize=10)
        if notes:
            ax.text(
                0.02,
                0.98,
                "\n".join(notes),
                transform=ax.transAxes,
                va="top",
                fontsize=8,
                bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"),
            )
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, markerscale=0.6, frameon=False)
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"autotune benchmark, {doc['date']}: torch {doc.get('torch_version')}, "
        f"transformers {doc.get('transformers_version')}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# -- files ----------------------------------------------------------------------------------------


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def output_stem(doc: dict) -> str:
    """'<device-slug>-<date>', with '-tiny-gpt2' for the CPU pipeline's tiny model."""
    stem = slug(doc["device"])
    if any(case.get("tiny") for case in doc["cases"]):
        stem += "-tiny-gpt2"
    return f"{stem}-{doc['date']}"


def write(doc: dict, out_dir: Path) -> tuple[Path, Path | None]:
    """Write the JSON (always) and the PNG (when matplotlib is there); returns their paths."""
    for case in doc["cases"]:
        compute_figures(case)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem(doc)
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    try:
        png_path: Path | None = plot(doc, out_dir / f"{stem}.png")
    except ImportError:
        png_path = None
    doc["files"] = {"json": str(json_path), "png": str(png_path) if png_path else None}
    return json_path, png_path


def main(argv: list[str] | None = None) -> int:
    """Re-render a result: `python -m benchmarks.report FILE.json [--out DIR]` prints the table
    and draws the plot again (e.g. here, from a JSON brought back from a GPU machine that lacks
    matplotlib)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=main.__doc__.split("\n")[0])
    parser.add_argument("json", help="a benchmarks/results/*.json file")
    parser.add_argument("--out", help="where to write the PNG (default: beside the JSON)")
    parser.add_argument("--brief", action="store_true", help="the summary only, not every ground-truth row")
    args = parser.parse_args(argv)
    path = Path(args.json)
    doc = json.loads(path.read_text())
    for case in doc["cases"]:
        compute_figures(case)
    print(format_report(doc, all_rows=not args.brief))
    png = plot(doc, Path(args.out or path.parent) / f"{path.stem}.png")
    print(f"\nwrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

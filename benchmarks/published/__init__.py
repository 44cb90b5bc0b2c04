"""The estimator held to published GPU measurements.

Each row of the validation set (the `*.toml` files beside this module, described in its README) is
a memory figure someone measured on a real card and published, with the configuration it was
measured with. This runs autotune's CUDA estimator on every row's configuration (the model's
config.json under models/), compares the prediction of the same kind (peak allocated, peak
reserved, or reserved + the CUDA context for what nvidia-smi shows) with the published figure, and
writes the error table, by kind and by method:

    python -m benchmarks.published [--workers 2] [--label after] [--before FILE] [--stated-error]
    python -m benchmarks.published --speed      (the speed model against speed.toml: speed.py)

writes benchmarks/results/published-estimates.{json,md}; `--label before --json FILE` keeps the
figures of an older estimator (run from its own checkout) for the table's "before" column, and
`--stated-error` writes the summary the estimator states beside its predictions
(autotune/estimate/stated_error.json). Traces on 2 cores: a few minutes.

Where a row's run used something the estimator does not build itself, the row says how it is
predicted (`STAND_INS`): its optimizer's stand-in, state the caching allocator never held
subtracted, the bitsandbytes version whose 4-bit layers it traces.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import tomllib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from autotune.estimate.stated_error import ALL, KINDS, METHODS
from autotune.levers.tasks import TASKS
from autotune.vocabulary.units import format_size, parse_size

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
GOAL_MEDIAN, GOAL_WORST = 0.05, 0.10  # the goal: per kind, on Hugging Face-stack rows
REQUIRED = (
    "id",
    "source",
    "quote",
    "figure",
    "measures",
    "gpu",
    "stack",
    "model",
    "task",
    "method",
    "micro_batch",
    "block_size",
    "precision",
    "optimizer",
)

# Optimizers a published run used that autotune does not build, each predicted by a stand-in:
# (autotune's optimizer traced, whether its state is subtracted, why).
STAND_INS = {
    "adamw_hf": (
        "adamw",
        False,
        "transformers' own AdamW (gone in transformers 5) steps one parameter at a time: traced as the fused "
        "AdamW, whose step makes no temporaries; its own are one parameter's at a time",
    ),
    "paged_adamw_32bit": (
        "adamw",
        True,
        "paged AdamW keeps its 32-bit state in CUDA unified memory, outside the caching allocator: "
        "traced as AdamW, with the state subtracted",
    ),
    "paged_adamw_8bit": (
        "adamw_8bit",
        True,
        "paged 8-bit AdamW keeps its state in CUDA unified memory, outside the caching allocator: "
        "traced as 8-bit AdamW, with the state subtracted",
    ),
}

# What an estimator from before Trainer's optimizer names were accepted traced for them (every
# AdamW as the fused one: it had no other).
EARLIER_NAMES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_bnb_8bit": "adamw_8bit"}


@dataclass
class Row:
    """One published figure and the configuration it was measured with (the README's fields)."""

    id: str
    source: str
    quote: str
    figure: str
    measures: str
    gpu: str
    stack: str
    model: str
    task: str
    method: str
    micro_batch: int
    block_size: int
    precision: str
    optimizer: str
    file: str = ""
    measured: str = ""
    grad_accum: int = 1
    weights: str = "fp32"
    checkpointing: bool = False
    attention: str = "sdpa"
    num_labels: int | None = None
    target_length: int | None = None
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_targets: str = "all-linear"
    torch: str | None = None  # the run's torch version, where known
    bitsandbytes: str | None = None  # the version the run used (QLoRA, 8-bit optimizers), where known
    context: str | None = None  # the CUDA context on the run's own stack, where the source measured it
    hf_stack: bool = True  # transformers' model code (False: torchtune's, litgpt's own)
    notes: str = ""
    explained: str = ""  # why the row stays beyond the goal, shown in the table
    skip: str = ""  # why it is not estimated

    @property
    def figure_bytes(self) -> int:
        return parse_size(self.figure, flag=f"{self.id}: figure")

    def config_text(self) -> str:
        return " ".join(config_parts(self))


def load_rows(folder: Path = HERE) -> list[Row]:
    """Every row of every `*.toml` in `folder`, checked; SystemExit with the row and the problem."""
    rows: list[Row] = []
    known = set(Row.__dataclass_fields__)
    for path in sorted(folder.glob("*.toml")):
        if path.name == "speed.toml":  # throughput rows, not memory: benchmarks/published/speed.py
            continue
        for raw in tomllib.loads(path.read_text()).get("row", []):
            where = f"{path.name}: row {raw.get('id', '?')!r}"
            missing = [k for k in REQUIRED if k not in raw]
            unknown = sorted(set(raw) - known)
            if missing or unknown:
                raise SystemExit(f"{where}: missing {missing}, unknown fields {unknown}")
            row = Row(**raw, file=path.name)
            problems = [
                f"{name} {getattr(row, name)!r} is not one of {allowed}"
                for name, allowed in (("measures", KINDS), ("method", METHODS), ("task", TASKS))
                if getattr(row, name) not in allowed
            ]
            if not (folder / "models" / row.model / "config.json").exists():
                problems.append(f"no models/{row.model}/config.json")
            try:
                row.figure_bytes
            except Exception as exc:  # (BadInput: the figure's unit)
                problems.append(str(exc))
            if problems:
                raise SystemExit(f"{where}: " + "; ".join(problems))
            rows.append(row)
    ids = [r.id for r in rows]
    if len(ids) != len(set(ids)):
        raise SystemExit(f"duplicate row ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    return rows


def _optimizer(row: Row) -> tuple[str, bool, str]:
    """autotune's optimizer for the row's, whether its state is to be subtracted, and a note."""
    from autotune.levers import recipes

    if row.optimizer in STAND_INS:
        return STAND_INS[row.optimizer]
    canonical = recipes.canonical_optimizer(row.optimizer) if hasattr(recipes, "canonical_optimizer") else row.optimizer
    if canonical in recipes.OPTIMIZERS:
        return canonical, False, ""
    if row.optimizer in EARLIER_NAMES:  # an estimator from before Trainer's names were accepted (the before column)
        return EARLIER_NAMES[row.optimizer], False, f"{row.optimizer} traced as {EARLIER_NAMES[row.optimizer]}"
    raise SystemExit(f"{row.id}: optimizer {row.optimizer!r} has no stand-in; add one to STAND_INS")


def probe_config(row: Row):
    """The ProbeConfig that predicts the row's run, and notes on what stands in for what."""
    from autotune.levers.config import ProbeConfig
    from autotune.levers.recipes import peft_text

    optimizer, _, note = _optimizer(row)
    peft = (
        None
        if row.method == "full"
        else peft_text(row.method, row.lora_rank, row.lora_alpha, row.lora_dropout, row.lora_targets)
    )
    config = ProbeConfig(
        model=str(HERE / "models" / row.model),
        micro_batch=row.micro_batch,
        block_size=row.block_size,
        grad_accum=row.grad_accum,
        precision=row.precision,
        checkpointing=row.checkpointing,
        attention=row.attention,
        optimizer=optimizer,
        task=row.task,
        weights=row.weights,
        num_labels=row.num_labels if row.task == "classification" else None,
        target_length=row.target_length if row.task == "seq2seq" else None,
        peft=peft,
    )
    return config, [note] if note else []


@dataclass
class Outcome:
    row: Row
    predicted: int | None = None
    error: float | None = None  # (predicted - measured) / measured
    notes: list[str] = field(default_factory=list)
    failed: str = ""
    breakdown: dict = field(default_factory=dict)


def predict(row: Row) -> Outcome:
    """The estimator's figure of the row's kind for the row's configuration."""
    from autotune.estimate import EstimateError, estimate_memory

    outcome = Outcome(row)
    try:
        config, outcome.notes = probe_config(row)
        kwargs = {"stack": run_stack(row)} if _takes_stack() else {}
        estimate = estimate_memory(config, device_type="cuda", use_cache=False, timeout=600, **kwargs)
    except (EstimateError, SystemExit, Exception) as exc:  # a row the estimator cannot take is reported, not fatal
        outcome.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        return outcome
    outcome.notes += [note for note in estimate.notes if note.startswith("predicted for")]
    _, paged, _ = _optimizer(row)
    outside = estimate.optimizer if paged else 0  # state the caching allocator never held
    context = estimate.context_bytes
    if row.context and row.measures == "nvidia-smi":  # the source measured the context on its own stack
        context = parse_size(row.context, flag=f"{row.id}: context")
        outcome.notes.append(
            f"CUDA context {format_size(context)}, as the source measured it on its stack "
            f"(the estimator assumes {format_size(estimate.context_bytes)})"
        )
    figure = {
        "allocated": estimate.peak_bytes,
        "reserved": estimate.reserved_bytes,
        "nvidia-smi": estimate.reserved_bytes + context,
    }[row.measures] - outside
    outcome.predicted = figure
    outcome.error = (figure - row.figure_bytes) / row.figure_bytes
    outcome.breakdown = {
        "params": estimate.params,
        "grads": estimate.grads,
        "optimizer": estimate.optimizer,
        "activations": estimate.activations,
        "temporaries": estimate.temporaries,
        "peak_allocated": estimate.peak_bytes,
        "peak_reserved": estimate.reserved_bytes,
        "context": context,
        "peak_phase": estimate.peak_phase,
        "trace_seconds": round(estimate.trace_seconds, 1),
    }
    return outcome


def _takes_stack() -> bool:
    """Whether this estimator predicts for a given stack (an older one, run for the before column, does not)."""
    import inspect

    from autotune.estimate import estimate_memory

    return "stack" in inspect.signature(estimate_memory).parameters


def run_stack(row: Row):
    """The row's library versions, where they change what the run allocates (estimate/stack.py)."""
    from autotune.estimate.stack import Stack

    return Stack(torch=row.torch, bitsandbytes=row.bitsandbytes)


def summarize(outcomes: Iterable[Outcome], *, hf_only: bool = False) -> list[dict]:
    """Count, median and worst absolute error by kind and method (and each kind over all methods)."""
    done = [o for o in outcomes if o.error is not None and (o.row.hf_stack or not hf_only)]
    out = []
    for kind in KINDS:
        for method in (*METHODS, ALL):
            errors = [abs(o.error) for o in done if o.row.measures == kind and method in (ALL, o.row.method)]
            if errors:
                signed = [o.error for o in done if o.row.measures == kind and method in (ALL, o.row.method)]
                out.append(
                    {
                        "kind": kind,
                        "method": method,
                        "count": len(errors),
                        "median": round(statistics.median(errors), 4),
                        "worst": round(max(errors), 4),
                        "median_signed": round(statistics.median(signed), 4),
                    }
                )
    return out


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:+.1%}"


def markdown(outcomes: list[Outcome], before: dict[str, float | None], meta: dict) -> str:
    lines = [
        f"# The estimator against published GPU measurements ({meta['date']})",
        "",
        f"{meta['rows']} published figures ({meta['estimated']} estimated; skipped rows say why), each predicted by "
        f"`autotune estimate --device-type cuda` for its configuration: `python -m benchmarks.published` "
        f"({meta['seconds']:.0f} s on {meta['machine']}). Error = (predicted - published) / published. "
        f"Sources, configurations and what each figure includes: benchmarks/published/*.toml.",
        "",
    ]
    for title, hf_only in (("Hugging Face-stack rows (transformers' model code)", True), ("All rows", False)):
        lines += [
            f"## {title}",
            "",
            "| kind | method | rows | median abs error | worst | median signed | before: median / worst |",
            "|---|---|---|---|---|---|---|",
        ]
        before_summary = {
            (s["kind"], s["method"]): s for s in meta.get("before_summary_hf" if hf_only else "before_summary", [])
        }
        for s in summarize(outcomes, hf_only=hf_only):
            b = before_summary.get((s["kind"], s["method"]))
            was = "" if b is None else f"{b['median']:.1%} / {b['worst']:.1%}"
            lines.append(
                f"| {s['kind']} | {s['method']} | {s['count']} | {s['median']:.1%} | {s['worst']:.1%} | "
                f"{s['median_signed']:+.1%} | {was} |"
            )
        lines.append("")
    lines += [
        "## Every row",
        "",
        "Rows marked * ran their own model code (litgpt, torchtune), not transformers'. "
        "Before: the estimator of the commit before this table, on the same rows.",
        "",
        "| row | model | GPU | config | measures | published | predicted | error | before | predicted as | "
        "why, where beyond 10% |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        r = o.row
        why = (
            r.skip
            and f"skipped: {r.skip}"
            or o.failed
            or (r.explained if o.error is not None and abs(o.error) > GOAL_WORST else "")
        )
        cells = [
            r.id + ("" if r.hf_stack else " *"),
            r.model,
            r.gpu,
            r.config_text(),
            r.measures,
            format_size(r.figure_bytes),
            format_size(o.predicted) if o.predicted is not None else "",
            _pct(o.error),
            _pct(before.get(r.id)),
            "; ".join(o.notes),
            why,
        ]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="traces at once")
    parser.add_argument("--only", default=None, help="row ids (comma-separated) to estimate, for a look at a few")
    parser.add_argument("--label", default="after")
    parser.add_argument("--json", type=Path, default=RESULTS / "published-estimates.json")
    parser.add_argument("--md", type=Path, default=RESULTS / "published-estimates.md")
    parser.add_argument(
        "--before",
        type=Path,
        default=RESULTS / "published-estimates-before.json",
        help="an older estimator's figures (written with --label before) for the before column",
    )
    parser.add_argument("--stated-error", action="store_true", help="write autotune/estimate/stated_error.json")
    parser.add_argument("--machine", default="a 2-core AMD EPYC CPU machine (no GPU)")
    parser.add_argument(
        "--speed",
        action="store_true",
        help="the speed model against speed.toml instead (writes benchmarks/results/published-speed.*; "
        "with --stated-error also autotune/planner/speed_error.json)",
    )
    args = parser.parse_args(argv)
    if args.speed:
        from benchmarks.published.speed import main as speed_main

        return speed_main(stated_error=args.stated_error)

    rows = load_rows()
    if args.only:
        wanted = set(args.only.split(","))
        rows = [r for r in rows if r.id in wanted]
    started = time.perf_counter()
    todo = [r for r in rows if not r.skip]
    pool = ThreadPoolExecutor(max(1, args.workers))
    try:
        done = {o.row.id: o for o in pool.map(predict, todo)}
    except KeyboardInterrupt:
        # Nothing is written before every row is in; the traces in flight die with this process
        # (their parent-death signal), without waiting for them.
        print("interrupted: nothing written", file=sys.stderr)
        os._exit(130)
    pool.shutdown()
    outcomes = [done.get(r.id) or Outcome(r) for r in rows]
    for o in outcomes:
        state = "skipped" if o.row.skip else o.failed or f"{_pct(o.error)}"
        print(
            f"{o.row.id:48} {o.row.measures:10} {format_size(o.row.figure_bytes):>11} -> "
            f"{format_size(o.predicted) if o.predicted else '':>11}  {state}",
            file=sys.stderr,
        )
    seconds = time.perf_counter() - started
    before_data = json.loads(args.before.read_text()) if args.before.exists() and args.label != "before" else {}
    before = {r["id"]: r.get("error") for r in before_data.get("rows", [])}
    meta = {
        "date": date.today().isoformat(),
        "rows": len(rows),
        "estimated": sum(o.error is not None for o in outcomes),
        "seconds": seconds,
        "machine": args.machine,
        "label": args.label,
        "before_summary": before_data.get("summary", []),
        "before_summary_hf": before_data.get("summary_hf", []),
    }
    data = {
        **meta,
        "summary": summarize(outcomes),
        "summary_hf": summarize(outcomes, hf_only=True),
        "rows": [
            {
                "id": o.row.id,
                "file": o.row.file,
                "model": o.row.model,
                "method": o.row.method,
                "measures": o.row.measures,
                "gpu": o.row.gpu,
                "hf_stack": o.row.hf_stack,
                "config": o.row.config_text(),
                "published_bytes": o.row.figure_bytes,
                "predicted_bytes": o.predicted,
                "error": None if o.error is None else round(o.error, 4),
                "notes": o.notes,
                "failed": o.failed,
                "skip": o.row.skip,
                "breakdown": o.breakdown,
            }
            for o in outcomes
        ],
    }
    if not args.only:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        if args.label != "before":
            args.md.write_text(markdown(outcomes, before, meta))
        if args.stated_error:
            write_stated_error(data)
    for s in data["summary"]:
        print(
            f"{s['kind']:10} {s['method']:5} n={s['count']:2} median {s['median']:.1%} worst {s['worst']:.1%} "
            f"(signed median {s['median_signed']:+.1%})"
        )
    return 0


def write_stated_error(data: dict) -> None:
    """The summary the estimator states beside its CUDA predictions (autotune/estimate/stated_error.py)."""
    from autotune.estimate import stated_error

    # The Hugging Face-stack rows only: autotune's probes and hand-off run transformers' model code.
    summary = {
        "source": f"python -m benchmarks.published, {data['date']}: the Hugging Face-stack rows of "
        f"{data['estimated']} estimated published GPU measurements "
        f"(benchmarks/results/published-estimates.md)",
        "errors": [{k: s[k] for k in ("kind", "method", "count", "median", "worst")} for s in data["summary_hf"]],
    }
    stated_error.FILE.write_text(json.dumps(summary, indent=1) + "\n")


def config_parts(row) -> list[str]:
    """A published row's configuration in words (a memory row's, or a speed row's, which adds to it)."""
    parts = [f"mb{row.micro_batch}x{row.grad_accum}", f"blk{row.block_size}", row.precision]
    if row.weights != "fp32":
        parts.append(f"{row.weights} weights")
    parts.append("ckpt" if row.checkpointing else "no-ckpt")
    if row.method != "full":
        parts.append(f"{row.method} r{row.lora_rank} {row.lora_targets}")
    parts.append(row.optimizer)
    return parts

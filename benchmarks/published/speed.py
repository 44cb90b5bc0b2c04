"""The speed model held to published GPU throughput measurements.

Each row of speed.toml (beside this module; benchmarks/published/README.md, "The speed table") is one
training throughput someone measured on a real card and published, with the configuration it was
measured with. This prices every row exactly as `autotune plan` prices a candidate, with
`autotune.planner.card_speed.predict_speed(config, dims, card)` (dims from the model's config.json under
models/, the card from autotune.specs.cards), and compares:

- per row, predicted / measured tokens/s;
- per lever group (rows of one source that differ in one lever), whether the model ranks the rows
  as the measurements do, and each row's predicted speed-up over the group's first row beside the
  measured one;
- a summary: median |ln(predicted / measured)| (and the same as |ratio - 1|), the worst ratio as
  max(r, 1/r), overall and by group.

    python -m benchmarks.published --speed

writes benchmarks/results/published-speed.{json,md}. CPU only and torch-free: no trace (plan passes
its memory estimate to predict_speed only to count the traced parameters; here the count comes from
config.json, as plan does for a model it has no estimate of).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import statistics
import sys
import tomllib
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
TABLE = HERE / "speed.toml"
RESULTS = HERE.parent / "results"
REQUIRED = (
    "id",
    "source",
    "quote",
    "figure",
    "conversion",
    "tokens_per_s",
    "gpu",
    "gpus",
    "strategy",
    "stack",
    "measured",
    "model",
    "task",
    "method",
    "micro_batch",
    "grad_accum",
    "block_size",
    "sequences",
    "precision",
    "weights",
    "checkpointing",
    "optimizer",
    "attention",
    "compile",
    "notes",
)

# Optimizers a published run used that autotune has no name for, priced as the nearest it has.
SPEED_STAND_INS = {
    "adamw_hf": "adamw_torch",  # transformers' own AdamW, an unfused loop over the parameters
}


@dataclass(frozen=True)
class SpeedRow:
    """One published throughput and the configuration it was measured with (the README's fields)."""

    id: str
    source: str
    quote: str
    figure: str
    conversion: str  # arithmetic from the printed figure to tokens_per_s
    tokens_per_s: float  # the whole run's, every GPU's tokens together
    gpu: str  # a name or alias of autotune.specs.cards
    gpus: int
    strategy: str  # none | ddp | fsdp | ... (autotune.levers.sharding)
    stack: str
    measured: str
    model: str  # a folder under models/
    task: str
    method: str  # full | lora | qlora
    micro_batch: int
    grad_accum: int
    block_size: int
    sequences: str  # fixed | packed | padded, and how
    precision: str
    weights: str
    checkpointing: bool
    optimizer: str
    attention: str
    compile: bool
    notes: str
    liger: bool = False
    num_labels: int | None = None
    target_length: int | None = None
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    lora_targets: str = "all-linear"
    hf_stack: bool = True
    group: tuple[str, ...] = ()
    missing: str = ""  # what the run did that plan cannot express (priced without it)
    transformers: str | None = None  # the run's versions where they change its speed (estimate/stack.py)
    peft: str | None = None
    lora: str | None = None  # LoRA code other than peft's
    skip: str = ""  # why the row is kept but not priced
    file: str = ""

    def config_text(self) -> str:
        from benchmarks.published import config_parts

        parts = [*config_parts(self), self.attention]
        if self.compile:
            parts.append("compile")
        if self.gpus > 1:
            parts.append(f"{self.gpus} GPUs {self.strategy}")
        return " ".join(parts)


def conversion_value(text: str) -> float:
    """The value of a row's `conversion`: numbers, + - * / and parentheses only."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"conversion {text!r}: only numbers, + - * / and parentheses")

    return value(ast.parse(text, mode="eval"))


def source_key(source: str) -> str:
    """Which publisher a row's source is: a GitHub repository (owner/name), else the site and page."""
    url = urlparse(source.split()[0])
    parts = [p for p in url.path.split("/") if p]
    if url.netloc == "github.com" and len(parts) >= 2:
        return f"github.com/{parts[0]}/{parts[1]}"
    return url.netloc + "/" + "/".join(parts[-1:])


def load_speed_rows(path: Path = TABLE) -> tuple[list[SpeedRow], dict[str, str]]:
    """Every row of speed.toml, checked, and the groups' levers; SystemExit with the row and the problem."""
    from autotune.specs.cards import find_card
    from autotune.vocabulary.errors import BadInput

    data = tomllib.loads(path.read_text())
    groups: dict[str, str] = data.get("group", {})
    known = set(SpeedRow.__dataclass_fields__)
    rows: list[SpeedRow] = []
    for raw in data.get("row", []):
        where = f"{path.name}: row {raw.get('id', '?')!r}"
        missing = [k for k in REQUIRED if k not in raw]
        unknown = sorted(set(raw) - known)
        if missing or unknown:
            raise SystemExit(f"{where}: missing {missing}, unknown fields {unknown}")
        raw = {
            **raw,
            "group": tuple([raw["group"]] if isinstance(raw.get("group"), str) else raw.get("group", ())),
            "tokens_per_s": float(raw["tokens_per_s"]),
        }
        row = SpeedRow(**raw, file=path.name)
        problems = [f"group {g!r} is not in the [group] table" for g in row.group if g not in groups]
        problems += [
            f"{name} {version!r} is not a version (e.g. 4.48.1)"
            for name, version in (("transformers", row.transformers), ("peft", row.peft))
            if version is not None and not _is_version(version)
        ]
        if not (HERE / "models" / row.model / "config.json").exists():
            problems.append(f"no models/{row.model}/config.json")
        try:
            find_card(row.gpu)
        except BadInput as exc:
            problems.append(str(exc))
        if problems:
            raise SystemExit(f"{where}: " + "; ".join(problems))
        rows.append(row)
    ids = [r.id for r in rows]
    if len(ids) != len(set(ids)):
        raise SystemExit(f"duplicate row ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    return rows, groups


def _is_version(text: str) -> bool:
    """Whether `text` reads as a version (estimate/stack.py would take anything else as the installed one's)."""
    from packaging.version import InvalidVersion, Version

    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def speed_config(row: SpeedRow):
    """The ProbeConfig `plan` would price for the row's run, and notes on what stands in for what."""
    from autotune.levers.config import ProbeConfig
    from autotune.levers.recipes import peft_text

    notes = []
    optimizer = SPEED_STAND_INS.get(row.optimizer, row.optimizer)
    if optimizer != row.optimizer:
        notes.append(f"{row.optimizer} priced as {optimizer}")
    peft = (
        None
        if row.method == "full"
        else peft_text(row.method, row.lora_rank, row.lora_alpha, row.lora_dropout, row.lora_targets)
    )
    several = row.gpus > 1
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
        compile=row.compile,
        liger=row.liger,
        gpus=row.gpus,
        strategy=row.strategy if several else None,
    )
    return config, notes


def run_stack(row: SpeedRow):
    """The row's software where it prices differently from autotune's own (estimate/stack.py)."""
    from autotune.estimate.stack import Stack

    return Stack(transformers=row.transformers, peft=row.peft, lora=row.lora)


def model_dims(row: SpeedRow):
    """The model's sizes as plan reads them (autotune.specs.shapes.dims_from_config of its config.json)."""
    from autotune.specs.shapes import dims_from_config

    return dims_from_config(json.loads((HERE / "models" / row.model / "config.json").read_text()))


@dataclass
class Priced:
    row: SpeedRow
    predicted: float | None = None
    ratio: float | None = None  # predicted / measured
    notes: list[str] = field(default_factory=list)
    not_priced: str = ""
    parts: dict = field(default_factory=dict)


def price(row: SpeedRow) -> Priced:
    """The row priced as `autotune plan` prices a candidate (planner/speed.py's predict_speed)."""
    from autotune.specs.cards import find_card
    from autotune.planner.card_speed import predict_speed, why_unsupported

    out = Priced(row)
    if row.skip:
        return out
    try:
        config, out.notes = speed_config(row)
        card = find_card(row.gpu)
        dims = model_dims(row)
        if dims is None:
            out.not_priced = f"not priced: config.json of {row.model} lacks the sizes plan reads"
            return out
        stack = run_stack(row)
        out.notes += [f"priced for {difference}" for difference in stack.differences()]
        speed = predict_speed(config, dims, card, stack=stack)
    except Exception as exc:  # a lever the model cannot price is a result for the table, not a crash
        out.not_priced = f"not priced: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        return out
    if speed is None:
        out.not_priced = f"not priced: {why_unsupported(config, card)}"
        return out
    out.predicted = speed.tokens_per_s
    out.ratio = speed.tokens_per_s / row.tokens_per_s
    # The matmuls' share of the card's peak the measured speed implies, for the run as the row
    # states it: above IMPLAUSIBLE_SHARE the run must have done less work than stated.
    implied = speed.flops_per_step * row.tokens_per_s / (config.tokens_per_step * speed.peak_flops * config.ranks)
    if implied > IMPLAUSIBLE_SHARE:
        out.notes.append(
            f"as stated, the measured speed puts its matmuls at {implied:.0%} of the card's dense "
            f"peak: the run likely did less work than the row says"
        )
    out.parts = {
        "step_seconds": speed.step_seconds,
        "compute": speed.compute_seconds,
        "memory": speed.memory_seconds,
        "launches": speed.overhead_seconds,
        "optimizer": speed.optimizer_seconds,
        "communication": speed.comm_seconds,
        "utilisation": round(speed.utilisation, 4),
        "predicted_mfu": round(speed.mfu, 4),
    }
    return out


# cuBLAS's best large GEMMs reach 80-90% of the dense peak; a whole step's matmuls above 90% are not credible.
IMPLAUSIBLE_SHARE = 0.9


def own_gpu_probes(path: Path = RESULTS / "nvidia-h100-80gb-hbm3-gpu-evidence-2026-11-26.json") -> list[dict]:
    """autotune's own probes on an H100 (the GPU evidence run of 2026-11-26: gpt2, block 512),
    priced as plan prices them: a held-out check, not part of the fit (a small model whose steps
    the host's launches bound)."""
    from autotune.specs.cards import find_card
    from autotune.levers.config import ProbeConfig
    from autotune.specs.models import resolve_model
    from autotune.planner.card_speed import model_dims_of, predict_step_seconds

    evidence = json.loads(path.read_text())
    card = find_card("h100")
    out = []
    for probe in evidence["sections"]["readme_command"]["probes_stored"]:
        if not probe.get("tokens_per_s"):
            continue
        config = ProbeConfig.from_dict(probe["config"])
        dims = model_dims_of(resolve_model(config.model))
        predicted = predict_step_seconds(config, dims, card)
        out.append(
            {
                "config": probe["label"],
                "measured_tokens_per_s": round(probe["tokens_per_s"]),
                "predicted_tokens_per_s": round(predicted.tokens_per_s),
                "ratio": round(predicted.tokens_per_s / probe["tokens_per_s"], 2),
                "predicted": predicted.describe(),
            }
        )
    return out


def _spread(ratios: list[float]) -> dict:
    """Median |ln r|, median |r - 1| and the worst max(r, 1/r) of some ratios."""
    if not ratios:
        return {"count": 0, "median_abs_log": None, "median_abs_error": None, "worst": None, "median_ratio": None}
    return {
        "count": len(ratios),
        "median_abs_log": round(statistics.median(abs(math.log(r)) for r in ratios), 4),
        "median_abs_error": round(statistics.median(abs(r - 1) for r in ratios), 4),
        "worst": round(max(max(r, 1 / r) for r in ratios), 3),
        "median_ratio": round(statistics.median(ratios), 3),
    }


# Speeds within this share of each other rank as a tie (a lever the model does not see prices two
# rows the same; measurements that close are within a run's noise).
TIE = 0.005


def _ranks(values: list[float]) -> list[int]:
    """1 for the fastest; values within TIE of each other share a rank."""
    return [1 + sum(other > value * (1 + TIE) for other in values) for value in values]


def _known(priced: list[Priced]) -> list[tuple[SpeedRow, float, float]]:
    """The priced rows as (row, predicted tokens/s, ratio)."""
    return [(p.row, p.predicted, p.ratio) for p in priced if p.predicted is not None and p.ratio is not None]


def group_report(group: str, lever: str, members: list[Priced]) -> dict:
    """A lever group: its rows in file order (the first is the baseline), measured and predicted
    speed-ups over the baseline, and whether the model orders the rows as the measurements do."""
    known = _known(members)
    report: dict = {
        "group": group,
        "lever": lever,
        "rows": [p.row.id for p in members],
        "priced": len(known),
        "same_order": None,
        "speedups": [],
        **{k: v for k, v in _spread([ratio for _, _, ratio in known]).items() if k != "count"},
    }
    if len(known) < 2 or known[0][0].id != members[0].row.id:
        report["why_not_compared"] = "fewer than two priced rows, or the baseline is not priced"
        return report
    base, base_predicted, _ = known[0]
    for row, predicted_tps, _ in known[1:]:
        measured = row.tokens_per_s / base.tokens_per_s
        predicted = predicted_tps / base_predicted
        report["speedups"].append(
            {
                "row": row.id,
                "measured": round(measured, 3),
                "predicted": round(predicted, 3),
                "predicted_over_measured": round(predicted / measured, 3),
            }
        )
    report["measured_ranks"] = _ranks([row.tokens_per_s for row, _, _ in known])
    report["predicted_ranks"] = _ranks([predicted for _, predicted, _ in known])
    report["same_order"] = report["measured_ranks"] == report["predicted_ranks"]
    # the model prices rows the same that the measurements tell apart: it does not see the lever
    report["predicted_tie"] = len(set(report["predicted_ranks"])) < len(set(report["measured_ranks"]))
    return report


def summarize(priced: list[Priced], groups: dict[str, str]) -> dict:
    """The spread of the ratios overall, over the rows with nothing missing, by source; each group's report."""
    done = _known(priced)
    by_group = [group_report(g, lever, [p for p in priced if g in p.row.group]) for g, lever in groups.items()]
    by_source: dict[str, list[float]] = {}
    for row, _, ratio in done:
        by_source.setdefault(source_key(row.source), []).append(ratio)
    compared = [g for g in by_group if g["same_order"] is not None]
    return {
        "all": _spread([ratio for _, _, ratio in done]),
        "nothing_missing": _spread([ratio for row, _, ratio in done if not row.missing]),
        "by_source": {k: _spread(v) for k, v in by_source.items()},
        "groups_ranked_as_measured": f"{sum(g['same_order'] for g in compared)} of {len(compared)}",
        "by_group": by_group,
    }


def _fmt(value: float | None, spec: str = ",.0f") -> str:
    return "" if value is None else format(value, spec)


def markdown(priced: list[Priced], summary: dict, meta: dict) -> str:
    s, e = summary["all"], summary["nothing_missing"]
    lines = [
        f"# The speed model against published GPU throughput ({meta['date']})",
        "",
        f"{meta['rows']} published training throughputs ({meta['priced']} priced; skipped and unpriced rows say why), "
        "each priced by `autotune.planner.card_speed.predict_speed` (what `autotune plan` shows) for its configuration: "
        "`python -m benchmarks.published --speed`. Ratio = predicted / measured tokens/s (whole run, every GPU). "
        "Sources, configurations and conversions: benchmarks/published/speed.toml.",
        "",
        "## Summary",
        "",
        "| rows | count | median abs(ln ratio) | median abs(ratio - 1) | median ratio | worst max(r, 1/r) |",
        "|---|---|---|---|---|---|",
    ]
    for name, spread in (
        ("all priced", s),
        ("nothing missing", e),
        *((f"source {k}", v) for k, v in summary["by_source"].items()),
    ):
        lines.append(
            f"| {name} | {spread['count']} | {_fmt(spread['median_abs_log'], '.3f')} | "
            f"{_fmt(spread['median_abs_error'], '.1%')} | {_fmt(spread['median_ratio'], '.2f')} | "
            f"{_fmt(spread['worst'], '.2f')}x |"
        )
    lines += [
        "",
        "'nothing missing': rows whose run used nothing plan cannot express (no stand-in optimizer, no "
        "chunked cross-entropy, ...).",
        "",
        f"## Lever groups ({summary['groups_ranked_as_measured']} ranked as measured)",
        "",
        "Rows of one source that differ in one lever; speed-ups are over the group's first row.",
        "",
        "| group | lever | rows | same order | speed-up measured -> predicted | median ratio | worst |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in summary["by_group"]:
        ups = "; ".join(f"{u['measured']:.2f}x -> {u['predicted']:.2f}x" for u in g["speedups"]) or g.get(
            "why_not_compared", ""
        )
        order = (
            ""
            if g["same_order"] is None
            else "yes"
            if g["same_order"]
            else "**no** (predicted a tie)"
            if g["predicted_tie"]
            else "**no**"
        )
        held = " (held out of the fit)" if g["group"] in HELD_OUT_GROUPS else ""
        lines.append(
            f"| {g['group']}{held} | {g['lever']} | {len(g['rows'])} | {order} | {ups} | "
            f"{_fmt(g['median_ratio'], '.2f')} | {_fmt(g['worst'], '.2f')}x |"
        )
    missed = goals_missed(summary)
    lines += [
        "",
        f"Goals missed (#47: every group ranked as measured, every speed-up within {GOAL_SPEEDUP:.0%}): {len(missed)}",
        "",
        *(f"- {line}" for line in missed),
    ]
    lines += [
        "",
        "## Every row",
        "",
        "| row | model | GPU | config | measured tok/s | predicted tok/s | ratio | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in priced:
        r = p.row
        why = (f"skipped: {r.skip}" if r.skip else p.not_priced) or "; ".join(
            [*p.notes, *([f"missing: {r.missing}"] if r.missing else [])]
        )
        cells = [
            r.id + ("" if r.hf_stack else " *"),
            r.model,
            f"{r.gpus}x {r.gpu}",
            r.config_text(),
            _fmt(r.tokens_per_s),
            _fmt(p.predicted),
            _fmt(p.ratio, ".2f"),
            why,
        ]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    lines += ["", "Rows marked * ran their own model code (torchtune), not transformers'."]
    if meta.get("own_probes"):
        lines += [
            "",
            "## Held out: autotune's own probes on an H100 (2026-11-26)",
            "",
            "gpt2 (124M), block 512, measured by `autotune search` in the GPU evidence run "
            "(benchmarks/results/nvidia-h100-80gb-hbm3-gpu-evidence-2026-11-26.json; the same config measured "
            "63,373-82,507 tokens/s in runs minutes apart). Not in the summary or the fit.",
            "",
            "| config | measured tok/s | predicted tok/s | ratio | predicted parts |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {p['config']} | {p['measured_tokens_per_s']:,} | {p['predicted_tokens_per_s']:,} | {p['ratio']:.2f} | "
            f"{p['predicted']} |"
            for p in meta["own_probes"]
        ]
    return "\n".join(lines) + "\n"


def run(
    json_path: Path = RESULTS / "published-speed.json",
    md_path: Path = RESULTS / "published-speed.md",
    *,
    write: bool = True,
) -> dict:
    """Price every row, summarize, write the table; returns what was written to the JSON."""
    rows, groups = load_speed_rows()
    priced = [price(r) for r in rows]
    summary = summarize(priced, groups)
    meta = {
        "date": date.today().isoformat(),
        "rows": len(rows),
        "priced": sum(p.ratio is not None for p in priced),
        "own_probes": own_gpu_probes(),
    }
    data = {
        **meta,
        "summary": summary,
        "rows": [
            {
                "id": p.row.id,
                "source": source_key(p.row.source),
                "model": p.row.model,
                "gpu": p.row.gpu,
                "gpus": p.row.gpus,
                "config": p.row.config_text(),
                "group": list(p.row.group),
                "measured_tokens_per_s": p.row.tokens_per_s,
                "predicted_tokens_per_s": None if p.predicted is None else round(p.predicted, 1),
                "ratio": None if p.ratio is None else round(p.ratio, 4),
                "notes": p.notes,
                "missing": p.row.missing,
                "not_priced": p.not_priced,
                "skip": p.row.skip,
                "parts": p.parts,
            }
            for p in priced
        ],
    }
    if write:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=1) + "\n")
        md_path.write_text(markdown(priced, summary, meta))
    return data


def write_stated_error(data: dict) -> None:
    """The error `plan` states beside its speeds (autotune/planner/speed_error.py)."""
    from autotune.planner import speed_error

    spread = data["summary"]["all"]
    speed_error.write(
        speed_error.SpeedError(
            spread["count"],
            spread["median_abs_error"],
            spread["worst"],
            f"python -m benchmarks.published --speed, {data['date']}: {spread['count']} published GPU training "
            f"throughputs (benchmarks/results/published-speed.md)",
        )
    )


def main(*, stated_error: bool = False) -> int:
    data = run()
    if stated_error:
        write_stated_error(data)
    for row in data["rows"]:
        state = (f"skipped: {row['skip']}" if row["skip"] else row["not_priced"]) or f"ratio {row['ratio']:.2f}"
        print(
            f"{row['id']:62} {row['measured_tokens_per_s']:>9,.0f} -> "
            f"{_fmt(row['predicted_tokens_per_s']):>9}  {state}",
            file=sys.stderr,
        )
    s = data["summary"]
    for name, spread in (("all priced", s["all"]), ("nothing missing", s["nothing_missing"])):
        print(
            f"{name:16} n={spread['count']:2} median |ln r| {spread['median_abs_log']:.3f} "
            f"(median |r-1| {spread['median_abs_error']:.1%}, median r {spread['median_ratio']:.2f}), "
            f"worst {spread['worst']:.2f}x"
        )
    print(f"lever groups ranked as measured: {s['groups_ranked_as_measured']}")
    missed = goals_missed(s)
    print(f"goals missed: {len(missed)}" + "".join(f"\n  {line}" for line in missed))
    for g in s["by_group"]:
        ups = ", ".join(f"{u['measured']:.2f}x->{u['predicted']:.2f}x" for u in g["speedups"])
        order = {None: "-", True: "same order", False: "ORDER DIFFERS"}[g["same_order"]]
        order += " (tie)" if g.get("predicted_tie") and not g["same_order"] else ""
        print(f"  {g['group']:32} {order:13} median r {_fmt(g['median_ratio'], '.2f'):>5}  speed-ups {ups}")
    return 0


# The two constants of autotune/planner/card_speed.py fitted to this table (its docstring: FITTED), and
# the grid searched; every other constant there is a count, a published figure or a measurement
# (the host's launch times: benchmarks/dispatch.py).
FITTED = {
    "GEMM_EFFICIENCY": (0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 1.00),
    "MEMORY_EFFICIENCY": (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
}


# The issue's goals for the table (#47): no row off by more than GOAL_WORST, every group ranked as
# measured, every speed-up within GOAL_SPEEDUP of the measured one.
GOAL_WORST, GOAL_SPEEDUP = 1.5, 0.15


def goals_missed(summary: dict) -> list[str]:
    """What of the goals a summary misses, one line each: rows beyond GOAL_WORST, groups out of
    order, speed-ups beyond GOAL_SPEEDUP."""
    missed = [f"{g['group']}: ranked otherwise" for g in summary["by_group"] if g["same_order"] is False]
    missed += [
        f"{g['group']}: {u['row']} {u['measured']:.2f}x measured, {u['predicted']:.2f}x predicted"
        for g in summary["by_group"]
        for u in g["speedups"]
        if abs(u["predicted_over_measured"] - 1) > GOAL_SPEEDUP
    ]
    return missed


# Groups kept out of the fit: the same job on several cards (issue 60: is the predicted order of cards
# and each ratio between them as measured?), a check of the model on what it was not fitted to. Fitted
# to them too, the grid's choice swung to its edge and beyond (GEMM 0.80, then 0.90 with a wider grid,
# the median error worse) without ranking one more group right: a sign of what the model lacks (one
# GEMM efficiency for every card), not of better constants. The stated error counts their rows.
HELD_OUT_GROUPS = frozenset(
    {
        "lambda-cards-bs112",
        "lambda-cards-bs28",
        "answerai-cards-fsdp",
        "answerai-cards-ddp",
        "llmfoundry-cards-mpt7b-4096",
        "llmfoundry-cards-mpt7b-8192",
        "llmfoundry-cards-mpt30b-4096",
        "llmfoundry-cards-mpt30b-8192",
    }
)


def fitted_rows() -> tuple[list[SpeedRow], dict[str, str]]:
    """The rows and groups the constants are fitted to: all but the held-out groups' rows."""
    rows, groups = load_speed_rows()
    kept = [row for row in rows if not (row.group and set(row.group) <= HELD_OUT_GROUPS)]
    return kept, {name: lever for name, lever in groups.items() if name not in HELD_OUT_GROUPS}


def fit() -> dict:
    """The grid point of FITTED that misses the fewest of the goals (rows beyond GOAL_WORST, groups
    out of order, speed-ups beyond GOAL_SPEEDUP), then gives the smallest median |ln r| over every
    priced row (the held-out groups' aside), with the summary there; the module's constants are put
    back after. (The median alone would trade the groups' order for a row's hundredth: 18 of 24
    groups at its best.)"""
    import itertools

    from autotune.planner import card_speed as speed

    rows, groups = fitted_rows()
    saved = {name: getattr(speed, name) for name in FITTED}
    best: tuple | None = None
    try:
        for values in itertools.product(*FITTED.values()):
            for name, value in zip(FITTED, values):
                setattr(speed, name, value)
            priced = [price(row) for row in rows]
            summary = summarize(priced, groups)
            spread = summary["all"]
            beyond = sum(max(r, 1 / r) > GOAL_WORST for _, _, r in _known(priced))
            score = (beyond + len(goals_missed(summary)), spread["median_abs_log"], spread["worst"])
            if best is None or score < best[0]:
                best = (score, dict(zip(FITTED, values)), spread)
    finally:
        for name, value in saved.items():
            setattr(speed, name, value)
    assert best is not None
    return {"constants": best[1], "summary": best[2], "goals_missed": best[0][0], "current": saved}

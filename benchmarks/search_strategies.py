"""Which search strategy decides a space in the fewest probes, and picks as well as probing it all?

Every strategy runs, from nothing known, against problems whose every candidate is known in
advance (benchmarks/problems.py): modelled fine-tunes of three sizes on a CUDA card, over eight
budgets each, and replays of real studies measured on this project's CPUs (every configuration
probed once), over five budgets each. For each run: the probes it ran (before the confirmation
round, which measures the contenders again whichever strategy found them), their probe-seconds
(each probe's wall time, as modelled or as measured), and its pick's quality: the pick's tokens/s
over the best of every config that fits (1.0: it found the best).

Memory predictions are the estimator's part of a search: exact (on a CPU the estimator equals the
probe to the byte), off by up to 5% either way per config (about what published CUDA figures
show), 20% low (a bad day), or none (`--no-predict`), with the prediction margin a search uses
(on CUDA the estimator's stated error against published GPU measurements, on a CPU none).
A lever the estimator does not trace (compile, the allocator) is predicted as its plain twin, as
the estimator does: an upper bound.

Then what the speed levers cost: the modelled problems' default space against the same with
`--compile off,on`, `--allocators default,expandable` and both.

Each search is driven through the same objects the search loop uses (`Knowledge`, the
strategies), without the database and Optuna's record, so that the ~700 searches take a minute or
two; tests/search/test_predictive.py checks that a search through the store probes the same
configs in the same order.

    python -m benchmarks.search_strategies [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path

from autotune.vocabulary import defaults
from autotune.levers.config import ProbeConfig
from autotune.specs.models import resolve_model
from autotune.results.probe_result import ProbeResult
from autotune.search import Knowledge, Prediction, SearchOptions, TpeStrategy, make_strategy
from autotune.search.strategies import plain_twin
from autotune.search.trials import distributions_of, tell
from autotune.search.space import SearchSpace
from autotune.vocabulary.status import ProbeStatus
from benchmarks.problems import Problem, budget_of, modelled, replays


def scattered(share: float) -> Callable[[ProbeConfig], float]:
    """Each config's prediction off by up to `share` either way (fixed per config)."""

    def error(config: ProbeConfig) -> float:
        digest = int(hashlib.sha256(("prediction" + config.key()).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return share * (2 * digest - 1)

    return error


PREDICTIONS: dict[str, float | Callable | None] = {"exact": 0.0, "+-5%": scattered(0.05), "20% low": -0.2, "none": None}
# (strategy, predictions): the rows of the table.
RUNS = [
    ("predictive", "exact"),
    ("predictive", "+-5%"),
    ("predictive", "20% low"),
    ("predictive", "none"),
    ("frontier", "exact"),
    ("frontier", "+-5%"),
    ("frontier", "none"),
    ("tpe", "exact"),
    ("grid", "exact"),
]
QUICK_RUNS = [("predictive", "exact"), ("frontier", "exact")]
LEVER_SPACES = {
    "default space": {},
    "+ --compile off,on": {"compiles": (False, True)},
    "+ --allocators default,expandable": {"allocators": ("default", "expandable")},
    "+ both": {"compiles": (False, True), "allocators": ("default", "expandable")},
}


@dataclass
class Run:
    problem: str
    kind: str
    budget: int
    strategy: str
    predictions: str
    probes: int
    probe_seconds: float
    quality: float | None  # pick's tokens/s over the best's; None when nothing fits (and nothing was picked)
    grid_probes: int
    grid_seconds: float
    space: str = "default space"
    order: list[str] | None = None  # the configs probed, in order (labels)


def predictions_of(problem: Problem, space: SearchSpace, name: str) -> dict[str, Prediction]:
    """The estimator's predictions of `space` as `name` says (a speed lever traced as its plain twin)."""
    error = PREDICTIONS[name]
    if error is None:
        return {}
    table = problem.predictions(error, space)
    return {c.key(): table[plain_twin(c).key()] for c in space.candidates()}


def decide(problem: Problem, space: SearchSpace, budget_bytes: int, strategy: str, predictions: str) -> Run:
    """One search of `space` from nothing known, as the search loop runs it for a lone worker:
    the strategy's next choice skipped or probed (the problem answers), learnt, until it has none."""
    budget = budget_of(budget_bytes)
    knowledge = Knowledge.of(
        space.candidates(),
        budget,
        SearchOptions().margin_for(problem.device_type, space.peft),
        predictions_of(problem, space, predictions),
    )
    study = None
    if strategy == "tpe":
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            direction="maximize", sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=5)
        )
        chooser = TpeStrategy(knowledge, study, distributions_of(space))
    else:
        chooser = make_strategy(SearchOptions(strategy=strategy), knowledge, problem.device_type, None)  # type: ignore[arg-type]
    order: list[str] = []
    seconds, since_better = 0.0, 0
    while (choice := chooser.next()) is not None:
        config, reason = choice
        trial = getattr(chooser, "pending_trial", None)
        if trial is not None:
            chooser.pending_trial = None  # type: ignore[union-attr]
        before = knowledge.best()
        if reason is not None:
            result = ProbeResult(status=ProbeStatus.SKIPPED, error=reason)
        else:
            result = problem.answer(config, budget)
            order.append(config.label())
            seconds += result.wall_seconds or 0.0
        knowledge.learn(config, result)
        if trial is not None:
            tell(study, trial, result, config, repeat=False)
        if reason is None:
            after = knowledge.best()
            since_better = 0 if after is not None and (before is None or after[0] != before[0]) else since_better + 1
            if strategy == "tpe" and since_better >= defaults.TPE_PATIENCE:
                break
    best, picked = problem.best(budget, space), knowledge.best()
    quality = (
        None
        if best is None and picked is None
        else (picked[1].tokens_per_s or 0.0) / best[1]
        if best and picked
        else 0.0
    )
    grid = [problem.answer(c, budget) for c in space.candidates()]
    return Run(
        problem.name,
        problem.kind,
        budget_bytes,
        strategy,
        predictions,
        len(order),
        seconds,
        quality,
        len(grid),
        sum(r.wall_seconds or 0.0 for r in grid),
        order=order,
    )


def summary(runs: list[Run], keys: tuple[str, ...]) -> list[dict]:
    """Mean probes and probe-seconds (and their share of the exhaustive grid's), worst and mean quality, by `keys`."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(tuple(getattr(run, k) for k in keys), []).append(run)
    rows = []
    for key, members in groups.items():
        qualities = [r.quality for r in members if r.quality is not None]
        rows.append(
            {
                **dict(zip(keys, key)),
                "runs": len(members),
                "probes": statistics.mean(r.probes for r in members),
                "probe_seconds": statistics.mean(r.probe_seconds for r in members),
                "grid_probes": statistics.mean(r.grid_probes for r in members),
                "probe_share": statistics.mean(r.probes / r.grid_probes for r in members),
                "seconds_share": statistics.mean(r.probe_seconds / r.grid_seconds for r in members if r.grid_seconds),
                "worst_quality": min(qualities) if qualities else None,
                "mean_quality": statistics.mean(qualities) if qualities else None,
                "best_found": sum(q >= 0.999 for q in qualities),
                "with_answer": len(qualities),
            }
        )
    return rows


def markdown(rows: list[dict], first: tuple[str, ...]) -> str:
    head = [
        *first,
        "probes (mean)",
        "of the grid's",
        "probe-s (mean)",
        "of the grid's",
        "quality (worst)",
        "quality (mean)",
        "found the best",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r[k]) for k in first] + [
            f"{r['probes']:.1f}",
            f"{r['probe_share']:.0%}",
            f"{r['probe_seconds']:,.0f}",
            f"{r['seconds_share']:.0%}",
            f"{r['worst_quality']:.3f}" if r["worst_quality"] is not None else "-",
            f"{r['mean_quality']:.3f}" if r["mean_quality"] is not None else "-",
            f"{r['best_found']}/{r['with_answer']}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results", help="directory for search-strategies.json and .md")
    parser.add_argument("--quick", action="store_true", help="predictive and frontier with exact predictions only")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    default_space = lambda **levers: SearchSpace.build(resolve_model("gpt2"), **levers)
    problems = modelled(default_space) + replays()
    runs: list[Run] = []
    lever_runs: list[Run] = []
    for problem in problems:
        for budget in problem.budgets:
            for strategy, predictions in QUICK_RUNS if args.quick else RUNS:
                runs.append(decide(problem, problem.space, budget, strategy, predictions))
        print(f"{problem.name}: {len(problem.budgets)} budgets, {time.perf_counter() - started:.0f} s", file=sys.stderr)
    for problem in (p for p in problems if p.kind == "modelled"):
        for name, levers in LEVER_SPACES.items():
            space = default_space(**levers)
            for budget in problem.budgets:
                for strategy in ("predictive", "frontier"):
                    lever_runs.append(replace(decide(problem, space, budget, strategy, "exact"), space=name))
        print(f"{problem.name}: speed levers, {time.perf_counter() - started:.0f} s", file=sys.stderr)
    by_strategy = summary(runs, ("kind", "strategy", "predictions"))
    by_problem = summary(runs, ("problem", "strategy", "predictions"))
    by_levers = summary(lever_runs, ("space", "strategy"))
    base = {r["strategy"]: r["probes"] for r in by_levers if r["space"] == "default space"}
    for r in by_levers:
        r["vs_default_space"] = r["probes"] / base[r["strategy"]]
    text = "\n\n".join(
        [
            f"Search strategies against {len(problems)} problems ({sum(len(p.budgets) for p in problems)} budgets), "
            f"from nothing known, probes before the confirmation round (`python -m benchmarks.search_strategies`, "
            f"{date.today()}).",
            "By kind of problem:\n\n" + markdown(by_strategy, ("kind", "strategy", "predictions")),
            "By problem:\n\n" + markdown(by_problem, ("problem", "strategy", "predictions")),
            "Speed levers (modelled problems, exact predictions):\n\n"
            + markdown(by_levers, ("space", "strategy"))
            + "\n\n"
            + "\n".join(
                f"- {r['space']}, {r['strategy']}: {r['vs_default_space']:.2f}x the probes of the default space"
                for r in by_levers
            ),
            "Problems:\n\n"
            + "\n".join(
                f"- {p.name} ({p.kind}{', ' + p.source if p.source else ''}): "
                f"{len(p.space.candidates())} candidates, budgets "
                + ", ".join(f"{b / 2**20:,.0f} MiB" for b in p.budgets)
                for p in problems
            ),
        ]
    )
    print(text)
    if not args.quick:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "search-strategies.md").write_text(text + "\n")
        (out / "search-strategies.json").write_text(
            json.dumps(
                {
                    "date": str(date.today()),
                    "by_kind": by_strategy,
                    "by_problem": by_problem,
                    "speed_levers": by_levers,
                    "runs": [{k: v for k, v in vars(r).items() if k != "order"} for r in runs + lever_runs],
                }
            )
            + "\n"
        )
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

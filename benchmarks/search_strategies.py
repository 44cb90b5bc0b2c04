"""Which search strategy reaches the exhaustive grid's best with the fewest probes?

The problem is modelled (tests/fakes.py: memory affine in micro-batch x block, lower with
checkpointing and half precision; throughput rising with micro-batch and saturating), so that many
budgets can be tried in seconds and every strategy faces the same numbers. For each budget the
grid (`grid-full`) gives the best; each strategy then runs from an empty database and we count the
probes it ran before first probing that best, the probes it ran in all, and whether its final pick
is the best.

Then what the speed levers cost the default strategy: the same budgets with `--compile off,on`,
`--allocators default,expandable` and both, whose values the frontier searches as groups of
their own (memory does not move in one known direction with them), against the default space.

    python -m benchmarks.search_strategies
"""

from __future__ import annotations

import re
import statistics
import tempfile
from pathlib import Path

from autotune.models import resolve_model
from autotune.search import Prediction, SearchOptions, run_search
from autotune.space import SearchSpace
from autotune.store import open_store
from tests.fakes import ScriptedRunner, modelled_result, request

GiB = 2**30
BUDGETS = (0.75, 1, 1.5, 2, 3, 4)           # GiB, against the fake model's 0.5 GiB fixed + activations


def predictor(error: float):
    def predict(candidates, device_type):
        out = {}
        for c in candidates:
            need = int(modelled_result(c, 10**15, 0).peak_reserved_bytes * (1 + error))
            out[c.key()] = Prediction(need, need, need)
        return out
    return predict


STRATEGIES = {
    "frontier": dict(strategy="frontier", predict=False),
    "frontier + exact predictions": dict(strategy="frontier", predictor=predictor(0.0)),
    "frontier + predictions 20% low": dict(strategy="frontier", predictor=predictor(-0.2)),
    "tpe (patience 10)": dict(strategy="tpe", predict=False, patience=10),
    "grid, OOM-pruned": dict(strategy="grid", predict=False),
}


def run_one(store, space, budget: int, study: str, **kw) -> tuple[object, list]:
    predict_fn = kw.pop("predictor", None)
    order: list = []
    options = SearchOptions(study=re.sub(r"[^\w.:@+-]", "_", study), fresh=True,
                            predict=predict_fn is not None or kw.pop("predict", True), **kw)
    outcome = run_search(request(space, resolve_model("gpt2"), budget, int(0.05 * budget), options), ScriptedRunner(), store,
                         on_event=lambda e: order.append(e) if e.how == "probed" else None, predictor=predict_fn)
    return outcome, order


def main() -> None:
    space = SearchSpace.build(resolve_model("gpt2"))
    rows: dict[str, list[tuple[int, int, bool]]] = {name: [] for name in STRATEGIES}
    grid_probes = []
    with tempfile.TemporaryDirectory() as tmp:
        with open_store(f"sqlite:///{Path(tmp) / 'strategies.db'}") as store:
            for gib in BUDGETS:
                budget = int(gib * GiB)
                grid, _ = run_one(store, space, budget, f"grid-{gib}", strategy="grid-full", predict=False)
                grid_probes.append(grid.probed)
                best = grid.best.config if grid.best else None
                for name, kw in STRATEGIES.items():
                    outcome, order = run_one(store, space, budget, f"{name}-{gib}", **dict(kw))
                    to_best = next((i + 1 for i, e in enumerate(order) if e.config == best), None)
                    picked = (outcome.best.config if outcome.best else None) == best
                    rows[name].append((to_best or outcome.probed, outcome.probed, picked))
    print(f"{len(space.candidates())} candidates (gpt2 default space), budgets {', '.join(f'{b:g}' for b in BUDGETS)} GiB; "
          f"the exhaustive grid probes {statistics.mean(grid_probes):.0f} on average")
    print(f"{'strategy':<32} {'probes to best':>15} {'probes in all':>14} {'picks the best':>15}")
    for name, results in rows.items():
        to_best = statistics.mean(r[0] for r in results)
        total = statistics.mean(r[1] for r in results)
        hits = sum(r[2] for r in results)
        print(f"{name:<32} {to_best:>15.1f} {total:>14.1f} {hits:>12}/{len(results)}")


LEVER_SPACES = {
    "default space": {},
    "+ --compile off,on": {"compiles": (False, True)},
    "+ --allocators default,expandable": {"allocators": ("default", "expandable")},
    "+ both": {"compiles": (False, True), "allocators": ("default", "expandable")},
}


def speed_lever_costs() -> None:
    """Probes the frontier strategy spends as the speed levers multiply the space."""
    print(f"\n{'space':<36} {'candidates':>10} {'probes in all':>14} {'vs default':>11} {'picks the best':>15}")
    base = None
    with tempfile.TemporaryDirectory() as tmp:
        with open_store(f"sqlite:///{Path(tmp) / 'levers.db'}") as store:
            for name, levers in LEVER_SPACES.items():
                space = SearchSpace.build(resolve_model("gpt2"), **levers)
                probes, hits = [], 0
                for gib in BUDGETS:
                    budget = int(gib * GiB)
                    grid, _ = run_one(store, space, budget, f"grid-{name}-{gib}", strategy="grid-full", predict=False)
                    outcome, _ = run_one(store, space, budget, f"frontier-{name}-{gib}", strategy="frontier", predict=False)
                    probes.append(outcome.probed)
                    hits += (outcome.best.config if outcome.best else None) == (grid.best.config if grid.best else None)
                mean = statistics.mean(probes)
                base = base or mean
                print(f"{name:<36} {len(space.candidates()):>10} {mean:>14.1f} {mean / base:>10.2f}x {hits:>12}/{len(BUDGETS)}")


if __name__ == "__main__":
    main()
    speed_lever_costs()

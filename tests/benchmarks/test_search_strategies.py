"""The search-strategy benchmark: its problems answer as a probe would, and its harness decides
exactly as a search through the store does (the same configs probed, in the same order)."""

from __future__ import annotations

import pytest

from autotune.host.environment import Environment
from autotune.specs.models import resolve_model
from autotune.search import SearchOptions, run_search
from autotune.search.space import SearchSpace
from autotune.store import open_store
from benchmarks.problems import budget_of, modelled, replays
from benchmarks.search_strategies import decide, predictions_of
from tests.helpers.fakes import ScriptedRunner, request

ENVIRONMENTS = {
    "cuda": Environment(device_type="cuda", device_name="modelled CUDA card 80GB", device_total_bytes=80 * 2**30),
    "cpu": Environment(device_type="cpu", device_name="cpu: replayed", device_total_bytes=24 * 2**30),
}


def problems():
    gpt2 = modelled(lambda: SearchSpace.build(resolve_model("gpt2")))[0]
    tiny = next(p for p in replays() if p.name.startswith("tiny GPT-2") and "compile" not in p.name)
    return {"modelled": (gpt2, gpt2.budgets[1]), "replayed": (tiny, tiny.budgets[2])}


@pytest.mark.parametrize(
    "kind, strategy", [("modelled", "predictive"), ("replayed", "predictive"), ("modelled", "frontier")]
)
def test_the_harness_probes_what_a_search_through_the_store_probes(kind, strategy):
    problem, budget_bytes = problems()[kind]
    decided = decide(problem, problem.space, budget_bytes, strategy, "exact")
    budget = budget_of(budget_bytes)
    table = predictions_of(problem, problem.space, "exact")
    runner = ScriptedRunner(answer=problem.answer, env=ENVIRONMENTS[problem.device_type])
    with open_store() as store:
        outcome = run_search(
            request(
                problem.space,
                resolve_model("gpt2"),
                budget.total_bytes,
                budget.margin_bytes,
                SearchOptions(study="s", strategy=strategy, confirm=False),
            ),
            runner,
            store,
            predictor=lambda candidates, device_type: {c.key(): table[c.key()] for c in candidates},
        )
    assert [c.label() for c in runner.asked] == decided.order
    assert outcome.probed == decided.probes and outcome.best is not None
    assert outcome.best.tokens_per_s == pytest.approx(decided.quality * problem.best(budget)[1])


def test_a_replayed_config_fits_a_budget_exactly_when_its_measured_need_does():
    problem = next(p for p in replays() if "Llama" in p.name)
    config = problem.space.candidates()[0]
    need = problem.measured(config).required_bytes
    fits = problem.answer(config, budget_of(int(need / 0.95) + 2))
    assert fits.status == "ok" and fits.tokens_per_s == problem.measured(config).tokens_per_s
    assert problem.answer(config, budget_of(int(need / 0.95) - 2)).status == "oom"
    # Every recorded study is a whole grid: each candidate of its space was measured.
    assert all(len({c.key() for c in p.space.candidates()}) == len(p.space.candidates()) for p in replays())

"""The predictive strategy with a scripted runner: it reaches the exhaustive grid's best in a
fraction of the probes, says why each config it did not probe could not win, verifies by a probe
what the memory prediction cannot decide, and resumes, confirms and shares a study as the others."""

from __future__ import annotations


from autotune.specs.models import resolve_model
from autotune.search import SearchOptions, run_search
from autotune.search.speed_model import SpeedModel
from autotune.search.strategies import WORTH_PROBING
from autotune.search.space import SearchSpace
from tests.helpers.fakes import ScriptedRunner, modelled_result, request
from tests.helpers.fakes import BUDGET, MARGIN, gpt2_space, modelled_predictor, search


def grid_best(space: SearchSpace, budget: int = BUDGET, margin: int = MARGIN) -> float:
    """The exhaustive grid's best tokens/s, from the fake's own model (as a grid-full search finds it)."""
    results = [modelled_result(c, budget, margin) for c in space.candidates()]
    return max(r.tokens_per_s for r in results if r.status == "ok")


def test_reaches_the_grids_best_in_a_fraction_of_the_frontiers_probes(store):
    space = gpt2_space()
    frontier = search(
        store,
        ScriptedRunner(),
        space,
        predictor=modelled_predictor(),
        study="frontier",
        fresh=True,
        strategy="frontier",
        confirm=False,
    )
    runner = ScriptedRunner()
    predictive = search(
        store,
        runner,
        space,
        predictor=modelled_predictor(),
        study="predictive",
        fresh=True,
        strategy="predictive",
        confirm=False,
    )
    assert predictive.best.tokens_per_s == grid_best(space)  # (fp16 and bf16 are as fast in the fake)
    assert predictive.probed <= frontier.probed / 2, (predictive.probed, frontier.probed)
    # Every candidate settled once: probed, or skipped with a reason; none of the skipped was run.
    probes = store.probes("predictive")
    assert len(probes) == len({p.config_key for p in probes}) == len(space.candidates()) == 72
    assert predictive.study.status == "finished" and predictive.complete
    asked = {c.key() for c in runner.asked}
    skipped = [p for p in probes if p.result.status == "skipped"]
    assert all(p.result.error for p in skipped) and not {p.config_key for p in skipped} & asked
    by_speed = [p for p in skipped if "speed model" in p.result.error]
    assert by_speed


def test_what_it_did_not_probe_could_not_have_won(store):
    space = gpt2_space()
    search(
        store, ScriptedRunner(), space, predictor=modelled_predictor(), study="p", strategy="predictive", confirm=False
    )
    probes = store.probes("p")
    measured = [(p.config, p.result) for p in probes if p.result.status == "ok"]
    best = max(r.tokens_per_s for _, r in measured)
    fitted = SpeedModel(space.candidates(), "cuda").fit(measured)
    for p in probes:
        if p.result.status == "skipped" and "speed model" in p.result.error:
            guess = fitted.guess(p.config)
            # Its optimistic speed is below the best measured (plus what is not worth a probe)...
            assert guess.optimistic_tokens_per_s <= best * (1 + WORTH_PROBING), p.config.label()
            # ...and so is its true one (the fake's model), had it been probed.
            truth = modelled_result(p.config, BUDGET, MARGIN)
            assert truth.status != "ok" or truth.tokens_per_s <= best * (1 + WORTH_PROBING), p.config.label()


def test_a_memory_prediction_inside_its_margin_is_verified_by_a_probe(store):
    # Predictions 9% high: configs that fit are predicted over the budget, but within the 10%
    # prediction margin, so the fastest of them are probed (and fit) rather than skipped.
    space = gpt2_space()
    runner = ScriptedRunner()
    high = search(
        store,
        runner,
        space,
        predictor=modelled_predictor(0.09),
        study="high",
        fresh=True,
        strategy="predictive",
        confirm=False,
    )
    assert high.best.tokens_per_s == grid_best(space)
    predicted = modelled_predictor(0.09)(space.candidates(), "cuda")
    best_key = high.best.config_key
    assert predicted[best_key].required_bytes > BUDGET - MARGIN  # predicted not to fit: verified, and it fits
    assert best_key in {c.key() for c in runner.asked}
    # Beyond the margin a prediction is trusted: 30% high skips configs that fit, unprobed.
    far = search(
        store,
        ScriptedRunner(),
        space,
        predictor=modelled_predictor(0.3),
        study="far",
        fresh=True,
        strategy="predictive",
        confirm=False,
    )
    assert any("prediction margin" in (p.result.error or "") for p in store.probes("far"))
    assert far.best.tokens_per_s <= grid_best(space)


def test_without_predictions_it_binary_searches_the_memory(store):
    space = gpt2_space()
    blind = search(store, ScriptedRunner(), space, study="blind", fresh=True, strategy="predictive", confirm=False)
    assert blind.best.tokens_per_s == grid_best(space)
    assert blind.probed <= 20
    assert any(p.result.status == "oom" for p in store.probes("blind"))  # the binary search met the budget


def test_an_interrupted_search_resumes_to_the_same_answer_without_probing_again(store):
    first = ScriptedRunner()
    partial = search(
        store,
        first,
        gpt2_space(),
        predictor=modelled_predictor(),
        study="r",
        strategy="predictive",
        max_trials=3,
        confirm=False,
    )
    assert partial.probed == 3 and partial.study.status == "interrupted"
    second = ScriptedRunner()
    done = search(
        store, second, gpt2_space(), predictor=modelled_predictor(), study="r", strategy="predictive", confirm=False
    )
    reference = search(
        store,
        ScriptedRunner(),
        gpt2_space(),
        predictor=modelled_predictor(),
        study="ref",
        strategy="predictive",
        fresh=True,
        confirm=False,
    )
    assert done.study.status == "finished"
    assert not {c.key() for c in first.asked} & {c.key() for c in second.asked}
    assert done.best.config == reference.best.config
    assert partial.probed + done.probed == reference.probed


def test_the_pick_is_confirmed_as_with_any_strategy(store):
    outcome = search(
        store, ScriptedRunner(), gpt2_space(), predictor=modelled_predictor(), study="c", strategy="predictive"
    )
    verdict = store.study("c").confirmation
    assert verdict is not None and verdict["winner"] == outcome.best.config_key and verdict["probes"] >= 2


def test_speed_levers_are_probed_only_where_they_could_win(store):
    # Half precision only (the fake's fastest): 16 plain configs, 64 with the levers.
    plain = SearchSpace.build(resolve_model("gpt2"), precisions=("fp16", "bf16"))
    levers = SearchSpace.build(
        resolve_model("gpt2"), precisions=("fp16", "bf16"), compiles=(False, True), allocators=("default", "expandable")
    )
    base = search(
        store,
        ScriptedRunner(),
        plain,
        predictor=modelled_predictor(),
        study="plain",
        strategy="predictive",
        confirm=False,
    )
    runner = ScriptedRunner()
    both = search(
        store,
        runner,
        levers,
        predictor=modelled_predictor(),
        study="levers",
        strategy="predictive",
        fresh=True,
        confirm=False,
    )
    assert len(levers.candidates()) == 4 * len(plain.candidates())
    assert both.best.tokens_per_s == grid_best(levers) and both.best.config.compile  # the fake's compile is 30% faster
    # Four times the candidates, not four times the probes (benchmarks/search_strategies: 1.7x on average).
    assert both.probed <= 2 * base.probed, (both.probed, base.probed)
    # An allocator twin of a config that fits is never probed: the same kernels, the same speed.
    reasons = [p.result.error for p in store.probes("levers") if p.result.status == "skipped"]
    assert any("runs the same kernels" in r for r in reasons)


def test_a_space_of_one_group_without_anything_that_fits_ends_with_no_pick(store):
    space = SearchSpace.build(
        resolve_model("gpt2"),
        micro_batches=(1, 2, 4, 8),
        precisions=("fp32",),
        checkpointing=(False,),
        attentions=("sdpa",),
        effective_batch=8,
    )
    outcome = run_search(
        request(
            space,
            resolve_model("gpt2"),
            520 * 2**20,
            26 * 2**20,
            SearchOptions(study="none", strategy="predictive", predict=False, confirm=False),
        ),
        ScriptedRunner(),
        store,
    )
    assert outcome.best is None and outcome.study.status == "finished"
    assert outcome.probed <= 3

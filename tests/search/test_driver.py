"""The search driver with a scripted runner: strategies, skipping, resume, the stored study."""

from __future__ import annotations

import threading
import time

import pytest

from autotune.vocabulary.errors import BadInput
from autotune.specs.models import resolve_model
from autotune.search import SearchOptions, run_search
from autotune.search.space import SearchSpace, group_key, group_priority
from autotune.store import open_store
from tests.helpers.fakes import (
    BUDGET,
    FAKE_ENV,
    MARGIN,
    ScriptedRunner,
    gpt2_space,
    modelled_predictor,
    request,
    search,
)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    """The exhaustive grid over gpt2_space() with the scripted runner, searched once for the module:
    the runner has no noise, so it answers the same each time. (The searches compared with it are
    `fresh`: they would not read its stored results in a shared database either.)"""
    root = tmp_path_factory.mktemp("grid")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOTUNE_HOME", str(root))  # (set up before the tests' own hermetic home)
        with open_store(f"sqlite:///{root / 'grid.db'}") as store:
            return search(store, ScriptedRunner(), gpt2_space(), study="grid", strategy="grid-full")


def test_frontier_finds_the_exhaustive_best_with_fewer_probes(store, grid):
    space = gpt2_space()
    frontier_runner = ScriptedRunner()
    frontier = search(store, frontier_runner, space, study="frontier", fresh=True, strategy="frontier")
    assert grid.probed == len(space.candidates()) == 72
    assert frontier.best.config == grid.best.config
    assert frontier.best.tokens_per_s == pytest.approx(grid.best.tokens_per_s)
    assert frontier.probed <= grid.probed / 2
    assert frontier.stop_reason == "exhausted" and frontier.study.status == "finished"


def test_skipped_configs_are_stored_with_reasons_and_never_run(store):
    runner = ScriptedRunner()
    # Effective batch 64: every micro-batch accumulates, so one OOM rules out all larger ones.
    outcome = search(store, runner, gpt2_space(effective_batch=64), study="s")
    asked = {c.key() for c in runner.asked}
    probes = store.probes("s")
    skipped = [p for p in probes if p.result.status == "skipped"]
    assert outcome.skipped == len(skipped) > 0
    assert all(p.config_key not in asked for p in skipped)
    assert all(p.result.error for p in skipped)
    assert any("ran out of memory" in p.result.error for p in skipped)
    assert any("without checkpointing" in p.result.error for p in skipped)
    # Every candidate is settled exactly once.
    assert len(probes) == len({p.config_key for p in probes}) == len(gpt2_space(effective_batch=64).candidates())
    # In Optuna's study a skip is a pruned trial, its reason a user attribute.
    import optuna

    study = optuna.load_study(study_name="s", storage=store.engine.url.render_as_string(hide_password=False))
    trials = {t.number: t for t in study.trials}
    assert all(trials[p.trial_number].state == optuna.trial.TrialState.PRUNED for p in skipped)
    assert all(trials[p.trial_number].user_attrs["reason"] == p.result.error for p in skipped)


def test_oom_is_a_completed_infeasible_optuna_trial(store):
    import optuna

    search(store, ScriptedRunner(), gpt2_space(), study="s")
    study = optuna.load_study(
        study_name="s", storage=store.engine.url.render_as_string(hide_password=False)
    )  # the same name
    oom_numbers = {p.trial_number for p in store.probes("s") if p.result.status == "oom"}
    trials = {t.number: t for t in study.trials}
    assert oom_numbers and all(trials[n].state == optuna.trial.TrialState.COMPLETE for n in oom_numbers)
    # (The list form of constraints, which optuna-dashboard shows, is Optuna's constraint "0".)
    assert all(trials[n].constraints == {"0": 1.0} and trials[n].user_attrs["status"] == "oom" for n in oom_numbers)


def test_interrupted_search_resumes_without_rerunning_anything(store):
    first = ScriptedRunner()
    partial = search(store, first, gpt2_space(), study="r", max_trials=3)
    assert partial.stop_reason == "max-trials" and partial.study.status == "interrupted"
    assert partial.probed == 3
    second = ScriptedRunner()
    done = search(store, second, gpt2_space(), study="r")
    assert done.stop_reason == "exhausted"
    assert not {c.key() for c in first.asked} & {c.key() for c in second.asked}
    reference = search(store, ScriptedRunner(), gpt2_space(), study="ref", fresh=True)
    assert done.best.config == reference.best.config


def test_a_sigterm_handled_as_a_claim_commits_gives_the_claim_back(store, monkeypatch):
    # A signal that arrives while SQLite commits a claim is handled as the commit returns: SIGTERM's
    # Terminated comes out of a claim() whose row is written (a Ray worker stopped this way left its
    # claim running, 2026-11-30). It is given back, as a probe's in flight is.
    from autotune.host.processes import Terminated

    claim = store.claims.take

    def claimed_then_terminated(*args, **kwargs):
        assert claim(*args, **kwargs) == 1
        raise Terminated

    monkeypatch.setattr(store.claims, "take", claimed_then_terminated)
    runner = ScriptedRunner()
    with pytest.raises(Terminated):
        search(store, runner, gpt2_space(), study="t")
    assert runner.asked == []
    assert [c for c in store.claims.of_study(store.study("t").id, stale_after=60) if c.state == "running"] == []


def test_finished_search_answers_from_the_database(store):
    from autotune.search.request import answer_from_store

    first = search(store, ScriptedRunner(), gpt2_space(), study="f")
    again = request(gpt2_space(), resolve_model("gpt2"), BUDGET, MARGIN, SearchOptions(study="f"))
    outcome = answer_from_store(store, again, 0.0)
    assert outcome is not None and outcome.answered_from_database
    assert outcome.best is not None and outcome.best.config_key == first.best.config_key
    assert (
        answer_from_store(
            store,
            request(gpt2_space(precisions=("bf16",)), resolve_model("gpt2"), BUDGET, MARGIN, SearchOptions(study="f")),
            0.0,
        )
        is None
    )  # another space: searched again


def test_stored_results_are_reused_across_studies(store):
    search(store, ScriptedRunner(), gpt2_space(), study="a")
    runner = ScriptedRunner()
    outcome = search(store, runner, gpt2_space(), study="b")
    assert outcome.probed == 0 and outcome.reused > 0
    assert runner.asked == []


def test_tpe_strategy_also_reaches_the_best(store):
    space = gpt2_space(precisions=("fp32", "bf16"), attentions=("sdpa",))
    grid = search(store, ScriptedRunner(), space, study="g", strategy="grid-full")
    tpe = search(store, ScriptedRunner(), space, study="t", strategy="tpe", fresh=True, patience=30)
    assert tpe.best.config == grid.best.config


def test_nothing_fits(store):
    outcome = run_search(
        request(
            gpt2_space(),
            resolve_model("gpt2"),
            520 * 2**20,
            26 * 2**20,
            SearchOptions(study="tiny-budget", predict=False),
        ),
        ScriptedRunner(),
        store,
    )
    assert outcome.best is None and outcome.leaderboard == []
    # Binary search: two OOMs settle each of the 12 accumulating groups, one each group of the
    # micro-batch that does not accumulate.
    assert outcome.probed <= 3 * 12


def test_study_on_another_device_is_refused_before_writing(store):
    search(store, ScriptedRunner(), gpt2_space(), study="d", max_trials=1)
    other = ScriptedRunner(env=FAKE_ENV.__class__(**{**FAKE_ENV.to_dict(), "device_name": "Other GPU"}))
    before = len(store.probes("d"))
    with pytest.raises(BadInput, match="new --study"):
        search(store, other, gpt2_space(), study="d")
    assert len(store.probes("d")) == before and other.asked == []


def test_a_study_resumed_under_other_openmp_settings_is_refused_naming_them(store):
    # Another thread count times every step differently: its probes would not compare.
    import dataclasses

    search(
        store,
        ScriptedRunner(env=dataclasses.replace(FAKE_ENV, openmp=(("OMP_NUM_THREADS", "1"),))),
        gpt2_space(),
        study="threads",
        max_trials=1,
    )
    other = ScriptedRunner(env=dataclasses.replace(FAKE_ENV, openmp=(("OMP_NUM_THREADS", "8"),)))
    with pytest.raises(BadInput, match="openmp OMP_NUM_THREADS=8 here, OMP_NUM_THREADS=1 in the study"):
        search(store, other, gpt2_space(), study="threads")
    assert other.asked == []


def test_several_block_sizes_need_effective_tokens():
    with pytest.raises(BadInput, match="effective-tokens"):
        SearchSpace.build(resolve_model("gpt2"), block_sizes=(256, 512), effective_batch=32)
    space = SearchSpace.build(resolve_model("gpt2"), block_sizes=(256, 512))
    assert {c.tokens_per_step for c in space.candidates()} == {8 * 512}  # the default effective batch, in tokens


def test_block_size_above_model_maximum_is_bad_input():
    with pytest.raises(BadInput, match="maximum of 1024"):
        SearchSpace.build(resolve_model("gpt2"), block_sizes=(2048,))


def test_predictions_skip_hopeless_configs_and_cut_probes(store, grid):
    space = gpt2_space()
    plain = search(store, ScriptedRunner(), space, study="plain", fresh=True)
    runner = ScriptedRunner()
    predicted = search(store, runner, space, predictor=modelled_predictor(), study="predicted", fresh=True)
    assert predicted.best.tokens_per_s == grid.best.tokens_per_s  # (fp16 and bf16 are as fast in the fake)
    assert predicted.probed < plain.probed
    probes = store.probes("predicted")
    by_prediction = [p for p in probes if p.result.status == "skipped" and "predicted" in p.result.error]
    assert by_prediction and not {p.config_key for p in by_prediction} & {c.key() for c in runner.asked}
    assert all(p.predicted_peak_bytes for p in probes)  # stored beside each measurement


@pytest.mark.parametrize("error", [-0.3, 0.3])
def test_wrong_predictions_cost_probes_not_the_answer(store, grid, error):
    space = gpt2_space()
    # 30% low: predicted fits that OOM are probed and found out. 30% high: beyond the 10% margin,
    # so configs that fit are skipped; the answer may then differ, and the test says by how much.
    outcome = search(
        store, ScriptedRunner(), space, predictor=modelled_predictor(error), study=f"wrong{error}", fresh=True
    )
    if error < 0:
        assert outcome.best.tokens_per_s == grid.best.tokens_per_s
    else:
        assert outcome.best.tokens_per_s >= 0.5 * grid.best.tokens_per_s


def test_the_micro_batch_that_does_not_accumulate_is_probed_despite_smaller_ooms(store):
    # Accumulating keeps 125 MiB of gradients more than the same work in one micro-step: under this
    # budget mb16x2 runs out of memory while mb32x1 fits; OOM-skipping across that line would miss it.
    space = gpt2_space(precisions=("bf16",), checkpointing=(True,), attentions=("sdpa",))
    budget = 725 * 2**20
    grid = run_search(
        request(space, resolve_model("gpt2"), budget, 0, SearchOptions(study="g", strategy="grid-full", predict=False)),
        ScriptedRunner(),
        store,
    )
    statuses = {p.config.micro_batch: p.result.status for p in store.probes("g")}
    assert statuses[16] == "oom" and statuses[32] == "ok"
    outcome = run_search(
        request(space, resolve_model("gpt2"), budget, 0, SearchOptions(study="f", fresh=True, predict=False)),
        ScriptedRunner(),
        store,
    )
    assert outcome.best.config == grid.best.config and outcome.best.config.micro_batch == 32


def test_predictions_in_the_background_arrive_group_by_group_and_match_waiting_for_them(store):
    # As on a GPU: probes start while predicting. Each group's predictions land when both its
    # traces are in (here: one group every 0.1 s, in the order the search visits them); a probe of
    # a group not yet predicted waits for it, so the search prunes as if it had waited for all.
    space = gpt2_space()
    delivered: set[str] = set()
    lock = threading.Lock()

    def streaming(candidates, device_type, on_predictions):
        everything = modelled_predictor()(candidates, device_type)
        groups: dict[tuple, dict] = {}
        for c in sorted(candidates, key=lambda c: group_priority(c, device_type)):
            groups.setdefault(group_key(c), {})[c.key()] = everything[c.key()]
        for group in groups.values():
            time.sleep(0.1)
            with lock:
                delivered.update(group)
            on_predictions(group)
        return everything

    class Watching(ScriptedRunner):
        early: list[str] = []

        def run(self, config, budget, spec=None, deadline=None, timing_only=False, fresh_process=False):
            with lock:
                if config.key() not in delivered:
                    self.early.append(config.label())
            return super().run(config, budget, spec, deadline)

    waited = search(store, ScriptedRunner(), space, predictor=modelled_predictor(), study="waited")
    runner = Watching()
    background = search(
        store, runner, space, predictor=streaming, study="background", fresh=True, predict_in_background=True
    )
    assert runner.early == []  # no probe ran before its group's predictions were in
    assert background.best.config == waited.best.config and background.probed == waited.probed
    assert all(p.predicted_peak_bytes for p in store.probes("background"))  # filled in as they land
    assert {p.config_key for p in store.probes("background") if "predicted" in (p.result.error or "")} == {
        p.config_key for p in store.probes("waited") if "predicted" in (p.result.error or "")
    }


def test_predictions_that_land_while_the_search_chooses_are_taken_before_its_probe(store, monkeypatch):
    # The race behind a flaky run of the test above: a group's predictions landing after the search
    # chose (on what it had taken: a binary search's step toward a config not yet predicted) and
    # before it looked whether to wait. Here each group lands exactly then, the moment the search
    # has chosen a config of it: the search must choose again with them, not probe the stale step.
    import queue

    from autotune.search.strategies import PredictiveStrategy

    space = gpt2_space()
    asked: queue.Queue = queue.Queue()
    landed: dict[tuple, threading.Event] = {}

    def on_request(candidates, device_type, on_predictions):
        everything = modelled_predictor()(candidates, device_type)
        groups: dict[tuple, dict] = {}
        for c in candidates:
            groups.setdefault(group_key(c), {})[c.key()] = everything[c.key()]
        while (wanted := asked.get(timeout=60)) is not None:
            if wanted in groups:
                on_predictions(groups.pop(wanted))
            landed[wanted].set()
        return everything

    choose = PredictiveStrategy.next

    def chosen_then_landed(self):
        proposed = choose(self)
        if proposed is not None and proposed[1] is None and proposed[0].key() not in self.knowledge.predictions:
            group = group_key(proposed[0])
            landed[group] = threading.Event()
            asked.put(group)
            assert landed[group].wait(10)
        return proposed

    waited = ScriptedRunner()
    search(store, waited, space, predictor=modelled_predictor(), study="waited")
    monkeypatch.setattr(PredictiveStrategy, "next", chosen_then_landed)
    runner = ScriptedRunner()
    try:
        search(store, runner, space, predictor=on_request, study="raced", fresh=True, predict_in_background=True)
    finally:
        asked.put(None)
    assert [c.label() for c in runner.asked] == [c.label() for c in waited.asked]


def test_a_study_made_before_optuna_studies_took_its_name_keeps_its_prefixed_one(store):
    # Older autotune named the Optuna study 'autotune:NAME': resuming such a study goes on adding
    # to it (its trials are there), rather than starting a second Optuna study beside it.
    import optuna

    from autotune.search.trials import optuna_storage

    url = store.engine.url.render_as_string(hide_password=False)
    optuna.create_study(storage=optuna_storage(url), study_name="autotune:old", direction="maximize")
    search(store, ScriptedRunner(), gpt2_space(), study="old")
    search(store, ScriptedRunner(), gpt2_space(), study="new")
    names = {s.study_name: s.n_trials for s in optuna.get_all_study_summaries(storage=url)}
    assert names["autotune:old"] > 0 and "old" not in names and names["new"] > 0


def test_a_runner_lent_to_a_search_must_probe_with_the_searchs_settings():
    # (search(runner=...) keeps one probe process across the searches of a script or a test module.)
    from autotune.probe import ProbeRunner, ProbeSettings
    from autotune.search import search as library_search

    with ProbeRunner(ProbeSettings(device="cpu")) as runner:
        with pytest.raises(ValueError, match="the search's own settings"):
            library_search(
                "gpt2",
                BUDGET,
                settings=ProbeSettings(device="cpu", measure_steps=1),
                options=SearchOptions(),
                runner=runner,
            )
        with pytest.raises(ValueError, match="for a search in this process"):
            library_search("gpt2", BUDGET, settings=runner.settings, options=SearchOptions(), runner=runner, workers=2)
        assert runner.children_started == 0

"""One truth about the pick: every window measured is kept as it is measured (a round cut short goes
on with them), every surface names the pick the study's stored decision names, for the reason it
gives (autotune.results.verdict), and a skip that rested on an outlier window is decided again once the
round lowers that window's figure. Scripted runners: each config's windows are given."""

from __future__ import annotations

import json

import pytest

from autotune.results import verdict
from autotune.handoff import best as best_of
from autotune.render.report import render_report
from autotune.specs.models import resolve_model
from autotune.render.tables import explain_winner, format_search_footer, search_summary
from autotune.results.probe_result import ProbeResult
from autotune.search import SearchOptions, run_search
from autotune.search.confirm import MAX_ROUNDS, RoundStopped, confirm
from autotune.search.space import SearchSpace
from autotune.store import open_store
from autotune.results.timing import relative_spread
from tests.helpers.fakes import ScriptedRunner, modelled_result, request
from tests.helpers.fakes import gpt2_space

GiB = 2**30
BUDGET = 8 * GiB
MARGIN = int(0.05 * BUDGET)


class WindowsRunner(ScriptedRunner):
    """Each micro-batch's windows in turn, tokens/s (the last repeats), five steady steps each
    (1% apart); memory as the fake's model has it."""

    def __init__(self, windows: dict[int, list[float]]):
        super().__init__()
        self.windows = {mb: list(speeds) for mb, speeds in windows.items()}
        self.measured: dict[int, int] = {}

    def run(self, config, budget, spec=None, deadline=None, timing_only=False, fresh_process=False) -> ProbeResult:
        self.asked.append(config)
        result = modelled_result(config, budget.total_bytes, budget.margin_bytes)
        n = self.measured.get(config.micro_batch, 0)
        self.measured[config.micro_batch] = n + 1
        speeds = self.windows[config.micro_batch]
        step = config.tokens_per_step / speeds[min(n, len(speeds) - 1)]
        times = [step * (1 + 0.01 * (i - 2)) for i in range(5)]
        result.step_times, result.step_seconds, result.step_spread = times, step, relative_spread(times)
        result.tokens_per_s, result.samples_per_s = config.tokens_per_step / step, config.effective_batch / step
        return result


def small_space() -> SearchSpace:
    return SearchSpace.build(
        resolve_model("gpt2"),
        micro_batches=(1, 2, 4),
        block_sizes=(128,),
        precisions=("fp32",),
        checkpointing=(False,),
        attentions=("sdpa",),
        effective_batch=4,
    )


def search(store, runner, study: str, space: SearchSpace | None = None, **options):
    options = {"study": study, "predict": False, "strategy": "grid", **options}
    return run_search(
        request(space or small_space(), resolve_model("gpt2"), BUDGET, MARGIN, SearchOptions(**options)), runner, store
    )


def surfaces(store, outcome, name: str) -> dict[str, str]:
    """The label each surface names as the pick."""
    chosen_line = next(line for line in explain_winner(outcome).splitlines() if line.startswith("Chosen:"))
    summary = next(s for s in store.studies() if s.name == name)
    report = render_report(store.study(name), store.probes(name), store.leaderboard(name))
    return {
        "search": chosen_line.split("  ")[0].removeprefix("Chosen: "),
        "leaderboard": store.leaderboard(name)[0].label,
        "best": best_of(name).row.label,
        "print(best)": str(best_of(name)).splitlines()[0].split(": ", 1)[1],
        "studies": summary.best_label or "",
        "report": next(line for line in report.splitlines() if line.startswith("Chosen:"))
        .split("  ")[0]
        .removeprefix("Chosen: "),
        "json": json.loads(json.dumps(search_summary(outcome)))["best"]["label"],
    }


def test_a_config_outside_the_round_that_its_windows_fall_below_joins_it_and_every_surface_agrees(hermetic_home):
    # mb4's first window was lucky (4000: its true speed 2950), mb2 is its runner-up; mb1's one
    # window, 2980, was lucky too (true 1000) but began outside the round. Pooled, mb4 and mb2 tie
    # near 2950, mb4 chosen for its memory; mb1's one window would be faster than that pick: it
    # joins the round, is measured again, and falls. Before, "Chosen:" named mb1 (measured once,
    # never in the round) while the stored verdict and print(best) named mb4.
    runner = WindowsRunner({4: [4000.0, 2950.0], 2: [3000.0, 2960.0], 1: [2980.0, 1000.0]})
    with open_store() as store:
        outcome = search(store, runner, "outsider")
        said = surfaces(store, outcome, "outsider")
        decision = store.study("outsider").confirmation
    assert runner.measured[1] >= 2, runner.measured  # the outsider was measured again
    assert decision["winner_label"].startswith("mb4x1") and decision["tied"], decision
    assert set(said.values()) == {decision["winner_label"]}, said
    # ... and for the same reason, in the same words.
    why = verdict.describe(decision)
    assert why in explain_winner(outcome)
    assert verdict.how_chosen(decision) in str(best_of("outsider"))


def test_a_tie_the_timing_cannot_resolve_is_said_so_everywhere(hermetic_home):
    # Windows that disagree by far more than a tie allows: the fastest measured is kept and said not
    # reliable; print(best) used to say "chosen for the most memory to spare" of it.
    runner = WindowsRunner({4: [3000.0, 2000.0, 3000.0, 2000.0], 2: [2000.0, 3000.0, 2000.0, 3000.0], 1: [900.0]})
    with open_store() as store:
        outcome = search(store, runner, "noisy")
        said = surfaces(store, outcome, "noisy")
        decision = store.study("noisy").confirmation
    assert decision["tied"] and decision["reliable"] is False, decision
    assert set(said.values()) == {decision["winner_label"]}, said
    text = str(best_of("noisy"))
    assert "kept the fastest measured" in text and "most memory to spare" not in text
    assert "kept the fastest measured" in explain_winner(outcome)
    assert verdict.unreliable_warning(decision) in explain_winner(outcome)


def test_a_round_cut_short_keeps_its_windows_and_the_same_command_finishes_it(hermetic_home, tmp_path):
    # A tie that takes every round (3 more windows of each of two contenders): cut after 3 windows.
    speeds = {4: [2970.0] * 2 + [3030.0] * 2, 2: [3000.0, 2960.0, 3040.0, 2990.0], 1: [1000.0]}
    whole = WindowsRunner(speeds)
    with open_store(tmp_path / "uncut.db") as store:  # the same search, never cut
        search(store, whole, "whole")
    uncut_windows = len(whole.asked) - 3
    with open_store() as store:
        runner = WindowsRunner(speeds)
        search(store, runner, "cut", confirm=False)  # the three first windows, no round yet
        study = store.study("cut")
        asked = []

        def stop_after_three() -> bool:
            return len(asked) >= 3

        def run(config, budget):
            asked.append(config)
            return runner.run(config, budget)

        with pytest.raises(RoundStopped):
            confirm(store, study, run, study_budget(study), stop=stop_after_three)
        partial = store.study("cut").confirmation
        assert partial["partial"] and partial["probes"] == 3 and "winner" not in partial
        pooled = {p.config.micro_batch: len(p.result.step_times) for p in store.probes("cut")}
        assert pooled[4] + pooled[2] == 2 * 5 + 3 * 5  # every window measured is stored

        again = search(store, runner, "cut")  # the same command
    decision = again.study.confirmation
    assert not decision.get("partial") and decision["winner"], decision
    assert decision["rounds"] <= MAX_ROUNDS and decision["probes"] == uncut_windows  # nothing measured twice
    assert again.round.reused_windows == 3 and again.round.probes == uncut_windows - 3
    footer = format_search_footer(again)
    left = uncut_windows - 3
    assert f"{left} probe{'s' if left != 1 else ''} run ({left} in the confirmation round)" in footer
    assert "3 windows of an earlier unfinished round reused" in footer and "every candidate settled" in footer


def study_budget(study):
    from autotune.results.budget import Budget

    return Budget(study.budget_bytes, study.margin_bytes)


def test_a_skip_that_rested_on_an_outlier_window_is_decided_again_and_the_true_best_picked(hermetic_home):
    # On this (scripted) CPU bf16 runs at 0.45x the fake's speed, below fp32. The first config
    # probed, mb32x1 bf16, has a first window 3x its true speed (24,000 tokens/s, truly 8,000): the
    # speed model skips the fp32 configs it says cannot beat that figure, the true best (mb32x1
    # fp32, 8,889) among them. The round measures the outlier until its windows agree; its figure
    # falls, the skips it held up go back, and the true best is probed and picked.
    from autotune.host.environment import Environment

    cpu = Environment("cpu", "cpu (scripted)", 64 * GiB, torch_version="2.13.0", transformers_version="5.23.0")
    space = gpt2_space(precisions=("fp32", "bf16"), checkpointing=(False,), attentions=("sdpa",))

    def truth(config, budget_bytes, margin_bytes):
        result = modelled_result(config, budget_bytes, margin_bytes)
        if result.status == "ok" and config.precision == "bf16":
            result.step_seconds /= 0.45
            result.tokens_per_s *= 0.45
        return result

    windows: dict[str, int] = {}

    def answer(config, budget):
        result = truth(config, budget.total_bytes, budget.margin_bytes)
        n = windows[config.key()] = windows.get(config.key(), 0) + 1
        if result.status == "ok":
            step = result.step_seconds / (3.0 if n == 1 and len(windows) == 1 else 1.0)
            times = [step * (1 + 0.01 * (i - 2)) for i in range(5)]
            result.step_times, result.step_seconds, result.step_spread = times, step, relative_spread(times)
            result.tokens_per_s = config.tokens_per_step / step
        return result

    runner = ScriptedRunner(answer=answer, env=cpu)
    with open_store() as store:
        outcome = search(store, runner, "outlier", space=space, strategy="predictive")
        probes = store.probes("outlier")
    grid_best = max(r.tokens_per_s for r in (truth(c, BUDGET, MARGIN) for c in space.candidates()) if r.status == "ok")
    footer = format_search_footer(outcome)
    assert runner.asked[0].precision == "bf16" and runner.asked[0].micro_batch == 32  # (the outlier: probed first)
    assert outcome.revisited > 0 and "decided again after the round" in footer, footer
    assert outcome.best.config.precision == "fp32" and outcome.best.config.micro_batch == 32, outcome.best.label
    assert outcome.best.tokens_per_s == pytest.approx(grid_best, rel=0.01)
    # Every candidate has one outcome (a revisited skip's row went, its new outcome stands).
    assert len({p.config_key for p in probes}) == len(probes) == len(space.candidates())


def test_a_study_made_only_of_reused_probes_still_says_its_pick_is_not_reliable(hermetic_home):
    # A first study whose windows disagree far beyond a tie; a second over the same space reuses
    # every probe (no probe of its own, no round): it decides on the stored windows, unreliable too.
    runner = WindowsRunner({4: [3000.0, 2000.0, 3000.0, 2000.0], 2: [2000.0, 3000.0, 2000.0, 3000.0], 1: [900.0]})
    with open_store() as store:
        search(store, runner, "first")
        asked = len(runner.asked)
        again = search(store, runner, "again")
        decision = store.study("again").confirmation
    assert len(runner.asked) == asked and again.reused == 3  # nothing probed
    assert decision["reused"] and decision["reliable"] is False and not decision["confirmed"], decision
    text = explain_winner(again)
    assert "every window was measured by earlier studies" in text and "not reliable" in text
    assert best_of("again").reliable is False and best_of("again").to_dict()["reliable"] is False


def test_a_pick_no_round_judged_is_not_said_reliable_and_the_report_counts_the_rounds_windows(hermetic_home):
    # Windows 3% apart inside ±14% of noise: without a round (--no-confirm, as a fleet of workers has
    # none), whether the pick is reliable is not known, where it used to read as `"reliable": true`.
    runner = WindowsRunner({4: [3000.0, 2600.0, 3400.0], 2: [2910.0, 3300.0, 2500.0], 1: [900.0]})
    with open_store() as store:
        search(store, runner, "unjudged", confirm=False)
        unjudged = render_report(store.study("unjudged"), store.probes("unjudged"), store.leaderboard("unjudged"))
        search(
            store,
            WindowsRunner({4: [3000.0, 2600.0, 3400.0], 2: [2910.0, 3300.0, 2500.0], 1: [900.0]}),
            "judged",
            fresh=True,
        )
        decision = store.study("judged").confirmation
        judged = render_report(store.study("judged"), store.probes("judged"), store.leaderboard("judged"))
    best = best_of("unjudged")
    assert best.reliable is None and best.to_dict()["reliable"] is None and best.to_dict()["confirmed"] is False
    assert "no confirmation round ran" in str(best)
    assert "confirmation round measured" not in unjudged
    # The round's own probes are counted beside the configurations'.
    assert decision["probes"] >= 2 and best_of("judged").reliable is not None
    assert f"The confirmation round measured {decision['probes']} more windows" in judged


@pytest.mark.parametrize(("spread", "revisited"), [(0.0, False), (0.10, True), (0.50, False)])
def test_a_skip_is_decided_again_when_the_config_is_within_the_noise_of_the_figure_it_was_skipped_against(
    spread, revisited
):
    # The best (fp32) measured 1,000 tokens/s, the median of windows in several processes that
    # spread by `spread`; bf16 was skipped for speed, predicted at most 950. Against a steady figure
    # 950 cannot win; within 10% between processes it could, and a probe decides. A spread past
    # what a reliable pick allows (15%) widens the bar no further: 950 is still within it, 850 not.
    from autotune.search.knowledge import Knowledge
    from autotune.search.speed_model import SpeedGuess
    from autotune.search.strategies import PredictiveStrategy
    from autotune.vocabulary.status import ProbeStatus

    space = gpt2_space(precisions=("fp32", "bf16"), checkpointing=(False,), attentions=("sdpa",), micro_batches=(4,))
    by_precision = {c.precision: c for c in space.candidates()}
    knowledge = Knowledge(space.candidates())
    best = modelled_result(by_precision["fp32"], BUDGET, MARGIN)
    best.tokens_per_s, best.step_spread = 1000.0, spread
    knowledge.learn(by_precision["fp32"], best)
    knowledge.learn(
        by_precision["bf16"],
        ProbeResult(status=ProbeStatus.SKIPPED, budget_bytes=BUDGET, margin_bytes=MARGIN, error="not faster"),
    )
    strategy = PredictiveStrategy(knowledge, "cuda")
    at_most = 850.0 if spread > 0.15 else 950.0
    strategy.guesses = lambda configs: {c.key(): SpeedGuess(at_most * 0.9, at_most, 0.05, 1) for c in configs}
    assert (strategy.revisitable() == [by_precision["bf16"]]) is revisited


@pytest.mark.parametrize(
    "margin, noise, said",
    [
        (0.064, 0.056, "wins by 6.4% ± 5.6%"),  # (whole percents would read "6% ± 6%": inside it)
        (0.061, 0.02, "wins by 6% ± 2%"),
        (0.0305, 0.0301, "wins by 3.05% ± 3.01%"),
    ],
)
def test_a_confirmed_margin_is_said_with_the_digits_that_show_it_beats_the_noise(margin, noise, said):
    decision = {"winner_label": "a", "runner_up": "b", "margin": margin, "noise": noise, "confirmed": True}
    assert said in verdict.describe({**decision, "rounds": 1})
    assert verdict.answer({**decision, "winner": "k"}, "k").startswith(f"yes: {said.removeprefix('wins by ')} faster")

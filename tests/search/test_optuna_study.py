"""The Optuna study a search leaves, as Optuna's own tools and optuna-dashboard open it."""

from __future__ import annotations

import json
from wsgiref.util import setup_testing_defaults

import optuna
import pytest
from optuna.study._constrained_optimization import _get_feasible_trials
from optuna.trial import TrialState

from autotune.search.trials import distributions_of, error_tail, optuna_storage, params_of
from tests.helpers.fakes import FAKE_ENV, ScriptedRunner
from tests.helpers.fakes import gpt2_space, search


def url_of(store) -> str:
    return store.engine.url.render_as_string(hide_password=False)


@pytest.fixture
def searched(store):
    """A study with fits, OOMs and structural skips: at effective batch 64 every micro-batch
    accumulates, so one OOM rules out the larger ones without a probe."""
    search(
        store, ScriptedRunner(), gpt2_space(effective_batch=64, precisions=("bf16",), checkpointing=(False,)), study="s"
    )
    by_number = {p.trial_number: p for p in store.probes("s")}
    return optuna.load_study(study_name="s", storage=url_of(store)), by_number


def test_trial_states_attributes_times_and_constraints_as_optuna_reads_them(searched):
    study, probes = searched
    trials = {t.number: t for t in study.trials}
    assert set(trials) == set(probes)  # one trial per settled config, linked by its number
    seen = set()
    for number, trial in trials.items():
        probe, attrs = probes[number], trials[number].user_attrs
        seen.add(probe.result.status)
        assert attrs["status"] == probe.result.status
        assert attrs["label"] == probe.config.label() and attrs["key"] == probe.config_key
        if probe.result.status == "ok":
            assert trial.state == TrialState.COMPLETE and trial.value == pytest.approx(probe.result.tokens_per_s)
            assert attrs["tokens_per_s"] == pytest.approx(probe.result.tokens_per_s)
            assert attrs["peak_reserved_bytes"] == probe.result.peak_reserved_bytes
            assert attrs["peak_allocated_bytes"] == probe.result.peak_allocated_bytes
            assert attrs["device"] == FAKE_ENV.device_name and "error" not in attrs
            assert trial.duration.total_seconds() == pytest.approx(2.0)  # the fake probe's wall time
        elif probe.result.status == "oom":
            assert trial.state == TrialState.COMPLETE and trial.value == 0.0
            assert attrs["error"] == "torch.OutOfMemoryError: CUDA out of memory (fake)"
            assert attrs["budget_bytes"] == probe.result.budget_bytes
            assert attrs["required_bytes"] == probe.result.required_bytes
            assert trial.duration.total_seconds() == pytest.approx(1.0)
        else:
            assert probe.result.status == "skipped"
            assert trial.state == TrialState.PRUNED and trial.value is None
            assert attrs["reason"] == probe.result.error and "error" not in attrs
            assert trial.duration.total_seconds() == 0  # ruled out without running
    assert seen == {"ok", "oom", "skipped"}
    assert any("ran out of memory" in t.user_attrs.get("reason", "") for t in trials.values())
    # Feasible (every constraint <= 0) exactly when the config fits; the best trial is the best fit.
    finished = [t for t in study.trials if t.state != TrialState.FAIL]
    assert {t.number for t in _get_feasible_trials(finished)} == {n for n, p in probes.items() if p.result.fits}
    best = max((p for p in probes.values() if p.result.fits), key=lambda p: p.result.tokens_per_s)
    assert study.best_trial.number == best.trial_number
    assert study.metric_names == ["tokens_per_s"]
    assert study.user_attrs["space"]["micro_batch"] == [1, 2, 4, 8, 16, 32]
    assert study.user_attrs["space"]["checkpointing"] == [False]


def test_optuna_dashboard_shows_the_constraints_and_the_objective_name(searched, store):
    pytest.importorskip("optuna_dashboard")
    from optuna_dashboard._app import create_app

    study, probes = searched
    # The dashboard's own handler of /api/studies/<id>, called as its web page calls it.
    environ: dict = {"PATH_INFO": f"/api/studies/{study._study_id}", "REQUEST_METHOD": "GET"}
    setup_testing_defaults(environ)
    statuses: list[str] = []
    app = create_app(optuna_storage(url_of(store)))
    body = b"".join(app(environ, lambda status, headers, exc_info=None: statuses.append(status)))
    assert statuses[0].startswith("200"), environ["wsgi.errors"].getvalue()[-2000:]
    detail = json.loads(body)
    assert detail["objective_names"] == ["tokens_per_s"]
    shown = {t["number"]: t for t in detail["trials"]}
    assert set(shown) == set(probes)
    for number, trial in shown.items():
        fits = probes[number].result.fits
        assert trial["constraints"] == ([-1.0] if fits else [1.0])
        assert trial["state"] == ("Complete" if probes[number].result.status != "skipped" else "Pruned")
        assert {"key": "status", "value": probes[number].result.status} in trial["user_attrs"]


def test_tpe_trials_carry_the_same_states_and_attributes(store):
    search(
        store,
        ScriptedRunner(),
        gpt2_space(effective_batch=64, attentions=("sdpa",), precisions=("bf16",)),
        study="t",
        strategy="tpe",
        patience=30,
    )
    study = optuna.load_study(study_name="t", storage=url_of(store))
    probes = {p.trial_number: p for p in store.probes("t")}
    told = [t for t in study.trials if t.number in probes]
    assert not any("repeat" in t.user_attrs for t in told)
    assert {probes[t.number].result.status for t in told} == {"ok", "oom", "skipped"}
    for trial in told:
        result = probes[trial.number].result
        expected = {"ok": TrialState.COMPLETE, "oom": TrialState.COMPLETE, "skipped": TrialState.PRUNED}[result.status]
        assert trial.state == expected and trial.user_attrs["status"] == result.status
        assert trial.constraints == {"0": -1.0 if result.fits else 1.0}
        if result.status != "skipped":
            assert trial.duration.total_seconds() > 0  # asked, probed, told
    # Repeats TPE proposes are answered from what is known: the same outcome, its status only.
    status_of = {json.dumps(t.params, sort_keys=True): t.user_attrs["status"] for t in told}
    repeats = [t for t in study.trials if t.number not in probes and t.state != TrialState.FAIL]
    assert repeats and all(
        t.user_attrs == {"status": status_of[json.dumps(t.params, sort_keys=True)], "repeat": True} for t in repeats
    )


def test_a_study_written_by_the_previous_release_loads_and_resumes(store):
    # The previous release named the study 'autotune:NAME' and stored every outcome as a COMPLETE
    # trial with Optuna 5's per-name constraint, skips included: TPE goes on from those trials
    # (six: past its five random start-up trials, its model reads old and new ones together).
    url = url_of(store)
    old = optuna.create_study(storage=optuna_storage(url), study_name="autotune:old", direction="maximize")
    space = gpt2_space(attentions=("sdpa",), precisions=("bf16",))
    for config in space.candidates()[:6]:
        old.add_trial(
            optuna.trial.create_trial(
                value=0.0, params=params_of(config), distributions=distributions_of(space), constraints={"memory": 1.0}
            )
        )
    search(store, ScriptedRunner(), space, study="old", strategy="tpe", max_trials=3)
    study = optuna.load_study(study_name="autotune:old", storage=url)
    assert all(t.constraints == {"memory": 1.0} for t in study.trials[:6])
    probes = {p.trial_number: p for p in store.probes("old")}
    assert len(probes) >= 3 and all(
        study.trials[n].constraints == {"0": -1.0 if p.result.fits else 1.0} for n, p in probes.items()
    )
    assert study.metric_names == ["tokens_per_s"]


def test_error_tail_keeps_the_last_lines_bounded():
    traceback = (
        "Traceback (most recent call last):\n"
        + "".join(f'  File "x.py", line {i}\n' for i in range(50))
        + "RuntimeError: boom\n\n"
    )
    assert error_tail(traceback).splitlines() == [
        '  File "x.py", line 46',
        '  File "x.py", line 47',
        '  File "x.py", line 48',
        '  File "x.py", line 49',
        "RuntimeError: boom",
    ]
    assert len(error_tail("x" * 5000)) == 1000 and error_tail("x" * 5000).endswith("x")


@pytest.mark.parametrize("status", ["ok", "oom", "skipped", "crashed"])
def test_a_settled_trial_written_at_once_reads_as_optunas_own_path_writes_it(tmp_path, status):
    # (trials.py writes a settled trial's rows at once; Optuna sets them one by one, as on a running trial.)
    from autotune.levers.config import ProbeConfig
    from autotune.results.probe_result import ProbeResult
    from autotune.search.trials import frozen_trial
    from autotune.search.space import SearchSpace
    from autotune.specs.models import resolve_model
    from tests.helpers.models import write_model_dir

    url = f"sqlite:///{tmp_path / 'both.db'}"
    model = str(write_model_dir(tmp_path / "m"))
    space = SearchSpace.build(
        resolve_model(model),
        micro_batches=(1, 2),
        block_sizes=(64,),
        precisions=("fp32",),
        checkpointing=(False,),
        attentions=("sdpa",),
        effective_batch=2,
    )
    distributions = distributions_of(space)
    config = ProbeConfig(model=model, micro_batch=2, block_size=64)
    result = ProbeResult(
        status=status,
        tokens_per_s=1234.5 if status == "ok" else None,
        peak_reserved_bytes=3 << 20 if status in ("ok", "oom") else None,
        error={"skipped": "needs more than the budget", "crashed": "Traceback\nboom"}.get(status),
    )
    template = frozen_trial(config, result, distributions)
    ours, plain = optuna_storage(url), optuna.storages.RDBStorage(url)
    read = []
    for storage, name in ((ours, "ours"), (plain, "optuna")):
        study_id = storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], name)
        for _ in range(2):  # (the second meets the first's distributions)
            storage.create_new_trial(study_id, template_trial=template) if storage is plain else storage.add_settled(
                study_id, template
            )
        read.append(storage.get_all_trials(study_id))
    for mine, theirs in zip(*read):
        assert (
            mine.number,
            mine.state,
            mine.values,
            mine.params,
            mine.distributions,
            mine.user_attrs,
            mine.system_attrs,
            mine.datetime_start,
            mine.datetime_complete,
        ) == (
            theirs.number,
            theirs.state,
            theirs.values,
            theirs.params,
            theirs.distributions,
            theirs.user_attrs,
            theirs.system_attrs,
            theirs.datetime_start,
            theirs.datetime_complete,
        )
    assert [t.number for t in read[0]] == [0, 1]
    ours.engine.dispose()
    plain.engine.dispose()

"""Several workers on one study, with scripted probes (milliseconds, no torch): every configuration
settled once, OOMs pruning for all, the same pick as one worker, a study pinned to its device, one
confirmation round among them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from autotune.host.environment import Environment
from autotune.vocabulary.errors import BadInput, DeviceError
from autotune.specs.models import resolve_model
from autotune.search import Knowledge, SearchOptions, run_search
from autotune.search.space import SearchSpace
from autotune.store import open_store
from autotune.search.driver import start_study
from autotune.search.fleet import check_joinable, run_worker, worker_devices
from autotune.store.claims import ROUND_KEY
from autotune.results.budget import Budget
from tests.helpers.fakes import FAKE_ENV, ScriptedRunner, request

GiB = 2**30
BUDGET = 1 * GiB
MARGIN = int(0.05 * BUDGET)


class SlowRunner(ScriptedRunner):
    """A scripted runner whose probes take a moment, so that several workers' probes overlap."""

    def __init__(self, seconds: float = 0.03, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds

    def run(self, config, budget, spec=None, deadline=None, timing_only=False, fresh_process=False):
        time.sleep(self.seconds)
        return super().run(config, budget, spec, deadline)


def gpt2_space() -> SearchSpace:
    # Effective batch 64: every micro-batch accumulates, so one OOM rules out all larger ones.
    return SearchSpace.build(
        resolve_model("gpt2"), micro_batches=(1, 2, 4, 8, 16, 32), block_sizes=(512,), effective_batch=64
    )


def in_threads(*jobs) -> None:
    """Run each job in a thread of its own (each worker its own store and runner), wait for them
    all, and raise what any of them raised here, in the test's own thread."""
    errors = []

    def guarded(job) -> None:
        try:
            job()
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors


def shared_search(db: str, study: str, strategy: str = "frontier", joiners: int = 2):
    """A search started in one thread, joined by `joiners` more: each its own store and runner."""
    space, spec = gpt2_space(), resolve_model("gpt2")
    runners = [SlowRunner() for _ in range(joiners + 1)]
    outcomes, planned = {}, threading.Event()

    def starter() -> None:
        try:
            with open_store(db) as store:
                # (No confirmation round: what is checked is that the claims let each config be
                # probed once; tests/search/test_confirm.py.)
                options = SearchOptions(
                    study=study, strategy=strategy, predict=False, heartbeat_seconds=0.5, confirm=False
                )
                outcomes[0] = run_search(
                    request(space, spec, BUDGET, MARGIN, options), runners[0], store, on_start=lambda *a: planned.set()
                )
        finally:
            planned.set()  # (a starter that failed lets the joiners go on, to fail too)

    def joiner(i: int) -> None:
        planned.wait(timeout=60)
        with open_store(db) as store:
            while store.study(study).plan is None:  # written just after on_start
                time.sleep(0.01)
            outcomes[i] = run_worker(store, study, runners[i])

    in_threads(starter, *(lambda i=i: joiner(i) for i in range(1, joiners + 1)))
    return outcomes, runners


@pytest.mark.slow  # three worker threads over a whole space: seconds each
@pytest.mark.parametrize("strategy", ["predictive", "frontier", "grid", "tpe"])
def test_three_workers_settle_every_config_once_and_pick_what_one_worker_picks(tmp_path, strategy):
    db = str(tmp_path / "shared.db")
    outcomes, runners = shared_search(db, "shared", strategy)
    asked = [c.key() for r in runners for c in r.asked]
    assert len(asked) == len(set(asked))  # no config probed twice, whichever worker took it
    with open_store(db) as store:
        probes = store.probes("shared")
        single = run_search(
            request(
                gpt2_space(),
                resolve_model("gpt2"),
                BUDGET,
                MARGIN,
                SearchOptions(study="single", strategy=strategy, fresh=True, predict=False, patience=30, confirm=False),
            ),
            ScriptedRunner(),
            store,
        )
        claims = store.claims.of_study(store.study("shared").id, stale_after=60)
    keys = [p.config_key for p in probes]
    assert len(keys) == len(set(keys))  # each settled once
    assert {c.config_key for c in claims} == set(keys) and all(c.state == "done" for c in claims)
    assert {p.config_key for p in probes if p.result.status != "skipped"} == set(asked)
    assert all(o.study.status == "finished" for o in outcomes.values())
    assert sum(o.probed for o in outcomes.values()) == len(asked)
    if strategy != "tpe":  # (TPE stops on its patience, wherever its samplers wandered)
        assert len(keys) == len(gpt2_space().candidates())
        # The same pick, up to an exact tie: the scripted fp16 and bf16 are equally fast and large,
        # and a tie goes to the config probed first, which among workers is whichever came first.
        shared_best = outcomes[0].best
        assert (shared_best.tokens_per_s, shared_best.peak_reserved_bytes) == (
            single.best.tokens_per_s,
            single.best.peak_reserved_bytes,
        )
        assert replace(shared_best.config, precision="bf16") == replace(single.best.config, precision="bf16")
        # An OOM found by one worker skips the larger configs for all: not many more probes than
        # alone (the extra ones are the micro-batches below one in flight, probed meanwhile).
        assert len(asked) <= 1.4 * single.probed, (len(asked), single.probed)
        assert any("ran out of memory" in (p.result.error or "") for p in probes if p.result.status == "skipped")
    # Optuna: one trial per probed config, whichever worker ran it, and its number stored with it.
    import optuna

    trials = optuna.load_study(study_name="shared", storage=f"sqlite:///{db}").trials
    numbers = [p.trial_number for p in probes if p.result.status != "skipped"]
    assert None not in numbers and len(set(numbers)) == len(numbers)
    by_number = {t.number: t for t in trials}
    for p in probes:
        if p.result.status == "ok":
            assert by_number[p.trial_number].params["micro_batch"] == p.config.micro_batch


def test_configs_in_flight_are_unavailable_and_what_they_may_rule_out_waits():
    space = SearchSpace.build(
        resolve_model("gpt2"),
        micro_batches=(1, 2, 4, 8),
        block_sizes=(512,),
        precisions=("fp32",),
        attentions=("sdpa",),
        effective_batch=32,
    )  # every micro-batch accumulates
    knowledge = Knowledge(space.candidates())
    by = {(c.micro_batch, c.checkpointing): c for c in space.candidates()}
    knowledge.busy = {by[2, False].key(): by[2, False]}
    assert not knowledge.available(by[2, False])
    assert knowledge.speculative(by[4, False])  # mb2 may run out of memory, and then so does mb4
    assert not knowledge.speculative(by[1, False])  # below it: worth probing now
    assert knowledge.speculative(by[1, True])  # its twin's group is being searched
    from autotune.search import FrontierStrategy

    assert FrontierStrategy(knowledge, "cuda").next() == (by[1, False], None)
    knowledge.busy[by[1, False].key()] = by[1, False]
    assert FrontierStrategy(knowledge, "cuda").next() is None  # nothing worth doing: wait for the others
    knowledge.learn(by[2, False], ScriptedRunner().run(by[2, False], Budget(BUDGET, MARGIN)))
    knowledge.busy.pop(by[2, False].key())
    assert not knowledge.speculative(by[4, False])  # mb1 in flight cannot rule out more than mb2 already fits


def test_a_study_is_pinned_to_its_device(tmp_path):
    db = str(tmp_path / "pinned.db")
    with open_store(db) as store:
        run_search(
            request(
                gpt2_space(),
                resolve_model("gpt2"),
                BUDGET,
                MARGIN,
                SearchOptions(study="p", predict=False, max_trials=1),
            ),
            ScriptedRunner(),
            store,
        )
        store.set_study_status("p", "running")  # as if the starter were still at work
        other = Environment(**{**FAKE_ENV.to_dict(), "device_name": "Other GPU 24GB", "device_total_bytes": 24 * GiB})
        newer = Environment(**{**FAKE_ENV.to_dict(), "torch_version": "2.14.0"})
        before = len(store.probes("p"))
        with pytest.raises(DeviceError, match="pinned to Fake GPU 16GB .*--allow-other-device") as info:
            run_worker(store, "p", ScriptedRunner(env=other))
        assert "\n" not in str(info.value)
        with pytest.raises(DeviceError, match="torch 2.14.0 here, 2.13.0 in the study"):
            run_worker(store, "p", ScriptedRunner(env=newer))
        assert len(store.probes("p")) == before  # nothing written
        check_joinable(store.study("p"), other, allow_other_device=True)
        allowed = run_worker(store, "p", ScriptedRunner(env=other), allow_other_device=True, max_trials=2)
        assert allowed.probed == 2
        assert {p.env_fingerprint for p in store.probes("p")} == {FAKE_ENV.fingerprint(), other.fingerprint()}


def test_a_stopped_study_is_not_joined(tmp_path):
    db = str(tmp_path / "stopped.db")
    with open_store(db) as store:
        run_search(
            request(
                gpt2_space(),
                resolve_model("gpt2"),
                BUDGET,
                MARGIN,
                SearchOptions(study="s", predict=False, max_trials=1),
            ),
            ScriptedRunner(),
            store,
        )
        with pytest.raises(BadInput, match="is stopped; resume it"):
            run_worker(store, "s", ScriptedRunner())


def test_workers_get_one_gpu_each_or_one_core_each(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5,7")
    assert worker_devices(2, "auto") == [("cuda", "2"), ("cuda", "5")]
    monkeypatch.setattr("os.cpu_count", lambda: 3)
    assert worker_devices(3, "cpu") == [("cpu", "")] * 3
    with pytest.raises(
        BadInput,
        match="--workers 1000: this machine has 3 cores.*--workers 3 or fewer, or --oversubscribe for up to 12",
    ):
        worker_devices(1000, "cpu")
    assert len(worker_devices(12, "cpu", oversubscribe=True)) == 12
    with pytest.raises(BadInput, match="give --workers 12 or fewer"):
        worker_devices(13, "cpu", oversubscribe=True)
    with pytest.raises(BadInput, match="only 3 are visible"):
        worker_devices(4, "cuda")
    with pytest.raises(BadInput, match="--device cuda"):
        worker_devices(2, "cuda:1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(BadInput, match="--device cpu"):
        worker_devices(1, "auto")


def test_workers_of_a_multi_gpu_study_share_a_nodes_gpus_without_overlap(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert worker_devices(2, "auto", ranks=4) == [("cuda", "0,1,2,3"), ("cuda", "4,5,6,7")]
    assert worker_devices(3, "cuda", ranks=2) == [("cuda", "0,1"), ("cuda", "2,3"), ("cuda", "4,5")]
    with pytest.raises(
        BadInput, match="--workers 3 of 4 ranks each need 12 GPUs: only 8 are visible.*at most 2 workers"
    ):
        worker_devices(3, "cuda", ranks=4)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert worker_devices(1, "cpu", ranks=2) == [("cpu", "")]
    with pytest.raises(BadInput, match="--workers 2 of 2 ranks each: this machine has 2 cores"):
        worker_devices(2, "cpu", ranks=2)


def test_a_joining_worker_probes_with_every_setting_the_search_was_given(tmp_path):
    # --max-compile-seconds (and every other probe setting) reaches `autotune worker` through the
    # study's plan; its device is its own, its margin the study's.
    from autotune.probe import ProbeSettings
    from autotune.search.fleet import worker_settings

    settings = ProbeSettings(
        device="cpu", measure_steps=2, measure_seconds=0.5, timeout=90, max_compile_seconds=7.0, margin=0.1
    )
    with open_store(str(tmp_path / "plan.db")) as store:
        run_search(
            request(
                gpt2_space(),
                resolve_model("gpt2"),
                BUDGET,
                MARGIN,
                SearchOptions(study="plan", predict=False, max_trials=1),
                settings,
            ),
            ScriptedRunner(),
            store,
        )
        joined = worker_settings(store.study("plan"), "cuda")
        timed = worker_settings(store.study("plan"), "cuda", probe_timeout=30)
    assert (joined.max_compile_seconds, joined.measure_steps, joined.measure_seconds, joined.timeout) == (
        7.0,
        2,
        0.5,
        90,
    )
    assert (joined.device, joined.margin) == ("cuda", MARGIN) and timed.timeout == 30


def test_a_joining_worker_takes_the_studys_openmp_settings_before_its_probes_start(monkeypatch):
    # A Ray worker gets OMP_NUM_THREADS=1 from Ray; the study's processes had 4 and the passive wait:
    # its probe children (which read them when torch loads) must time as the study's did.
    from autotune.host.environment import adopt_openmp, openmp_settings

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    adopt_openmp([["OMP_WAIT_POLICY", "PASSIVE"], ["OMP_NUM_THREADS", "4"]])
    assert openmp_settings(os.environ) == (("OMP_WAIT_POLICY", "PASSIVE"), ("OMP_NUM_THREADS", "4"))
    adopt_openmp(None)  # a study recorded before they were: left as they are
    assert os.environ["OMP_NUM_THREADS"] == "4"


class RoundRunner(SlowRunner):
    """A SlowRunner that keeps the confirmation round's windows (timing only) apart."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.windows: list = []

    def run(self, config, budget, spec=None, deadline=None, timing_only=False, fresh_process=False):
        if timing_only:
            self.windows.append(config)
        return super().run(config, budget, spec, deadline, timing_only, fresh_process)


def workers_only(db: str, study: str, *, confirm: bool, workers: int = 2):
    """A study started as `search --workers` starts it (the plan stored, no loop of its own), then
    `workers` joining workers on it, each in a thread of its own with its own store and runner."""
    space, spec = gpt2_space(), resolve_model("gpt2")
    with open_store(db) as store:
        options = SearchOptions(study=study, predict=False, heartbeat_seconds=0.5, confirm=confirm)
        _, trials = start_study(request(space, spec, BUDGET, MARGIN, options), ScriptedRunner(), store)
        trials.close()
    runners = [RoundRunner() for _ in range(workers)]
    outcomes = {}

    def worker(i: int) -> None:
        with open_store(db) as store:
            outcomes[i] = run_worker(store, study, runners[i])

    in_threads(*(lambda i=i: worker(i) for i in range(workers)))
    return outcomes, runners


def test_a_fleet_s_workers_run_one_confirmation_round_and_the_study_finishes_with_its_verdict(tmp_path):
    db = str(tmp_path / "fleet.db")
    outcomes, runners = workers_only(db, "fleet", confirm=True)
    # One worker ran the round; the other left it to that one.
    assert sorted(len(r.windows) for r in runners) == [0, len(max(runners, key=lambda r: len(r.windows)).windows)]
    holder = next(i for i, r in enumerate(runners) if r.windows)
    assert outcomes[holder].round.probes == len(runners[holder].windows) >= 2
    with open_store(db) as store:
        study = store.study("fleet")
        claims = store.claims.of_study(study.id, stale_after=60)
        board = store.leaderboard("fleet")
    decision = study.confirmation
    assert study.status == "finished" and decision is not None and not decision.get("partial")
    assert decision["winner"] == board[0].config_key and decision["probes"] == len(runners[holder].windows)
    assert "confirmation-round" not in {c.config_key for c in claims}  # given back


def test_a_fleet_told_no_confirm_runs_no_round(tmp_path):
    db = str(tmp_path / "fleet.db")
    outcomes, runners = workers_only(db, "quick", confirm=False)
    assert all(not r.windows for r in runners) and all(o.round.probes == 0 for o in outcomes.values())
    with open_store(db) as store:
        study = store.study("quick")
    assert study.status == "finished" and study.confirmation is None


def test_a_round_whose_holder_died_is_taken_over_with_its_windows(tmp_path):
    # A worker that held the round was killed: its claim names a process gone from this machine, and
    # the round's first window is stored as partial. The next worker takes the claim over and goes
    # on from that window.
    db = str(tmp_path / "fleet.db")
    workers_only(db, "dead", confirm=False)  # (every config settled, no round yet)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = f"{socket.gethostname()}:{int(gone.stdout)}:cpu"
    with open_store(db) as store:
        study = store.study("dead")
        best = store.leaderboard("dead")[0]
        assert store.claims.take(study.id, ROUND_KEY, dead, stale_after=60) == 1
        store.set_confirmation(
            study.id,
            {
                "partial": True,
                "rounds": 1,
                "probes": 1,
                "seconds": 0.5,
                "windows": {best.config_key: [best.tokens_per_s, best.tokens_per_s]},
                "by_round": {best.config_key: {"1": best.tokens_per_s}},
            },
        )
        store.set_study_status(study.id, "running")
        store.set_study_plan(study.id, {**study.plan, "confirm": True})
        assert store.claims.release_dead(study.id) == 1  # (as a worker or a resumed search does on start)
    runner = RoundRunner()
    with open_store(db) as store:
        outcome = run_worker(store, "dead", runner)
        record = store.study("dead")
        claims = {c.config_key for c in store.claims.of_study(study.id, stale_after=60)}
    decision = record.confirmation
    assert runner.windows and outcome.round.probes == len(runner.windows) and record.status == "finished"
    assert decision is not None and not decision.get("partial") and decision["probes"] == 1 + len(runner.windows)
    assert ROUND_KEY not in claims


def test_a_search_waits_for_the_round_another_worker_holds_and_keeps_its_verdict(tmp_path):
    # A `search` joined by an `autotune worker`: the worker took the round first (a live claim,
    # heartbeaten here). The search does not run a second round beside it: it waits, and once the
    # holder stores its verdict and gives the claim back, finishes with that verdict.
    db = str(tmp_path / "fleet.db")
    holder = f"{socket.gethostname()}:{os.getpid()}:other"  # (alive: this process)
    space, spec = gpt2_space(), resolve_model("gpt2")
    options = SearchOptions(study="mixed", predict=False, heartbeat_seconds=0.5)
    runner = RoundRunner()
    outcomes, errors, started = {}, [], threading.Event()

    def search() -> None:
        try:
            with open_store(db) as store:
                outcomes["search"] = run_search(
                    request(space, spec, BUDGET, MARGIN, options), runner, store, on_start=lambda *a: started.set()
                )
        except Exception as exc:
            errors.append(exc)
            started.set()

    thread = threading.Thread(target=search)
    thread.start()
    assert started.wait(60) and not errors, errors
    with open_store(db) as store:
        study = store.study("mixed")
        assert store.claims.take(study.id, ROUND_KEY, holder, stale_after=options.stale_after) == 1
        # Held, beating, until the search has settled every candidate and sits waiting for the round.
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            store.claims.beat(study.id, ROUND_KEY, holder)
            settled = {c.config_key for c in store.claims.of_study(study.id, stale_after=60) if c.state == "done"}
            if len(settled) == len(space.candidates()):
                break
            time.sleep(0.1)
        for _ in range(10):  # (2 s of waiting, beaten as a live holder does)
            store.claims.beat(study.id, ROUND_KEY, holder)
            time.sleep(0.2)
        assert thread.is_alive() and not runner.windows  # waiting, no round of its own
        best = store.leaderboard("mixed")[0]
        verdict = {
            "winner": best.config_key,
            "winner_label": best.label,
            "runner_up": None,
            "margin": None,
            "noise": None,
            "confirmed": True,
            "rounds": 0,
            "probes": 0,
            "seconds": 0.0,
            "tied": [],
            "tied_keys": [],
            "reliable": True,
            "host_load": None,
            "reused": False,
        }
        store.set_confirmation(study.id, verdict)
        store.claims.release(study.id, ROUND_KEY, holder)
    thread.join(timeout=60)
    assert not thread.is_alive() and not errors, errors
    assert not runner.windows and outcomes["search"].study.status == "finished"
    assert outcomes["search"].study.confirmation == verdict

"""The benchmark pipeline (benchmarks/run.py): ground truth, autotune's search, the alternatives and
the report, end to end; with the scripted runner in milliseconds, and once for real on CPU."""

from __future__ import annotations

import json
import time

import pytest

from autotune.results.budget import Budget
from autotune.vocabulary.errors import BadInput
from autotune.probe import ProbeSettings
from benchmarks import alternatives, report, run
from tests.helpers.models import write_model_dir
from tests.helpers.fakes import FAKE_ENV, ScriptedRunner, modelled_result

MiB = 2**20
# Under 768 MiB the fake model runs out of memory at Trainer's defaults (micro-batch 8, fp32) but
# fits smaller micro-batches and half precision.
BUDGET = 768 * MiB
SPACE = dict(precisions=("fp32", "bf16"), attentions=("sdpa",), effective_batch=32)


def fake_estimator(configs, device_type):
    """Predicts 5% above what the scripted runner will measure."""
    return [int(modelled_result(c, 2**40, 0).peak_allocated_bytes * 1.05) for c in configs]


def fake_predictor(candidates, device_type):
    """The search's memory prediction, exact for the scripted runner (where the search predicts)."""
    from autotune.search import Prediction

    out = {}
    for config in candidates:
        r = modelled_result(config, 2**40, 0)
        out[config.key()] = Prediction(r.peak_allocated_bytes, r.peak_allocated_bytes, r.peak_reserved_bytes)
    return out


def run_fake(tmp_path, **kwargs):
    options = dict(
        new_runner=ScriptedRunner,
        margin_of=lambda b: int(0.05 * b),
        out_dir=tmp_path / "out",
        estimator=fake_estimator,
        search_predictor=fake_predictor,
        quiet=True,
    )
    options.update(kwargs)
    return run.run_benchmark([run.Case("gpt2", "gpt2", BUDGET, SPACE)], **options)


@pytest.fixture
def no_lightning(monkeypatch):
    monkeypatch.setattr(alternatives, "_import_lightning", lambda: "lightning is not installed (pip install lightning)")


def test_pipeline_with_scripted_runner_writes_figures_json_and_plot(tmp_path, no_lightning):
    doc = run_fake(tmp_path)
    (case,) = doc["cases"]
    truth, search = case["ground_truth"], case["autotune"]

    assert doc["device"] == FAKE_ENV.device_name and doc["torch_version"] and doc["date"]
    assert truth["probed"] == case["candidates"] == len(truth["rows"]) == 24
    assert {r["status"] for r in truth["rows"]} == {"ok", "oom"}
    assert 0 < search["probed"] < truth["probed"]
    assert search["pick"]["status"] == "ok"

    figures = case["figures"]
    assert figures["pick_quality"] == 1.0 and figures["pick_is_ground_truth_best"]
    assert figures["search_cost"] == pytest.approx(search["gpu_seconds"] / truth["gpu_seconds"])
    assert figures["search_cost"] < 1
    assert figures["repeat_configs"] > 0 and figures["repeat_median_abs_diff"] == 0  # the fake runner has no noise

    alts = {a["name"]: a for a in case["alternatives"]}
    assert alts["trainer-defaults"]["status"] == "oom"
    assert alts["trainer-defaults"]["tried"][0]["label"] == "mb8x4 blk512 fp32 no-ckpt sdpa"
    assert figures["speedup_over"]["trainer-defaults"] is None
    finder = alts["auto-find-batch-size"]
    sizes = [t["micro_batch"] for t in finder["tried"]]
    assert sizes[0] == 8 and sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert [t["status"] for t in finder["tried"]][:-1] == ["oom"] * (len(sizes) - 1)
    assert finder["status"] == "ok" and finder["pick"]["precision"] == "fp32" and not finder["pick"]["checkpointing"]
    assert finder["gpu_seconds"] == pytest.approx(sum(t["wall_seconds"] for t in finder["tried"]))
    assert figures["speedup_over"]["auto-find-batch-size"] > 1
    assert alts["lightning-binsearch"]["status"] == "not-installed"

    assert figures["estimator_median_abs_error"] == pytest.approx(0.05, abs=0.002)
    assert figures["estimator_configs"] == sum(r["status"] == "ok" for r in truth["rows"])

    json_path, png_path = (
        tmp_path / "out" / "fake-gpu-16gb-{}.json".format(doc["date"]),
        tmp_path / "out" / "fake-gpu-16gb-{}.png".format(doc["date"]),
    )
    assert doc["files"] == {"json": str(json_path), "png": str(png_path)}
    stored = json.loads(json_path.read_text())
    assert stored["cases"][0]["figures"]["pick_quality"] == 1.0
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    text = report.format_report(doc)
    assert FAKE_ENV.device_name in text
    assert "pick quality 1.000" in text and "auto_find_batch_size" in text and "not installed" in text


def test_phases_split_across_runs_merge_into_one_report(tmp_path, no_lightning):
    first = run_fake(tmp_path, phases=("ground-truth",))
    assert "autotune" not in first["cases"][0] and "pick_quality" not in first["cases"][0]["figures"]
    merged = run_fake(tmp_path, phases=("search", "alternatives"), merge=json.loads(json.dumps(first)), estimator=None)
    (case,) = merged["cases"]
    assert case["ground_truth"]["rows"] == first["cases"][0]["ground_truth"]["rows"]
    assert case["figures"]["pick_quality"] == 1.0
    assert case["figures"]["estimator_median_abs_error"] == pytest.approx(0.05, abs=0.002)  # kept from the first run

    other = dict(first, device="another GPU")
    with pytest.raises(BadInput, match="another GPU"):
        run_fake(tmp_path, merge=other)


def test_oom_wording_is_what_accelerate_and_lightning_recognise():
    from accelerate.utils.memory import should_reduce_batch_size

    from autotune.levers.config import ProbeConfig
    from autotune.specs.models import resolve_model
    from autotune.search.space import SearchSpace

    config = ProbeConfig(model="gpt2", micro_batch=8, block_size=512)
    for device_type in ("cuda", "cpu"):
        setting = alternatives.Setting(
            resolve_model("gpt2"),
            SearchSpace.build(resolve_model("gpt2"), effective_batch=32),
            Budget(BUDGET, int(0.05 * BUDGET)),
            device_type,
            ScriptedRunner,
        )
        assert should_reduce_batch_size(setting.oom_error(config))
    assert setting.trainer_config(8).grad_accum == 4 and setting.trainer_config(7).grad_accum == 5


def test_pareto_frontier_keeps_only_configs_nothing_beats_with_less_memory():
    rows = [
        dict(status="ok", required_bytes=m, tokens_per_s=t, key=str(i))
        for i, (m, t) in enumerate([(1, 10), (2, 5), (3, 20), (4, 15), (5, 30)])
    ] + [dict(status="oom", required_bytes=0, tokens_per_s=None, key="x")]
    assert [r["tokens_per_s"] for r in report.pareto_frontier(rows)] == [10, 20, 30]


def test_cli_refuses_unknown_phase_before_starting_a_worker(capsys):
    assert run.main(["--phases", "ground-truth,everything"]) == 2
    assert "unknown phase or alternative: everything" in capsys.readouterr().err


@pytest.mark.slow
def test_real_cpu_pipeline_on_a_tiny_model(tmp_path, monkeypatch, probe_runner):
    """The real thing, smaller: probe workers, the CPU memory accountant, accelerate's finder."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = str(write_model_dir(tmp_path / "tiny"))  # the same 2-layer GPT-2 as the CPU benchmark's
    settings = ProbeSettings(device="cpu", measure_steps=1, timeout=120)
    # mb8 without checkpointing needs about 17.5 MiB, mb6 about 14 MiB: under 16 MiB the first
    # runs out of memory and accelerate's finder settles after a step or two.
    space = dict(
        micro_batches=(2, 4, 8),
        block_sizes=(64,),
        precisions=("fp32",),
        checkpointing=(False, True),
        attentions=("sdpa",),
        effective_batch=8,
    )
    case = run.Case("tiny-gpt2", model, 16 * MiB, space, tiny=True)
    # Every phase borrows one real runner (its child imports torch and transformers once, not once a
    # phase: seconds each here); the benchmark's own command gives each phase a fresh one.
    runner = probe_runner(settings)
    doc = run.run_benchmark(
        [case],
        new_runner=lambda: runner,
        margin_of=lambda b: settings.budget(b).margin_bytes,
        out_dir=tmp_path / "out",
        alternatives=("trainer-defaults", "auto-find-batch-size"),
        quiet=True,
        estimator=None,
    )  # the estimator column is tested above; its traces cost 10 s here
    (case_doc,) = doc["cases"]
    rows = case_doc["ground_truth"]["rows"]
    assert doc["device"].startswith("cpu") and doc["device_type"] == "cpu"
    assert len(rows) == 6 and {r["status"] for r in rows} == {"ok", "oom"}
    assert all(r["tokens_per_s"] > 0 and r["peak_allocated_bytes"] > 0 for r in rows if r["status"] == "ok")
    ok_keys = {r["key"] for r in rows if r["status"] == "ok"}
    assert case_doc["autotune"]["pick"]["key"] in ok_keys
    # The search probes no more configs than the grid; its confirmation round measures a few again.
    search = case_doc["autotune"]
    assert search["probed"] - search["confirmation_probes"] <= case_doc["ground_truth"]["probed"]
    alts = {a["name"]: a for a in case_doc["alternatives"]}
    assert alts["trainer-defaults"]["status"] == "oom"
    assert alts["auto-find-batch-size"]["status"] == "ok" and alts["auto-find-batch-size"]["pick"]["micro_batch"] < 8
    figures = case_doc["figures"]
    assert 0 < figures["pick_quality"] <= 1 and figures["search_cost"] > 0
    assert doc["complete"] and case_doc["estimates"]["status"] == "not-run"
    assert list((tmp_path / "out").glob("cpu-*-tiny-gpt2-*.json")) and list(
        (tmp_path / "out").glob("cpu-*-tiny-gpt2-*.png")
    )


@pytest.mark.slow  # three benchmark runs over a scripted space
def test_a_deadline_leaves_work_that_the_same_command_finishes_with_its_state(tmp_path, no_lightning):
    asked: list[str] = []

    class SlowRunner(ScriptedRunner):
        pause = 0.4  # seconds a probe takes while the deadline is what is tested

        def run(self, config, budget, spec=None, deadline=None, timing_only=False, fresh_process=False):
            time.sleep(self.pause)
            asked.append(config.key())
            return super().run(config, budget, spec, deadline)

    state = tmp_path / "state"
    # Probes of 0.4 s against a 4 s deadline: the ground truth (16 probes) cannot finish, and the
    # set-up before its first probe (well under a second, seconds on a loaded 2-core machine) fits.
    first = run_fake(tmp_path, new_runner=SlowRunner, state_dir=state, deadline=run.Deadline(4.0))
    (case,) = first["cases"]
    assert not first["complete"] and "ground-truth" in case["pending"]
    assert 0 < case["ground_truth"]["probed"] < case["candidates"]
    # Without a deadline how long a probe takes no longer matters: the runs that finish go at full speed.
    SlowRunner.pause = 0.0
    again = run_fake(tmp_path, new_runner=SlowRunner, state_dir=state)
    (case,) = again["cases"]
    assert again["complete"] and not case["pending"]
    assert case["ground_truth"]["probed"] == case["candidates"] == len({r["key"] for r in case["ground_truth"]["rows"]})
    assert case["figures"]["pick_quality"] == 1.0
    # Nothing the first command finished was probed again.
    assert len(asked) == case["ground_truth"]["probed"] + case["autotune"]["probed"] + sum(
        a["probed"] for a in case["alternatives"]
    )
    before = len(asked)
    run_fake(tmp_path, new_runner=SlowRunner, state_dir=state)
    assert len(asked) == before  # everything was finished: a third run probes nothing


def test_lightning_binsearch_runs_the_real_finder_over_probes():
    pytest.importorskip("lightning")
    from autotune.specs.models import resolve_model
    from autotune.search.space import SearchSpace

    spec = resolve_model("gpt2")
    setting = alternatives.Setting(
        spec, SearchSpace.build(spec, **SPACE), Budget(BUDGET, int(0.05 * BUDGET)), "cuda", ScriptedRunner
    )
    outcome = alternatives.lightning_binsearch(setting)
    tried = [(c.micro_batch, r.status) for c, r in outcome.tried]
    first_oom = next(i for i, (_, status) in enumerate(tried) if status == "oom")
    # Lightning starts at 2 and doubles until out of memory, then halves the gap to the last size that ran.
    assert [size for size, _ in tried[: first_oom + 1]] == [2 << i for i in range(first_oom + 1)]
    assert tried[first_oom + 1][0] == (tried[first_oom][0] + tried[first_oom - 1][0]) // 2
    assert outcome.status == "ok" and outcome.result.status == "ok"
    assert outcome.config.micro_batch < tried[first_oom][0] and outcome.config.precision == "fp32"
    assert "oom" in [r.status for _, r in outcome.tried]


def test_repeated_picks_agree_when_equal_or_found_tied_by_a_run_that_saw_both():
    from benchmarks.agreement import agree

    def run(pick, tied=(), within=()):
        return {"pick": pick, "tied_with": list(tied), "within_noise": list(within)}

    assert agree([run("a"), run("a"), run("a")])
    assert agree([run("a"), run("b", tied=["a"]), run("a")])
    assert agree([run("a", within=["b"]), run("b")])
    assert not agree([run("a", within=["b"]), run("b"), run("a")])  # the third run told b from a
    assert not agree([run("a"), run("b"), run("a")])
    assert not agree([run("a", tied=["c"]), run("b", tied=["c"])])

"""`autotune train` evaluates as its probe did: the evaluation flags go into the search that runs
first (so the winner's probe ran the eval phase), a settled study's evaluation decides (flags may
repeat it, not contradict it), and the run evaluates under the same cap with each phase's peak
measured on its own and held against the probe's (CPU accounting: the two compare exactly).
Real searches and runs of a tiny GPT-2 and a tiny T5 on CPU; the recipe checks without either."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from autotune.levers.config import ProbeConfig
from autotune.vocabulary.errors import BadInput
from autotune.levers.evaluation import EVAL_RECIPE, recipe_fields
from autotune.search import search as real_search
from autotune.store import open_store
from autotune.train import SUMMARY_FILE, PEAK_TOLERANCE, ProbeMeasurement, RunSummary, TrainOptions, train
from autotune.train.winner import FixedRecipe, evaluation_flags
from tests.helpers.cli import assert_usage_error, autotune
from tests.helpers.tiny_tasks import write_tiny
from tests.helpers.corpus import corpus_text, write_pretrained_gpt2, write_task_tokenizer

BUDGET = 64 * 2**20
# One candidate per search (a probe child's start, its steps and its later phases: seconds), no estimator.
NARROW = {
    "micro_batches": (2,),
    "block_sizes": (32,),
    "precisions": ("fp32",),
    "checkpointing": (False,),
    "attentions": ("sdpa",),
    "effective_batch": 2,
}
ASKED = {
    "eval_batch": 4,
    "eval_logits": None,
    "eval_accumulation_steps": None,
    "generate": False,
    "generation_max_length": None,
    "num_beams": None,
}


def narrow_search(model, budget, *, runner, settings, options, db=None, on_event=None, on_start=None, **space_args):
    """autotune.search.search over one configuration on CPU, with the recipe train asked for,
    probed by `runner` (the module's)."""
    return real_search(
        model,
        budget,
        settings=runner.settings,
        options=replace(options, predict=False),
        db=db,
        on_event=on_event,
        on_start=on_start,
        runner=runner,
        **space_args,
        **NARROW,
    )


@pytest.fixture(scope="module")
def runner(probe_runner):
    from autotune.probe import ProbeSettings

    return probe_runner(ProbeSettings(device="cpu", measure_steps=1))


@dataclass(frozen=True)
class Evaluated:
    root: Path
    model: Path
    corpus: Path
    db: str
    searched: list[dict]  # the keyword arguments train's search was given
    outcome: object  # TrainOutcome of the run that searched first


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, runner) -> Evaluated:
    """A tiny GPT-2 with weights and a tokenizer, trained with --eval-batch 4 and an eval split by a
    `train` that searches first: 3 steps, evaluating at step 2 (its checkpoint) and at the end."""
    import autotune.search

    root = tmp_path_factory.mktemp("eval-phases")
    text = corpus_text()
    corpus = root / "corpus.txt"
    corpus.write_text(text[:40_000])
    model = write_pretrained_gpt2(text, root / "tiny-gpt2")
    db = f"sqlite:///{root / 'studies.db'}"
    searched: list[dict] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(
            autotune.search, "search", lambda *a, **k: searched.append(k) or narrow_search(*a, runner=runner, **k)
        )
        outcome = train(
            TrainOptions(
                dataset=str(corpus),
                output_dir=str(root / "run"),
                max_steps=3,
                save_steps=2,
                device="cpu",
                eval_split="5%",
            ),
            model=str(model),
            gpu_budget=BUDGET,
            evaluation=ASKED,
            db=db,
            echo=lambda line: None,
        )
    return Evaluated(root=root, model=model, corpus=corpus, db=db, searched=searched, outcome=outcome)


def phase_ratio(summary: RunSummary, phase: str) -> float:
    row = next(p for p in summary.phases if p.phase == phase)
    assert row.run_bytes and row.probe_bytes, summary.phases
    print(
        f"{phase} phase: run peak reserved {row.run_bytes:,} B, probe's {row.probe_bytes:,} B, run/probe {row.ratio:.4f}"
    )
    return row.run_bytes / row.probe_bytes


@pytest.mark.slow
def test_search_first_measures_the_evaluation_and_the_run_evaluates_within_its_probes_eval_peak(evaluated):
    outcome = evaluated.outcome
    assert outcome.finished and outcome.searched, outcome.message
    # The evaluation flags went into the search's fixed recipe, so the winner's probe ran the eval phase.
    assert [k.get("evaluation") for k in evaluated.searched] == [{k: v for k, v in ASKED.items()}]
    summary = outcome.summary
    assert (summary.config.eval_batch, summary.config.eval_logits) == (4, "loss-only")
    assert summary.training_arguments["per_device_eval_batch_size"] == 4
    assert set(summary.probe.phase_peaks) == {"train", "eval"}
    # The run evaluated (at step 2 and at its end), each phase's peak its own.
    assert set(summary.phase_peaks) == {"train", "eval"} and summary.eval_loss is not None
    assert summary.eval_blocks and summary.steps == 3
    assert [p.phase for p in summary.phases] == ["train", "eval"]
    # Evaluation holds the weights and the optimizer state and an eval batch's forward without
    # gradients: less than a training step, in the run as in the probe.
    assert summary.phase_peaks["eval"]["reserved"] < summary.phase_peaks["train"]["reserved"]
    eval_ratio = phase_ratio(summary, "eval")
    assert eval_ratio <= 1 + PEAK_TOLERANCE, f"run/probe eval peak {eval_ratio:.4f}: {summary.phases}"
    train_ratio = phase_ratio(summary, "train")
    assert 1 - PEAK_TOLERANCE < train_ratio < 1 + PEAK_TOLERANCE, f"run/probe train peak {train_ratio:.4f}"
    assert summary.peak_reserved_bytes == max(p["reserved"] for p in summary.phase_peaks.values())
    # autotune-run.json and the store's row carry the comparison.
    data = json.loads((Path(summary.output_dir) / SUMMARY_FILE).read_text())
    assert [row["phase"] for row in data["phases"]] == ["train", "eval"]
    assert data["phases"][1]["run_peak_reserved_bytes"] == summary.phase_peaks["eval"]["reserved"]
    assert data["phases"][1]["probe_peak_reserved_bytes"] == summary.probe.phase_peaks["eval"]["reserved"]
    assert data["probe"]["phase_peaks"] == summary.probe.phase_peaks
    with open_store(evaluated.db) as store:
        run = store.runs.all()[-1]
    assert run.summary == data


@pytest.mark.slow
def test_a_flag_contradicting_a_settled_studys_evaluation_is_one_line_and_records_nothing(evaluated, tmp_path):
    study = evaluated.outcome.study
    with open_store(evaluated.db) as store:
        before = len(store.runs.all())
    proc = autotune(
        "train",
        "--study",
        study,
        "--dataset",
        str(evaluated.corpus),
        "--eval-split",
        "5%",
        "--eval-batch",
        "8",
        "--output-dir",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--db",
        evaluated.db,
    )
    assert_usage_error(proc, f"--eval-batch 8 contradicts study {study!r}, which measured --eval-batch 4")
    for evaluation, eval_split, needle in (
        ({"eval_logits": "kept"}, "5%", "--eval-logits kept contradicts"),
        ({"generate": True}, "5%", "--generate is for --task seq2seq"),
        ({"eval_batch": 4}, None, "give --eval-split"),
    ):
        with pytest.raises(BadInput, match=needle):
            train(
                TrainOptions(
                    dataset=str(evaluated.corpus), output_dir=str(tmp_path / "out"), device="cpu", eval_split=eval_split
                ),
                study=study,
                evaluation=evaluation,
                db=evaluated.db,
                echo=lambda line: None,
            )
    with open_store(evaluated.db) as store:
        assert len(store.runs.all()) == before


@pytest.mark.slow
def test_a_settled_study_without_eval_data_only_trains_and_says_so(evaluated, tmp_path):
    lines: list[str] = []
    outcome = train(
        TrainOptions(dataset=str(evaluated.corpus), output_dir=str(tmp_path / "out"), max_steps=1, device="cpu"),
        study=evaluated.outcome.study,
        evaluation={"eval_batch": None},
        db=evaluated.db,
        echo=lines.append,
    )
    assert outcome.finished and not outcome.searched
    assert outcome.summary.phase_peaks is None and outcome.summary.eval_loss is None
    assert any("no --eval-split gives this run data to evaluate on" in w for w in outcome.summary.warnings), lines
    # The probe's phases still show, with no run figure for its eval phase.
    assert [(p.phase, p.run_bytes is None) for p in outcome.summary.phases] == [("train", True), ("eval", True)]


@pytest.mark.slow
def test_kept_logits_are_kept_by_the_run_as_by_its_probe(evaluated, runner, tmp_path, monkeypatch):
    """--eval-logits kept: the run hands Trainer a compute_metrics (without one, Trainer.evaluate keeps
    the loss only) and eval_accumulation_steps, so it holds the logits its probe held."""
    import autotune.search

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(autotune.search, "search", functools.partial(narrow_search, runner=runner))
    lines: list[str] = []
    outcome = train(
        TrainOptions(
            dataset=str(evaluated.corpus), output_dir=str(tmp_path / "run"), max_steps=1, device="cpu", eval_split="5%"
        ),
        model=str(evaluated.model),
        gpu_budget=BUDGET,
        study="kept",
        db=evaluated.db,
        echo=lines.append,
        evaluation={**ASKED, "eval_logits": "kept", "eval_accumulation_steps": 2},
    )
    assert outcome.finished, outcome.message
    summary = outcome.summary
    assert (summary.config.eval_logits, summary.config.eval_accumulation_steps) == ("kept", 2)
    assert summary.training_arguments["eval_accumulation_steps"] == 2
    assert "prediction_loss_only" not in summary.training_arguments
    # The logits reached the metrics (run_clm.py's accuracy): Trainer kept them.
    assert any("eval_accuracy" in line for line in lines), lines
    assert set(summary.phase_peaks) == {"train", "eval"}
    ratio = phase_ratio(summary, "eval")
    assert ratio <= 1 + PEAK_TOLERANCE, f"run/probe eval peak {ratio:.4f}: {summary.phases}"
    with open_store(evaluated.db) as store:
        run = store.runs.all("kept")[-1]
    assert run.summary["phases"][1]["phase"] == "eval"


@pytest.mark.slow
def test_seq2seq_generation_runs_in_the_evaluation_within_its_probes_generate_peak(runner, tmp_path, monkeypatch):
    """A tiny T5 searched first with --generate --num-beams 2: the run's evaluation is
    Seq2SeqTrainer's predict_with_generate, measured as the probe's generate phase."""
    import autotune.search

    text = corpus_text()
    model = write_tiny(tmp_path, "t5")
    write_task_tokenizer(text, model)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps({"document": text[i : i + 300], "summary": text[i + 300 : i + 360]}) + "\n"
            for i in range(0, 12_000, 400)
        )
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    searched: list[dict] = []
    monkeypatch.setattr(
        autotune.search, "search", lambda *a, **k: searched.append(k) or narrow_search(*a, runner=runner, **k)
    )
    asked = {**ASKED, "eval_batch": 2, "generate": True, "num_beams": 2}
    lines: list[str] = []
    outcome = train(
        TrainOptions(dataset=str(pairs), output_dir=str(tmp_path / "run"), max_steps=1, device="cpu", eval_split="10%"),
        model=str(model),
        gpu_budget=BUDGET,
        target_length=16,
        evaluation=asked,
        db=f"sqlite:///{tmp_path / 'studies.db'}",
        echo=lines.append,
    )
    assert outcome.finished, outcome.message
    assert any("eval_gen_len" in line for line in lines), lines  # Seq2SeqTrainer generated
    assert searched[0]["evaluation"] == asked and searched[0]["target_length"] == 16
    summary = outcome.summary
    config = summary.config
    assert (config.eval_batch, config.generation_max_length, config.generation_num_beams) == (2, 16, 2)
    assert set(summary.probe.phase_peaks) == {"train", "eval", "generate"}
    # The run's evaluation generated: its peak is the generate phase's; the probe's loss-only eval
    # phase has no counterpart in a run that generates.
    assert set(summary.phase_peaks) == {"train", "generate"} and summary.eval_loss is not None
    ratio = phase_ratio(summary, "generate")
    assert ratio <= 1 + PEAK_TOLERANCE, f"run/probe generate peak {ratio:.4f}: {summary.phases}"
    assert [(p.phase, p.run_bytes is None) for p in summary.phases] == [
        ("train", False),
        ("eval", True),
        ("generate", False),
    ]


# -- without processes: the recipe's checks and the summary's form ---------------------------------


def _recipe(**evaluation) -> FixedRecipe:
    return FixedRecipe("causal-lm", evaluation={**EVAL_RECIPE, **evaluation})


def test_evaluation_flags_read_back_to_the_same_fields():
    for fields in (
        recipe_fields({"eval_batch": 8}, None),
        recipe_fields({"eval_batch": 8, "eval_logits": "kept", "eval_accumulation_steps": 4}, None),
        recipe_fields({"eval_batch": 2, "generate": True, "num_beams": 4}, 64),
    ):
        assert recipe_fields(evaluation_flags(fields), 64) == fields
    assert evaluation_flags(dict(EVAL_RECIPE)) is None


def test_flags_may_repeat_a_studys_evaluation_but_not_contradict_it():
    studied = _recipe(eval_batch=8)
    studied.check("s", evaluation={"eval_batch": 8, "eval_logits": "loss-only"})  # repeats it
    studied.check("s", evaluation=None)
    studied.check("s", evaluation={"eval_batch": None, "generate": False})  # nothing given
    with pytest.raises(BadInput, match="--eval-batch 4 contradicts study 's', which measured --eval-batch 8"):
        studied.check("s", evaluation={"eval_batch": 4})
    with pytest.raises(
        BadInput, match="--eval-logits kept contradicts study 's', which measured --eval-logits loss-only"
    ):
        studied.check("s", evaluation={"eval_logits": "kept", "eval_accumulation_steps": 2})
    with pytest.raises(BadInput, match="measured no --eval-accumulation-steps"):
        _recipe(eval_batch=8).check("s", evaluation={"eval_accumulation_steps": 2, "eval_logits": "kept"})
    with pytest.raises(BadInput, match="whose probes measured no evaluation"):
        FixedRecipe("causal-lm").check("s", evaluation={"eval_batch": 8})
    seq2seq = FixedRecipe(
        "seq2seq", target_length=32, evaluation=recipe_fields({"eval_batch": 2, "generate": True, "num_beams": 2}, 32)
    )
    seq2seq.check("s", evaluation={"generate": True, "num_beams": 2})
    with pytest.raises(BadInput, match="--num-beams 4 contradicts study 's', which measured --num-beams 2"):
        seq2seq.check("s", evaluation={"generate": True, "num_beams": 4})
    with pytest.raises(BadInput, match="give --generate too"):  # the flags' own mistake, as search says it
        seq2seq.check("s", evaluation={"num_beams": 2})


def test_a_resumed_study_searches_with_its_own_evaluation():
    study = SimpleNamespace(
        space={
            "task": "seq2seq",
            "target_length": 32,
            "eval_batch": 2,
            "generation_max_length": 32,
            "generation_num_beams": 2,
        }
    )
    recipe = FixedRecipe.of_study(study)
    assert recipe.evaluation["eval_batch"] == 2 and recipe.evaluation["eval_logits"] == "loss-only"
    assert recipe.search_fields() == {
        "task": "seq2seq",
        "target_length": 32,
        "evaluation": {
            "eval_batch": 2,
            "eval_logits": "loss-only",
            "eval_accumulation_steps": None,
            "generate": True,
            "generation_max_length": 32,
            "num_beams": 2,
        },
    }
    assert "evaluation" not in FixedRecipe.of_study(SimpleNamespace(space={})).search_fields()


def test_the_summary_compares_each_phase_with_the_probes():
    MiB = 2**20
    config = ProbeConfig(model="gpt2", micro_batch=4, block_size=128, eval_batch=8)
    probe = ProbeMeasurement(
        395 * MiB,
        400 * MiB,
        0,
        1000.0,
        {
            "train": {"allocated": 395 * MiB, "reserved": 400 * MiB},
            "eval": {"allocated": 190 * MiB, "reserved": 200 * MiB},
        },
    )
    summary = RunSummary(
        status="finished",
        run_id=1,
        study="s",
        probe_id=1,
        model="gpt2",
        weights="random-init",
        dataset="d",
        output_dir="/o",
        device="cpu",
        device_type="cpu",
        config=config,
        training_arguments={},
        train_blocks=10,
        eval_blocks=2,
        resumed_from=None,
        steps=2,
        steps_this_run=2,
        max_steps=2,
        tokens_per_s=None,
        wall_tokens_per_s=None,
        train_seconds=None,
        seconds=1.0,
        budget_bytes=1024 * MiB,
        margin_bytes=0,
        cap_bytes=1024 * MiB,
        context_bytes=0,
        peak_allocated_bytes=390 * MiB,
        peak_reserved_bytes=400 * MiB,
        probe=probe,
        final_loss=None,
        eval_loss=None,
        phase_peaks={
            "train": {"allocated": 390 * MiB, "reserved": 400 * MiB},
            "eval": {"allocated": 180 * MiB, "reserved": 190 * MiB},
        },
    )
    data = summary.to_dict()
    assert data["phases"] == [
        {
            "phase": "train",
            "run_peak_reserved_bytes": 400 * MiB,
            "probe_peak_reserved_bytes": 400 * MiB,
            "run_vs_probe": 1.0,
        },
        {
            "phase": "eval",
            "run_peak_reserved_bytes": 190 * MiB,
            "probe_peak_reserved_bytes": 200 * MiB,
            "run_vs_probe": 0.95,
        },
    ]
    assert data["phase_peaks"] == summary.phase_peaks and data["probe"]["phase_peaks"] == probe.phase_peaks
    assert json.loads(json.dumps(data)) == data
    # A run that only trained, of a probe that only trained: the summary's form as it always was.
    plain = replace(summary, phase_peaks=None, probe=replace(probe, phase_peaks=None))
    assert plain.phases == () and "phases" not in plain.to_dict() and "phase_peaks" not in plain.to_dict()["probe"]
    stopped = replace(summary, status="oom", failed_phase="eval")
    assert stopped.to_dict()["failed_phase"] == "eval"

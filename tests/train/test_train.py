"""`autotune train` on CPU: a real run of a study's winner under the CPU memory accountant, the run
stored beside its probe; a budget the run cannot meet; resume; bad data sets; search first."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.vocabulary.errors import AutotuneError, BadInput, DatasetError, ModelNotFound
from autotune.store import open_store
from autotune.train import SUMMARY_FILE, TrainOptions, checkpoints, train
from tests.helpers.cli import assert_usage_error, autotune
from tests.helpers.training import STUDY_BUDGET

pytestmark = pytest.mark.slow


def runs(db: str):
    with open_store(db) as store:
        return store.runs.all()


def test_train_command_saves_a_model_that_loads_and_records_the_run(workspace, tmp_path):
    out = tmp_path / "run"
    # Started with more threads than the study's probes had: the run takes the probes' OpenMP settings.
    proc = autotune(
        "train",
        "--study",
        workspace.study,
        "--dataset",
        str(workspace.corpus),
        "--max-steps",
        "5",
        "--save-steps",
        "2",
        "--eval-split",
        str(workspace.small_eval),
        "--device",
        "cpu",
        "--output-dir",
        str(out),
        "--db",
        workspace.db,
        env={"OMP_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    assert "OpenMP: OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 (as the study's probes ran)" in proc.stdout
    assert "random initialisation" not in proc.stdout and f"weights from {workspace.model}" in proc.stdout
    assert "finished: 5 steps" in proc.stdout and "run/probe peak" in proc.stdout

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.n_layer == 2 and len(AutoTokenizer.from_pretrained(out)) == 500
    assert [p.name for p in checkpoints(out)] == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]

    summary = json.loads((out / SUMMARY_FILE).read_text())
    with open_store(workspace.db) as store:
        best = store.leaderboard(workspace.study, top=1)[0]
        run = store.runs.all(workspace.study)[-1]
    assert run.status == "finished" and run.probe_id == best.probe_id and run.config == best.config.to_dict()
    assert run.steps == 5 and run.tokens_per_s > 0 and run.peak_reserved_bytes > 0 and run.peak_allocated_bytes > 0
    assert math.isfinite(run.final_loss) and run.output_dir == str(out.resolve())
    assert summary["run_id"] == run.id and summary["status"] == "finished"
    # The run trains what the probe measured, so its peak is the probe's (CPU accounting is exact).
    assert summary["probe"]["peak_reserved_bytes"] == best.peak_reserved_bytes
    assert 0.95 < summary["peak_vs_probe"] < 1.05, summary
    assert summary["peak_reserved_bytes"] + summary["margin_bytes"] <= summary["budget_bytes"]
    assert summary["eval_loss"] is not None and summary["eval_blocks"] >= 1
    assert run.summary == summary


def test_a_budget_the_run_cannot_meet_fails_it_and_keeps_the_checkpoints(workspace, tmp_path):
    out = tmp_path / "run"
    base = {"dataset": str(workspace.corpus), "output_dir": str(out), "device": "cpu", "save_steps": 1}
    first = train(TrainOptions(max_steps=2, **base), study=workspace.study, db=workspace.db, echo=lambda line: None)
    assert first.finished and [p.name for p in checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]

    with pytest.raises(BadInput, match="--resume"):  # an earlier run's checkpoints are not overwritten silently
        train(TrainOptions(max_steps=3, **base), study=workspace.study, db=workspace.db, echo=lambda line: None)

    # 2 MiB cannot hold the tiny model's weights, gradients and Adam state: the accountant raises
    # torch.OutOfMemoryError as a 2 MiB card would.
    result = CliRunner().invoke(
        cli,
        [
            "train",
            "--study",
            workspace.study,
            "--dataset",
            str(workspace.corpus),
            "--output-dir",
            str(out),
            "--device",
            "cpu",
            "--max-steps",
            "4",
            "--resume",
            "--gpu-budget",
            "2MiB",
            "--db",
            workspace.db,
        ],
    )
    assert result.exit_code == 1, result.output
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and message[0].startswith("autotune: out of memory"), result.stderr
    assert "checkpoints kept" in message[0]
    failed = runs(workspace.db)[-1]
    assert failed.status == "failed" and "out of memory" in failed.error
    assert failed.summary["status"] == "oom" and failed.summary["budget_bytes"] == 2 * 2**20
    assert [p.name for p in checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    assert json.loads((out / SUMMARY_FILE).read_text())["status"] == "oom"

    # The study's own budget holds it: resume goes on from the last checkpoint.
    resumed = train(
        TrainOptions(max_steps=3, resume=True, **base), study=workspace.study, db=workspace.db, echo=lambda line: None
    )
    assert resumed.finished and resumed.summary.resumed_from.endswith("checkpoint-2")
    assert resumed.summary.steps == 3 and resumed.summary.steps_this_run == 1
    assert runs(workspace.db)[-1].status == "finished"


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: d / "missing.txt", "no such file"),
        (lambda d: _write(d / "numbers.csv", "a,b\n1,2\n3,4\n"), "no text column"),
        (lambda d: _write(d / "notes.docx", "text"), "cannot read files ending in '.docx'"),
        (lambda d: _write(d / "empty.txt", ""), "empty"),
        (lambda d: _write(d / "short.jsonl", '{"text": "too short"}\n'), "fewer than one block of 64"),
    ],
)
def test_bad_data_set_is_a_user_error_and_records_nothing(workspace, tmp_path, make, needle):
    dataset = make(tmp_path)
    before = len(runs(workspace.db))
    with pytest.raises(DatasetError, match=needle):
        train(
            TrainOptions(dataset=str(dataset), output_dir=str(tmp_path / "out"), max_steps=1, device="cpu"),
            study=workspace.study,
            db=workspace.db,
            echo=lambda line: None,
        )
    assert len(runs(workspace.db)) == before


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "dataset, extra, needle",
    [
        ("missing.txt", [], "no such file"),
        ("numbers.csv", ["--text-column", "body"], "--text-column 'body'"),
    ],
)
def test_bad_data_set_on_the_command_line_is_one_line_and_exit_2(workspace, tmp_path, dataset, extra, needle):
    (tmp_path / "numbers.csv").write_text("a,b\n1,2\n")
    before = len(runs(workspace.db))
    proc = autotune(
        "train",
        "--study",
        workspace.study,
        "--dataset",
        str(tmp_path / dataset),
        *extra,
        "--output-dir",
        str(tmp_path / "out"),
        "--db",
        workspace.db,
    )
    assert_usage_error(proc, needle)
    assert len(runs(workspace.db)) == before


def test_text_column_is_found_or_chosen(tmp_path):
    from autotune.data import load_text

    (tmp_path / "docs.jsonl").write_text('{"id": 1, "body": "some text"}\n{"id": 2, "body": "more"}\n')
    assert load_text(str(tmp_path / "docs.jsonl")).column == "body"  # the only text column
    (tmp_path / "two.csv").write_text("title,body\nA,some text\n")
    with pytest.raises(DatasetError, match="choose one with --text-column"):
        load_text(str(tmp_path / "two.csv"))
    assert load_text(str(tmp_path / "two.csv"), column="body").column == "body"
    with pytest.raises(DatasetError, match="one file with no other splits"):
        load_text(str(tmp_path / "two.csv"), column="body", eval_split="validation")


def test_without_a_tokenizer_the_error_names_the_option(workspace, tiny_model, tmp_path, monkeypatch):
    import autotune.search

    # tiny_model is a directory with only config.json: enough to probe, not to tokenise text. The
    # tokenizer is checked before the search that this command would otherwise run.
    monkeypatch.setattr(autotune.search, "search", lambda *a, **k: pytest.fail("searched without a tokenizer"))
    with pytest.raises(ModelNotFound, match="pass --tokenizer PATH"):
        train(
            TrainOptions(dataset=str(workspace.corpus), output_dir=str(tmp_path / "out")),
            model=tiny_model,
            gpu_budget=STUDY_BUDGET,
            db=workspace.db,
            echo=lambda line: None,
        )
    with open_store(workspace.db) as store:  # nothing searched, nothing recorded
        assert [s.name for s in store.studies()] == [workspace.study]


def test_options_are_checked():
    with pytest.raises(BadInput, match="choose one"):
        TrainOptions(dataset="x.txt", max_steps=5, epochs=1)
    with pytest.raises(AutotuneError, match="--study"):
        train(TrainOptions(dataset="x.txt"))


def test_model_and_budget_without_a_study_search_first(workspace, tmp_path, monkeypatch, probe_runner):
    """The search that runs first is autotune.search.search with the default study name; here it is
    narrowed to the fixture's small space, without predictions, in the worker's warm probe child,
    so that the test stays quick."""
    import dataclasses

    import autotune.search
    from autotune.probe import ProbeSettings

    real_search = autotune.search.search
    asked = {}
    runner = probe_runner(ProbeSettings(device="cpu", measure_steps=1))

    def narrow_search(model, budget, *, settings, options, db=None, on_event=None, on_start=None, **space_args):
        asked.update(model=model, budget=budget, study=options.study, device=settings.device, space_args=space_args)
        return real_search(
            model,
            budget,
            settings=runner.settings,
            runner=runner,
            options=dataclasses.replace(options, predict=False),
            db=db,
            on_event=on_event,
            on_start=on_start,
            micro_batches=(1, 2),
            block_sizes=(32,),
            precisions=("fp32",),
            checkpointing=(False,),
            attentions=("sdpa",),
            effective_batch=2,
        )

    monkeypatch.setattr(autotune.search, "search", narrow_search)
    events, lines = [], []
    outcome = train(
        TrainOptions(
            dataset=str(workspace.corpus), output_dir=str(tmp_path / "out"), max_steps=2, random_init=True, device="cpu"
        ),
        model=str(workspace.model),
        gpu_budget=32 * 2**20,
        db=workspace.db,
        echo=lines.append,
        on_search_event=events.append,
    )
    assert asked == {
        "model": str(workspace.model),
        "budget": 32 * 2**20,
        "study": "tiny-gpt2-32MiB",
        "device": "cpu",
        "space_args": {},
    }
    assert outcome.searched and outcome.finished and outcome.study == "tiny-gpt2-32MiB"
    assert len([e for e in events if e.how != "confirming"]) == 2  # (then the confirmation round's)
    assert outcome.summary.weights == "random-init" and outcome.summary.config.block_size == 32
    assert any("random initialisation" in line for line in lines)

    # The same command again trains the finished study's winner without searching.
    monkeypatch.setattr(autotune.search, "search", lambda *a, **k: pytest.fail("searched again"))
    again = train(
        TrainOptions(
            dataset=str(workspace.corpus),
            output_dir=str(tmp_path / "again"),
            max_steps=1,
            random_init=True,
            device="cpu",
        ),
        model=str(workspace.model),
        gpu_budget=32 * 2**20,
        db=workspace.db,
        echo=lambda line: None,
    )
    assert not again.searched and again.finished
    with open_store(workspace.db) as store:
        assert len(store.runs.all("tiny-gpt2-32MiB")) == 2

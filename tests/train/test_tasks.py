"""`autotune train` for every task: seq2seq (T5), classification (BERT) and masked LM (BERT), each a
real two-step run on CPU of a winner chosen by a real search, saved as the task's model class, its
peak the probe's (the examples have the shapes the probe measured); and the data mistakes of each
task, refused before anything is searched or recorded."""

from __future__ import annotations

import csv
import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.vocabulary.errors import BadInput, DatasetError
from autotune.search import SearchOptions
from autotune.search import search as real_search
from autotune.store import open_store
from autotune.levers.tasks import Task
from autotune.train import SUMMARY_FILE, TrainOptions, train
from autotune.data.task_data import load_task_data
from autotune.train.winner import FixedRecipe
from tests.helpers.cli import assert_usage_error, autotune
from tests.helpers.tiny_tasks import write_tiny
from tests.helpers.corpus import corpus_text, write_task_tokenizer

BUDGET = 64 * 2**20
# One candidate per search (a probe child's start and three steps: seconds), no estimator child.
NARROW = {
    "micro_batches": (2,),
    "block_sizes": (32,),
    "precisions": ("fp32",),
    "checkpointing": (False,),
    "attentions": ("sdpa",),
    "effective_batch": 2,
}


@dataclass(frozen=True)
class TaskWorkspace:
    models: dict[str, Path]  # family -> directory with config.json and tokenizer files (no weights)
    pairs: Path  # JSONL: document, summary
    reviews: Path  # CSV: review, sentiment ('neg'/'pos')
    plain: Path  # plain text
    db: str  # holds studies 'cls' (bert-classification, 3 labels) and 'mlm' (bert-mlm)


def narrow_search(model, budget, *, runner, settings, options, db=None, on_event=None, on_start=None, **space_args):
    """autotune.search.search over one configuration on CPU, probed by `runner` (the module's)."""
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


@pytest.fixture(scope="module")
def ws(tmp_path_factory, runner) -> TaskWorkspace:
    root = tmp_path_factory.mktemp("tasks")
    text = corpus_text()
    models = {}
    for family in ("t5", "bert-classification", "bert-mlm"):
        models[family] = write_tiny(root, family)
        write_task_tokenizer(text, models[family])
    pairs = root / "pairs.jsonl"
    rows = [{"document": text[i : i + 300], "summary": text[i + 300 : i + 360]} for i in range(0, 20_000, 400)]
    rows.append({"document": "a document without a summary is left out", "summary": ""})
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    reviews = root / "reviews.csv"
    with reviews.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["review", "sentiment"])
        writer.writerows([text[i * 200 : i * 200 + 200], ("pos", "neg")[i % 2]] for i in range(40))
    plain = root / "plain.txt"
    plain.write_text(text[:60_000])
    db = f"sqlite:///{root / 'studies.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        for study, family in (("cls", "bert-classification"), ("mlm", "bert-mlm")):
            outcome = narrow_search(
                str(models[family]), BUDGET, runner=runner, settings=None, options=SearchOptions(study=study), db=db
            )
            assert outcome.best is not None and outcome.study.status == "finished"
    return TaskWorkspace(models=models, pairs=pairs, reviews=reviews, plain=plain, db=db)


def runs(db: str):
    with open_store(db) as store:
        return store.runs.all()


def quiet(line: str) -> None:
    pass


@pytest.mark.slow
def test_seq2seq_searches_first_with_the_task_fields_and_saves_a_seq2seq_model(ws, runner, tmp_path, monkeypatch):
    from transformers import AutoModelForSeq2SeqLM

    import autotune.search

    asked = []
    monkeypatch.setattr(
        autotune.search, "search", lambda *a, **k: asked.append(k) or narrow_search(*a, runner=runner, **k)
    )
    out, lines = tmp_path / "run", []
    outcome = train(
        TrainOptions(dataset=str(ws.pairs), output_dir=str(out), max_steps=2, device="cpu", eval_split="10%"),
        model=str(ws.models["t5"]),
        gpu_budget=BUDGET,
        target_length=16,
        db=ws.db,
        echo=lines.append,
    )
    assert [{k: v for k, v in a.items() if k in ("task", "target_length", "num_labels")} for a in asked] == [
        {"target_length": 16}
    ]
    assert outcome.finished and outcome.searched, outcome.message
    assert any("text in column 'document', target in column 'summary'" in line for line in lines), lines
    summary = outcome.summary
    assert (summary.config.task, summary.config.block_size, summary.config.target_length) == ("seq2seq", 32, 16)
    assert summary.tokens_per_step == 2 * (32 + 16) and summary.steps == 2
    # 50 rows with a summary (the one without is left out), 10% of them held out.
    assert (summary.train_blocks, summary.eval_blocks) == (45, 5) and summary.eval_loss is not None
    # Sources padded to the block size and targets to the target length: the probe's shapes, its peak.
    assert 0.95 < summary.peak_vs_probe < 1.05, summary
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert type(model).__name__ == "T5ForConditionalGeneration" and not model.config.use_cache
    assert json.loads((out / SUMMARY_FILE).read_text())["config"]["target_length"] == 16


@pytest.mark.slow
def test_classification_maps_text_labels_to_ids_and_warns_of_another_head_size(ws, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out = tmp_path / "run"
    outcome = train(
        TrainOptions(dataset=str(ws.reviews), output_dir=str(out), max_steps=2, device="cpu", label_column="sentiment"),
        study="cls",
        db=ws.db,
        echo=quiet,
    )
    assert outcome.finished, outcome.message
    assert outcome.summary.config.num_labels == 3  # the study measured the config's three labels
    assert any("the data has 2 labels and the probe measured a head of 3" in w for w in outcome.warnings), (
        outcome.warnings
    )
    assert 0.95 < outcome.summary.peak_vs_probe < 1.05, outcome.summary
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert type(model).__name__ == "BertForSequenceClassification" and model.config.num_labels == 2
    assert model.config.id2label == {0: "neg", 1: "pos"} and model.config.label2id == {"neg": 0, "pos": 1}
    assert AutoTokenizer.from_pretrained(out).pad_token == "<pad>"
    run = runs(ws.db)[-1]
    assert run.status == "finished" and run.config["task"] == "classification" and run.steps == 2


@pytest.mark.slow
def test_masked_lm_command_trains_with_masking_and_saves_a_masked_lm(ws, tmp_path):
    from transformers import AutoModelForMaskedLM

    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli,
        [
            "train",
            "--study",
            "mlm",
            "--dataset",
            str(ws.plain),
            "--max-steps",
            "2",
            "--device",
            "cpu",
            "--output-dir",
            str(out),
            "--db",
            ws.db,
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["status"] == "finished" and summary["config"]["task"] == "masked-lm" and summary["steps"] == 2
    assert 0.95 < summary["peak_vs_probe"] < 1.05, summary
    assert "packed into" in result.stderr and "(BertForMaskedLM)" in result.stderr
    assert type(AutoModelForMaskedLM.from_pretrained(out)).__name__ == "BertForMaskedLM"


@pytest.mark.slow
def test_a_new_classifier_study_is_searched_with_the_labels_of_its_data(ws, tmp_path, monkeypatch):
    import autotune.search

    class Searched(Exception):
        pass

    def stop(*args, **kwargs):
        raise Searched({k: v for k, v in kwargs.items() if k in ("task", "target_length", "num_labels")})

    monkeypatch.setattr(autotune.search, "search", stop)
    with pytest.raises(Searched) as searched:  # the config's id2label has 3 labels, the data 2: the data's are measured
        train(
            TrainOptions(
                dataset=str(ws.reviews), output_dir=str(tmp_path / "out"), label_column="sentiment", device="cpu"
            ),
            model=str(ws.models["bert-classification"]),
            gpu_budget=BUDGET,
            task="classification",
            db=ws.db,
            echo=quiet,
        )
    assert searched.value.args[0] == {"task": "classification", "num_labels": 2}


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "study, make, options, kwargs, error, needle",
    [
        (
            "cls",
            lambda ws, d: ws.reviews,
            {},
            {},
            DatasetError,
            "no label column for classification (columns: review, sentiment); give a data set with a 'label' column",
        ),
        ("cls", lambda ws, d: ws.reviews, {"label_column": "stars"}, {}, DatasetError, "--label-column 'stars': "),
        (
            "cls",
            lambda ws, d: _write(d / "one.csv", "text,label\nsome text,pos\nmore text,pos\n"),
            {},
            {},
            DatasetError,
            "a classifier needs at least two labels",
        ),
        (
            "cls",
            lambda ws, d: ws.reviews,
            {"label_column": "sentiment", "target_column": "review"},
            {},
            BadInput,
            "--target-column is for --task seq2seq",
        ),
        (
            "mlm",
            lambda ws, d: ws.plain,
            {},
            {"task": "classification"},
            BadInput,
            "--task classification contradicts study 'mlm', which measured masked-lm",
        ),
        ("mlm", lambda ws, d: ws.plain, {}, {"num_labels": 4}, BadInput, "--num-labels is for --task classification"),
        ("mlm", lambda ws, d: ws.plain, {"tokenizer": "no-mask"}, {}, BadInput, "has no mask token"),
        (None, lambda ws, d: ws.plain, {}, {}, DatasetError, "no target column (columns: text)"),
    ],
)
def test_a_task_mistake_is_refused_before_anything_is_searched_or_recorded(
    ws, tmp_path, monkeypatch, study, make, options, kwargs, error, needle
):
    import autotune.search

    monkeypatch.setattr(autotune.search, "search", lambda *a, **k: pytest.fail("searched"))
    if options.get("tokenizer") == "no-mask":
        write_task_tokenizer(corpus_text()[:20_000], tmp_path / "no-mask", mask=False)
        options = {**options, "tokenizer": str(tmp_path / "no-mask")}
    where = {"study": study} if study else {"model": str(ws.models["t5"]), "gpu_budget": BUDGET}
    before = len(runs(ws.db))
    with pytest.raises(error) as raised:
        train(
            TrainOptions(
                dataset=str(make(ws, tmp_path)), output_dir=str(tmp_path / "out"), max_steps=1, device="cpu", **options
            ),
            db=ws.db,
            echo=quiet,
            **where,
            **kwargs,
        )
    assert needle in str(raised.value) and "\n" not in str(raised.value)
    assert len(runs(ws.db)) == before and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, needle",
    [
        ([], "no label column for classification (columns: review, sentiment)"),
        (["--task", "seq2seq"], "--task seq2seq contradicts study 'cls', which measured classification"),
    ],
)
def test_a_task_mistake_on_the_command_line_is_one_line_and_exit_2(ws, tmp_path, extra, needle):
    before = len(runs(ws.db))
    proc = autotune(
        "train",
        "--study",
        "cls",
        "--dataset",
        str(ws.reviews),
        *extra,
        "--output-dir",
        str(tmp_path / "out"),
        "--device",
        "cpu",
        "--db",
        ws.db,
    )
    assert_usage_error(proc, needle)
    assert len(runs(ws.db)) == before


# -- the columns and labels of each task, without a run -------------------------------------------


def test_labels_are_ids_as_the_example_scripts_make_them(tmp_path):
    def labels(rows: str, **options):
        path = _write(tmp_path / f"data{len(list(tmp_path.iterdir()))}.csv", "text,label\n" + rows)
        return load_task_data(Task.CLASSIFICATION, TrainOptions(dataset=str(path), **options)).labels

    named = labels("a,positive\nb,negative\nc,neutral\nd,positive\n")
    assert named.count == 3 and named.id2label() == {0: "negative", 1: "neutral", 2: "positive"}
    assert named.encode("positive") == 2
    ids = labels("a,0\nb,2\nc,2\n")  # whole numbers are ids already: id 1 is a label the data happens not to use
    assert (ids.count, ids.names, ids.encode(2)) == (3, None, 2)
    scores = labels("a,0.5\nb,1.25\n")
    assert scores.regression and scores.count == 1 and scores.encode(0.5) == 0.5
    with pytest.raises(DatasetError, match="negative"):
        labels("a,-1\nb,1\n")
    with pytest.raises(DatasetError, match="some rows have no label"):
        labels("a,1\nb,\nc,0\n")
    validation = _write(tmp_path / "validation.csv", "text,label\nx,positive\ny,unheard\n")
    with pytest.raises(DatasetError, match="'unheard' of column 'label' is not among the training data's labels"):
        labels("a,positive\nb,negative\n", eval_split=str(validation))


def test_seq2seq_columns_are_found_or_named(tmp_path):
    def columns(rows: list[dict], **options):
        path = tmp_path / f"pairs{len(list(tmp_path.iterdir()))}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        data = load_task_data(Task.SEQ2SEQ, TrainOptions(dataset=str(path), **options)).text
        return data.column, data.others["target"]

    assert columns([{"id": 1, "article": "a long text", "highlights": "short"}]) == ("article", "highlights")
    with pytest.raises(DatasetError, match=r"no target column \(columns: src, tgt\).* or name it with --target-column"):
        columns([{"src": "a long text", "tgt": "short"}])
    # The target named, the source is the only other text column.
    assert columns([{"src": "a long text", "tgt": "short"}], target_column="tgt") == ("src", "tgt")
    with pytest.raises(DatasetError, match="several text columns"):
        columns([{"title": "t", "body": "a long text", "summary": "short"}])
    with pytest.raises(DatasetError, match="--text-column 'summary': .* already read for another role"):
        columns([{"body": "a long text", "summary": "short"}], text_column="summary")


def test_flags_may_repeat_a_study_but_not_contradict_it():
    measured = FixedRecipe("seq2seq", target_length=128)
    measured.check("s2s", task="SEQ2SEQ", target_length=128)  # repeating it is fine
    with pytest.raises(BadInput, match="--target-length 64 contradicts study 's2s', which measured 128"):
        measured.check("s2s", target_length=64)
    with pytest.raises(BadInput, match="--num-labels is for --task classification; study 's2s' trains seq2seq"):
        measured.check("s2s", num_labels=3)
    with pytest.raises(BadInput, match="--task 'nonsense' is unknown"):
        measured.check("s2s", task="nonsense")


def test_train_refuses_a_study_that_timed_trls_step():
    """`train` runs transformers' Trainer: a study of TRL's SFTTrainer step measured neither its
    memory (Trainer holds the full logits) nor its speed."""
    with pytest.raises(BadInput, match="study 'sft': the probes timed TRL's SFTTrainer step .* hand the pick to TRL"):
        FixedRecipe("causal-lm", trainer="trl").check("sft")
    FixedRecipe("causal-lm").check("plain")


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, data, auto_class, class_name",
    [
        ("pegasus", "pairs", "AutoModelForSeq2SeqLM", "PegasusForConditionalGeneration"),
        ("bart", "pairs", "AutoModelForSeq2SeqLM", "BartForConditionalGeneration"),
        ("distilbert", "plain", "AutoModelForMaskedLM", "DistilBertForMaskedLM"),
        ("roberta", "plain", "AutoModelForMaskedLM", "RobertaForMaskedLM"),
    ],
)
def test_every_other_family_searches_trains_two_steps_and_saves_its_task_class(
    ws, runner, tmp_path, monkeypatch, family, data, auto_class, class_name
):
    """The families the tests above do not train: a search first (one configuration), two real
    steps on CPU, and a saved model that the task's Auto class loads."""
    import transformers

    import autotune.search

    model = write_tiny(tmp_path, family)
    write_task_tokenizer(corpus_text()[:60_000], model)
    monkeypatch.setattr(autotune.search, "search", functools.partial(narrow_search, runner=runner))
    out = tmp_path / "run"
    outcome = train(
        TrainOptions(dataset=str(getattr(ws, data)), output_dir=str(out), max_steps=2, device="cpu"),
        model=str(model),
        gpu_budget=BUDGET,
        db=f"sqlite:///{tmp_path / 'own.db'}",
        echo=quiet,
        **({"target_length": 16} if data == "pairs" else {}),
    )
    assert outcome.finished and outcome.searched and outcome.summary.steps == 2, outcome.message
    assert 0.95 < outcome.summary.peak_vs_probe < 1.05, outcome.summary
    assert type(getattr(transformers, auto_class).from_pretrained(out)).__name__ == class_name
